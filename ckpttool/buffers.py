"""Buffers and byte views of tensor memory, below every format and the engine: growable buffers
reused from slab to slab, a writable byte view of a tensor, and a read of a box of a C-order tensor
straight into its destination."""

from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING

from .index import dtype_size
from .layout import Box

if TYPE_CHECKING:
    import torch


class SlabBuffers:
    """Growable byte buffers viewed as any shape and dtype, reused from slab to slab.

    A sink writes each slab before it asks for the next, so one buffer per role serves every slab;
    a fresh allocation would fault in new pages for every slab, which costs more than the disk.
    """

    def __init__(self, count: int):
        self._bufs: list[torch.Tensor | None] = [None] * count  # made at the first view (torch imported then)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, which: int) -> torch.Tensor:
        import torch

        n = math.prod(shape) * dtype_size(dtype)
        buf = self._bufs[which]
        if buf is None or buf.numel() < n:
            buf = self._bufs[which] = torch.empty(n, dtype=torch.uint8)
        return buf[:n].view(dtype).view(shape)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, no numpy)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_char * n).from_address(t.data_ptr())
    array.owner = t  # the view keeps the array alive, the array keeps the tensor alive
    return memoryview(array).cast("B")


def read_c_order_box(reader, offset: int, shape: tuple[int, ...], dtype: torch.dtype, box: Box,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Read ``box`` of a tensor stored C-contiguous at byte ``offset``, into ``out`` when given.

    A box spanning whole rows is one read straight into the destination; otherwise the rows it
    touches are read and the inner slice copied (so a region costs the rows, not the tensor).
    """
    import torch

    if out is None:
        out = torch.empty(box[1], dtype=dtype)
    if not shape:
        reader.readinto(offset, tensor_buffer(out))
        return out
    item = dtype_size(dtype)
    row = math.prod(shape[1:]) * item
    start = offset + box[0][0] * row
    inner_whole = all(o == 0 and n == s for o, n, s in zip(box[0][1:], box[1][1:], shape[1:]))
    if inner_whole and out.is_contiguous():
        reader.readinto(start, tensor_buffer(out))
        return out
    rows = torch.empty((box[1][0], *shape[1:]), dtype=dtype)
    reader.readinto(start, tensor_buffer(rows))
    out.copy_(rows[(slice(None), *(slice(o, o + n) for o, n in zip(box[0][1:], box[1][1:])))])
    return out
