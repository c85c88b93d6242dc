"""Shared fixtures: a reference state dict with the shapes and dtypes that break converters."""

from __future__ import annotations

import pytest
import torch


def reference_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(7, 3, generator=g),
            "wt": torch.randn(3, 4, generator=g).t(),  # saved from a transposed view: strided storage
            "b16": torch.randn(5, generator=g).to(torch.bfloat16),
            "h": torch.randn(4, 2, generator=g).to(torch.float16),
            "f64": torch.randn(2, 2, generator=g).double(),
            "ids": torch.arange(6, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "u8": torch.arange(5, dtype=torch.uint8),
            "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(2.5),
            "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        },
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(7, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None, "params": ["w"]}],
        },
        "extra": {"step": 10, "name": "run-1", "tags": ["a", "b"], "inf": float("inf"), "nested": {"k": (1, 2)}},
    }


@pytest.fixture
def ref_state():
    return reference_state()


@pytest.fixture
def ref_pt(tmp_path):
    """The reference state written by plain torch.save."""
    path = tmp_path / "ref.pt"
    torch.save(reference_state(), path)
    return path
