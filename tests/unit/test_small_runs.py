"""A run of small records is read together (issue 50, part 4): the small tensors a sink asks for one
after another are read with one ``Source.read_tensors``, a DCP file's back-to-back records in one
read, and each is checked from those bytes as a read of it alone checks it (the manifest's digest
of a ckpttool step's record, torch's CRC-32 of a plain DCP record); a record that does not check
is refused by name, as before."""

from __future__ import annotations

import os

import pytest
import torch

from ckpttool import Checkpointer, convert
from ckpttool.errors import ChecksumError
from ckpttool.formats import open_source
from ckpttool.formats.dcp.checks import RecordChecks
from ckpttool.formats.dcp.source import DcpSource

N = 40


class Many(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(256, generator=g)) for _ in range(N)])


def _ckpttool_step(tmp_path) -> tuple[str, Many]:
    model = Many()
    Checkpointer(str(tmp_path / "run")).save(1, model)
    return str(tmp_path / "run" / "step-1"), model


def _dcp_step(tmp_path) -> tuple[str, Many]:
    import torch.distributed.checkpoint as dcp

    model = Many()
    step = str(tmp_path / "dcp")
    dcp.save(model.state_dict(), checkpoint_id=step, no_dist=True)
    return step, model


def _key(step: str, i: int) -> str:
    with open_source(step) as source:
        return next(k for k in source.index() if k.endswith(f"p.{i}"))


def _flip_data(step: str, key: str, at: int = 100, chunk: int | None = None) -> None:
    """Flip one byte of ``key``'s tensor data, in its record (of its chunk ``chunk``, where it has several)."""
    with open_source(step) as source:
        spans = source.data_spans(key)
    assert chunk is not None or len(spans) == 1
    loc, start, _ = spans[chunk or 0]
    with open(loc.path, "r+b") as f:
        f.seek(start + at)
        byte = f.read(1)
        f.seek(start + at)
        f.write(bytes([byte[0] ^ 0x10]))


def _count_reads_alone(monkeypatch) -> list[str]:
    """The keys read on their own (``DcpSource.read_tensor``) from now on."""
    alone: list[str] = []
    read_tensor = DcpSource.read_tensor

    def one(self, key, box=None, out=None):
        alone.append(key)
        return read_tensor(self, key, box, out)

    monkeypatch.setattr(DcpSource, "read_tensor", one)
    return alone


def _count_parses(monkeypatch) -> list[str]:
    """The keys of the records parsed on their own (``DcpSource.archive``) from now on (verify's
    check of a record on its own parses it)."""
    alone: list[str] = []
    archive = DcpSource.archive

    def one(self, info, key, *args, **kwargs):
        alone.append(key)
        return archive(self, info, key, *args, **kwargs)

    monkeypatch.setattr(DcpSource, "archive", one)
    return alone


@pytest.mark.parametrize("make", [_ckpttool_step, _dcp_step], ids=["ckpttool", "dcp"])
def test_small_records_are_read_as_a_run_and_come_out_bitwise(tmp_path, monkeypatch, make):
    step, model = make(tmp_path)
    alone = _count_reads_alone(monkeypatch)
    runs: list[int] = []
    read_tensors = DcpSource.read_tensors

    def many(self, items):
        runs.append(len(items))
        return read_tensors(self, items)

    monkeypatch.setattr(DcpSource, "read_tensors", many)
    convert(step, str(tmp_path / "out.safetensors"), to="safetensors")
    assert sum(runs) == N and len(runs) == 1, runs  # all of them asked for at once (40 KiB: one batch)
    assert len(alone) <= 2, alone  # the first record of its layout is parsed (read alone), the others not
    monkeypatch.undo()
    with open_source(str(tmp_path / "out.safetensors")) as out:
        for i, p in enumerate(model.p):
            assert torch.equal(out.read_tensor(_key(step, i)), p.detach()), i


def _two_rank_step(tmp_path) -> tuple[str, Many]:
    """A DCP step of two ranks' files (what FSDP2 on two ranks writes): each tensor two chunks, its
    first half of rows a record in rank 0's file, the other half in rank 1's."""
    from ckpttool.offline.reshard import reshard

    step, model = _dcp_step(tmp_path)
    reshard(step, str(tmp_path / "two"), world_size=2)
    with open_source(str(tmp_path / "two")) as source:
        chunks = source.index()[_key(str(tmp_path / "two"), 0)].chunks
        assert len(chunks) == 2 and chunks[0].location.relative_path != chunks[1].location.relative_path
    return str(tmp_path / "two"), model


def test_a_tensor_s_chunks_in_two_ranks_files_are_read_in_a_run_each_and_come_out_bitwise(tmp_path, monkeypatch):
    step, model = _two_rank_step(tmp_path)
    alone = _count_reads_alone(monkeypatch)
    convert(step, str(tmp_path / "out.safetensors"), to="safetensors")
    assert alone == [], alone  # (the first record of its layout parsed from the run's span, then taken)
    monkeypatch.undo()
    with open_source(str(tmp_path / "out.safetensors")) as out:
        for i, p in enumerate(model.p):
            assert torch.equal(out.read_tensor(_key(step, i)), p.detach()), i


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("which", [0, 20, N - 1])
def test_a_damaged_chunk_of_a_two_rank_tensor_is_refused_by_name_and_nothing_is_written(tmp_path, which, half):
    """One flipped byte in either rank's record of a tensor: whatever the other rank's record took,
    the tensor is refused by name (its other half is never written with a hole)."""
    step, _ = _two_rank_step(tmp_path)
    key = _key(step, which)
    _flip_data(step, key, 3, half)
    with pytest.raises(ChecksumError) as err:
        convert(step, str(tmp_path / "out.safetensors"), to="safetensors")
    assert key in str(err.value), err.value
    assert not os.path.exists(tmp_path / "out.safetensors")


@pytest.mark.parametrize("make", [_ckpttool_step, _dcp_step], ids=["ckpttool", "dcp"])
@pytest.mark.parametrize("which", [20, N - 1])
def test_a_damaged_record_in_a_run_is_refused_by_name_and_nothing_is_written(tmp_path, make, which):
    step, _ = make(tmp_path)
    key = _key(step, which)
    _flip_data(step, key)
    with pytest.raises(ChecksumError) as err:
        convert(step, str(tmp_path / "out.safetensors"), to="safetensors")
    assert repr(key) in str(err.value) or key in str(err.value), err.value
    assert not os.path.exists(tmp_path / "out.safetensors")


@pytest.mark.parametrize("make", [_ckpttool_step, _dcp_step], ids=["ckpttool", "dcp"])
def test_a_record_whose_headers_differ_from_its_layout_is_parsed_and_refused(tmp_path, make):
    """A byte of a record's pickle changed: its parse is not the kept one, so it is read alone, and
    refused (its manifest digest; a plain DCP record's pickle by its zip CRC-32, as its data's
    CRC-32 does not cover it)."""
    step, _ = make(tmp_path)
    key = _key(step, 20)
    with open_source(step) as source:
        chunk = source.index()[key].chunks[0]
    path = os.path.join(step, chunk.location.relative_path)
    with open(path, "r+b") as f:
        record = bytearray(f.read())[chunk.location.offset:chunk.location.offset + chunk.location.length]
        at = record.index(b"data.pkl") + 40  # (inside the pickle, after its local header)
        f.seek(chunk.location.offset + at)
        f.write(bytes([record[at] ^ 0x01]))
    with pytest.raises(Exception) as err:
        convert(step, str(tmp_path / "out.safetensors"), to="safetensors")
    assert key in str(err.value), err.value
    assert not os.path.exists(tmp_path / "out.safetensors")


def test_a_load_reads_the_small_tensors_as_a_run_and_refuses_a_damaged_one(tmp_path, monkeypatch):
    from ckpttool import load

    step, model = _ckpttool_step(tmp_path)
    alone = _count_reads_alone(monkeypatch)

    def checked_alone(self, key, *args, **kwargs):
        alone.append(key)
        return read_chunk(self, key, *args, **kwargs)

    read_chunk = RecordChecks.read_chunk
    monkeypatch.setattr(RecordChecks, "read_chunk", checked_alone)  # (a load's own read of one record)
    fresh = Many()
    with torch.no_grad():
        for p in fresh.p:
            p.zero_()
    load(step, fresh)
    assert len(alone) <= 2, alone
    monkeypatch.undo()
    for i, (a, b) in enumerate(zip(fresh.p, model.p)):
        assert torch.equal(a, b), i
    key = _key(step, 20)
    _flip_data(step, key)
    with pytest.raises(ChecksumError) as err:
        load(step, Many())
    assert key in str(err.value), err.value


@pytest.mark.parametrize("make", [_ckpttool_step, _dcp_step], ids=["ckpttool", "dcp"])
def test_verify_checks_the_small_records_as_a_run_and_names_a_damaged_one(tmp_path, monkeypatch, make):
    from ckpttool.offline.verify import verify_path

    step, _ = make(tmp_path)
    alone = _count_parses(monkeypatch)
    report = verify_path(step)
    assert report.ok, report.problems
    assert len(alone) <= 2, alone  # the first record of its layout on its own, the others in a run
    monkeypatch.undo()
    keys = [_key(step, i) for i in (20, N - 1)]
    for key in keys:
        _flip_data(step, key)
    report = verify_path(step)
    assert not report.ok
    assert sorted({p.key for p in report.problems}) == sorted(keys), report.problems


@pytest.mark.parametrize("change", ["dtype", "shape", "chunk"])
@pytest.mark.parametrize("src,dst", [("p.21", "p.20"), ("p.20", "p.21")])
def test_verify_names_a_key_whose_metadata_points_at_another_key_s_record_as_another_tensor(tmp_path, change, src, dst):
    """A damaged ``.metadata`` that gives ``dst`` the record of ``src`` as an int32 or a 16x16
    tensor, or as one chunk of half its rows: the record is checked as each key's on its own terms (``src``'s passes, ``dst``'s is
    named), not once for both, whichever of them the walk meets first."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from ckpttool.offline.verify import verify_path

    step, _ = _dcp_step(tmp_path)
    with open(os.path.join(step, ".metadata"), "rb") as f:
        md = pickle.load(f)  # (the test's own file, written by dcp.save above)
    info = md.storage_data.pop(MetadataIndex(dst, (0,), 0))
    tensor = md.state_dict_metadata[dst]
    if change == "dtype":
        tensor = dataclasses.replace(tensor, properties=dataclasses.replace(tensor.properties, dtype=torch.int32))
        md.storage_data[MetadataIndex(dst, (0,), 0)] = md.storage_data[MetadataIndex(src, (0,), 0)]
    elif change == "chunk":  # (one chunk of half its rows: its record holds all of them)
        tensor = dataclasses.replace(tensor, chunks=[ChunkStorageMetadata(torch.Size([0]), torch.Size([128]))])
        md.storage_data[MetadataIndex(dst, (0,), 0)] = md.storage_data[MetadataIndex(src, (0,), 0)]
    else:
        tensor = dataclasses.replace(tensor, size=torch.Size([16, 16]),
                                     chunks=[ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([16, 16]))])
        md.storage_data[MetadataIndex(dst, (0, 0), 0)] = md.storage_data[MetadataIndex(src, (0,), 0)]
    assert info is not None
    md.state_dict_metadata[dst] = tensor
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    report = verify_path(step)
    assert {p.key for p in report.problems} == {dst}, report.problems
    assert any(" holds torch.float32[256], .metadata says " in p.what for p in report.problems), report.problems


def test_records_asked_for_out_of_their_file_order_are_read_apart_within_the_span_bound(tmp_path, monkeypatch):
    """A run holds only records back to back in their file, up to LOCAL_SPAN: asked for last to
    first, each record is a read of its own (no span reaches back, none reads the gaps between)."""
    from ckpttool.formats.dcp.source import LOCAL_SPAN

    step, model = _two_rank_step(tmp_path)
    spans: list[int] = []
    read_span = DcpSource.read_span

    def counted(self, path, start, length):
        spans.append(length)
        return read_span(self, path, start, length)

    monkeypatch.setattr(DcpSource, "read_span", counted)
    with open_source(step) as source:
        keys = [_key(step, i) for i in range(N)]
        records = [c.location.length for k in keys for c in source.index()[k].chunks]
        outs = [torch.empty(256) for _ in keys]
        source.read_tensors(list(zip(keys, outs))[::-1])
    assert all(0 < n <= LOCAL_SPAN for n in spans) and sum(spans) == sum(records), (spans, records)
    for out, p in zip(outs, model.p):
        assert torch.equal(out, p.detach())
    spans.clear()
    with open_source(step) as source:
        source.read_tensors(list(zip(keys, outs)))
    assert len(spans) == 2 and sum(spans) == sum(records), spans  # in file order: one span a rank's file
    from ckpttool.formats.dcp import source as source_module

    spans.clear()
    monkeypatch.setattr(source_module, "LOCAL_SPAN", 3 * max(records))
    with open_source(step) as source:
        source.read_tensors(list(zip(keys, outs)))
    assert len(spans) > 2 and all(n <= 3 * max(records) for n in spans) and sum(spans) == sum(records), spans
    for out, p in zip(outs, model.p):
        assert torch.equal(out, p.detach())


def test_verify_checks_a_two_rank_step_s_records_as_runs_and_names_a_damaged_chunk(tmp_path, monkeypatch):
    from ckpttool.offline.verify import verify_path

    step, _ = _two_rank_step(tmp_path)
    alone = _count_parses(monkeypatch)
    report = verify_path(step)
    assert report.ok, report.problems
    assert len(alone) <= 4, alone  # the first record of its layout in each file on its own, the others in runs
    monkeypatch.undo()
    damaged = []
    for which, half in ((20, 1), (N - 1, 0)):
        damaged.append(_key(step, which))
        _flip_data(step, damaged[-1], 5, half)
    report = verify_path(step)
    assert not report.ok
    assert sorted({p.key for p in report.problems}) == sorted(damaged), report.problems


def test_verify_names_a_chunk_whose_metadata_points_at_its_tensor_s_other_chunk_s_record(tmp_path):
    """A damaged ``.metadata`` that gives a tensor's first chunk (128 rows) the record of its second
    (127 rows): the record passes as the second chunk's, and the first chunk is still checked
    against it on its own terms, and named."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from ckpttool.offline.reshard import reshard
    from ckpttool.offline.verify import verify_path

    # ("a" first: its records are parsed first, so w's are then of a known layout, checked in a run)
    dcp.save({"a": torch.randn(255), "w": torch.randn(255)}, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    step = str(tmp_path / "two")
    reshard(str(tmp_path / "one"), step, world_size=2)
    with open(os.path.join(step, ".metadata"), "rb") as f:
        md = pickle.load(f)  # (the test's own file, written by reshard above)
    md.storage_data[MetadataIndex("w", (0,))] = md.storage_data[MetadataIndex("w", (128,))]
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    report = verify_path(step)
    assert {p.key for p in report.problems} == {"w"}, report.problems
    assert any("holds torch.float32[127], .metadata says torch.float32[128]" in p.what for p in report.problems), report.problems
