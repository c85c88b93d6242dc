"""Layout maths: boxes, FSDP2 chunking over 1-D and HSDP meshes, intersections, slabs. Pure code.

A *box* is ``(offsets, sizes)`` in a tensor's global index space. No I/O, no torch.distributed:
everything here is tested exhaustively in one process.
"""

from __future__ import annotations

import bisect
import fnmatch
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .errors import UsageError

Box = tuple[tuple[int, ...], tuple[int, ...]]

#: the most ranks ``reshard`` lays a checkpoint out for (one file each)
MAX_WORLD_SIZE = 1 << 16


def unravel(flat: int, sizes: Sequence[int]) -> list[int]:
    """The coordinates of position ``flat`` in a row-major array of ``sizes`` (a rank in a mesh, an
    element in a box)."""
    out = []
    for s in reversed(sizes):
        out.append(flat % s if s else 0)
        flat //= s if s else 1
    return list(reversed(out))


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
        if world_size > MAX_WORLD_SIZE:
            raise UsageError(f"--world-size {world_size} is more than ckpttool writes ({MAX_WORLD_SIZE} ranks)",
                             hint="one file per rank; ask for support of larger jobs")
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
    if not sharded or not tuple(shape):
        return [(0, whole(shape))]
    return [(s, box) for s in range(mesh.shard) for box in stored_box_of(shape, mesh, s)]


def stored_box_of(shape: Sequence[int], mesh: Mesh, rank: int, sharded: bool = True) -> list[Box]:
    """The boxes of :func:`stored_boxes` that ``rank`` stores (none, or one), in O(1)."""
    shape = tuple(shape)
    if not sharded or not shape:
        return [whole(shape)] if rank == 0 else []
    if rank >= mesh.shard:
        return []
    box = fsdp_box(shape, mesh.shard, rank)
    if box is not None:
        return [box]
    size = -(-shape[0] // mesh.shard) if shape[0] else 0
    first_empty = -(-shape[0] // size) if size else 0
    return [((shape[0], *([0] * (len(shape) - 1))), (0, *shape[1:]))] if rank == first_empty else []


def rank_box(shape: Sequence[int], mesh: Mesh, rank: int) -> Box | None:
    """The box a given rank holds (in memory) under FSDP2 on ``mesh``."""
    return fsdp_box(shape, mesh.shard, rank % mesh.shard)


# --- output layouts: which rank's file stores which box ----------------------------------------


class Layout(Protocol):
    """Where each tensor of an output goes: which boxes each rank's file stores, each box once."""

    @property
    def world_size(self) -> int: ...

    def boxes_of(self, rank: int, key: str, shape: tuple[int, ...]) -> list[Box]: ...


@dataclass(frozen=True)
class SingleRank:
    """Everything whole, in rank 0's file (what a converted checkpoint holds)."""

    world_size: int = 1

    def boxes_of(self, rank: int, key: str, shape: tuple[int, ...]) -> list[Box]:
        return [whole(shape)] if rank == 0 else []


@dataclass(frozen=True)
class FsdpLayout:
    """FSDP2's ``Shard(0)`` boxes on ``mesh``, each stored once; ``replicated`` keys (buffers,
    scalars) stay whole on rank 0."""

    mesh: Mesh
    replicated: frozenset[str] = field(default_factory=frozenset)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def boxes_of(self, rank: int, key: str, shape: tuple[int, ...]) -> list[Box]:
        return stored_box_of(shape, self.mesh, rank, sharded=key not in self.replicated)


def matches(key: str, pattern: str) -> bool:
    """Whether a tensor key belongs to a layer named by ``pattern``: dotted names inside the key
    (``w1`` matches ``model.w1.weight`` and ``optim.state.w1.weight.exp_avg``), or a glob of the
    whole key (``*.attention.wq.*``)."""
    return f".{pattern}." in f".{key}." or fnmatch.fnmatchcase(key, pattern)


@dataclass(frozen=True)
class TpLayout:
    """FSDP2 over ``dp`` ranks and tensor parallelism over ``tp`` on a ``(dp, tp)`` mesh (rank
    ``d * tp + t``), for the common placements: layers matching ``colwise`` are cut by rows over
    tp (``ColwiseParallel``: weight and bias), layers matching ``rowwise`` by columns
    (``RowwiseParallel``: the weight's dim 1), and FSDP2 cuts each rank's part again by rows over
    dp (a colwise part within its tp rows, as FSDP2's strided sharding does). Other tensors are
    FSDP2's ``Shard(0)`` over dp, replicated over tp and stored once (tp rank 0's file);
    ``replicated`` keys (buffers, scalars) stay whole on rank 0. Cuts follow ``torch.chunk``."""

    dp: int
    tp: int
    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    replicated: frozenset[str] = field(default_factory=frozenset)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def tp_dim(self, key: str, ndim: int) -> int | None:
        """The dim tensor parallelism cuts ``key`` along (None: replicated over tp)."""
        if ndim >= 1 and any(matches(key, p) for p in self.colwise):
            return 0
        if ndim >= 2 and any(matches(key, p) for p in self.rowwise):
            return 1
        return None

    def boxes_of(self, rank: int, key: str, shape: tuple[int, ...]) -> list[Box]:
        shape = tuple(shape)
        d, t = divmod(rank, self.tp)
        if not shape or key in self.replicated or 0 in shape:
            return [whole(shape)] if rank == 0 else []
        starts, sizes = [0] * len(shape), list(shape)
        dim = self.tp_dim(key, len(shape))
        if dim is None:
            if t:
                return []
            starts[0], stop = shard_range(shape[0], self.dp, d)
            sizes[0] = stop - starts[0]
        elif dim == 0:
            lo, hi = shard_range(shape[0], self.tp, t)
            start, stop = shard_range(hi - lo, self.dp, d)
            starts[0], sizes[0] = lo + start, stop - start
        else:
            starts[1], stop = shard_range(shape[1], self.tp, t)
            sizes[1] = stop - starts[1]
            starts[0], stop = shard_range(shape[0], self.dp, d)
            sizes[0] = stop - starts[0]
        return [] if 0 in sizes else [(tuple(starts), tuple(sizes))]


@dataclass(frozen=True)
class ChunkLayout:
    """Boxes given per key and rank, as another checkpoint stores them (``reshard --like``):
    ``boxes[key][rank]`` lists the boxes rank ``rank``'s file stores of ``key``."""

    world_size: int
    boxes: dict[str, dict[int, tuple[Box, ...]]] = field(hash=False)

    def boxes_of(self, rank: int, key: str, shape: tuple[int, ...]) -> list[Box]:
        return list(self.boxes.get(key, {}).get(rank, ()))


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


#: the most grid cells :func:`tiles_exactly` builds (a byte each); real layouts have about one per chunk
MAX_GRID_CELLS = 1 << 22
#: a cell's count, one more box on it: 0 -> 1 -> 2, and 2 stays (two is all the check needs to know)
_COVER_ONCE_MORE = bytes([1, 2, *([2] * 254)])


def _rows_end_to_end(shape: tuple[int, ...], boxes: Sequence[Box]) -> bool:
    """Whether ``boxes`` are the layout FSDP2 and every row-sharded writer make: each spans every
    dim but the first, and the non-empty ones lie end to end along it from 0 to its size (a
    check in one pass, no grid; False sends the layout to the general check, which names what is
    wrong)."""
    zeros, rest = (0,) * (len(shape) - 1), tuple(shape[1:])
    rows = []
    for off, size in boxes:
        if tuple(off[1:]) != zeros or tuple(size[1:]) != rest:
            return False
        if size[0]:
            rows.append((off[0], size[0]))
    end = 0
    for off, size in sorted(rows):
        if off != end:
            return False
        end += size
    return end == shape[0]


def tiles_exactly(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None if ``boxes`` cover ``shape`` with no gap and no overlap, else what is wrong (naming the
    first element in no chunk, or two chunks that overlap).

    The cut points of all boxes along each dim split the tensor into a grid of cells; each box
    covers a block of cells, so counting covers per cell checks both properties in time linear in
    the cells and the boxes (a sharded layout has about one cell per chunk; 20,000 chunks take
    well under a second). A layout whose grid would exceed :data:`MAX_GRID_CELLS` is reported as
    one ckpttool cannot check. The first overlap, else the first gap, in C order is named.
    """
    shape = tuple(shape)
    for box in boxes:
        if len(box[0]) != len(shape) or len(box[1]) != len(shape):
            return f"chunk {box} has rank {len(box[0])}, tensor has rank {len(shape)}"
        for o, n, size in zip(box[0], box[1], shape):
            if o < 0 or n < 0 or o + n > size:
                return f"chunk at {box[0]} of size {box[1]} lies outside the shape {shape}"
    if not shape:
        return None if boxes else "the scalar has no chunk (a gap)"
    if _rows_end_to_end(shape, boxes):
        return None
    nonempty = [b for b in boxes if box_numel(b) > 0]
    if math.prod(shape) == 0:
        return None
    cuts = [sorted({0, size, *(b[0][d] for b in nonempty), *(b[0][d] + b[1][d] for b in nonempty)}) for d, size in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_GRID_CELLS:
        return f"the {len(nonempty)} chunks do not form a grid of at most {MAX_GRID_CELLS} cells; ckpttool cannot check this layout"
    dims = [len(c) - 1 for c in cuts]
    grid = bytearray(cells)  # C order; a cell's count saturates at 2
    strides = [math.prod(dims[d + 1:]) for d in range(len(dims))]
    for b in nonempty:
        block = [(bisect.bisect_left(c, o), bisect.bisect_left(c, o + n)) for c, o, n in zip(cuts, b[0], b[1])]
        lo, hi = block[-1]
        for outer in itertools.product(*(range(a, z) for a, z in block[:-1])):
            start = sum(i * st for i, st in zip(outer, strides)) + lo
            grid[start:start + hi - lo] = grid[start:start + hi - lo].translate(_COVER_ONCE_MORE)
    for count, what in ((2, "overlap"), (0, "gap")):
        flat = grid.find(count)
        if flat >= 0:
            cell = [flat // st % n for st, n in zip(strides, dims)]
            corner = tuple(c[i] for c, i in zip(cuts, cell))
            if what == "gap":
                return f"chunks leave a gap: element {list(corner)} is in no chunk"
            a, b = [box for box in nonempty if all(o <= x < o + n for o, n, x in zip(box[0], box[1], corner))][:2]
            return f"chunks at {a[0]} and {b[0]} overlap (both hold element {list(corner)})"
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
