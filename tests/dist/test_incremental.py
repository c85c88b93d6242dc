"""Incremental checkpoints on 2 gloo ranks: a step shares the previous step's file of frozen
tensors by hard link when their bytes are the same, and every step stays a plain DCP directory."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from ckpttool import Checkpointer

from ..helpers import cli, flip_bit
from .harness import run_ranks, spawn_ranks, wait_then_kill
from .incremental_workloads import (ckpttool_load, crash_during_incremental_save, damaged_shared_files, incremental_run, plain_load,
                                   resume_and_save)
from .workloads import assert_same


def commit_record(step_dir: str) -> dict:
    with open(os.path.join(step_dir, ".ckpttool-commit.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three steps saved incrementally with keep_last=2 (step 1 deleted by retention)."""
    base = tmp_path_factory.mktemp("incremental")
    root, expected = str(base / "run"), str(base / "expected")
    os.makedirs(expected)
    run_ranks(incremental_run, 2, root, expected)
    return root, expected


def expected_state(expected: str, step: int) -> dict:
    return torch.load(os.path.join(expected, f"{step}.pt"), weights_only=False)


def test_steps_share_the_frozen_files_and_say_what_they_wrote(run):
    root, _ = run
    assert Checkpointer(root).steps() == [2, 3]
    for rank in (0, 1):
        a, b = (os.stat(os.path.join(root, f"step-{s}", f"__{rank}_1.distcp")) for s in (2, 3))
        assert a.st_ino == b.st_ino and b.st_nlink == 2, "step 3 should share step 2's frozen file (a hard link)"
    first, second = commit_record(os.path.join(root, "step-2")), commit_record(os.path.join(root, "step-3"))
    shared = sum(os.path.getsize(p) for p in glob.glob(os.path.join(root, "step-3", "__*_1.distcp")))
    assert second["bytes_shared"] == shared > 0
    written = sum(os.path.getsize(p) for p in glob.glob(os.path.join(root, "step-3", "__*_0.distcp")))
    assert second["bytes_written"] == written
    assert first["bytes_shared"] == shared  # step 2 shared step 1's files too
    report = json.loads(cli("inspect", root, "--json"))
    rows = {s["step"]: s for s in report["steps"]}
    assert rows[3]["bytes_shared"] == shared and rows[3]["bytes_written"] == written


@pytest.mark.parametrize("step", [2, 3])
def test_plain_dcp_load_of_each_step_alone_is_bitwise(run, step, tmp_path):
    root, expected = run
    path = os.path.join(root, f"step-{step}")
    for where in (path, shutil.copytree(path, str(tmp_path / "alone"))):
        for r in run_ranks(plain_load, 2, where):
            assert_same(expected_state(expected, step), r["state"], f"dcp.load of step {step} at {where}")


def test_a_flipped_bit_in_a_shared_record_is_caught_by_verify_and_every_load(run, tmp_path):
    root, _ = run
    copy = str(tmp_path / "run")
    # copy the root keeping its hard links (cp -a), so the copy shares as the original does
    subprocess.run(["cp", "-a", root, copy], check=True)
    shared = os.path.join(copy, "step-3", "__1_1.distcp")
    assert os.stat(shared).st_nlink == 2
    flip_bit(shared, os.path.getsize(shared) // 3)
    for step in (2, 3):
        cli("verify", os.path.join(copy, f"step-{step}"), code=1)
        for r in run_ranks(ckpttool_load, 2, copy, step):
            assert "ChecksumError" in r.get("error", ""), r


def test_kill_9_during_an_incremental_save_leaves_the_newest_step(tmp_path):
    root, expected_path = str(tmp_path / "run"), str(tmp_path / "expected.pt")
    pause_file = str(tmp_path / "paused")
    with tempfile.TemporaryDirectory() as rdzv:
        procs, _ = spawn_ranks(crash_during_incremental_save, 2, rdzv, root, expected_path,
                               env={"CKPTTOOL_PAUSE_AT": "after-write", "CKPTTOOL_PAUSE_FILE": pause_file})
        wait_then_kill(procs, lambda: len(glob.glob(pause_file + ".*")) >= 2, what="ranks never reached the pause point")
    assert Checkpointer(root).steps() == [2]  # keep_last=1 deleted step 1, whose files step 2 still holds
    for r in run_ranks(plain_load, 2, os.path.join(root, "step-2")):
        assert_same(torch.load(expected_path, weights_only=False), r["state"], "step 2 after a kill -9 in step 3")
    cli("verify", root)


def test_async_incremental_saves_share_too(tmp_path):
    root, expected = str(tmp_path / "run"), str(tmp_path / "expected")
    os.makedirs(expected)
    run_ranks(incremental_run, 2, root, expected, (1, 2), None, True)
    a, b = (os.stat(os.path.join(root, f"step-{s}", "__0_1.distcp")) for s in (1, 2))
    assert a.st_ino == b.st_ino
    for r in run_ranks(plain_load, 2, os.path.join(root, "step-2")):
        assert_same(expected_state(expected, 2), r["state"], "dcp.load of async step 2")


def test_a_resume_on_another_world_size_writes_a_full_step_then_shares_again(tmp_path):
    """Saved on 2 ranks, resumed on 3: nothing lines up with the 2-rank files, so the first save
    writes every byte; the next shares its frozen files; both load bitwise with plain dcp.load."""
    root, expected = str(tmp_path / "run"), str(tmp_path / "expected")
    os.makedirs(expected)
    run_ranks(incremental_run, 2, root, expected, (1, 2), None)
    assert [r["resumed"] for r in run_ranks(resume_and_save, 3, root, expected, (3, 4))] == [2, 2, 2]
    third, fourth = commit_record(os.path.join(root, "step-3")), commit_record(os.path.join(root, "step-4"))
    assert third["bytes_shared"] == 0 and third["bytes_written"] > 0
    frozen = sorted(glob.glob(os.path.join(root, "step-4", "__*_1.distcp")))
    assert len(frozen) == 3 and fourth["bytes_shared"] == sum(os.path.getsize(p) for p in frozen) > 0
    for path in frozen:
        assert os.stat(path).st_ino == os.stat(path.replace("step-4", "step-3")).st_ino
    for step in (3, 4):
        for r in run_ranks(plain_load, 3, os.path.join(root, f"step-{step}")):
            assert_same(expected_state(expected, step), r["state"], f"dcp.load of step {step} on 3 ranks")


def test_a_damaged_shared_file_is_never_linked_again(tmp_path):
    """A bit flips in a step's frozen file after it committed (after step 1, and again after step
    2): the next save finds it, writes its frozen tensors afresh from memory and says so; every
    newest step loads bitwise, and verify ROOT names the damaged steps only."""
    root, expected = str(tmp_path / "run"), str(tmp_path / "expected")
    os.makedirs(expected)
    results = run_ranks(damaged_shared_files, 2, root, expected)
    for rank, r in enumerate(results):
        inodes = r["inodes"]
        assert inodes[0] != inodes[1] != inodes[2] and inodes[2] == inodes[3], f"rank {rank}: {inodes}"
        warned = [w for w in r["warnings"] if "no longer holds what was written" in w]
        assert len(warned) == 2 and f"step-1/__{rank}_1.distcp" in warned[0] and f"step-2/__{rank}_1.distcp" in warned[1], warned
        assert "afresh" in warned[0]
        assert r["loaded"] == [True] * 4, r["loaded"]  # each step, loaded when it was the newest
    for step in (3, 4):
        for r in run_ranks(ckpttool_load, 2, root, step):
            assert_same(expected_state(expected, step), r["state"], f"step {step}")
    report = json.loads(cli("verify", root, "--json", code=1))
    text = json.dumps(report)
    assert "step-1" in text and "step-2" in text and "step-3/" not in text and "step-4/" not in text, text[:2000]
