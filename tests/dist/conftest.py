"""Checkpoints written by plain torch (no ckpttool code) at world sizes 1-4, shared by the dist tests."""

from __future__ import annotations

import pytest

from .harness import run_ranks
from .workloads import plain_torch_save


@pytest.fixture(scope="session")
def plain(tmp_path_factory):
    """world size -> (path, the full state torch.save would hold)."""
    out = {}
    for w in (1, 2, 3, 4):
        path = str(tmp_path_factory.mktemp(f"plain{w}") / "ck")
        out[w] = (path, run_ranks(plain_torch_save, w, path)[0])
    return out
