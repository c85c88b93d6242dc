"""The one place that touches torch names which are private, dunder or moved between releases.

Everything else in the package uses torch's public API; when a torch upgrade moves one of these
names, this module is where it breaks (and its tests say which name).
"""

from __future__ import annotations

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]


def local_shard_box(value: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """(local tensor, its box in the global tensor) for a DTensor shard or a plain tensor.

    DTensor's ``__create_chunk_list__`` is the dunder DCP itself calls to learn a shard's box
    (public since torch 2.2, unlike ``torch.distributed.tensor._utils``).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        (chunk,) = value.__create_chunk_list__()
        return value.to_local(), (tuple(chunk.offsets), tuple(chunk.sizes))
    return value, (tuple(0 for _ in value.shape), tuple(value.shape))
