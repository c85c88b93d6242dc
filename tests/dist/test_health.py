"""A step's health in its commit record: NaN/Inf counted as the bytes are written, shown by
``inspect ROOT`` and warned by ``load``, refused with ``on_nonfinite="refuse"``; a trainable tensor
left unchanged while its optimizer state moved (a stale copy) named."""

from __future__ import annotations

import json

import pytest

from ckpttool.steps import read_commit_record
from ckpttool.storage import resolve

from ..helpers import cli
from .harness import run_ranks
from .health_workloads import nan_steps, nonfinite_objects, stale_steps

KEY = "model.layers.0.feed_forward.w1.weight"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_nan_is_counted_shown_by_inspect_and_warned_by_load(tmp_path, async_save):
    root = tmp_path / "run"
    results = run_ranks(nan_steps, 2, str(root), "warn", async_save)
    assert all(r["steps"] == [1, 2] and r["errors"] == [] and r["loaded"] == 2 for r in results)
    record = read_commit_record(resolve(str(root / "step-2")))
    assert record["health"]["nonfinite"] == {KEY: {"nan": 3, "inf": 1}}
    assert read_commit_record(resolve(str(root / "step-1")))["health"]["nonfinite"] == {}
    # said at once by rank 0 when it commits, and by the load of the newest step, naming the healthy one
    assert any("step 2 holds non-finite values" in w and KEY in w for w in results[0]["at_save"]), results[0]["at_save"]
    warned = [w for w in results[0]["at_load"] if "non-finite" in w]
    assert len(warned) == 1 and "loading step 2" in warned[0] and "the newest step without any is step 1" in warned[0]
    assert results[1]["at_load"] == []
    text = cli("inspect", root)
    lines = text.splitlines()
    assert any("step        1" in line and "healthy" in line and "unhealthy" not in line for line in lines), text
    assert any("step        2" in line and "unhealthy" in line for line in lines), text
    assert f"{KEY}: 3 NaN, 1 Inf" in text
    report = json.loads(cli("inspect", root, "--json"))
    health = {s["step"]: s["health"] for s in report["steps"]}
    assert health[1]["state"] == "healthy" and health[2]["state"] == "unhealthy" and health[2]["nonfinite"] == [KEY]


def test_on_nonfinite_refuse_commits_nothing_and_every_rank_is_told(tmp_path):
    results = run_ranks(nan_steps, 2, str(tmp_path / "run"), "refuse", True)
    for r in results:
        assert r["steps"] == [1] and r["loaded"] == 1
        assert len(r["errors"]) == 1 and "non-finite" in r["errors"][0] and KEY in r["errors"][0], r["errors"]


def test_a_trainable_tensor_unchanged_while_its_optimizer_state_moved_is_named(tmp_path):
    root = tmp_path / "run"
    warnings = run_ranks(stale_steps, 2, str(root))[0]["warnings"]
    stale = "model.layers.1.attention.wq.weight"
    health = {s: read_commit_record(resolve(str(root / f"step-{s}")))["health"] for s in (1, 2, 3)}
    assert health[1]["compared_with"] is None and health[1]["unchanged"] == []  # nothing to compare the first with
    # the head's group has lr 0: its weight stays by design and is not named
    assert health[2]["compared_with"] == 1 and health[2]["unchanged"] == [stale]
    assert health[3]["compared_with"] == 2 and health[3]["unchanged"] == []
    assert any("step 2: 1 trainable tensor(s) unchanged since step 1" in w and stale in w for w in warnings), warnings
    assert f"{stale}: unchanged since step 1 while its optimizer state moved" in cli("inspect", root)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_nonfinite_float_in_extra_is_counted_where_the_step_keeps_it(tmp_path, async_save):
    """A value of ``extra`` kept per rank is counted under its own rank's key (rank 1's inf, not rank
    0's finite value); a value every rank shares, once under its own key."""
    root = tmp_path / "run"
    run_ranks(nonfinite_objects, 2, str(root), async_save)
    step1 = read_commit_record(resolve(str(root / "step-1")))
    assert step1["per_rank"] == ["loss", "pair"]  # (a DTensor inside an object: each rank pickles its own shard)
    assert step1["health"]["nonfinite"] == {"per_rank.1.loss": {"nan": 0, "inf": 1}}
    assert read_commit_record(resolve(str(root / "step-2")))["health"]["nonfinite"] == {"extra.loss": {"nan": 1, "inf": 0}}
    assert "per_rank.1.loss: 1 Inf" in cli("inspect", root)
