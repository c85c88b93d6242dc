"""Checkpoints written by plain torch (no ckpttool code) at world sizes 1-4, shared by the dist tests."""

from __future__ import annotations

import pytest

from .harness import run_ranks
from .workloads import plain_torch_save, train_run


@pytest.fixture(scope="session")
def plain(tmp_path_factory):
    """world size -> (path, the full state torch.save would hold)."""
    out = {}
    for w in (1, 2, 3, 4):
        path = str(tmp_path_factory.mktemp(f"plain{w}") / "ck")
        out[w] = (path, run_ranks(plain_torch_save, w, path)[0])
    return out


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """The trainer run 3 steps on 1..3 ranks, saving at steps 2 and 3: world size -> (root, result)."""
    out = {}
    for w in (1, 2, 3):
        root = str(tmp_path_factory.mktemp(f"w{w}"))
        res = run_ranks(train_run, w, steps=3, ckpt_dir=root, save_every=2)
        out[w] = (root, res[0])
    return out
