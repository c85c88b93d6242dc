"""Incremental saves in one process: what is shared, what is written, on a local disk and in memory://."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import pytest
import torch

from ckpttool import Checkpointer


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    return m


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)


def record(root: str, step: int) -> dict:
    with open(os.path.join(root, f"step-{step}", ".ckpttool-commit.json")) as fh:
        return json.load(fh)


def test_unchanged_frozen_parameters_are_shared_and_changed_ones_written(tmp_path):
    root = str(tmp_path / "run")
    m = model()
    ck = Checkpointer(root, incremental=True)
    ck.save(1, m)
    first = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m[1].weight += 1  # trains: in the rank's main file
    ck.save(2, m)
    a, b = (os.stat(os.path.join(root, f"step-{s}", "__0_1.distcp")) for s in (1, 2))
    assert a.st_ino == b.st_ino, "step 2 should share step 1's file of frozen parameters"
    assert record(root, 1)["bytes_shared"] == 0 and record(root, 2)["bytes_shared"] == a.st_size
    with torch.no_grad():
        m[0].weight[3, 3] += 1  # a frozen parameter changed in place: its blocks differ, so it is written
    ck.save(3, m)
    c = os.stat(os.path.join(root, "step-3", "__0_1.distcp"))
    assert c.st_ino != b.st_ino and record(root, 3)["bytes_shared"] == 0
    for step in (1, 2, 3):
        fresh = model(seed=step + 10)
        Checkpointer(root).load(fresh, step=step)
        if step == 3:
            assert same(fresh, m)
    fresh = model(seed=99)
    Checkpointer(root).load(fresh, step=1)
    assert all(torch.equal(v.view(torch.uint8), first[k].view(torch.uint8)) for k, v in fresh.state_dict().items())


def test_an_object_store_shares_by_copy_and_every_step_loads(tmp_path):
    root = f"memory://incremental-{uuid.uuid4().hex}"
    try:
        m = model()
        ck = Checkpointer(root, incremental=True, keep_last=1)  # retention deletes the step shared from
        ck.save(1, m)
        ck.save(2, m)
        fresh = model(seed=5)
        Checkpointer(root).load(fresh)
        assert same(fresh, m) and Checkpointer(root).steps() == [2]
    finally:
        fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_a_filesystem_without_hard_links_writes_every_byte_and_says_so_once(tmp_path):
    """Where the disk refuses a hard link (EPERM, as vfat and some network mounts do), each save
    writes its frozen file in full, every step loads alone, and the warning comes once (once per
    process: the saves run in a fresh one, whose os.link refuses)."""
    import subprocess
    import sys

    root = str(tmp_path / "run")
    saves = f"""
import errno, os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_incremental import model
from ckpttool import Checkpointer

def refuse(src, dst, *args, **kwargs):
    raise OSError(errno.EPERM, "Operation not permitted", dst)

os.link = refuse
m = model()
ck = Checkpointer({root!r}, incremental=True)
for step in (1, 2, 3):
    ck.save(step, m)
"""
    out = subprocess.run([sys.executable, "-c", saves], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = model()
    files = [os.stat(os.path.join(root, f"step-{s}", "__0_1.distcp")) for s in (1, 2, 3)]
    assert len({f.st_ino for f in files}) == 3 and all(f.st_nlink == 1 for f in files)
    assert all(record(root, s)["bytes_shared"] == 0 for s in (1, 2, 3))
    assert record(root, 3)["bytes_written"] == record(root, 1)["bytes_written"]
    said = [line for line in out.stderr.splitlines() if "cannot share a file" in line]
    assert len(said) == 1, out.stderr[-3000:]
    for step in (1, 2, 3):
        fresh = model(seed=step + 20)
        Checkpointer(root).load(fresh, step=step)
        assert same(fresh, m)


def test_a_rank_index_that_names_another_file_is_refused_at_commit(tmp_path):
    """A chunk entry's file (fifth element) must be the rank's own frozen file: a rank index
    naming any other path (here one out of the step) never reaches .metadata."""
    from ckpttool.errors import CorruptCheckpointError
    from ckpttool.rendezvous import part_name as partial_name
    from ckpttool.training.step_writer import commit_metadata, read_rank_indexes, write_rank
    from ckpttool.storage import resolve

    step = resolve(str(tmp_path / "step"))
    step.makedirs()
    m = model()
    write_rank(step, 0, {"model": m.state_dict()}, frozen=frozenset({"model.0.weight"}))
    path = tmp_path / "step" / partial_name(0)
    index = json.loads(path.read_text())
    chunk = index["tensors"]["model.0.weight"]["chunks"][0]
    assert chunk[4] == "__0_1.distcp"
    chunk[4] = "../../outside.distcp"
    path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="not its own"):
        commit_metadata(step, read_rank_indexes(step, 1, timeout=5))
    assert not (tmp_path / "step" / ".metadata").exists()


def test_a_shared_file_whose_version_moved_is_read_and_checked_before_a_link(tmp_path, caplog):
    """The link trusts an unchanged storage version; a moved one (touched, copied back) is read and
    every record checked: intact, it is linked; a record that differs from its digest, it is not
    (the frozen tensors are written afresh, said in one line)."""
    from ckpttool.training import step_writer as dcp_save

    root = str(tmp_path / "run")
    m = model()
    ck = Checkpointer(root, incremental=True)
    ck.save(1, m)
    first = os.path.join(root, "step-1", "__0_1.distcp")
    os.utime(first, ns=(1, 1))  # the version moves, the bytes do not
    reads = []
    real = dcp_save.hash_range
    dcp_save.hash_range = lambda *a: reads.append(a[1]) or real(*a)
    try:
        ck.save(2, m)
    finally:
        dcp_save.hash_range = real
    assert reads, "a moved version must be checked by reading the records"
    assert os.stat(os.path.join(root, "step-2", "__0_1.distcp")).st_ino == os.stat(first).st_ino
    assert not [r for r in caplog.records if "no longer holds" in r.getMessage()]
    size = os.path.getsize(first)
    with open(first, "r+b") as fh:  # damage, then the modification time put back as it was
        st = os.stat(first)
        fh.seek(size // 2)
        byte = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([byte[0] ^ 1]))
    os.utime(first, ns=(st.st_atime_ns, 5))  # (another mtime than the proof's: read again, found)
    ck.save(3, m)
    assert os.stat(os.path.join(root, "step-3", "__0_1.distcp")).st_ino != os.stat(first).st_ino
    assert [r for r in caplog.records if "no longer holds what was written" in r.getMessage()]
    fresh = model(seed=5)
    Checkpointer(root).load(fresh, step=3)
    assert same(fresh, m)
