"""Each byte range of a checkpoint is read once (issue 50, part 6): an object's record, hashed
against the step's manifest, is unpickled from the very bytes the hash proved, not read again; a
tensor record's head and tail, read to parse it, are hashed from those reads."""

from __future__ import annotations

import collections
import os

import torch

from ckpttool import Checkpointer, load
from ckpttool.offline.verify import verify_path
from ckpttool.formats import open_source
from ckpttool.index import ObjectEntry, TensorEntry
from ckpttool.storage import LocalDisk


def _reads(monkeypatch) -> collections.Counter:
    """Every (file name, offset, length) read from a local disk, counted."""
    seen: collections.Counter = collections.Counter()
    pread = LocalDisk.pread

    def counted(self, handle, offset, out, path, size):
        seen[(os.path.basename(path), offset, out.nbytes)] += 1
        return pread(self, handle, offset, out, path, size)

    monkeypatch.setattr(LocalDisk, "pread", counted)
    return seen


def _object_records(step: str) -> set[tuple[str, int, int]]:
    with open_source(step) as source:
        index = source.index()
        return {(e.location.relative_path, e.location.offset, e.location.length)
                for e in (index[k] for k in index) if isinstance(e, ObjectEntry)}


def test_an_object_record_is_read_once_by_a_load_and_by_verify(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    Checkpointer(str(tmp_path / "run")).save(1, model, opt, extra={"note": "x" * 300, "epoch": 3})
    step = str(tmp_path / "run" / "step-1")
    objects = _object_records(step)
    assert len(objects) >= 3  # the extras, the optimizer's hyper-parameters
    results = []
    for run, reads_all in ((lambda: load(step, model, opt), False), (lambda: verify_path(step), True)):
        reads = _reads(monkeypatch)
        results.append(run())
        read = {r for r in reads if r in objects}
        assert read == objects if reads_all else len(read) >= 3  # (a load reads the objects it restores)
        assert all(reads[r] == 1 for r in read)  # each once: checked, then unpickled from the same bytes
        monkeypatch.undo()
    assert results[0].extra == {"note": "x" * 300, "epoch": 3}  # the values, unpickled from the checked bytes
    assert results[1].ok


def test_a_load_reads_a_large_tensor_record_in_three_reads(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 300)  # 1.2 MB: parsed from its head and tail, not read whole
    Checkpointer(str(tmp_path / "run")).save(1, model)
    step = str(tmp_path / "run" / "step-1")
    with open_source(step) as source:
        index = source.index()
        (record,) = [(c.location.relative_path, c.location.offset, c.location.length)
                     for e in (index[k] for k in index) if isinstance(e, TensorEntry) for c in e.chunks if c.location.length > 1 << 20]
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    reads = _reads(monkeypatch)
    load(step, model)
    name, start, length = record
    inside = [r for r in reads.elements() if r[0] == name and start <= r[1] < start + length]
    assert len(inside) == 3, inside  # the zip directory at its end, its head, its data: then hashed from them
    assert torch.equal(model.weight, expected["weight"])
