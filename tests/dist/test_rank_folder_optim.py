"""Optimizer state in per-rank folders goes to the right parameters, or stays keyed by index with a
note: torch numbers an optimizer's parameters group by group, which is model.parameters()'s order
only for a single group built from it (layer-wise LR decay and weight-decay splits are not)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ..helpers import cli
from .harness import run_ranks
from .rank_folder_workloads import load_folder, load_with_other_groups, save_folder
from .workloads import assert_same

MAPPED = {"single": True, "named": True, "reversed": False, "decay": False, "frozen": False}


@pytest.fixture(scope="module", params=list(MAPPED))
def folder(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"ranks-{request.param}") / "ck")
    return request.param, path, run_ranks(save_folder, 2, path, request.param)[0]


def test_a_live_optimizer_gets_its_own_state_back_on_2_and_3_ranks(folder):
    layout, path, saved = folder
    for world in (2, 3):
        got = run_ranks(load_folder, world, path, layout)[0]
        assert_same(saved["model"], got["model"], f"{layout}: model on {world} ranks")
        assert_same(saved["optim"], got["optim"], f"{layout}: optimizer state on {world} ranks")


def test_offline_the_indices_are_named_only_where_the_folder_proves_the_mapping(folder, tmp_path):
    layout, path, saved = folder
    report = json.loads(cli("inspect", path, "--json"))
    keys = {e["key"] for e in report["entries"]}
    notes = " ".join(report["notes"])
    out = tmp_path / "full.pt"
    cli("convert", path, out)
    converted = torch.load(out, weights_only=False)
    if MAPPED[layout]:
        for name in ("blocks.0.weight", "blocks.2.bias"):
            assert f"optim.state.{name}.exp_avg" in keys
            assert torch.equal(converted["optim"]["state"][name]["exp_avg"], saved["optim"][f"{name}.exp_avg"]), (layout, name)
    else:
        assert not any(k.startswith("optim.state.blocks") for k in keys), sorted(keys)[:8]
        assert "stays keyed by parameter index" in notes and "ckpttool.load(FOLDER, model, optimizer)" in notes, notes
        # what is kept is what torch saved: index i is the i-th parameter of the groups, in order
        n = 4 if layout == "frozen" else 6
        assert set(converted["optim"]["state"]) == {str(i) for i in range(n)}  # (flattened keys: int keys come back as str)


def test_an_optimizer_built_with_other_groups_is_refused_saying_so(folder):
    layout, path, _ = folder
    if layout != "reversed":
        pytest.skip("one saved layout is enough")
    for message in run_ranks(load_with_other_groups, 2, path, "single"):
        assert "saved by an optimizer with 3 param group(s) of [2, 2, 2] parameters" in message, message
        assert "the optimizer given has 1 of [6]" in message and "param groups of the job that saved it" in message


@pytest.mark.parametrize("case,key,expected", [
    ("buffer", "model.counts", False),
    ("replica", "model.scale", False),
    ("mixed", "optim.state.blocks.0.weight.step", False),
    ("rng", "rng.cpu", True),
])
def test_every_value_that_differs_between_ranks_is_named(case, key, expected, tmp_path):
    """Values every rank stores (plain tensors, a Replicate DTensor's replicas, objects) are compared
    across the ranks' files: each that differs is named by inspect (text and --json) and verify;
    verify fails (exit 1) unless the group is per-rank by nature (a group of plain values such as
    rng_rank_<R>.pt), where it says so and passes."""
    from .rank_folder_workloads import folder_with_rank_values

    path = str(tmp_path / case)
    run_ranks(folder_with_rank_values, 2, path, case)
    if case == "mixed":  # rank 1's files from a run one step longer
        for name in ("model_rank_1.pt", "optim_rank_1.pt"):
            os.replace(os.path.join(path + "-longer", name), os.path.join(path, name))
    text = cli("inspect", path)
    assert f"{key} (" in text and "rank(s) 1 differ from rank 0" in text, text[-1500:]
    notes = " ".join(json.loads(cli("inspect", path, "--json"))["notes"])
    assert key in notes
    if expected:
        out = cli("verify", path)
        assert "as a per-rank group's value may" in out and key in out and "OK: " in out, out
    else:
        out = cli("verify", path, code=1)
        assert f"differs between ranks: {key}" in out and "which it must not" in out, out
        report = json.loads(cli("verify", path, "--json", code=1))
        assert any(p["key"] == key for p in report["problems"]), report["problems"]
