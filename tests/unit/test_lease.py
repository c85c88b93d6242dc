"""One writer per training root: a second live job is refused with one line naming the holder; a
holder that is gone is taken over with a warning; a process may use several Checkpointers."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from ckpttool import Checkpointer
from ckpttool.cli import main
from ckpttool.errors import LeaseError
from ckpttool.training.lease import LEASE_FILE

HOLDER = r"""
import sys, time, torch
from ckpttool import Checkpointer
ckpt = Checkpointer(sys.argv[1])
ckpt.save(1, torch.nn.Linear(2, 2))
print("holding", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another job (a live process) that saved step 1 into tmp_path/run and holds its lease."""
    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        yield root, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_job_is_refused_naming_the_holder(holder, caplog):
    root, proc = holder
    model = torch.nn.Linear(2, 2)
    with pytest.raises(LeaseError) as info:
        Checkpointer(root).save(2, model)
    assert f"pid {proc.pid} on {socket.gethostname()}" in str(info.value) and str(root) in str(info.value)
    assert Checkpointer(root).steps() == [1]  # nothing of the second job's step was written
    assert sorted(os.listdir(root)) == [LEASE_FILE, "step-1"]
    result = CliRunner().invoke(main, ["clean", str(root)])  # clean would remove the holder's save in progress
    assert result.exit_code == 2 and "another job holds this training root" in result.stderr
    proc.send_signal(signal.SIGKILL)  # the holder dies without releasing: the next job takes over
    proc.wait()
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        ckpt = Checkpointer(root)
        ckpt.save(2, model)
    assert "taking over the lease" in caplog.text and f"pid {proc.pid}" in caplog.text
    assert ckpt.steps() == [1, 2]
    ckpt.close()
    assert not (root / LEASE_FILE).exists()  # released


def test_another_hosts_lease_is_refused_until_stale(tmp_path, caplog):
    root = tmp_path / "run"
    root.mkdir()
    lease = {"host": "elsewhere", "pid": 1, "started": None, "job": "SLURM_JOB_ID=42", "token": "x", "time": time.time()}
    (root / LEASE_FILE).write_text(json.dumps(lease))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(LeaseError, match="pid 1 on elsewhere, SLURM_JOB_ID=42"):
        Checkpointer(root, lease_stale_after=600).save(1, model)
    lease["time"] = time.time() - 700
    (root / LEASE_FILE).write_text(json.dumps(lease))
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        Checkpointer(root, lease_stale_after=600).save(1, model)
    assert "taking over the lease" in caplog.text


def test_one_process_may_use_several_checkpointers_and_a_lost_lease_is_noticed(tmp_path):
    root = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    a = Checkpointer(root)
    a.save(1, model)
    b = Checkpointer(root)  # same process: not another job
    b.save(2, model)
    with pytest.raises(LeaseError, match="lost its lease"):
        a.save(3, model)  # b took the lease over: a notices at its next save
    assert b.steps() == [1, 2]
    b.close()


def test_clean_of_a_missing_root_exits_2(tmp_path):
    for args in (["clean", str(tmp_path / "nope")], ["clean", str(tmp_path / "nope"), "--dry-run"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "does not exist" in result.stderr, (args, result.output)


def test_a_lease_file_appears_only_whole(tmp_path, monkeypatch):
    """Another job reads the lease as soon as its name exists, and takes an unreadable lease for
    none. So the name must appear only once the content is written and durable (checked at the
    fsync), a second create must fail without touching it, and no hidden file may be left."""
    from ckpttool.storage import resolve

    loc = resolve(str(tmp_path / "root" / LEASE_FILE))
    real_fsync, seen = os.fsync, []

    def fsync(fd):
        seen.append(os.path.exists(loc.path))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert loc.create_exclusive(b'{"first": 1}')
    assert seen and not any(seen), "the lease's name existed before its content was durable"
    assert not loc.create_exclusive(b'{"second": 2}')
    assert loc.read_bytes() == b'{"first": 1}'
    assert sorted(os.listdir(tmp_path / "root")) == [LEASE_FILE]
