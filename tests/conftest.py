"""Shared fixtures: the reference state written by plain torch.save."""

from __future__ import annotations

import pytest
import torch

from .helpers import reference_state


@pytest.fixture
def ref_state():
    return reference_state()


@pytest.fixture
def ref_pt(tmp_path):
    """The reference state written by plain torch.save."""
    path = tmp_path / "ref.pt"
    torch.save(reference_state(), path)
    return path
