"""An async save written by a process of the rank's own (``Checkpointer(writer="process")``): the
same bytes as the writer thread's, a writer process that dies fails its save by name and the next
save starts another, and the training script is never run again to start it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckpttool import Checkpointer
from ckpttool.errors import CkptError, UsageError


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _writer_processes() -> list[int]:
    """The pids of this process's children that run a writer process."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == os.getpid() and b"writer_process import serve" in cmdline:
            found.append(int(pid))
    return found


def test_a_writer_process_writes_the_bytes_the_writer_thread_writes(tmp_path):
    model, optimizer = _model()
    for writer in ("thread", "process"):
        with Checkpointer(str(tmp_path / writer), async_save=True, writer=writer) as ckpt:
            ckpt.save(1, model, optimizer, extra={"note": "x", "t": torch.arange(5)})
            ckpt.wait()
    for name in ("__0_0.distcp", "__0.manifest"):  # (.metadata holds a random save id)
        with open(tmp_path / "thread" / "step-1" / name, "rb") as a, open(tmp_path / "process" / "step-1" / name, "rb") as b:
            assert a.read() == b.read(), name
    assert not _writer_processes()  # close() ended it


def test_a_writer_process_that_dies_mid_write_fails_that_save_by_name_and_the_next_save_commits(tmp_path, monkeypatch):
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTTOOL_PAUSE_AT", "after-write:2")  # the writer process stops in its second write
    monkeypatch.setenv("CKPTTOOL_PAUSE_FILE", str(marker))
    model, optimizer = _model()
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer="process") as ckpt:
        ckpt.save(1, model, optimizer)
        ckpt.wait()
        ckpt.save(2, model, optimizer)
        for _ in range(600):
            if os.path.exists(f"{marker}.0") and os.path.getsize(f"{marker}.0"):
                break
            time.sleep(0.1)
        pid = int(open(f"{marker}.0").read())
        assert pid in _writer_processes()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CkptError, match=r"the writer process of rank 0 ended while writing step 2 \(killed by signal 9\)"):
            ckpt.wait()
        ckpt.save(3, model, optimizer)  # a new writer process (its count of pause points starts again)
        ckpt.wait()
        assert ckpt.steps() == [1, 3]
        assert _writer_processes() and pid not in _writer_processes()


def test_a_writer_process_that_died_between_saves_is_replaced_and_no_save_is_lost(tmp_path):
    model, optimizer = _model()
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer="process") as ckpt:
        ckpt.save(1, model, optimizer)
        ckpt.wait()
        (pid,) = _writer_processes()
        os.kill(pid, signal.SIGKILL)
        # until it can be waited for, left unreaped (its main thread shows "Z" before its other threads have
        # ended: waiting for that state was not enough under load, CI saw the save then find it alive)
        for _ in range(600):
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the writer process {pid} did not end within 30 s of SIGKILL")
        ckpt.save(2, model, optimizer)
        ckpt.wait()
        assert ckpt.steps() == [1, 2]


def test_starting_the_writer_process_does_not_run_the_training_script_again(tmp_path):
    script = tmp_path / "train.py"  # no ``if __name__ == "__main__"``: as many training scripts are written
    script.write_text(
        "import torch\n"
        "from ckpttool import Checkpointer\n"
        f"print('script ran', flush=True)\n"
        "m = torch.nn.Linear(4, 4)\n"
        f"c = Checkpointer({str(tmp_path / 'run')!r}, async_save=True, writer='process')\n"
        "c.save(1, m)\n"
        "c.wait()\n"
        "c.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("script ran") == 1, out.stdout
    assert (tmp_path / "run" / "step-1" / ".ckpttool-commit.json").exists()


def test_an_unknown_writer_is_refused():
    with pytest.raises(UsageError, match="writer must be 'thread' or 'process'"):
        Checkpointer("/tmp/unused", writer="processes")


def _read_by(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_the_writer_process_reads_the_staged_state_from_shared_memory_not_through_its_socket(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB, 12 MiB with AdamW's state
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer="process") as ckpt:
        ckpt.save(1, model, optimizer)
        ckpt.wait()
        (pid,) = _writer_processes()
        before = _read_by(pid)
        ckpt.save(2, model, optimizer)
        ckpt.wait()
        read = _read_by(pid) - before  # what its read calls returned: the socket's messages (it writes the step's files)
    assert read < 1 << 20, read


def _tagged(tag: str) -> list[int]:
    """The pids of the processes whose environment holds ``CKPTTOOL_TEST_TAG=tag``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"CKPTTOOL_TEST_TAG={tag}".encode() in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_a_training_process_killed_9_leaves_no_writer_process_behind(tmp_path):
    tag = os.urandom(8).hex()
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal, torch\n"
        "from ckpttool import Checkpointer\n"
        "m = torch.nn.Linear(4, 4)\n"
        f"c = Checkpointer({str(tmp_path / 'run')!r}, async_save=True, writer='process')\n"
        "c.save(1, m)\n"
        "c.wait()\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # no close(), no exit handlers\n")
    with open(tmp_path / "log", "w") as log:  # (a file, not a pipe: the run ends with the script, whatever it left)
        out = subprocess.run([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT, timeout=120,
                             env=dict(os.environ, CKPTTOOL_TEST_TAG=tag))
    assert out.returncode == -signal.SIGKILL, (tmp_path / "log").read_text()
    assert (tmp_path / "run" / "step-1" / ".ckpttool-commit.json").exists()
    for _ in range(100):
        if not _tagged(tag):
            break
        time.sleep(0.1)
    assert not _tagged(tag), "a writer process outlived its training process"


def test_a_storage_error_in_the_writer_process_is_that_error_and_the_process_serves_the_next_save(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTTOOL_FAIL_AT", "after-write:1")  # the first write in the writer process meets a full disk
    model, optimizer = _model()
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer="process") as ckpt:
        ckpt.save(1, model, optimizer)
        with pytest.raises(CkptError, match="(?i)no space left on device") as failed:
            ckpt.wait()
        assert "writer process" not in str(failed.value) and failed.value.where
        (pid,) = _writer_processes()
        ckpt.save(2, model, optimizer)
        ckpt.wait()
        assert ckpt.steps() == [2] and _writer_processes() == [pid]


def test_a_value_of_the_state_is_read_by_the_writer_process_from_the_modules_this_process_imports(tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "run_config_of_this_test.py").write_text("class Config:\n    def __init__(self, value):\n        self.value = value\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))  # (a module beside a training script: on its sys.path only)
    import run_config_of_this_test

    model, optimizer = _model()
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer="process") as ckpt:
        ckpt.save(1, model, optimizer, extra={"cfg": run_config_of_this_test.Config(3)})
        ckpt.wait()
        assert ckpt.steps() == [1]


def test_a_writer_process_that_cannot_start_fails_that_save_by_name_and_the_next_one_starts(tmp_path, monkeypatch):
    """save() has marked its step pending when the writer process starts: a start that fails (here
    the interpreter is not where it was, a real failed exec) is that save's error, in the background
    and by name, not a raw OSError out of save(); the next save starts one and commits."""
    model, optimizer = _model()
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer="process") as ckpt:
        python = sys.executable
        monkeypatch.setattr(sys, "executable", str(tmp_path / "gone" / "python"))
        ckpt.save(1, model, optimizer)  # (does not raise)
        with pytest.raises(CkptError, match="the writer process could not be started .*No such file") as info:
            ckpt.wait()
        assert "not committed" in str(info.value)
        monkeypatch.setattr(sys, "executable", python)
        ckpt.save(2, model, optimizer)
        ckpt.wait()
        assert ckpt.steps() == [2]


def test_rank_0s_commit_runs_in_the_writer_process_and_one_killed_there_fails_that_save_by_name(tmp_path):
    """The step's indexes are merged into .metadata by the writer process (it stops at the pause
    point before .metadata: its pid, not the training process's, is in the marker); killed there,
    that save fails naming the commit, nothing is committed, and the next save commits. (A script of
    its own: were the commit in the training process, the pause would hold it, not this test.)"""
    marker = tmp_path / "paused"
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch\n"
        "from ckpttool import Checkpointer\n"
        "from ckpttool.errors import CkptError\n"
        "m = torch.nn.Linear(4, 4)\n"
        f"c = Checkpointer({str(tmp_path / 'run')!r}, async_save=True, writer='process')\n"
        "c.save(1, m)\n"
        "try:\n"
        "    c.wait()\n"
        "except CkptError as exc:\n"
        "    print('FAILED:', exc, flush=True)\n"
        "del os.environ['CKPTTOOL_PAUSE_AT']  # (the next writer process would stop there again)\n"
        "c.save(2, m)\n"
        "c.wait()\n"
        "print('STEPS:', c.steps(), flush=True)\n"
        "c.close()\n")
    env = dict(os.environ, CKPTTOOL_PAUSE_AT="before-metadata:1", CKPTTOOL_PAUSE_FILE=str(marker))
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            for _ in range(600):
                if os.path.exists(f"{marker}.0") and os.path.getsize(f"{marker}.0"):
                    break
                time.sleep(0.1)
            pid = int(open(f"{marker}.0").read())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"writer_process import serve" in f.read(), "the commit ran outside the writer process"
            assert not (tmp_path / "run" / "step-1").exists()
            os.kill(pid, signal.SIGKILL)
            assert proc.wait(timeout=120) == 0, (tmp_path / "log").read_text()
        finally:
            proc.kill()
            proc.wait()
    out = (tmp_path / "log").read_text()
    assert re.search(r"FAILED: .*: the writer process of rank 0 ended while committing step 1 \(killed by signal 9\)", out), out
    assert "not committed" in out and "STEPS: [2]" in out, out


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_an_error_in_rank_0s_commit_is_raised_as_the_commit_raised_it_whichever_writer(tmp_path, monkeypatch, writer):
    """The commit's own error comes back as it was raised (here the OSError of a full disk at the
    point before .metadata), not as a storage error of the writer process's making: a save that
    tolerate_failures lets pass is the same save with either writer."""
    monkeypatch.setenv("CKPTTOOL_FAIL_AT", "before-metadata:1")
    model, optimizer = _model()
    with Checkpointer(str(tmp_path / "run"), async_save=True, writer=writer, tolerate_failures=1) as ckpt:
        ckpt.save(1, model, optimizer)
        with pytest.raises(OSError, match="(?i)no space left on device") as failed:
            ckpt.wait()
        assert not isinstance(failed.value, CkptError)
        ckpt.save(2, model, optimizer)
        ckpt.wait()
        assert ckpt.steps() == [2]
