"""A failed save costs one save, where the user allows it (``tolerate_failures``): every rank logs
it, naming the failing rank, nothing is committed, training goes on, and K+1 failures in a row
raise on every rank alike."""

from __future__ import annotations

import pytest

from ckpttool import Checkpointer

from .failure_workloads import failing_saves
from .harness import run_ranks
from .test_async_and_crash import _full_state_on_a_laptop
from .workloads import assert_same


@pytest.mark.parametrize("async_save,point,writer", [
    (False, "after-write", "thread"),
    (True, "after-write", "thread"),   # its index says it failed
    (True, "before-index", "thread"),  # no index at all (as where storage refuses it): its beat says it failed
    (True, "after-write", "process"),  # in rank 1's writer process; rank 0's waits for the indexes, then commits there
])
def test_two_failed_saves_cost_two_saves_and_training_goes_on(tmp_path, async_save, point, writer):
    root = str(tmp_path / "run")
    results = run_ranks(failing_saves, 2, root, async_save, 2, 2, 1, point, writer=writer)
    for rank, res in enumerate(results):
        assert res["raised"] is None, (rank, res["raised"])
        if not async_save:  # a sync save says at once that it failed
            assert res["returned"][4] is None and res["returned"][6] is None and res["returned"][8], (rank, res["returned"])
        assert len(res["logged"]) == 2, (rank, res["logged"])
        for line in res["logged"]:
            assert "rank 1 failed" in line and "no space left on device" in line.lower(), line
            assert line.startswith(f"ckpttool: rank {rank}: step "), line
        assert "step 4 was not saved" in res["logged"][0] and "step 6 was not saved" in res["logged"][1], res["logged"]
        assert res["steps"] == [2, 8], res["steps"]
    ckpt = Checkpointer(root)
    assert ckpt.steps() == [2, 8]
    assert len(ckpt.incomplete()) == 2  # the failed saves' directories: never committed, clean removes them
    step, state = _full_state_on_a_laptop(root)
    assert step == 8
    expected = results[0]["states"][8]
    assert_same({k: v for k, v in expected.items() if k in state}, state, "step 8 after two failed saves")
    assert sorted(ckpt.clean()) and ckpt.incomplete() == [] and ckpt.steps() == [2, 8]


@pytest.mark.parametrize("async_save", [False, True])
def test_one_failure_more_than_tolerated_raises_on_every_rank(tmp_path, async_save):
    root = str(tmp_path / "run")
    results = run_ranks(failing_saves, 2, root, async_save, 1, 2, 1)
    # sync: step 6's save raises; async: its failure is judged when step 8 is saved
    at = 6 if not async_save else 8
    for rank, res in enumerate(results):
        assert res["raised"] is not None and res["raised"][2] == at, (rank, res["raised"])
        kind, text, _ = res["raised"]
        assert "no space left on device" in text.lower(), text
        assert kind == ("StorageError" if rank == 1 else "RankFailedError"), (rank, kind)
        assert len(res["logged"]) == 1 and "step 4 was not saved" in res["logged"][0], res["logged"]
        assert res["steps"] == [2], res["steps"]


def test_by_default_the_first_failed_save_raises_on_every_rank(tmp_path):
    root = str(tmp_path / "run")
    results = run_ranks(failing_saves, 2, root, True, 0, 1, 1)
    for rank, res in enumerate(results):
        assert res["raised"] is not None and res["raised"][2] == 6, (rank, res["raised"])
        assert res["logged"] == [], res["logged"]


@pytest.mark.parametrize("async_save", [False, True])
def test_one_rank_failing_before_its_write_fails_the_save_on_every_rank_and_nobody_waits(tmp_path, async_save):
    """Rank 1's save fails before it writes a byte (a caller's mistake on that rank alone): every
    rank raises it at the same call (sync: step 4's; async: the next save's, which judges step 4),
    naming rank 1, with tolerate_failures=2 (a caller's mistake is never let pass)."""
    from .failure_workloads import one_rank_fails_before_its_write

    results = run_ranks(one_rank_fails_before_its_write, 2, str(tmp_path / "run"), async_save, timeout=120)
    at = 4 if not async_save else 6
    assert results[1]["raised"][:1] == ("UsageError",) and results[1]["raised"][2] == at, results[1]
    assert results[0]["raised"][0] == "RankFailedError" and results[0]["raised"][2] == at, results[0]
    assert "rank 1 failed: UsageError: extra must be a dict" in results[0]["raised"][1], results[0]
    assert results[0]["steps"] == [2]


@pytest.mark.slow
def test_with_a_writer_process_a_failed_rank_is_named_at_once_while_another_is_still_writing(tmp_path):
    """Rank 1's async save of step 4 fails before its write while rank 2 is held 20 s after
    writing its data: rank 0's save of step 4 (its commit sent to its writer process once every
    part is in) fails naming rank 1 within seconds, not once rank 2 is done. (Every rank raises it
    at step 6's save, which they all reach once rank 2 is.)"""
    from .failure_workloads import one_rank_fails_before_its_write

    results = run_ranks(one_rank_fails_before_its_write, 3, str(tmp_path / "run"), True, "process", 2, 20.0, timeout=180)
    assert results[0]["raised"][0] == "RankFailedError" and results[0]["raised"][2] == 6, results[0]
    assert "rank 1 failed: UsageError: extra must be a dict" in results[0]["raised"][1], results[0]
    assert results[0]["seconds"] is not None and results[0]["seconds"] < 12, results[0]
    assert results[0]["steps"] == [2]
