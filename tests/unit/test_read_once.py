"""Each byte range of a checkpoint is read once (issue 50, part 6): an object's record, hashed
against the step's manifest, is unpickled from the very bytes the hash proved, not read again; a
tensor record's head and tail, read to parse it, are hashed from those reads."""

from __future__ import annotations

import collections
import json
import os

import pytest
import torch

from ckpttool import Checkpointer, load
from ckpttool.errors import ChecksumError
from ckpttool.offline.verify import verify_path
from ckpttool.formats import open_source
from ckpttool.index import ObjectEntry, TensorEntry
from ckpttool.formats.dcp.source import LOCAL_HELD
from ckpttool.storage import LocalDisk, RangeReader


def _reads(monkeypatch) -> collections.Counter:
    """Every (file name, offset, length) read from a local disk, counted."""
    seen: collections.Counter = collections.Counter()
    preadv = LocalDisk.preadv

    def counted(self, handle, offset, outs, path, size):
        seen[(os.path.basename(path), offset, sum(out.nbytes for out in outs))] += 1
        return preadv(self, handle, offset, outs, path, size)

    monkeypatch.setattr(LocalDisk, "preadv", counted)
    return seen


def _asked(monkeypatch) -> collections.Counter:
    """Every (file name, offset, length) a reader was asked for, counted, whether the disk was read
    or a held span answered."""
    seen: collections.Counter = collections.Counter()
    readinto_parts = RangeReader.readinto_parts  # (every read of a range reader, readinto's too)

    def counted(self, offset, outs):
        seen[(os.path.basename(self.loc.path), offset, sum(out.nbytes for out in outs))] += 1
        return readinto_parts(self, offset, outs)

    monkeypatch.setattr(RangeReader, "readinto_parts", counted)
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
        asked, reads = _asked(monkeypatch), _reads(monkeypatch)
        results.append(run())
        spans = sorted(r[1:] for r in reads.elements() if r[0].endswith(".distcp"))  # (small records only: no windows)
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), spans  # objects first, then tensors: no byte twice
        read = {o for o in objects if asked[o]}  # (a span fetched around them is another range)
        assert read == objects if reads_all else len(read) >= 3  # (a load reads the objects it restores)
        assert all(asked[o] == 1 for o in read), {o: asked[o] for o in read}  # checked, then unpickled from those bytes
        monkeypatch.undo()
    assert results[0].extra == {"note": "x" * 300, "epoch": 3}  # the values, unpickled from the checked bytes
    assert results[1].ok


def test_a_load_reads_a_large_tensor_record_in_one_read_its_parse_after_it(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 300)  # 1.2 MB: read by its manifest's layout, parsed after
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
    # its head, its data (into the tensor) and its rest (pickle, zip directory) in one read, then
    # parsed and hashed from those bytes
    assert inside == [(name, start, length)], inside
    assert torch.equal(model.weight, expected["weight"])


def _layers(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(n)])  # 1 KiB weights: small records


def test_adjacent_small_records_a_load_needs_are_read_together_and_no_others(tmp_path, monkeypatch):
    Checkpointer(str(tmp_path / "run")).save(1, _layers(30))
    step = str(tmp_path / "run" / "step-1")
    with open_source(step) as source:
        index = source.index()
        records = {k: (e.chunks[0].location.offset, e.chunks[0].location.length) for k in index
                   for e in [index[k]] if isinstance(e, TensorEntry)}
    half = _layers(15)
    with torch.no_grad():
        for p in half.parameters():
            p.zero_()
    reads = _reads(monkeypatch)
    load(step, half, strict=False)
    data = [(offset, n) for (name, offset, n), count in reads.items() for _ in range(count) if name.endswith(".distcp")]
    needed = [records[f"model.{k}"] for k in half.state_dict()]
    assert len(needed) == 30 and len(data) <= 3, data  # 30 records in one read (or a few), not 30 reads
    # and no record the load does not need: every byte read lies in a needed record
    spans = sorted(needed)
    for offset, n in data:
        assert any(s <= offset and offset + n <= s + l for s, l in _merged(spans)), (offset, n)
    assert all(torch.equal(a, b) for a, b in zip(half.state_dict().values(), _layers(15).state_dict().values()))


def _merged(spans):
    out = []
    for s, n in spans:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


def test_a_convert_reads_no_byte_twice_when_a_tensor_alternates_between_files(tmp_path, monkeypatch):
    from ckpttool.offline.convert import convert

    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "plain-dcp-w2")  # plain torch DCP, 2 ranks
    reads = _reads(monkeypatch)
    convert(fixture, str(tmp_path / "out.pt"))
    by_file: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for (name, offset, n), count in reads.items():
        if name.endswith(".distcp"):
            by_file[name] += [(offset, n)] * count
    for name, spans in by_file.items():
        spans.sort()
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), (name, spans)  # no byte read twice
    assert sum(map(len, by_file.values())) <= 4  # each file's small records in one read or two, not one each


def test_a_truncated_file_is_reported_against_the_record_it_cut_not_a_neighbour_fetched_with_it(tmp_path):
    Checkpointer(str(tmp_path / "run")).save(1, _layers(6))
    step = str(tmp_path / "run" / "step-1")
    with open_source(step) as source:
        index = source.index()
        locations = {(loc.relative_path, loc.offset, loc.length): k for k in index for loc in
                     ([c.location for c in index[k].chunks] if isinstance(index[k], TensorEntry) else [index[k].location])}
    (name, offset, length), last = max(locations.items(), key=lambda kv: kv[0][1])  # the file's last record
    path = os.path.join(step, name)
    with open(path, "r+b") as f:
        f.truncate(offset + length - 10)
    report = verify_path(step)
    assert not report.ok and {p.key for p in report.problems} <= {last, None}, [p.line() for p in report.problems]
    assert any(p.key == last for p in report.problems)


def test_records_left_in_a_lost_span_are_fetched_together_again(tmp_path, monkeypatch):
    # 48 records of 58 KB in one file; two tensors read, then an object (its span replaces the
    # first), then the rest: they come in spans again, not one read each
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(120, 120, bias=False) for _ in range(48)])
    Checkpointer(str(tmp_path / "run")).save(1, model, extra={"note": "x", "epoch": 3})
    step = str(tmp_path / "run" / "step-1")
    keys = [f"model.{k}" for k in model.state_dict()]
    objects = sorted(_object_records(step))
    reads = _reads(monkeypatch)
    with open_source(step) as source:
        source.will_read(None)
        for key in keys[:2]:
            source.read_tensor(key)
        first = next(k for k in source.index() if isinstance(source.index()[k], ObjectEntry)
                     and source.index()[k].location.offset == objects[0][1])
        source.read_object(first)  # with the object after it: a span that replaces the first
        rest = [source.read_tensor(key) for key in keys[2:]]
    assert all(torch.equal(t, model.state_dict()[k[len("model."):]]) for t, k in zip(rest, keys[2:]))
    data = [r for r in reads.elements() if r[0].endswith(".distcp")]
    assert len(data) <= 10, data  # 46 records of 58 KB: 1 MiB spans of 17 or so, and the few before


def test_spans_are_held_in_at_most_local_held_files(tmp_path, monkeypatch):
    from ckpttool.offline.reshard import reshard

    torch.manual_seed(0)
    Checkpointer(str(tmp_path / "run")).save(1, torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(4)]))
    reshard(str(tmp_path / "run" / "step-1"), str(tmp_path / "w12"), world_size=12)  # each weight's rows in 12 files
    reads = _reads(monkeypatch)
    with open_source(str(tmp_path / "w12")) as source:
        source.will_read(None)
        holding = 0
        for key in source.index():
            if isinstance(source.index()[key], TensorEntry):
                source.read_tensor(key)
                holding = max(holding, source.held_spans())
    files = {name for name, _, _ in reads if name.endswith(".distcp")}
    assert len(files) == 12 and 1 < holding <= LOCAL_HELD  # (memory: LOCAL_HELD spans at most)


def _forge_layout(step: str, name: str, offset: int, shift: int) -> None:
    """Rewrite the manifest row of the record at ``offset`` of ``name`` to place its data ``shift``
    bytes later than its zip directory does, every digest made to match (the manifest file's, the
    commit record's own): a hostile step whose checksums all hold."""
    from ckpttool.checksums import PARTS, BlockHasher, hash_bytes, parts_digest

    with open(os.path.join(step, "__0.manifest"), "rb") as f:
        manifest = json.loads(f.read())
    row = next(r for r in manifest["records"][name] if r[0] == offset)
    start, nbytes = row[3]["data"]
    with open(os.path.join(step, name), "rb") as f:
        f.seek(offset)
        record = f.read(row[1])
    start += shift
    rest = hash_bytes(record[:start] + record[start + nbytes:])
    blocks = BlockHasher(64 << 10)
    blocks.update(memoryview(record)[start:start + nbytes])
    block_digests = blocks.finish()
    row[2:] = [parts_digest(rest, block_digests), {"data": [start, nbytes], "rest": rest, "blocks": block_digests, "digest": PARTS}]
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    with open(os.path.join(step, "__0.manifest"), "wb") as f:
        f.write(raw)
    with open(os.path.join(step, ".ckpttool-commit.json"), "rb") as f:
        commit = json.loads(f.read())
    commit["manifest"]["manifests"]["__0.manifest"][:2] = [len(raw), hash_bytes(raw)]
    del commit["checksum"]
    commit["checksum"] = {"algorithm": "xxh3_64", "digest": hash_bytes(json.dumps(commit, sort_keys=True, separators=(",", ":")).encode())}
    with open(os.path.join(step, ".ckpttool-commit.json"), "wb") as f:
        f.write(json.dumps(commit, sort_keys=True, separators=(",", ":")).encode())


def test_a_record_read_by_its_manifest_s_layout_is_refused_where_its_archive_places_the_data_elsewhere(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 300)  # a large record: read by its manifest's layout, parsed after
    Checkpointer(str(tmp_path / "run")).save(1, model)
    step = str(tmp_path / "run" / "step-1")
    with open_source(step) as source:
        (chunk,) = source.index()["model.weight"].chunks
    load(step, torch.nn.Linear(1024, 300))  # (the step as saved loads)
    _forge_layout(step, chunk.location.relative_path, chunk.location.offset, 64)
    with pytest.raises(ChecksumError, match="not laid out as the manifest written at commit says"):
        load(step, torch.nn.Linear(1024, 300))
    report = verify_path(step)
    assert not report.ok and "not laid out as the manifest written at commit says" in str(report.problems), report.problems


def test_a_part_of_a_large_record_is_read_in_one_read_with_the_rest_of_its_first_and_last_blocks(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 300)  # rows of 4 KiB; 64 KiB blocks of 16 rows
    Checkpointer(str(tmp_path / "run")).save(1, model)
    step = str(tmp_path / "run" / "step-1")
    with open_source(step) as source:
        (chunk,) = source.index()["model.weight"].chunks
        name, start = chunk.location.relative_path, chunk.location.offset
        reads = _reads(monkeypatch)
        part = source.read_tensor("model.weight", ((10, 0), (190, 1024)))  # starts and ends inside a block
    assert torch.equal(part, model.weight.detach()[10:200])
    data = (start + 64, start + 64 + 300 * 1024 * 4)  # (the record's data: after its 64-byte head)
    inside = [r for r in reads.elements() if r[0] == name and data[0] <= r[1] < data[1]]
    # the blocks the rows touch (checked whole), the rows straight into the tensor: one read
    assert len(inside) == 1 and inside[0][2] == 13 * (64 << 10), inside


def test_a_small_record_read_in_parts_is_checked_once_and_a_large_one_block_by_block(tmp_path, monkeypatch):
    """A part of a record under one block reads and checks all of it (its one block, its rest): the
    record is then checked, and its other parts (a reshard's) read only their own bytes. A part of
    a large record checks only its blocks: the others are still checked when read."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 300), torch.nn.Linear(10, 3))  # 0.weight: 19 blocks of 64 KiB
    Checkpointer(str(tmp_path / "run")).save(1, model)
    step = str(tmp_path / "run" / "step-1")
    with open_source(step) as source:
        asked = _asked(monkeypatch)
        rows = []
        for lo in (0, 100, 200):  # rows: straight into the tensor
            rows.append(source.read_tensor("model.0.bias", ((lo,), (100,))))
            if lo == 0:
                assert max(n for (_, _, n) in asked) >= 300 * 4  # the whole record's data: its one block
                asked.clear()
        assert torch.equal(torch.cat(rows), model[0].bias.detach())
        assert sorted(n for (_, _, n) in asked.elements()) == [400, 400], asked  # the others: their own bytes
        columns = [source.read_tensor("model.1.weight", ((0, lo), (3, 5))) for lo in (0, 5)]  # through a buffer
        assert torch.equal(torch.cat(columns, 1), model[1].weight.detach())
        first = source.read_tensor("model.0.weight", ((0, 0), (16, 1024)))  # its first block only
        assert torch.equal(first, model[0].weight.detach()[:16])
        (chunk,) = source.index()["model.0.weight"].chunks
        path = os.path.join(step, chunk.location.relative_path)
        at = chunk.location.offset + 64 + 250 * 1024 * 4  # (the record's data: after its 64-byte head) row 250
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(ChecksumError):
            source.read_tensor("model.0.weight", ((240, 0), (16, 1024)))


def test_a_reshard_reads_a_small_tensor_whole_once_and_copies_its_parts(tmp_path, monkeypatch):
    """A reshard asks for a tensor's boxes one target rank after another: one under
    ``WHOLE_PART_BYTES`` is read whole once (its record's lookup, parse and checks once, not once a
    part) and its parts are copied from it, bit for bit; a larger one is still read part by part,
    a small one the budget splits into slabs is read slab by slab, and one whose parts the sink asks
    for apart (the torch-ranks sink: rank by rank) part by part."""
    from ckpttool.engine import WHOLE_PART_BYTES
    from ckpttool.formats.dcp.source import DcpSource
    from ckpttool.offline.reshard import reshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 60), torch.nn.Linear(150, 120))
    assert model[0].weight.numel() * 4 <= WHOLE_PART_BYTES < model[1].weight.numel() * 4
    Checkpointer(str(tmp_path / "run")).save(1, model)
    step = str(tmp_path / "run" / "step-1")
    asked: list[tuple[str, object]] = []
    read_tensor = DcpSource.read_tensor

    def counted(self, key, box=None, out=None):
        asked.append((key, box))
        return read_tensor(self, key, box, out)

    monkeypatch.setattr(DcpSource, "read_tensor", counted)
    reshard(step, str(tmp_path / "r3"), world_size=3)
    # (whole, with the small tensors after it: read_tensors; or alone, whole, where its record does not check there)
    assert [box for key, box in asked if key == "model.0.weight"] in ([], [None])
    assert [box for key, box in asked if key == "model.0.bias"] in ([], [None])
    assert len([box for key, box in asked if key == "model.1.weight"]) == 3  # (its three parts)
    asked.clear()
    reshard(step, str(tmp_path / "r3-slabs"), world_size=3, memory_budget=4096)
    small = [box for key, box in asked if key == "model.0.weight"]
    assert len(small) > 3 and None not in small  # slab by slab, under the budget
    asked.clear()
    reshard(step, str(tmp_path / "r3-ranks"), world_size=3, to="torch-ranks")  # (asks rank by rank)
    small = [box for key, box in asked if key == "model.0.weight"]
    assert len(small) == 3 and None not in small  # each rank's part on its own: never the whole three times
    monkeypatch.undo()
    for out in ("r3", "r3-slabs", "r3-ranks"):
        with open_source(str(tmp_path / out)) as source:
            for key, value in model.state_dict().items():
                assert torch.equal(source.read_tensor(f"model.{key}"), value), (out, key)
