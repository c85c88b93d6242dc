"""The one model of a checkpoint every format maps onto: Index, TensorEntry, ObjectEntry, Chunk.

Keys are DCP's flattened names (nested dicts joined with ``.``, list items by position). The nesting
is kept beside the keys as a path tuple per key, so a nested ``torch.save`` dict and a flat DCP or
safetensors file map onto each other both ways. Pure code: no I/O, no ``torch.distributed``.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .dtypes import DType, dtype_of, dtype_size
from .errors import CorruptCheckpointError
from .layout import Box, intersect, tiles_exactly

if TYPE_CHECKING:
    import torch

PathItem = str | int
ObjPath = tuple[PathItem, ...]


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: ``offsets``/``sizes`` in the global shape, and where its bytes are.

    ``location`` is format-specific and opaque above the format layer (a DCP record, a safetensors
    file and byte range, ...).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: Any = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor: global shape, element type and the chunks that store it.

    Made with a torch dtype or a :class:`~ckpttool.dtypes.DType`; ``element_type`` is the DType
    (what describing and checking need, without torch), ``dtype`` torch's (importing torch).
    """

    key: str
    shape: tuple[int, ...]
    element_type: DType
    chunks: tuple[Chunk, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "element_type", dtype_of(self.element_type))

    @property
    def dtype(self) -> torch.dtype:
        return self.element_type.torch

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.element_type)

    @cached_property
    def _row_bands(self) -> tuple[list[int], list[list[Chunk]]] | None:
        """The chunks grouped by their rows (dim-0 range), when those ranges partition the rows (any
        grid layout does): band starts, and the chunks of each band. None otherwise."""
        if not self.shape:
            return None
        bands: dict[tuple[int, int], list[Chunk]] = {}
        for c in self.chunks:
            if c.numel:
                bands.setdefault((c.offsets[0], c.offsets[0] + c.sizes[0]), []).append(c)
        ranges = sorted(bands)
        if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            return None
        return [r[0] for r in ranges], [bands[r] for r in ranges]

    def chunks_in(self, box: Box) -> Iterator[tuple[Chunk, Box]]:
        """(chunk, the part of ``box`` it holds) for every chunk that holds part of ``box``: a
        bisection over row bands when there are many chunks, so reading a box costs the chunks it
        touches, not all of them."""
        touching = getattr(self.chunks, "touching", None)  # (chunks laid out by a rule: its arithmetic)
        bands = self._row_bands if len(self.chunks) > 8 and touching is None else None
        if touching is not None and self.shape:
            candidates: Iterable[Chunk] = touching(box[0][0], box[0][0] + box[1][0])
        elif bands is None:
            candidates = self.chunks
        else:
            starts, groups = bands
            lo = max(0, bisect.bisect_right(starts, box[0][0]) - 1)
            hi = bisect.bisect_left(starts, box[0][0] + box[1][0])
            candidates = (c for group in groups[lo:hi] for c in group)
        for c in candidates:
            part = intersect((c.offsets, c.sizes), box)
            if part is not None:
                yield c, part

    def check_coverage(self, where: str) -> None:
        """Refuse a tensor whose chunks leave a gap or overlap: its gap would be uninitialised
        memory in any output or load, so nothing is written or loaded from it."""
        if getattr(self.chunks, "touching", None) is not None:
            return  # chunks made by a rule's arithmetic (load_index.RuleChunks) tile the shape by construction
        if len(self.chunks) == 1 and self.chunks[0].offsets == (0,) * len(self.shape) and self.chunks[0].sizes == self.shape:
            return
        problem = tiles_exactly(self.shape, [(c.offsets, c.sizes) for c in self.chunks])
        if problem:
            raise CorruptCheckpointError(f"tensor {self.key!r}: {problem}", where=where,
                                         hint="its metadata is inconsistent; `ckpttool verify` lists every problem")


@dataclass(frozen=True)
class ObjectEntry:
    """Any non-tensor value (step counters, param_groups, strings). Read through the Source."""

    key: str
    location: Any = field(default=None, compare=False)


Entry = TensorEntry | ObjectEntry


class Index:
    """An ordered map key -> entry, with the nesting path of each key."""

    def __init__(self, entries: list[Entry] | None = None, paths: Mapping[str, ObjPath] | None = None):
        self._entries: dict[str, Entry] = {}
        self._paths: dict[str, ObjPath] = {}
        for entry in entries or []:
            self.add(entry, (paths or {}).get(entry.key))

    def add(self, entry: Entry, path: ObjPath | None = None, where: str | None = None) -> None:
        """Add ``entry`` under its nesting ``path``; ``where``: the file that recorded both (named
        in the error when they do not agree)."""
        if entry.key in self._entries:
            raise CorruptCheckpointError(f"key {entry.key!r} appears twice", where=where)
        path = tuple(path) if path else (entry.key,)
        if not _spells(path) or key_of(path) != entry.key:
            raise CorruptCheckpointError(f"the nesting recorded for key {entry.key!r} does not spell it: {path!r}",
                                         where=where, hint="the checkpoint's metadata is damaged")
        self._entries[entry.key] = entry
        self._paths[entry.key] = path

    def __getitem__(self, key: str) -> Entry:
        return self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self):
        return self._entries.keys()

    def tensors(self) -> Iterator[TensorEntry]:
        return (e for e in self._entries.values() if isinstance(e, TensorEntry))

    def objects(self) -> Iterator[ObjectEntry]:
        return (e for e in self._entries.values() if isinstance(e, ObjectEntry))

    def path(self, key: str) -> ObjPath:
        return self._paths[key]

    def under(self, top: str | None) -> list[str]:
        """The keys under the top-level key ``top`` (every key when None), in order."""
        return list(self) if top is None else [k for k in self if str(self._paths[k][0]) == top]

    @property
    def paths(self) -> dict[str, ObjPath]:
        return dict(self._paths)

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors())


#: the most elements a tensor may declare (counting non-zero dims only: strides are products of them)
MAX_NUMEL = 1 << 58


def plausible_shape(shape: Any) -> bool:
    """Non-negative int dims whose non-zero product stays far below int64's range (torch computes
    strides from it, and a zero dim elsewhere would hide a huge product from ``numel``)."""
    if not isinstance(shape, (tuple, list)):
        return False
    numel = 1
    for d in shape:  # (a loop, not generators: every key of a large step's index passes here, several times)
        if not (type(d) is int or (isinstance(d, int) and not isinstance(d, bool))) or d < 0:
            return False
        if d:
            numel *= d
            if numel > MAX_NUMEL:
                return False
    return True


# --- key flattening, mirroring DCP's traversal so our keys equal plain torch's -------------------


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # (no value is a tensor in a process that never imported torch)
    return torch is not None and isinstance(value, torch.Tensor)


def _is_leaf(value: Any, is_tensor=_is_tensor) -> bool:
    """DCP's rule: mappings are traversed; a list only if something inside it must be (a tensor, or
    a container that is itself traversed); everything else (tuples included) is a leaf."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for item in value:
        if is_tensor(item):
            return False
        if isinstance(item, (Mapping, list)) and not _is_leaf(item, is_tensor):
            return False
    return True


def iter_leaves(state: Mapping[str, Any], is_tensor=_is_tensor) -> Iterator[tuple[ObjPath, Any]]:
    """Yield (path, value) for every leaf of a nested state dict, in DCP's order.

    ``is_tensor`` says what counts as a tensor (formats pass their lazy tensor references).
    """

    def walk(path: ObjPath, value: Any) -> Iterator[tuple[ObjPath, Any]]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from walk(path + (str(k),), v)
        elif _is_leaf(value, is_tensor):
            yield path, value
        else:
            for i, v in enumerate(value):
                yield from walk(path + (i,), v)

    for key, value in state.items():
        yield from walk((str(key),), value)


def key_of(path: ObjPath) -> str:
    return ".".join(map(str, path))


def _spells(path: ObjPath) -> bool:
    """Each component a str or a non-negative int (a loop: every key of an index passes here)."""
    for p in path:
        if not (type(p) is str or isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0)):
            return False
    return True


def flatten(state: Mapping[str, Any], is_tensor=_is_tensor) -> tuple[dict[str, Any], dict[str, ObjPath]]:
    """Nested state dict -> (flat key -> value, key -> path). Raises on colliding keys."""
    flat: dict[str, Any] = {}
    paths: dict[str, ObjPath] = {}
    for path, value in iter_leaves(state, is_tensor):
        key = key_of(path)
        if key in flat:
            raise CorruptCheckpointError(f"two entries flatten to the same key {key!r}")
        flat[key] = value
        paths[key] = path
    return flat, paths


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, ObjPath]) -> dict[str, Any]:
    """Inverse of :func:`flatten`: rebuild nested dicts (str path items) and lists (int items).

    Paths come from checkpoints, so they are checked first: a list position past the number of
    entries, or two paths that disagree on what a node is (a value in one, a container in the
    other; a list in one, a dict in the other), are corrupt input, not something to build.
    """
    kinds: dict[ObjPath, type] = {(): dict}  # every container on some path, and what it is
    leaves: set[ObjPath] = set()
    for key in flat:
        path = tuple(paths.get(key, (key,)))
        for i, item in enumerate(path):
            kind = list if isinstance(item, int) else dict
            if (isinstance(item, int) and item > len(flat)) or kinds.setdefault(path[:i], kind) is not kind \
                    or path[:i] in leaves:
                raise CorruptCheckpointError(f"the nesting recorded for key {key!r} conflicts with another key's",
                                             hint="the checkpoint's metadata is damaged")
        if path in kinds or path in leaves:
            raise CorruptCheckpointError(f"the nesting recorded for key {key!r} conflicts with another key's",
                                         hint="the checkpoint's metadata is damaged")
        leaves.add(path)
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = tuple(paths.get(key, (key,)))
        node: Any = root
        for i, here in enumerate(path):
            if isinstance(node, list):
                node.extend([None] * (here + 1 - len(node)))
            if i == len(path) - 1:
                node[here] = value
            else:
                child = node[here] if isinstance(node, list) else node.get(here)
                if child is None:
                    child = node[here] = kinds[path[: i + 1]]()
                node = child
    return root


def strip_prefix(paths: Mapping[str, ObjPath], top: str) -> dict[str, tuple[str, ObjPath]]:
    """Keys under the top-level key ``top`` -> (new key without the prefix, new path).

    Used by ``--only model``: keep one top-level entry and drop its name from every key.
    """
    out: dict[str, tuple[str, ObjPath]] = {}
    for key, path in paths.items():
        if len(path) >= 2 and str(path[0]) == top:
            rest = path[1:]
            out[key] = (key_of(rest), rest)
    return out
