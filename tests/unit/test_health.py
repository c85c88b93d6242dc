"""Counting NaN and Inf where the bytes pass: every float dtype, the one-pass check that proves a
tensor finite, and the exact count when it cannot."""

from __future__ import annotations

import pytest
import torch

from ckpttool.health import count_nonfinite, numbered, problems

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nan_and_inf_are_counted_in_every_float_dtype(dtype):
    t = torch.linspace(-2, 2, 1000).to(dtype)
    assert count_nonfinite(t) == (0, 0)
    t[[3, 500, 999]] = float("nan")
    if dtype != torch.float8_e4m3fn:  # (it has no Inf: out of range saturates to NaN)
        t[10] = float("inf")
        t[11] = float("-inf")
        assert count_nonfinite(t) == (3, 2)
    else:
        assert count_nonfinite(t) == (3, 0)


def test_finite_values_whose_sum_overflows_are_counted_not_guessed():
    t = torch.full((4096,), 60000.0, dtype=torch.float16)  # the fp16 sum overflows; float64 does not
    assert count_nonfinite(t) == (0, 0)
    big = torch.full((4,), torch.finfo(torch.float64).max, dtype=torch.float64)  # even float64's sum does
    assert count_nonfinite(big) == (0, 0)
    big[1] = float("inf")
    assert count_nonfinite(big) == (0, 1)


def test_complex_integers_and_empty_tensors():
    c = torch.zeros(8, dtype=torch.complex64)
    assert count_nonfinite(c) == (0, 0)
    c[2] = complex(float("nan"), 0)
    c[3] = complex(0, float("inf"))
    assert count_nonfinite(c) == (1, 1)
    assert count_nonfinite(torch.arange(10)) == (0, 0) and count_nonfinite(torch.ones(3, dtype=torch.bool)) == (0, 0)
    assert count_nonfinite(torch.empty(0)) == (0, 0)


def test_what_a_step_health_says():
    health = {"nonfinite": {"model.w": {"nan": 2, "inf": 0}, "optim.state.w.exp_avg": {"nan": 0, "inf": 1}},
              "unchanged": ["model.b"], "compared_with": 4}
    assert problems(health) == ["model.w: 2 NaN", "optim.state.w.exp_avg: 1 Inf",
                                "model.b: unchanged since step 4 while its optimizer state moved"]
    assert problems({"nonfinite": {}, "unchanged": [], "compared_with": None}) == [] and problems(None) == []


def test_nonfinite_python_floats_and_numpy_values_are_counted():
    import numpy as np

    from ckpttool.health import count_nonfinite_value

    assert count_nonfinite_value(float("inf")) == (0, 1) and count_nonfinite_value(float("nan")) == (1, 0)
    assert count_nonfinite_value(np.float32("nan")) == (1, 0) and count_nonfinite_value(np.float16("-inf")) == (0, 1)
    assert count_nonfinite_value(np.array([1.0, np.nan, np.inf, -np.inf])) == (1, 2)
    assert count_nonfinite_value(complex(float("nan"), 1)) == (1, 0)
    nested = {"losses": [1.0, float("nan")], "pair": (torch.tensor([float("inf")]), 2), "seen": {float("inf")}}
    assert count_nonfinite_value(nested) == (1, 2)
    # finite values, integers, bools, strings and numpy integers are not counted
    assert count_nonfinite_value([1.5, 3, True, "inf", np.int64(7), np.array([1, 2]), None]) == (0, 0)


def test_a_step_holding_a_nonfinite_float_in_extra_is_unhealthy_and_refused(tmp_path):
    """A diverged loss kept as float("inf") and a numpy NaN in ``extra`` are in the commit record's
    health (one process: the writer's own path); ``on_nonfinite="refuse"`` commits nothing."""
    import numpy as np

    from ckpttool import Checkpointer
    from ckpttool.errors import UnhealthyStepError
    from ckpttool.steps import read_commit_record
    from ckpttool.storage import resolve

    model = torch.nn.Linear(2, 2)
    root = str(tmp_path / "run")
    with Checkpointer(root) as ckpt:
        ckpt.save(1, model, extra={"loss": float("inf"), "acc": np.float32("nan"), "lr": 0.1, "hist": [1.0, 2.0]})
        ckpt.save(2, model, extra={"loss": 0.5, "acc": np.float32(0.9), "lr": 0.1, "hist": [1.0, 2.0]})
    found = read_commit_record(resolve(f"{root}/step-1"))["health"]["nonfinite"]
    assert found == {"extra.loss": {"nan": 0, "inf": 1}, "extra.acc": {"nan": 1, "inf": 0}}
    assert read_commit_record(resolve(f"{root}/step-2"))["health"]["nonfinite"] == {}
    with pytest.raises(UnhealthyStepError, match="extra.loss: 1 NaN"):
        with Checkpointer(root, on_nonfinite="refuse") as ckpt:
            ckpt.save(3, model, extra={"loss": float("nan")})
    assert Checkpointer(root).steps() == [1, 2]


def test_the_merge_of_ranks_stale_findings_is_the_rule_it_states():
    """A parameter is unchanged when every rank that stores it found its records the same, some
    rank's optimizer state for it moved, and its learning rate is not 0: the merge, on random
    findings of up to 40 ranks, against that rule spelled out."""
    import random

    from ckpttool.health import merge

    rng = random.Random(3)
    keys = [f"model.p{i}" for i in range(12)]
    for _ in range(400):
        parts = []
        for _ in range(rng.randrange(1, 40)):
            stored = sorted(rng.sample(keys, rng.randrange(0, len(keys))))
            same = [k for k in stored if rng.random() < 0.9] + rng.sample(keys, rng.randrange(0, 2))  # (and one it does not store)
            parts.append({"nonfinite": {}, "stale": {"stored": stored, "same": same,
                                                     "moved": rng.sample(keys, rng.randrange(0, 3))}})
        frozen = set(rng.sample(keys, rng.randrange(0, 2)))
        want = [k for k in sorted({k for p in parts for k in p["stale"]["stored"]})
                if all(k in p["stale"]["same"] for p in parts if k in p["stale"]["stored"])
                and any(k in p["stale"]["moved"] for p in parts) and k not in frozen]
        assert merge(parts, 7, frozen)["unchanged"] == want
        # the same findings with some ranks' keys numbered (the DTensor keys, shared by most ranks; one rank numbered
        # another list, as a pipeline stage would): the same merge
        shared, other = keys[:9], keys[3:][::-1]
        lists = [rng.choice([shared, shared, other, None]) for _ in parts]
        coded = [numbered(p, k) if k is not None else p for p, k in zip(parts, lists)]
        assert merge(coded, 7, frozen, lists)["unchanged"] == want


def test_numbered_findings_that_are_not_their_ranks_keys_are_refused():
    from ckpttool.health import merge

    keys = ["model.a", "model.b"]
    part = numbered({"nonfinite": {}, "stale": {"stored": ["model.a"], "same": ["model.a"], "moved": ["model.a"]}}, keys)
    assert merge([part], 7, set(), [keys])["unchanged"] == ["model.a"]
    for bad in (["4", "1", "1"], ["1", "zz", "1"], ["1", "1"], "111"):
        with pytest.raises(ValueError):
            merge([{**part, "stale": {**part["stale"], "numbered": bad}}], 7, set(), [keys])
    with pytest.raises(ValueError, match="without the rank's names"):
        merge([part], 7, set(), [None])
