"""Exact resume through the library: a user's script with dropout, a learning-rate schedule, a
stateful loader and per-rank RNG states, stopped after a save and resumed in new processes, runs
on as if never stopped; values of ``extra`` that differ between ranks come back to their own rank,
and on another world size to none (with a warning and every rank's value at hand)."""

from __future__ import annotations

import pytest
import torch

from .harness import run_ranks
from .resume_workloads import (ShuffledLoader, extra_kinds_save_and_load, fallback_save_and_load, first_part, own_buffers_load,
                               own_buffers_save, per_rank_load, per_rank_save, plain_dcp_load_extra, resumed, straight)
from .snapshot_workloads import two_optimizers_load, two_optimizers_save
from .workloads import assert_same


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_users_script_resumed_in_new_processes_runs_on_bitwise_as_if_never_stopped(tmp_path, async_save):
    root = str(tmp_path / "run")
    whole = run_ranks(straight, 2)
    first = run_ranks(first_part, 2, root, async_save)
    second = run_ranks(resumed, 2, root)
    for rank in range(2):
        assert first[rank]["steps"] == whole[rank]["steps"][:3]
        assert second[rank]["start"] == 3
        # losses and learning rates, as floats: bitwise
        assert second[rank]["steps"] == whole[rank]["steps"][3:], f"rank {rank}"
        assert_same(whole[rank]["final"], second[rank]["final"], f"rank {rank} final weights")
    assert whole[0]["steps"] != whole[1]["steps"]  # the ranks' data and dropout masks are their own


def _rng(rank: int) -> torch.Tensor:
    torch.manual_seed(100 + rank)
    return torch.get_rng_state()


def test_values_of_extra_that_differ_between_ranks_come_back_to_their_own_rank(tmp_path):
    root = str(tmp_path / "run")
    run_ranks(per_rank_save, 2, root)
    for rank, r in enumerate(run_ranks(per_rank_load, 2, root)):
        extra = r["extra"]
        assert torch.equal(extra["rng"], _rng(rank)) and extra["loader"] == {"pos": 10 * rank, "epoch": 2}
        assert extra["same"] == 5 and r["warnings"] == []
        assert r["loader"]["order"] != list(range(64)) and r["loader"] == extra["data"]  # restored in place, its own
        # a value saved per rank is its whole top-level key, as that rank had it
        assert set(r["by_rank"]) == {0, 1} and r["by_rank"][rank]["loader"] == {"pos": 10 * rank, "epoch": 2}
        assert "same" not in r["by_rank"][rank]
    # plain torch still reads the step (rank 0's values)
    for r in run_ranks(plain_dcp_load_extra, 2, f"{root}/step-1"):
        assert torch.equal(r["extra"]["rng"], _rng(0)) and r["extra"]["loader"] == {"pos": 0, "epoch": 2}


def test_on_another_world_size_no_rank_gets_another_ranks_value(tmp_path):
    root = str(tmp_path / "run")
    run_ranks(per_rank_save, 2, root)
    results = run_ranks(per_rank_load, 3, root)
    for rank, r in enumerate(results):
        extra = r["extra"]
        # the values the ranks saved alike are kept; each one saved per rank is left out, whole
        assert set(extra) == {"same"} and extra["same"] == 5
        assert r["loader"] == {"order": ShuffledLoader(99).order, "pos": 0, "epoch": 0}  # not restored: not wholly its own
        by_rank = r["by_rank"]
        assert set(by_rank) == {0, 1}
        assert all(torch.equal(by_rank[s]["rng"], _rng(s)) and by_rank[s]["loader"] == {"pos": 10 * s, "epoch": 2}
                   and by_rank[s]["data"] == ShuffledLoader(s).state_dict() for s in (0, 1))
    warned = results[0]["warnings"]
    assert len(warned) == 1 and "2 ranks cannot be matched to 3 ranks" in warned[0], warned
    assert warned[0].endswith("left out of LoadResult.extra: data, loader, rng (every saved rank's value is in "
                              "LoadResult.extra_by_rank)"), warned
    assert results[1]["warnings"] == [] and results[2]["warnings"] == []


def _same(a, b, where: str) -> None:
    """Equal, and of the same kinds all the way down (int keys stay int, tensors stay tensors)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {list(a)} vs {list(b)}"  # (1 != "1")
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_values_whose_kind_length_or_key_types_differ_between_ranks_come_back_as_they_were(tmp_path, async_save):
    """A tensor on one rank and a str on another, lists of different lengths, int keys, an optimizer
    and a scheduler in extra: each rank gets back its own, kinds and key types included."""
    for rank, r in enumerate(run_ranks(extra_kinds_save_and_load, 2, str(tmp_path / "run"), async_save)):
        want = r["want"]
        _same({k: want[k] for k in ("mixed", "lst", "ints", "same")}, r["extra"], f"rank {rank} extra")
        _same(want["opt_state"], r["opt"], f"rank {rank} optimizer in extra")
        _same(want["sched_state"], r["sched"], f"rank {rank} scheduler in extra")


def test_two_optimizers_saved_on_2_ranks_load_bitwise_on_3(tmp_path):
    root = str(tmp_path / "run")
    saved = run_ranks(two_optimizers_save, 2, root)[0]
    for r in run_ranks(two_optimizers_load, 3, root):
        assert_same(saved, r, "two optimizers, 2 -> 3 ranks")


def test_dcp_s_own_writer_keeps_per_rank_values_and_counts_nan_too(tmp_path):
    """A strided-shard DTensor sends the async save through DCP's writer (collective): each rank's
    own value of extra still comes back to it, and the commit record counts the NaN and the Inf."""
    from ckpttool.steps import read_commit_record
    from ckpttool.storage import resolve

    root = tmp_path / "run"
    for rank, r in enumerate(run_ranks(fallback_save_and_load, 2, str(root))):
        assert torch.equal(r["extra"]["mine"], torch.full((3,), float(rank))) and r["extra"]["same"] == 1
        assert torch.equal(r["extra"]["z"], torch.arange(8.0))
    record = read_commit_record(resolve(str(root / "step-1")))
    assert record["per_rank"] == ["mine"]
    # a Python float in extra is counted too (rank 0 writes the objects)
    assert record["health"]["nonfinite"] == {"model.norm.weight": {"nan": 1, "inf": 0}, "extra.loss": {"nan": 0, "inf": 1}}


def test_a_step_with_per_rank_and_stateful_values_converts_and_verifies_against_its_conversion(tmp_path):
    """What `make demo` does after training: convert the step to one torch file and back, and
    verify the step against each. Per-rank values and a Stateful's state must read alike in every
    format (kept whole as one object, they read as an object here and as entries there)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    root = str(tmp_path / "run")
    run_ranks(per_rank_save, 2, root)
    step, full, back = f"{root}/step-1", str(tmp_path / "full.pt"), str(tmp_path / "back")
    for args, code in ((["convert", step, full], 0), (["verify", step, "--against", full], 0),
                       (["convert", full, back], 0), (["verify", back, "--against", step], 0)):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == code, (args, result.output)


@pytest.mark.parametrize("async_save,through_dcp", [(False, False), (True, False), (True, True)],
                         ids=["sync", "async", "dcp-writer"])
def test_buffers_that_differ_between_ranks_come_back_to_their_own_rank(tmp_path, async_save, through_dcp):
    """FSDP2 with BatchNorm1d (no SyncBatchNorm): each rank's running statistics are its own. They are
    kept per rank, listed in the commit record and by inspect, and each comes back to its own rank
    on the same world size; on another, every rank gets rank 0's and one warning names them. Plain
    dcp.load still reads the step (rank 0's values under model.*)."""
    from ckpttool.steps import read_commit_record
    from ckpttool.storage import resolve

    from ..helpers import cli

    root = tmp_path / "run"
    saved = run_ranks(own_buffers_save, 2, str(root), async_save, through_dcp)
    assert not torch.equal(saved[0]["buffers"]["norm.running_mean"], saved[1]["buffers"]["norm.running_mean"])
    record = read_commit_record(resolve(str(root / "step-1")))
    assert record["per_rank_buffers"] == ["model.norm.running_mean", "model.norm.running_var"]  # num_batches_tracked agrees
    assert record["health"]["nonfinite"] == {"per_rank_buffers.1.norm.running_var": {"nan": 1, "inf": 0}}
    assert "buffers model.norm.running_mean, model.norm.running_var" in cli("inspect", root)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(root / "step-1"), str(tmp_path / "plain.pt"))  # plain torch reads it: rank 0's under model.*
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert torch.equal(plain["model"]["norm.running_mean"], saved[0]["buffers"]["norm.running_mean"])
    assert torch.equal(plain["per_rank_buffers"]["1"]["norm.running_mean"], saved[1]["buffers"]["norm.running_mean"])
    for rank, got in enumerate(run_ranks(own_buffers_load, 2, str(root))):
        assert_same(got["buffers"], saved[rank]["buffers"], f"rank {rank}'s buffers")
        assert_same(got["weights"], saved[0]["weights"], f"rank {rank}'s weights")
        assert not any("cannot be matched" in w for w in got["warnings"]) and got["verified"]
    on3 = run_ranks(own_buffers_load, 3, str(root))
    assert any("buffers saved per rank on 2 ranks" in w and "model.norm.running_mean" in w for w in on3[0]["warnings"]), on3[0]
    for got in on3:
        assert_same(got["buffers"], saved[0]["buffers"], "rank 0's buffers on another world size")
