"""A rank killed (SIGKILL) at any moment of a save is named on every live rank within seconds.

The ranks are plain processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the job's
TCPStore), so no launcher kills the survivors: what they do is ckpttool's doing alone.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from ckpttool import Checkpointer

WORKER = os.path.join(os.path.dirname(__file__), "plain_rank.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_plain_ranks(world: int, scenario: str, root: str, out: str, env: dict[str, str],
                      per_rank: dict[int, dict[str, str]] | None = None) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(world):
        e = {**os.environ, **env, **(per_rank or {}).get(r, {}), "RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = open(f"{out}.{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, WORKER, scenario, root, out], env=e, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _logs(out: str) -> str:
    return "".join(f"\n--- rank log {p}:\n{open(p).read()[-3000:]}" for p in sorted(glob.glob(out + ".*.log")))


def run_and_kill(tmp_path, world: int, mode: str, point: str, victim: int, size: str = "tiny",
                 dead_after: float | None = 4.0) -> tuple[dict[int, dict], float, dict[int, float]]:
    """Start ``world`` plain ranks; once the victim stops at ``point`` of step 4's save, kill it
    with SIGKILL. Returns each live rank's report, the moment of the kill, and when each live rank
    exited."""
    root, out, pause = str(tmp_path / "run"), str(tmp_path / "seen"), str(tmp_path / "paused")
    env = {"CKPTTOOL_TEST_MODE": mode, "CKPTTOOL_TEST_VICTIM": str(victim), "CKPTTOOL_TEST_POINT": point,
           "CKPTTOOL_TEST_SIZE": size, "CKPTTOOL_PAUSE_FILE": pause}
    if dead_after is not None:
        env["CKPTTOOL_TEST_DEAD_AFTER"] = str(dead_after)
    procs = start_plain_ranks(world, "killed_mid_save", root, out, env)
    try:
        deadline = time.monotonic() + 180
        while not os.path.exists(f"{pause}.{victim}"):
            assert time.monotonic() < deadline, "the victim never reached its pause point" + _logs(out)
            assert all(p.poll() is None for p in procs), f"a rank ended early: {[p.poll() for p in procs]}" + _logs(out)
            time.sleep(0.05)
        time.sleep(1.5)  # stopped there a moment: the others have seen its beat say so
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.time()
        exited: dict[int, float] = {}
        while len(exited) < world - 1:
            assert time.monotonic() < deadline + 60, f"live ranks still running 60 s after the kill: {[p.poll() for p in procs]}" + _logs(out)
            for r, p in enumerate(procs):
                if r != victim and r not in exited and p.poll() is not None:
                    exited[r] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    seen = {}
    for r in range(world):
        if r != victim:
            assert procs[r].returncode == 0, f"rank {r} exited {procs[r].returncode}" + _logs(out)
            with open(f"{out}.{r}.json") as f:
                seen[r] = json.load(f)
    return seen, killed, exited


def assert_named(seen: dict[int, dict], killed: float, exited: dict[int, float], victim: int, phase: str,
                 within: float = 30.0) -> None:
    for r, s in seen.items():
        assert s["outcome"] == "RankDeadError", (r, s)
        assert s["ranks"] == [victim], (r, s)
        assert f"rank {victim} stopped answering" in s["message"], s
        assert phase in s["message"], (phase, s["message"])
        assert s["at"] - killed <= within, f"rank {r} raised {s['at'] - killed:.1f} s after the kill"
        assert "close" not in s, s
        assert exited[r] - killed <= within + 10, f"rank {r} exited {exited[r] - killed:.1f} s after the kill"


def assert_step_4_not_committed_and_2_loads(root: str, size: str) -> None:
    from ckpttool.training.trainer.model import PRESETS, build_model

    ckpt = Checkpointer(root)
    assert ckpt.steps() == [2]
    assert ckpt.incomplete(), "the killed save left its uncommitted directory"
    model = build_model(PRESETS[size], seed=3)
    res = ckpt.load(model, torch.optim.AdamW(model.parameters()))
    assert res.step == 2


@pytest.mark.parametrize("world,mode,point,victim,size,phase", [
    (3, "async", "after-stage", 1, "tiny", "stage of step 4"),      # staged, its writer not started
    (2, "async", "mid-write", 1, "small", "write of step 4"),       # its data file half written
    (2, "sync", "mid-write", 1, "small", "write of step 4"),
    # (the rest are marked slow: make test-slow, which CI runs, keeps them; make test stays minutes)
    # rank 0, which hosts the job's store
    pytest.param(2, "async", "mid-write", 0, "small", "write of step 4", marks=pytest.mark.slow),
    # its data written, its index not published
    pytest.param(3, "sync", "before-index", 2, "tiny", "write of step 4", marks=pytest.mark.slow),
    pytest.param(3, "async", "before-index", 1, "tiny", "write of step 4", marks=pytest.mark.slow),
    (3, "async", "before-commit", 0, "tiny", "commit of step 4"),   # rank 0, before the commit record
    pytest.param(3, "sync", "before-commit", 0, "tiny", "commit of step 4", marks=pytest.mark.slow),
])
def test_a_rank_killed_mid_save_is_named_on_every_live_rank(tmp_path, world, mode, point, victim, size, phase):
    seen, killed, exited = run_and_kill(tmp_path, world, mode, point, victim, size)
    assert_named(seen, killed, exited, victim, phase, within=15)
    assert_step_4_not_committed_and_2_loads(str(tmp_path / "run"), size)


@pytest.mark.slow
def test_with_the_default_settings_a_dead_rank_is_named_within_30_seconds(tmp_path):
    """commit_timeout stays 1,800 s; the default dead_after names the rank well inside 30 s."""
    seen, killed, exited = run_and_kill(tmp_path, 2, "async", "mid-write", 1, "small", dead_after=None)
    assert_named(seen, killed, exited, 1, "write of step 4", within=30)
    assert_step_4_not_committed_and_2_loads(str(tmp_path / "run"), "small")
