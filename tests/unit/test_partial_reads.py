"""Verified partial reads: a load that needs part of a record reads only the manifest blocks its
box touches, and checks each of them (and, once per record, the bytes around its data).

One process plays rank R of a job of W ranks in torch's fake process group (no collective runs in
a load), so a DTensor's box can be a single block of a 32 MiB record. Bytes read are counted by
the kernel (``rchar`` of ``/proc/self/io``: every read syscall of this process).
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ckpttool import Checkpointer, compat
from ckpttool.checksums import HASH_BLOCK
from ckpttool.errors import ChecksumError
from ckpttool.formats.dcp import DcpSource
from ckpttool.training.read_into import load_into
from ckpttool.steps import read_commit_record
from ckpttool.storage import resolve
from tests.helpers import cli, flip_bit

ROWS, COLS = 256, HASH_BLOCK // 4  # float32 rows of exactly one block: a 32 MiB record
KEY = "model.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A ckpttool step holding one 32 MiB tensor, and the tensor."""
    root = tmp_path_factory.mktemp("partial") / "run"
    model = torch.nn.Linear(COLS, ROWS, bias=False)
    torch.nn.init.normal_(model.weight, generator=torch.Generator().manual_seed(0))
    Checkpointer(str(root)).save(1, model)
    (step,) = glob.glob(str(root / "step-*"))
    return step, model.weight.detach().clone()


def data_start(step: str) -> int:
    """Where the tensor's data begins in its data file, from the manifest."""
    ((name, (length, digest, files)),) = read_commit_record(resolve(step))["manifest"]["manifests"].items()
    (rows,) = json.loads(open(os.path.join(step, name), "rb").read())["records"].values()
    (row,) = [r for r in rows if len(r) == 4]
    return row[0] + row[3]["data"][0]


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar"))


def load_box(step: str, rank: int, world: int, placement=Shard(0)) -> tuple[torch.Tensor, tuple, int]:
    """Rank ``rank`` of ``world`` loads its box of the tensor; (its local tensor, its global
    slices, bytes this process read during the load)."""
    with compat.fake_rank(rank, world):
        mesh = init_device_mesh("cpu", (world,))
        shape, offset = compute_local_shape_and_global_offset((ROWS, COLS), mesh, [placement])
        value = DTensor.from_local(torch.full(shape, float("nan")), mesh, [placement], run_check=False,
                                   shape=(ROWS, COLS), stride=(COLS, 1))
        source = DcpSource(resolve(step), verify=True, rank=rank)
        try:
            source.index()
            before = rchar()
            load_into(source, {KEY: value})
            read = rchar() - before
        finally:
            source.close()
        return value.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape)), read


def test_a_load_needing_one_block_reads_about_that_block(saved):
    step, full = saved
    local, where, read = load_box(step, 5, ROWS)  # one row: one block of the record's 256
    assert torch.equal(local, full[where])
    assert local.numel() * 4 == HASH_BLOCK
    # the block, and a few KiB to parse the record and check the bytes around its data
    assert HASH_BLOCK <= read <= HASH_BLOCK + (48 << 10), f"read {read} bytes for one block of a {ROWS * HASH_BLOCK}-byte record"


@pytest.mark.parametrize("rank,world", [(3, 7), (1, 2)])
def test_a_partial_load_reads_its_rows_and_at_most_a_block_more_at_each_end(saved, rank, world):
    step, full = saved
    local, where, read = load_box(step, rank, world)
    assert torch.equal(local, full[where])
    need = local.numel() * 4
    assert need <= read <= need + 2 * HASH_BLOCK + (48 << 10)


def test_a_column_shard_is_read_through_the_blocks_it_spans(saved):
    step, full = saved
    local, where, _ = load_box(step, 2, 3, Shard(1))  # every row, a third of each: not one byte range
    assert torch.equal(local, full[where])


def corrupted(saved, tmp_path, offset: int) -> str:
    """A copy of the step with one bit flipped ``offset`` bytes into the tensor's data (negative:
    before it, in the record's headers)."""
    step, _ = saved
    copy = tmp_path / "step-1"
    os.makedirs(copy)
    for name in os.listdir(step):
        with open(os.path.join(step, name), "rb") as src, open(copy / name, "wb") as dst:
            dst.write(src.read())
    flip_bit(str(copy / "__0_0.distcp"), data_start(str(copy)) + offset, 4)
    return str(copy)


def test_a_flipped_bit_in_a_block_a_partial_load_reads_is_caught(saved, tmp_path):
    step = corrupted(saved, tmp_path, 5 * HASH_BLOCK + 1000)
    with pytest.raises(ChecksumError) as err:
        load_box(step, 5, ROWS)
    text = str(err.value)
    assert KEY in text and "__0_0.distcp" in text and "rank 5" in text and "block 5" in text, text


def test_a_flipped_bit_is_caught_on_the_scratch_path_too(saved, tmp_path):
    step = corrupted(saved, tmp_path, 7 * HASH_BLOCK + 4)  # row 7, column 1: in rank 0's third of the columns
    with pytest.raises(ChecksumError, match="block 7"):
        load_box(step, 0, 3, Shard(1))


def test_a_flipped_bit_in_the_records_headers_is_caught(saved, tmp_path):
    step = corrupted(saved, tmp_path, -10)  # the zip entry's padding, just before the data: parses fine
    with pytest.raises(ChecksumError, match="headers of the record"):
        load_box(step, 5, ROWS)


def test_a_block_the_load_does_not_read_is_not_claimed_checked(saved, tmp_path):
    """Damage outside the box loads fine (it was never read), and verify, which reads it, says so."""
    step = corrupted(saved, tmp_path, 100 * HASH_BLOCK)
    local, where, _ = load_box(step, 5, ROWS)
    assert torch.equal(local, saved[1][where])
    cli("verify", step, code=1)


def syscr() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("syscr"))


def test_a_small_local_record_is_read_in_one_read_whatever_the_parts_taken_of_it(tmp_path):
    """A reshard takes each small record in parts (a box per target rank), each part wanting the
    record's header, data and rest: all of it served from one read of the record."""
    from ckpttool.offline.reshard import reshard

    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(300)) for _ in range(200)])
    Checkpointer(str(tmp_path / "run")).save(1, model)
    (step,) = glob.glob(str(tmp_path / "run" / "step-*"))
    before = syscr()
    reshard(step, str(tmp_path / "w3"), world_size=3)
    reads = syscr() - before
    assert reads < 200 * 1.5, reads  # one a record, and a few for .metadata and the commit record
    back = DcpSource(resolve(str(tmp_path / "w3")))
    for i, p in enumerate(model):
        assert torch.equal(back.read_tensor(f"model.{i}"), p.detach())
    back.close()
