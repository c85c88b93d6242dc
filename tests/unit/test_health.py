"""Counting NaN and Inf where the bytes pass: every float dtype, the one-pass check that proves a
tensor finite, and the exact count when it cannot."""

from __future__ import annotations

import pytest
import torch

from ckpttool.health import count_nonfinite, problems

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
