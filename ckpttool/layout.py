"""Layout maths: boxes, FSDP2 chunking over 1-D and HSDP meshes, intersections, slabs. Pure code.

A *box* is ``(offsets, sizes)`` in a tensor's global index space. No I/O, no torch.distributed:
everything here is tested exhaustively in one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .errors import UsageError

Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_numel(box: Box) -> int:
    return math.prod(box[1])


def whole(shape: Sequence[int]) -> Box:
    return (tuple(0 for _ in shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None when they do not overlap.

    Zero-sized boxes never overlap anything (they hold no element); 0-d boxes always overlap.
    """
    (ao, asz), (bo, bsz) = a, b
    if len(ao) != len(bo):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    offs, sizes = [], []
    for a0, an, b0, bn in zip(ao, asz, bo, bsz):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that select ``inner`` inside a tensor holding ``outer``."""
    return tuple(slice(i - o, i - o + n) for i, o, n in zip(inner[0], outer[0], inner[1]))


# --- FSDP2 layouts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """A device mesh as FSDP2 uses it: ``replicate`` groups x ``shard`` ranks (1-D when replicate=1)."""

    replicate: int
    shard: int

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @classmethod
    def parse(cls, world_size: int, mesh: str | None = None) -> Mesh:
        """``--world-size M [--mesh RxS]`` -> Mesh; a bad combination raises :class:`UsageError`."""
        if world_size < 1:
            raise UsageError(f"--world-size must be at least 1, got {world_size}")
        if not mesh:
            return cls(1, world_size)
        try:
            r, s = (int(p) for p in mesh.lower().split("x"))
        except ValueError:
            raise UsageError(f"--mesh must look like RxS (e.g. 2x2), got {mesh!r}") from None
        if r < 1 or s < 1 or r * s != world_size:
            raise UsageError(f"--mesh {mesh} has {r}x{s}={r * s} ranks but --world-size is {world_size}")
        return cls(r, s)


def shard_range(n: int, shards: int, index: int) -> tuple[int, int]:
    """``torch.chunk`` along one dim: shard ``index`` of ``shards`` holds ``[start, stop)``.

    Chunks are ``ceil(n / shards)`` long, so the last ones may be short or empty (FSDP2's rule).
    """
    size = -(-n // shards) if n else 0
    start = min(index * size, n)
    return start, min(start + size, n)


def fsdp_box(shape: Sequence[int], shards: int, index: int) -> Box | None:
    """The box shard ``index`` holds of a tensor of ``shape`` under ``Shard(0)``; None when empty.

    0-d tensors are not sharded: every shard holds the whole (one) element.
    """
    shape = tuple(shape)
    if not shape:
        return ((), ())
    start, stop = shard_range(shape[0], shards, index)
    if stop <= start:
        return None
    return (start, *([0] * (len(shape) - 1))), (stop - start, *shape[1:])


def stored_boxes(shape: Sequence[int], mesh: Mesh, sharded: bool = True) -> list[tuple[int, Box]]:
    """(rank, box) for every box a checkpoint stores once on ``mesh``.

    Sharded tensors: shard index s is stored by rank ``s`` of replicate group 0 (ranks are numbered
    replicate-major, so that is global rank s). Replicated tensors (buffers, scalars): rank 0 only.
    Empty shards are stored as FSDP2 stores them: one zero-row chunk at offset ``shape[0]`` (DCP
    keys chunks by offset, so several empty shards share that one).
    """
    shape = tuple(shape)
    if not sharded or not shape:
        return [(0, whole(shape))]
    out = []
    empty_stored = False
    for s in range(mesh.shard):
        box = fsdp_box(shape, mesh.shard, s)
        if box is None:
            if empty_stored:
                continue
            box = ((shape[0], *([0] * (len(shape) - 1))), (0, *shape[1:]))
            empty_stored = True
        out.append((s, box))
    return out


def rank_box(shape: Sequence[int], mesh: Mesh, rank: int) -> Box | None:
    """The box a given rank holds (in memory) under FSDP2 on ``mesh``."""
    return fsdp_box(shape, mesh.shard, rank % mesh.shard)


# --- output layouts: which rank's file stores which box ----------------------------------------


class Layout(Protocol):
    """Where each tensor of an output goes: a list of (rank, box), each box stored once."""

    @property
    def world_size(self) -> int: ...

    def boxes(self, key: str, shape: tuple[int, ...]) -> list[tuple[int, Box]]: ...


@dataclass(frozen=True)
class SingleRank:
    """Everything whole, in rank 0's file (what a converted checkpoint holds)."""

    world_size: int = 1

    def boxes(self, key: str, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
        return [(0, whole(shape))]


@dataclass(frozen=True)
class FsdpLayout:
    """FSDP2's ``Shard(0)`` boxes on ``mesh``, each stored once; ``replicated`` keys (buffers,
    scalars) stay whole on rank 0."""

    mesh: Mesh
    replicated: frozenset[str] = field(default_factory=frozenset)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def boxes(self, key: str, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
        return stored_boxes(shape, self.mesh, sharded=key not in self.replicated)


def stored_replicated(shape: Sequence[int], chunks: Sequence[Box], source: Mesh) -> bool:
    """Whether a checkpoint saved on ``source`` holds this tensor replicated (a buffer, a scalar).

    It is when it is stored as one whole chunk although sharding it over ``source`` would have made
    several. From a world-size-1 source that cannot be told, so the answer there is False.
    """
    shape = tuple(shape)
    if not shape:
        return True
    if len(chunks) != 1 or tuple(chunks[0][1]) != shape:
        return False
    return len(stored_boxes(shape, source)) > 1


# --- covering and slabs --------------------------------------------------------------------------


def tiles_exactly(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None if ``boxes`` cover ``shape`` with no gap and no overlap, else what is wrong."""
    shape = tuple(shape)
    total = math.prod(shape)
    for box in boxes:
        if len(box[0]) != len(shape):
            return f"chunk {box} has rank {len(box[0])}, tensor has rank {len(shape)}"
        for o, n, s in zip(box[0], box[1], shape):
            if o < 0 or n < 0 or o + n > s:
                return f"chunk at {box[0]} of size {box[1]} lies outside the shape {shape}"
    nonempty = [b for b in boxes if box_numel(b) > 0] if shape else list(boxes[:1])
    for i in range(len(nonempty)):
        for j in range(i + 1, len(nonempty)):
            if intersect(nonempty[i], nonempty[j]) is not None:
                return f"chunks at {nonempty[i][0]} and {nonempty[j][0]} overlap"
    covered = sum(box_numel(b) for b in nonempty)
    if covered != total:
        return f"chunks cover {covered} of {total} elements (a gap)"
    return None


def slabs(shape: Sequence[int], itemsize: int, budget: int, box: Box | None = None) -> Iterator[Box]:
    """Split ``box`` (default: the whole tensor) into C-order slabs of at most ``budget`` bytes.

    Each slab is a run of whole sub-blocks along the outermost dims, so when the box is the whole
    tensor every slab is one contiguous byte range and the slabs come in file order: a writer can
    stream a tensor slab after slab. A single element larger than the budget still makes one slab.
    """
    shape = tuple(shape)
    offs, sizes = box if box is not None else whole(shape)
    if not sizes or math.prod(sizes) * itemsize <= budget:
        yield tuple(offs), tuple(sizes)
        return
    inner = math.prod(sizes[1:]) * itemsize
    if inner <= budget:
        step = max(1, budget // max(inner, 1))
        for start in range(0, sizes[0], step):
            n = min(step, sizes[0] - start)
            yield (offs[0] + start, *offs[1:]), (n, *sizes[1:])
        return
    for i in range(sizes[0]):  # one outer index at a time, split inside it
        sub_offs = (offs[0] + i, *offs[1:])
        sub_sizes = (1, *sizes[1:])
        for o, s in slabs(shape[1:], itemsize, budget, (sub_offs[1:], sub_sizes[1:])):
            yield (offs[0] + i, *o), (1, *s)
