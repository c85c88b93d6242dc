"""Bitwise comparison of tensors: which elements differ in any bit, and where the first one is.
Pure code (no I/O): verify's equality check and the check of a load's live shards share it."""

from __future__ import annotations

import torch


def bits_differ(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per element (flat, C order) whether ``x`` and ``y`` (same dtype and shape) differ in any bit:
    each element compared as one integer (complex128: two int64s)."""
    a, b = x.contiguous().reshape(-1), y.contiguous().reshape(-1)
    if not a.numel():
        return torch.zeros(0, dtype=torch.bool)
    size = x.element_size()
    if size == 16:
        return (a.view(torch.int64).view(-1, 2) != b.view(torch.int64).view(-1, 2)).any(dim=1)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return a.view(view) != b.view(view)


