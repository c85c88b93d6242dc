"""Loads onto other meshes (1-D of any size, HSDP 2x2) and the per-shard check of what was loaded."""

from __future__ import annotations

import shutil

import pytest

from ckpttool.formats import open_source

from .harness import run_ranks
from .workloads import assert_same, load_and_report, load_and_verify, load_wrong_shape


@pytest.mark.parametrize("w_save", [1, 2, 3])
@pytest.mark.parametrize("w_load,mesh", [(4, None), (4, (2, 2)), (2, (2, 1)), (2, None)])
def test_load_on_other_meshes_bitwise_and_verified(saved, w_save, w_load, mesh):
    root, trained = saved[w_save]
    results = run_ranks(load_and_verify, w_load, root, mesh)
    for r in results:
        assert r["ok"] and r["tensors"] > 0 and r["mismatches"] == []
        assert_same(trained["state"], r["state"], f"saved on {w_save}, loaded on {w_load} mesh {mesh}")


def test_verify_loaded_names_a_corrupted_box_on_every_rank(saved, tmp_path):
    root = str(tmp_path / "copy")
    shutil.copytree(saved[2][0], root)
    with open_source(f"{root}/step-3") as src:
        entry = src.index()["model.layers.1.attention.wq.weight"]
        chunk = entry.chunks[1]  # the second shard: rank 1's box on 2 ranks
        file, start, _ = src.data_spans(entry.key)[1]
        flip = (file.name, start + 8)
    results = run_ranks(load_and_verify, 2, root, None, flip)
    assert results[0]["mismatches"] == results[1]["mismatches"]
    assert not results[0]["ok"]
    (key, rank, index), = results[0]["mismatches"]
    assert key == "model.layers.1.attention.wq.weight" and rank == 1 and index[0] >= chunk.offsets[0]


def test_model_whose_shapes_differ_gets_a_typed_error_on_every_rank(saved):
    for text in run_ranks(load_wrong_shape, 2, saved[2][0]):
        assert "tok_embeddings.weight" in text and "(67, 34)" in text and "(70, 34)" in text


@pytest.mark.parametrize("w_save", [1, 4])
@pytest.mark.parametrize("w_load,mesh", [(1, None), (3, None), (4, (2, 2))])
def test_odd_shapes_bf16_and_buffers_through_the_checkpointer(tmp_path, w_save, w_load, mesh):
    from ..helpers import assert_same_nested
    from .workloads import oddnet_ckpt_load, oddnet_ckpt_save

    root = str(tmp_path / "run")
    expected = run_ranks(oddnet_ckpt_save, w_save, root)[0]
    results = run_ranks(oddnet_ckpt_load, w_load, root, mesh)
    assert all(r["ok"] and r["extra"] == {"k": (1, 2)} for r in results)
    assert_same_nested(results[0]["model"], expected["model"], "model")  # full state dicts live on rank 0
    assert_same_nested(results[0]["optim"], expected["optim"], "optim")


@pytest.mark.parametrize("w_load", [2, 3])
def test_a_flipped_bit_in_one_shard_fails_the_load_on_every_rank(saved, tmp_path, w_load):
    """Loads check what they read by default (a ckpttool step: against its manifest): the rank that
    reads the damaged record names it, with the key and the file, and every rank raises;
    verify=False loads it (the opt-out)."""
    root = str(tmp_path / "copy")
    shutil.copytree(saved[2][0], root)
    key = "model.layers.1.attention.wq.weight"
    with open_source(f"{root}/step-3", verify=False) as src:
        file, start, _ = src.data_spans(key)[1]  # rank 1's shard
    with open(file.path, "r+b") as f:
        f.seek(start + 8)
        b = f.read(1)[0]
        f.seek(start + 8)
        f.write(bytes([b ^ 0x10]))
    results = run_ranks(load_and_report, w_load, root)
    assert all(r["error"] is not None for r in results), results
    readers = [i for i, r in enumerate(results) if r["error"] == "ChecksumError"]
    assert readers, results  # the rank(s) whose box touches the damaged shard name it
    for i in readers:
        msg = results[i]["message"]
        assert key in msg and file.name in msg and "manifest's checksum" in msg and f"on rank {i}" in msg, msg
    for i, r in enumerate(results):  # every other rank raises the reader's error, naming its rank
        if i not in readers:
            assert r["error"] == "RankFailedError" and f"rank {readers[0]} failed: ChecksumError" in r["message"], r
    assert all(r["error"] is None and r["step"] == 3 for r in run_ranks(load_and_report, w_load, root, False))

