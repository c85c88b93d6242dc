"""A rank that trails the others is named by rank 0 while it waits, at growing intervals; every
step's commit record holds each rank's phase durations, and ``inspect ROOT`` names its slowest rank."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from ckpttool.cli import main
from ckpttool.steps import read_commit_record

from .failure_workloads import straggling_save
from .harness import run_ranks


@pytest.mark.parametrize("async_save", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_straggler_is_named_at_growing_intervals_and_inspect_shows_the_slowest_rank(tmp_path, async_save):
    root = tmp_path / "run"
    lines = run_ranks(straggling_save, 2, str(root), async_save, 6.5, 1.5)
    assert lines[1] == [], lines[1]  # only rank 0, which waits for everyone, says it
    said = lines[0]
    assert len(said) >= 2, said  # after 1.5 s, 3 s (and 6 s) behind the rest: rank 0 starts waiting after its own write
    behind = []
    for line in said:
        assert "rank(s) 1 still at work" in line and "writing its part of step 4" in line, line
        assert re.search(r"rank 1: write of step 4, [\d.]+ KiB written", line), line
        behind.append(int(re.search(r"at work (\d+) s after", line).group(1)))
    assert behind[0] >= 1 and all(b >= 1.5 * a for a, b in zip(behind, behind[1:])), behind  # growing intervals

    from ckpttool.storage import resolve

    record = read_commit_record(resolve(str(root / "step-4")))
    phases = record["phases"]
    assert sorted(phases) == ["0", "1"], phases
    assert phases["1"]["write"] >= 6.5 > phases["0"]["write"], phases
    assert "commit" in phases["0"] and "state" in phases["1"] and "prepare" not in phases["1"], phases  # each rank's own work
    if async_save:
        assert "stage" in phases["1"], phases
    out = CliRunner().invoke(main, ["inspect", str(root), "--json"])
    assert out.exit_code == 0, out.output
    steps = {s["step"]: s for s in json.loads(out.output)["steps"]}
    slow = steps[4]["slowest_rank"]
    assert slow["rank"] == 1 and slow["seconds"] >= 6.5 and slow["phases"]["write"] >= 6.5, slow
    assert steps[2]["slowest_rank"]["seconds"] < 6.5, steps[2]
    text = CliRunner().invoke(main, ["inspect", str(root)])
    assert re.search(r"slowest rank 1: [\d.]+ s \(write [\d.]+ s", text.output), text.output
