"""zstd-compressed DCP, written by ckpttool (Checkpointer(compress="zstd"), convert/reshard
--compress zstd), read back by ckpttool on another world size and by plain torch."""

from __future__ import annotations

import pickle

import pytest

from .harness import run_ranks
from .workloads import assert_same, compressed_save, load_into_fresh, plain_dcp_load


def _descriptors(step: str) -> set:
    with open(f"{step}/.metadata", "rb") as f:
        md = pickle.load(f)  # our own test output: trusted
    return {tuple(getattr(info, "transform_descriptors", None) or ()) for info in md.storage_data.values()}


@pytest.mark.parametrize("async_save", [False, True])
def test_compressed_steps_load_bitwise_with_ckpttool_and_plain_torch(tmp_path, async_save):
    root = str(tmp_path / "ck")
    saved = run_ranks(compressed_save, 2, root, async_save)[0]
    assert _descriptors(f"{root}/step-1") == {("stream.zstd/1",)}  # every record, none plain
    for w in (1, 3):
        loaded = run_ranks(load_into_fresh, w, root)[0]
        assert loaded["extra"]["note"] == "zstd"
        assert_same(saved["state"], loaded["state"], f"zstd step loaded on {w}")
    plain = run_ranks(plain_dcp_load, 2, f"{root}/step-1")[0]
    assert_same(saved["state"], plain["state"], "zstd step read by plain dcp.load")
