"""What every format implements: a Source (index + region reads) and a Sink (streamed writes).

Sources answer ``index()`` and ``read_tensor(key, box)`` for any box of a tensor, reading only the
bytes that box needs, so callers control memory. Sinks are told up front what will be written
(``begin``), then pull each tensor through a ``read(box)`` callback in slabs no bigger than the
memory budget, and ``finalize()`` commits the output (written under a temporary name until then).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..index import Index, ObjPath, TensorEntry, dtype_size
from ..layout import Box, slabs, whole
from ..storage import Location, temp_sibling

ReadFn = Callable[[Box], torch.Tensor]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the sink will receive: its key, nesting path, global shape and (output) dtype."""

    key: str
    path: ObjPath
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class ObjectSpec:
    key: str
    path: ObjPath
    value: Any


def split(entries: list[TensorSpec | ObjectSpec]) -> tuple[list[TensorSpec], list[ObjectSpec]]:
    return [e for e in entries if isinstance(e, TensorSpec)], [e for e in entries if isinstance(e, ObjectSpec)]


class Source(ABC):
    """A checkpoint opened for reading. Cheap to open; ``index()`` reads only metadata."""

    format: str = ""

    def __init__(self, location: Location):
        self.location = location

    @abstractmethod
    def index(self) -> Index: ...

    @abstractmethod
    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of ``box`` (default: all) of tensor ``key`` as a contiguous CPU tensor: a new
        one, or ``out`` (of the box's shape and the entry's dtype) filled in place, so a caller
        streaming many slabs can reuse one buffer instead of faulting in fresh pages each time."""

    @abstractmethod
    def read_object(self, key: str) -> Any: ...

    def chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        """The name of the file that holds a chunk (for inspect and error messages)."""
        return self.location.name

    def files(self) -> list[str]:
        """Names of the data files this checkpoint consists of."""
        return [self.location.name]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Sink(ABC):
    """An output being written under a temporary name; nothing at the destination until finalize."""

    format: str = ""

    def __init__(self, location: Location):
        self.location = location
        # Local disks: write under a hidden name and rename into place at the end. Object stores
        # have no atomic rename: write in place, the file that makes the output complete last
        # (.metadata, the index, or a single object whose upload completes at close).
        self.tmp = temp_sibling(location) if location.is_local else location
        self.dropped: list[str] = []  # object keys the format could not hold

    def order(self, tensors: list[TensorSpec]) -> list[TensorSpec]:
        """The order tensors will be written in (a format may need its own, e.g. for alignment)."""
        return tensors

    @abstractmethod
    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        """Everything that will be written, in the source's order (objects carry their values)."""

    @abstractmethod
    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        """Write one tensor (tensors arrive in ``begin``'s order), pulling slabs of <= budget bytes."""

    @abstractmethod
    def _close(self) -> None:
        """Flush and close what is open under ``self.tmp``."""

    def finalize(self) -> None:
        """Commit: the output appears at its destination whole, or not at all."""
        self._close()
        if self.tmp == self.location:
            return
        if self.location.exists():
            self.location.remove()  # only reached with force; checked before writing began
        self.tmp.rename_to(self.location)

    def abort(self) -> None:
        """Remove the temporary output after a failure or interrupt."""
        try:
            self._close()
        except Exception:  # noqa: BLE001 - already failing; removing the temp output matters more
            pass
        try:
            self.tmp.remove()
        except Exception:  # noqa: BLE001
            pass


class SlabBuffers:
    """Growable byte buffers viewed as any shape and dtype, reused from slab to slab.

    A sink writes each slab before it asks for the next, so one buffer per role serves every slab;
    fresh allocations would fault in new pages each time (3 s per GB on the test machine, more
    than the disk).
    """

    def __init__(self, count: int):
        self._bufs = [torch.empty(0, dtype=torch.uint8) for _ in range(count)]

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, which: int) -> torch.Tensor:
        n = math.prod(shape) * dtype_size(dtype)
        if self._bufs[which].numel() < n:
            self._bufs[which] = torch.empty(n, dtype=torch.uint8)
        return self._bufs[which][:n].view(dtype).view(shape)


def read_c_order_box(reader, offset: int, shape: tuple[int, ...], dtype: torch.dtype, box: Box,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Read ``box`` of a tensor stored C-contiguous at byte ``offset``, into ``out`` when given.

    A box spanning whole rows is one read straight into the destination; otherwise the rows it
    touches are read and the inner slice copied (so a region costs the rows, not the tensor).
    """
    from .torchzip import tensor_buffer

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


def stream_tensor(write: Callable[[torch.Tensor], None], spec: TensorSpec, read: ReadFn, budget: int, box: Box | None = None) -> None:
    """Feed the C-order slabs of ``box`` (default whole) of a tensor to ``write``, one at a time."""
    itemsize = dtype_size(spec.dtype)
    for slab in slabs(spec.shape, itemsize, budget, box if box is not None else whole(spec.shape)):
        write(read(slab))
