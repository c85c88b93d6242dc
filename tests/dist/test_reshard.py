"""Offline reshard: plain torch loads the result on the target layout bitwise, the chunks are FSDP2's
boxes, each rank reads its own file, and resharding back gives the original bytes."""

from __future__ import annotations

import pytest

from ckpttool.formats.dcp import read_metadata
from ckpttool.pipeline import reshard
from ckpttool.storage import resolve

from ..helpers import assert_same_checkpoint, assert_same_nested
from .harness import run_ranks
from .workloads import plain_torch_load

TARGETS = [(1, None), (2, None), (3, None), (4, None), (4, "2x2")]


def chunk_layout(path: str) -> dict[str, list]:
    md = read_metadata(resolve(path))
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
            for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}


@pytest.mark.parametrize("w_src", [1, 2, 3, 4])
@pytest.mark.parametrize("w_dst,mesh", TARGETS)
def test_plain_torch_loads_resharded_checkpoint_bitwise(plain, tmp_path, w_src, w_dst, mesh):
    path, expected = plain[w_src]
    out = str(tmp_path / "out")
    report = reshard(path, out, world_size=w_dst, mesh=mesh)
    assert report.source_world_size == w_src and report.world_size == w_dst
    mesh_shape = tuple(int(x) for x in mesh.split("x")) if mesh else None
    results = run_ranks(plain_torch_load, w_dst, out, mesh_shape)
    assert_same_nested(results[0]["model"], expected["model"], "model")
    assert_same_nested(results[0]["optim"], expected["optim"], "optim")
    if mesh is None:
        # every rank read its own file, plus rank 0's file for replicated entries only
        ours = chunk_layout(out)
        for r in results:
            for fname, info in r["reads"].items():
                if fname == f"__{r['rank']}_0.distcp":
                    continue
                if w_src == 1:  # a 1-rank source cannot tell buffers from parameters: buffers get sharded
                    info["keys"].discard("model.counts")
                    if not info["keys"]:
                        continue
                assert fname == "__0_0.distcp", (r["rank"], fname)
                for key in info["keys"]:
                    assert key not in ours or len(ours[key]) == 1, (r["rank"], key, "sharded entry read from rank 0's file")


@pytest.mark.parametrize("w_src", [2, 3, 4])
@pytest.mark.parametrize("w_dst", [1, 2, 3, 4])
def test_chunks_equal_what_fsdp2_itself_saves(plain, tmp_path, w_src, w_dst):
    out = str(tmp_path / "out")
    reshard(plain[w_src][0], out, world_size=w_dst)
    assert chunk_layout(out) == chunk_layout(plain[w_dst][0])


def test_reshard_there_and_back_gives_the_original_bytes(plain, tmp_path):
    path, _ = plain[3]
    reshard(path, str(tmp_path / "w2"), world_size=2)
    reshard(str(tmp_path / "w2"), str(tmp_path / "back"), world_size=3, memory_budget="64B")
    assert chunk_layout(str(tmp_path / "back")) == chunk_layout(path)
    assert_same_checkpoint(path, str(tmp_path / "back"))


def test_hsdp_stores_each_box_once(plain, tmp_path):
    out = str(tmp_path / "hsdp")
    reshard(plain[4][0], out, world_size=4, mesh="2x2")
    layout = chunk_layout(out)
    w2 = chunk_layout(plain[2][0])
    assert layout == w2  # boxes follow the shard dim (2 shards), stored once
    # and each box is stored once: no two storage entries of a key share an offset
    md = read_metadata(resolve(out))
    seen = [(mi.fqn, tuple(mi.offset)) for mi in md.storage_data if mi.offset is not None]
    assert len(seen) == len(set(seen))
