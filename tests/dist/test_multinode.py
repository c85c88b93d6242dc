"""Jobs of two nodes on one machine, as on a cluster: one torchrun agent per node (``--nnodes 2
--node-rank K --master-addr 127.0.0.1``), each node's processes in a mount namespace of their own
with the node's local disk bound at the same path (``unshare -m`` + ``mount --bind``), the
checkpoint root shared. A node killed in the middle of a save; the job restarted resumes bitwise
from the newest committed step."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from ckpttool import Checkpointer
from ckpttool.cli import main

from .test_dead_ranks import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: where every node sees its own local disk (a directory of the test's, bound there in its namespace)
LOCAL = "/tmp/ckpttool-node-local"


def can_unshare() -> bool:
    try:
        os.makedirs(LOCAL, exist_ok=True)
        return subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind /tmp {LOCAL}"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


pytestmark = pytest.mark.skipif(not can_unshare(), reason="needs mount namespaces (root, unshare -m) for its nodes")

TRAIN = ["-m", "ckpttool.training.trainer.train", "--steps", "6", "--save-every", "2", "--async-save"]


def start_node(node: int, port: int, root: str, disk: str, log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """One node: its torchrun agent and its worker, in a mount namespace where ``disk`` is the
    node's local disk at LOCAL; its own session, so that the test can kill the whole node."""
    os.makedirs(disk, exist_ok=True)
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0"]
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    cmd = ["unshare", "-m", "sh", "-c", script, "sh", disk, LOCAL, *agent, *TRAIN, "--ckpt-dir", root]
    e = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TMPDIR": LOCAL, **(env or {})}
    return subprocess.Popen(cmd, env=e, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)


def run_job(tmp, name: str, root: str, env_by_node: dict[int, dict[str, str]] | None = None, timeout: float = 240) -> list[int]:
    port = free_port()
    nodes = [start_node(k, port, root, str(tmp / f"{name}-disk{k}"), str(tmp / f"{name}-node{k}.log"), (env_by_node or {}).get(k))
             for k in range(2)]
    deadline = time.monotonic() + timeout
    try:
        while any(n.poll() is None for n in nodes):
            assert time.monotonic() < deadline, f"job {name} still running after {timeout} s" + _logs(tmp, name)
            time.sleep(0.2)
    finally:
        for n in nodes:
            _kill_node(n)
    return [n.returncode for n in nodes]


def _kill_node(node: subprocess.Popen) -> None:
    """SIGKILL to the node's agent and every process under it (torchrun starts each worker in a
    session of its own), as a node that loses power."""
    for pid in [node.pid, *_descendants(node.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _logs(tmp, name: str) -> str:
    return "".join(f"\n--- {p}:\n{open(p).read()[-4000:]}" for p in sorted(glob.glob(str(tmp / f"{name}-node*.log"))))


def test_a_node_killed_mid_save_and_the_job_restarted_resumes_bitwise(tmp_path):
    ref = str(tmp_path / "ref")
    assert run_job(tmp_path, "ref", ref) == [0, 0], _logs(tmp_path, "ref")
    assert Checkpointer(ref).steps() == [2, 4, 6]

    # node 1's rank stops in its write of step 4 (its data written, its index not yet); the test
    # kills the whole node there; node 0's rank names it and its agent ends the job
    root = str(tmp_path / "run")
    pause = str(tmp_path / "paused")
    port = free_port()
    env1 = {"CKPTTOOL_PAUSE_AT": "before-index:2", "CKPTTOOL_PAUSE_FILE": pause}
    nodes = [start_node(k, port, root, str(tmp_path / f"run-disk{k}"), str(tmp_path / f"run-node{k}.log"), env1 if k == 1 else None)
             for k in range(2)]
    try:
        deadline = time.monotonic() + 180
        while not glob.glob(pause + ".*"):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "node 1 never paused" + _logs(tmp_path, "run")
            time.sleep(0.1)
        time.sleep(1.0)
        _kill_node(nodes[1])
        killed = time.monotonic()
        while nodes[0].poll() is None:
            assert time.monotonic() - killed < 90, "node 0 still running 90 s after node 1 died" + _logs(tmp_path, "run")
            time.sleep(0.2)
    finally:
        for n in nodes:
            _kill_node(n)
    assert nodes[0].returncode != 0
    assert Checkpointer(root).steps() == [2], _logs(tmp_path, "run")
    node0 = open(tmp_path / "run-node0.log").read()
    assert "RankDeadError: rank 1 stopped answering (rank 1: last seen" in node0 and "write of step 4" in node0, node0[-4000:]

    # the job restarted on both nodes: it resumes from step 2 and ends where the run that never stopped ended
    assert run_job(tmp_path, "again", root) == [0, 0], _logs(tmp_path, "again")
    assert Checkpointer(root).steps() == [2, 4, 6]
    assert "resum" in open(tmp_path / "again-node0.log").read().lower()
    out = CliRunner().invoke(main, ["verify", os.path.join(root, "step-6"), "--against", os.path.join(ref, "step-6")])
    assert out.exit_code == 0, out.output
