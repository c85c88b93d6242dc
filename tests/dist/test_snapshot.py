"""A step is exactly the state at its save, on every rank: async saves followed at once by every
kind of in-place write a training script makes (2 gloo ranks, FSDP2), and a write no guard sees
refused on every rank, never committed."""

from __future__ import annotations

import pytest

from .harness import run_ranks
from .snapshot_workloads import EDITS, foreign_thread_write, saves_with_edits
from .workloads import assert_same


@pytest.mark.parametrize("two", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["one optimizer", "two optimizers"])
def test_every_async_save_holds_the_state_of_its_call_whatever_comes_next(tmp_path, two):
    # the copy thread starts 0.3 s late, so every edit comes before it has copied anything: only
    # the guards (every optimizer's step, the write guard on the saving thread) keep the steps exact
    saves = 3 * len(EDITS)  # 24
    results = run_ranks(saves_with_edits, 2, str(tmp_path / "run"), saves, two, timeout=300,
                        env={"CKPTTOOL_DELAY_AT": "stage-copy:0.3"})
    for rank, r in enumerate(results):
        assert r["steps"] == list(range(1, saves + 1)), f"rank {rank}: committed {r['steps']}"
        for i in r["steps"]:
            assert_same(r["expected"][i], r["loaded"][i], f"rank {rank} step {i} (after {EDITS[i % len(EDITS)]!r})")


def test_a_write_no_guard_sees_fails_the_save_on_every_rank_and_commits_nothing(tmp_path):
    results = run_ranks(foreign_thread_write, 2, str(tmp_path / "run"), env={"CKPTTOOL_DELAY_AT": "stage-copy:0.5"})
    for rank, r in enumerate(results):
        assert len(r["errors"]) == 1, f"rank {rank}: {r['errors']}"
        assert "tok_embeddings.weight" in r["errors"][0] and "not committed" in r["errors"][0], r["errors"][0]
        assert r["steps_after_failure"] == [1] and r["steps"] == [1, 3]
    assert "SnapshotError" in results[1]["errors"][0]  # the rank where it happened; rank 0 refused the step
