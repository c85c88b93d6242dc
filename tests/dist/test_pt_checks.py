"""A torch.save file loaded onto several ranks: each rank reads its own rows, and the records' CRC-32s
are still checked whole, from the pieces every rank read plus a share of the bytes none did."""

from __future__ import annotations

import pytest
import torch

from ckpttool.formats.torch_save import TorchSaveSource
from ckpttool.storage import resolve

from .harness import run_ranks
from .pt_check_workloads import COLS, ROWS, load_pt, model_and_state


def _write(tmp_path) -> str:
    path = str(tmp_path / "full.pt")
    torch.save(model_and_state(), path)
    return path


def _flip(path: str, key: str, at: float) -> None:
    """Flip one byte of ``key``'s record, at fraction ``at`` of it (1.0 and past: the record's
    bytes after the tensor's view)."""
    with TorchSaveSource(resolve(path)) as src:
        _, start, end = src.data_spans(key)[0]
    offset = start + int((end - start) * at) if at < 1 else end - 5
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_reads_its_rows_once_and_the_load_is_bitwise(tmp_path, world):
    path = _write(tmp_path)
    got = run_ranks(load_pt, world, path)
    expected = model_and_state()
    assert torch.equal(got[0]["state"]["weight"], expected["weight"]) and torch.equal(got[0]["state"]["bias"], expected["bias"])
    tail = 64 * COLS * 4  # the record's bytes after the view: read by the ranks in shares
    for r, g in enumerate(got):
        # its rows, the bias (replicated: every rank reads it), its share of the tail, the pickle and
        # the zip's directory (20 KiB here, in the process's second load). The old check scanned each
        # record whole on every rank first: 2 MiB more on each.
        assert g["read"] <= 1.1 * (g["shard"] + COLS * 4) + tail / world + 128 * 1024, (r, g["read"], g["shard"])


@pytest.mark.parametrize("at", [0.1, 0.9, 1.0], ids=["rank 0's rows", "the last rank's rows", "bytes no rank reads"])
def test_a_flipped_byte_anywhere_in_a_read_record_fails_the_load_on_every_rank(tmp_path, at):
    path = _write(tmp_path)
    _flip(path, "weight", at)
    got = run_ranks(load_pt, 2, path)
    for g in got:
        assert g["error"] is not None and g["error"].startswith("ChecksumError") and "'weight'" in g["error"], g["error"]
    # without verify, the bytes are what they are: the load succeeds (nothing else checks them)
    assert all(g["error"] is None for g in run_ranks(load_pt, 2, path, verify=False))


def test_rows_too_few_for_every_rank_still_check_the_whole_record(tmp_path):
    # 3 ranks over 512 rows: uneven shards; a flip in the middle of the record is found on every rank
    path = _write(tmp_path)
    _flip(path, "weight", 0.5)
    got = run_ranks(load_pt, 3, path)
    assert all(g["error"] is not None and "ChecksumError" in g["error"] for g in got), [g["error"] for g in got]
    assert ROWS % 3 != 0
