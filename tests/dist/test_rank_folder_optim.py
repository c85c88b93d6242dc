"""Optimizer state in per-rank folders goes to the right parameters, or stays keyed by index as torch
wrote it, with a note: torch numbers an optimizer's parameters group by group in the order it was
given them, which nothing in the folder records unless the optimizer was built from named
parameters (a single group from model.parameters() and one given the same blocks in another order
look alike: every shape repeats). The order may be stated (--optimizer-order model), and the output
then says its names rest on that."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ..helpers import cli
from .harness import run_ranks
from ckpttool.formats.torch_ranks import STATED_NOTE

from .rank_folder_workloads import Blocks, load_folder, load_with_other_groups, optimizer_for, optimizer_state, save_folder
from .workloads import assert_same

MAPPED = {"single": False, "shuffled": False, "named": True, "reversed": False, "decay": False, "frozen": False}


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
    said = [n for n in report["notes"] if "param" in n and "optim" in n]
    assert len(said) == 1, report["notes"]  # one line says what became of the indices
    out = tmp_path / "full.pt"
    cli("convert", path, out)
    converted = torch.load(out, weights_only=False)
    assert "OK: " in cli("verify", path) and "OK: " in cli("verify", path, "--against", out)
    if MAPPED[layout]:
        assert "that torch recorded in its param groups (param_names)" in said[0]
        for name in ("blocks.0.weight", "blocks.2.bias"):
            assert f"optim.state.{name}.exp_avg" in keys
            assert torch.equal(converted["optim"]["state"][name]["exp_avg"], saved["optim"][f"{name}.exp_avg"]), (layout, name)
        return
    assert not any(k.startswith("optim.state.blocks") for k in keys), sorted(keys)[:8]
    assert "stays keyed by parameter index" in said[0] and "--optimizer-order model" in said[0], said
    assert "ckpttool.load(FOLDER, model, optimizer)" in said[0], said
    # what is kept is what torch saved, keyed as torch keys it: optimizer.load_state_dict of the
    # output gives an optimizer built the same way over the whole model the saved state
    n = 4 if layout == "frozen" else 6
    assert sorted(converted["optim"]["state"]) == list(range(n))
    model = Blocks()
    model.load_state_dict(converted["model"])
    optimizer = optimizer_for(model, layout)
    optimizer.load_state_dict(converted["optim"])
    assert_same(optimizer_state(model, optimizer), saved["optim"], f"{layout}: the converted optimizer state")


def test_an_order_stated_names_the_indices_and_the_output_says_so(folder, tmp_path):
    """``--optimizer-order model``: the indices become the model's parameter names in the order the
    model lists them; every output records that its names rest on that statement, and verify of
    the folder read the same way passes. Stated where it cannot hold (fewer indices than
    parameters), the command fails naming why; an order nothing stated is never applied."""
    layout, path, saved = folder
    if layout not in ("single", "frozen"):
        pytest.skip("a layout with a stated order and one where it cannot hold are enough")
    out = tmp_path / "stated.pt"
    if layout == "frozen":
        text = cli("convert", path, out, "--optimizer-order", "model", code=2)
        assert "numbers 4 parameters and model has 6" in text and not out.exists(), text
        return
    text = cli("convert", path, out, "--optimizer-order", "model")
    assert "as stated (--optimizer-order model): nothing in the folder proves it" in text, text
    converted = torch.load(out, weights_only=False)
    groups = converted["optim"]["param_groups"]
    assert all(g["param_names_from"] == STATED_NOTE for g in groups), groups
    for name in ("blocks.0.weight", "blocks.2.bias"):
        assert torch.equal(converted["optim"]["state"][name]["exp_avg"], saved["optim"][f"{name}.exp_avg"])
    dcp_out = tmp_path / "stated-dcp"
    cli("convert", path, dcp_out, "--optimizer-order", "model")
    assert "optim.param_groups.0.param_names_from" in {e["key"] for e in json.loads(cli("inspect", dcp_out, "--json"))["entries"]}
    verified = cli("verify", path, "--against", dcp_out, "--optimizer-order", "model")
    assert "OK: " in verified and "as stated" in verified, verified
    # unstated, the folder's indices do not match the output's names: verify says so, never OK
    assert "only in" in cli("verify", path, "--against", dcp_out, code=1)
    # stated where no folder is read, it would be ignored: refused
    assert "applies to per-rank torch.save folders" in cli("convert", out, tmp_path / "again.pt", "--optimizer-order", "model", code=2)


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
    ("mixed", "optim.state.0.step", False),  # (the optimizer records no names: keyed by index)
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
