"""Async save is a snapshot on its own process group; failures surface; a crash at any point of a
save (kill -9 of every rank) leaves the previous step as the newest one that loads, bitwise."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest
import torch

from ckpttool import Checkpointer

from .harness import run_ranks, spawn_ranks, wait_then_kill
from .workloads import assert_same, async_snapshot, async_write_error, crash_during_save


def test_async_save_is_a_snapshot_while_training_goes_on(tmp_path):
    # the background copy starts 2 s late, so the next optimizer step certainly comes first: only
    # the fence (the step waits for the copy) keeps the snapshot exact
    for r in run_ranks(async_snapshot, 2, str(tmp_path / "run"), env={"CKPTTOOL_DELAY_AT": "stage-copy:2"}):
        assert r["steps"] == [2, 5] and r["extra"] == {"step": 2}
        assert_same(r["expected"], r["loaded2"], "async step 2")
        assert_same(r["after"], r["loaded5"], "async step 5")


def test_background_write_error_surfaces_at_the_next_call(tmp_path):
    for r in run_ranks(async_write_error, 2, str(tmp_path / "run")):
        assert r["returned"], "save() itself must not block on the write"
        assert "no space" in r["message"] or "save failed" in r["message"], r["message"]
        assert r["steps"] == [1]  # the failed step never committed; step 1 intact


def _full_state_on_a_laptop(root: str, model_size: str = "tiny") -> dict:
    """Load the newest committed step into an unsharded model in this process (no process group)."""
    from ckpttool.training.trainer.model import PRESETS, build_model

    model = build_model(PRESETS[model_size], seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    res = Checkpointer(root).load(model, opt)
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = v.clone()
    for i, g in enumerate(opt.param_groups):
        for k, v in g.items():
            if k != "params":
                out[f"optim.group{i}.{k}"] = v
    return res.step, out


@pytest.mark.parametrize("point,async_save,size", [
    ("after-stage", True, "tiny"),      # async: snapshot taken, nothing written yet
    ("mid-write", True, "small"),       # the writer killed with its file's first buffers on disk (O_DIRECT where allowed)
    ("mid-write", False, "small"),
    ("after-write", False, "tiny"),     # data files and .metadata written, not committed
    ("after-write", True, "tiny"),
    ("before-rename", False, "tiny"),   # commit record written inside the temp dir, not renamed
])
def test_kill_9_during_save_leaves_the_previous_step(tmp_path, point, async_save, size):
    root = str(tmp_path / "run")
    expected_path = str(tmp_path / "expected.pt")
    pause_file = str(tmp_path / "paused")
    with tempfile.TemporaryDirectory() as rdzv:
        procs, _ = spawn_ranks(crash_during_save, 2, rdzv, root, expected_path, async_save, size,
                               env={"CKPTTOOL_PAUSE_AT": point, "CKPTTOOL_PAUSE_FILE": pause_file})
        need = 1 if point == "before-rename" else 2  # only rank 0 renames
        wait_then_kill(procs, lambda: len(glob.glob(pause_file + ".*")) >= need, what="ranks never reached the pause point")
    ckpt = Checkpointer(root)
    assert ckpt.steps() == [2]
    assert any(name.startswith((".step-4", "step-4")) for name in ckpt.incomplete())
    if point == "mid-write":  # killed inside the data file: part of it is there, no index, nothing committed
        dirs = glob.glob(os.path.join(root, ".step-4*")) + glob.glob(os.path.join(root, "step-4*"))
        parts = [p for d in dirs for p in glob.glob(os.path.join(d, "__*_0.distcp"))]
        assert len(parts) == 2 and all(os.path.getsize(p) >= 16 << 20 for p in parts), (dirs, parts)
        assert not [p for d in dirs for p in glob.glob(os.path.join(d, ".ckpttool-rank-*.json"))]
    step, state = _full_state_on_a_laptop(root, size)
    assert step == 2
    expected = torch.load(expected_path, weights_only=False)
    expected = {k: v for k, v in expected.items() if k in state}
    assert_same(expected, state, f"after a crash at {point}")
    assert ckpt.clean() and ckpt.incomplete() == []


def cached_state_saves(root: str) -> dict[str, object]:
    """Async saves on FSDP2 served from the kept state dict, around an unshard (FSDP2 swaps the
    registered parameters: a miss) and a learning-rate change (read live): each step as it was."""
    from .workloads import _train_steps, fresh_model, full_state

    model, optimizer = fresh_model(seed=0)
    _train_steps(model, optimizer, 0, 1)
    expected = {}
    with Checkpointer(root, async_save=True) as ckpt:
        for step in range(1, 6):
            if step == 4:
                for group in optimizer.param_groups:
                    group["lr"] = 5e-4
            expected[step] = full_state(model, optimizer)  # (its state_dict() would reshard the model: before unshard)
            if step == 3:
                model.unshard()  # the parameters are swapped for unsharded ones until resharded
            ckpt.save(step, model, optimizer, extra={"step": step})
            _train_steps(model, optimizer, step, 1)
        counts = (ckpt.state_cache.hits, ckpt.state_cache.misses)
    loaded = {}
    for step in expected:
        fresh, fopt = fresh_model(seed=9)
        Checkpointer(root).load(fresh, fopt, step=step)
        loaded[step] = full_state(fresh, fopt)
    return {"expected": expected, "loaded": loaded, "counts": counts}


def test_async_saves_from_the_kept_state_dict_load_back_bitwise(tmp_path):
    for r in run_ranks(cached_state_saves, 2, str(tmp_path / "run")):
        assert r["counts"] == (3, 2)  # saves 2, 4, 5 kept; 1 and 3 (unsharded) asked torch
        for step, want in r["expected"].items():
            assert_same(want, r["loaded"][step], f"step {step}")
        assert r["loaded"][4]["optim.group0.lr"] == 5e-4
