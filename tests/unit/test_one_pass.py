"""One pass over each byte (issue 50): ckpttool's save hashes each data byte of a tensor record once,
into its manifest's 64 KiB block digests, and derives the record's digest from its parts' digests;
it computes no CRC-32 (0 stands where the zip format puts one, as torch writes with
``set_crc32_options(False)``; torch's reader never checks it). Every reader of the step hashes the
record the way its row says, and a changed byte anywhere in a record is still found."""

from __future__ import annotations

import io
import json
import os
import random
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool import Checkpointer, load
from ckpttool.offline.reshard import reshard
from ckpttool.checksums import PARTS, RecordHasher, by_parts, hash_bytes, parts_digest
from ckpttool.errors import CkptError
from ckpttool.offline.verify import verify_path
from ckpttool.steps import parse_manifest_file

from ..helpers import flip_bit, tensor_data_spans


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 1.2 MB of weight: past the records written from a template (1 MiB), through the zip writer
    return torch.nn.Sequential(torch.nn.Linear(1024, 300), torch.nn.Linear(300, 4))


def _saved(tmp_path) -> tuple[torch.nn.Module, str]:
    model = _model()
    Checkpointer(str(tmp_path / "run")).save(1, model)
    return model, str(tmp_path / "run" / "step-1")


def _rows(step: str) -> dict[str, list]:
    raw = open(os.path.join(step, "__0.manifest"), "rb").read()
    records, _ = parse_manifest_file(raw, 64 << 10, [n for n in os.listdir(step) if n.endswith(".distcp")])
    return records


def test_a_saved_tensor_record_is_hashed_by_parts_and_carries_no_crc(tmp_path):
    model, step = _saved(tmp_path)
    rows = _rows(step)
    (file, file_rows), = rows.items()
    data = open(os.path.join(step, file), "rb").read()
    tensors = [row for row in file_rows if len(row) > 3]
    assert len(tensors) == 4 and any(row[3]["data"][1] > 1 << 20 for row in tensors)
    for start, length, digest, extra in tensors:
        assert extra["digest"] == PARTS and digest == parts_digest(extra["rest"], extra["blocks"])
        record = data[start:start + length]
        h = RecordHasher(extra)
        h.update(record)
        assert h.hexdigest() == digest and hash_bytes(record) != digest
        with zipfile.ZipFile(io.BytesIO(record)) as z:
            entries = [i for i in z.infolist() if "/data/" in i.filename]
            assert entries and all(i.CRC == 0 for i in entries)  # no CRC-32 computed
    assert all(len(row) == 3 for row in file_rows if row not in tensors)  # objects: hashed whole, as before
    assert verify_path(step).ok
    # torch's own reader loads it as it is (it never checks a record's CRC-32)
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=step, no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    # ckpttool's reads: whole records into place, and a reshard's reads in parts (rows of a record in order)
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load(step, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    reshard(step, str(tmp_path / "on3"), world_size=3)
    assert verify_path(str(tmp_path / "on3")).ok
    again = _model()
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    load(str(tmp_path / "on3"), again)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("where", ["data", "header", "tail"])
def test_a_changed_byte_of_a_record_hashed_by_parts_is_found_by_every_reader(tmp_path, where):
    model, step = _saved(tmp_path)
    file, start, end, key = next(s for s in tensor_data_spans(step) if s[3] == "model.0.weight")
    (_, file_rows), = _rows(step).items()
    row = next(r for r in file_rows if len(r) > 3 and r[0] + r[3]["data"][0] == start)
    at = {"data": (start + end) // 2, "header": row[0] + 20, "tail": end + 8}[where]
    flip_bit(file, at, 1)
    report = verify_path(step)
    assert report.problems and {p.key for p in report.problems} == {key}, report.problems
    assert not any("CRC-32" in p.what for p in report.problems)
    with pytest.raises(CkptError) as caught:
        load(step, _model())
    assert key in caught.value.what
    with pytest.raises(CkptError):
        reshard(step, str(tmp_path / "on3"), world_size=3)


def test_a_record_hasher_gives_one_digest_whatever_the_pieces():
    rng = random.Random(7)
    head, body, tail = os.urandom(300), os.urandom(200_000), os.urandom(77)
    record = head + body + tail
    extra = {"data": [len(head), len(body)], "rest": "", "blocks": "", "digest": PARTS}
    whole = RecordHasher(extra)
    whole.update(record)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(record)), rng.randint(1, 12)))
        h = RecordHasher(extra)
        for a, b in zip([0, *cuts], [*cuts, len(record)]):
            h.update(memoryview(record)[a:b])
        assert h.hexdigest() == whole.hexdigest()
    plain = RecordHasher(None)
    plain.update(record)
    assert plain.hexdigest() == hash_bytes(record) != whole.hexdigest()
    assert by_parts(extra) and not by_parts(None) and not by_parts({**extra, "digest": "whole"})


def test_a_manifest_row_with_another_digest_rule_is_refused(tmp_path):
    _, step = _saved(tmp_path)
    raw = json.loads(open(os.path.join(step, "__0.manifest"), "rb").read())
    files = list(raw["records"])
    assert parse_manifest_file(json.dumps(raw).encode(), 64 << 10, files) is not None
    for change in ({"digest": "whole"}, {"digest": None}, {"crc": 0}):
        bad = json.loads(json.dumps(raw))
        next(r for r in bad["records"][files[0]] if len(r) > 3)[3].update(change)
        assert parse_manifest_file(json.dumps(bad).encode(), 64 << 10, files) is None, change


def test_a_large_tensor_counted_and_hashed_piece_by_piece_has_its_exact_counts_and_digests(tmp_path):
    """A tensor over ``PIECE`` bytes is counted (NaN, Inf) and hashed a piece at a time, in one pass,
    before its slab is written: its block digests are those of the bytes in the file, and the
    health counts are exact wherever the non-finite values lie (first, middle and last piece)."""
    from ckpttool.checksums import BlockHasher
    from ckpttool.training.step_writer import PIECE

    torch.manual_seed(1)
    model = torch.nn.Linear(2 * PIECE // 4 // 1000 + 1, 1000, bias=False)  # 2 pieces and a part of one
    nbytes = model.weight.numel() * 4
    assert nbytes > 2 * PIECE and nbytes % PIECE
    flat = model.weight.data.view(-1)
    flat[[3, PIECE // 4 + 5, PIECE // 4 + 9, flat.numel() - 1]] = float("nan")
    flat[[PIECE // 4 - 1, 2 * PIECE // 4]] = float("inf")
    flat[flat.numel() - 7] = float("-inf")
    Checkpointer(str(tmp_path / "run")).save(1, model)
    step = tmp_path / "run" / "step-1"
    record = json.loads((step / ".ckpttool-commit.json").read_text())
    assert record["health"]["nonfinite"] == {"model.weight": {"nan": 4, "inf": 3}}, record["health"]
    (file, rows), = _rows(str(step)).items()
    data = (step / file).read_bytes()
    (row,) = [r for r in rows if len(r) > 3]
    start, length = row[3]["data"]
    assert length == nbytes
    blocks = BlockHasher()
    blocks.update(memoryview(data)[row[0] + start:row[0] + start + length])
    assert row[3]["blocks"] == blocks.finish()
    h = RecordHasher(row[3])
    h.update(data[row[0]:row[0] + row[1]])
    assert h.hexdigest() == row[2]
    assert verify_path(str(step)).ok
    again = torch.nn.Linear(model.in_features, 1000, bias=False)
    load(str(step), again)
    assert torch.equal(again.weight.view(torch.int32), model.weight.view(torch.int32))  # (NaN's bits too)
