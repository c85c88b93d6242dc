"""A step's load index: what a loading rank reads instead of ``.metadata``.

FSDP2 gives every DTensor a chunk on every rank, so ``.metadata`` names N chunks of every tensor
(14 M at 16,384 ranks for an 8B model) and every loading rank would unpickle all of them to find
the few it reads. Where every rank's DTensor chunks are exactly FSDP2's layout of the job's N
ranks (``shared_chunks``: each rank checked it against its own chunks), rank 0 writes
``.ckpttool-index.json`` beside ``.metadata``, hashed in the commit record's manifest like it:

- ``world_size`` N, every key in the state's order with its planner path;
- ``sharded``: the DTensor keys (name, shape, dtype), their names' digest and the records'
  transforms: rank ``r``'s chunk of such a key is rows ``layout.shard_range(rows, N, r)``, the
  whole of every other dim, in ``__<r>_0.distcp``;
- ``tensors`` and ``objects``: every other entry, as ``.metadata`` has it (chunks and records).

Where each rank's record of each sharded key lies is in that rank's manifest file (``sharded``:
``[names digest, N, [start, length, ...]]``, in the keys' order), which a reader loads anyway
to check the records it reads. So a rank's load plan reads the commit record, this index and the
manifest files of the ranks whose rows it overlaps: nothing grows with N but the commit record's
list of manifest files. The chunks of a sharded key are made on demand (:class:`RuleChunks`);
an offline command that walks all of them reads every rank's manifest file, as it reads every
data file. ``ckpttool verify`` checks the index against ``.metadata`` entry by entry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ...checksums import ALGORITHM, hash_bytes
from ...dtypes import PLAIN, dtype_size
from ...errors import CorruptCheckpointError
from ...index import Chunk, Index, ObjectEntry, TensorEntry, plausible_shape
from ...layout import MAX_WORLD_SIZE, shard_range
from ...storage import Location
from .metadata_types import _StorageInfo
from .transforms import check_descriptors

INDEX_FILE = ".ckpttool-index.json"
FORMAT, VERSION = "ckpttool-index", 1
#: what a reader parses; a step whose index would be larger is written without one (loads read .metadata)
MAX_INDEX_BYTES = 64 << 20
_HINT = "the step's load index is damaged; `ckpttool verify` the step, or load an earlier one"


# --- written: by every rank (its manifest file) and by rank 0 (the index) ------------------------

def rank_locations(index: Any) -> list[Any] | None:
    """A rank's manifest entry ``sharded``: where each of its DTensor records lies, when its
    chunks follow FSDP2's layout of N (``index.sharded``'s rule: one chunk of every key, in its
    data file); None otherwise."""
    entry = index.sharded
    if entry is None or entry[5] is None:
        return None
    flat: list[int] = []
    for key in index.everyone:
        (chunk,) = index.tensors[key]["chunks"]
        flat += (chunk[2], chunk[3])
    return [entry[0], entry[5], flat]


def index_bytes(described: Any, world_size: int, digest: str, names: list[str], shapes: list[Any], dtypes: list[str],
                transforms: list[str] | None) -> bytes | None:
    """Rank 0: the index of a step whose DTensor keys ``names`` (their chunks in no entry of
    ``described``) every rank stores by FSDP2's layout of ``world_size``; None when it would pass
    what a reader takes (loads then read ``.metadata``)."""
    sharded = set(names)
    keys = [k for k in described.order if k in described.tensors or k in described.objects]
    tensors = {k: [list(shape), dtype, [[list(offs), list(sizes), list(record)] for offs, sizes, record in chunks]]
               for k, (shape, dtype, chunks) in described.tensors.items() if k not in sharded}
    objects = {k: list(record) for k, record in described.objects.items()}
    body = {"format": FORMAT, "version": VERSION, "world_size": world_size, "keys": keys,
            "paths": [list(described.paths.get(k, (k,))) for k in keys],
            "sharded": {"digest": digest, "transforms": transforms,
                        "keys": [[n, list(s), d] for n, s, d in zip(names, shapes, dtypes)]},
            "tensors": tensors, "objects": objects}
    raw = json.dumps(body, separators=(",", ":")).encode()
    return raw if len(raw) <= MAX_INDEX_BYTES else None


# --- read: the index, checked, as an Index ---------------------------------------------------------

def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _shape(x: Any) -> bool:
    return isinstance(x, list) and plausible_shape(x)


def _dtype(x: Any) -> bool:
    return isinstance(x, str) and x in PLAIN


def _record(x: Any) -> bool:
    return (isinstance(x, list) and len(x) == 4 and isinstance(x[0], str) and _count(x[1]) and _count(x[2])
            and (x[3] is None or isinstance(x[3], list)))


class RuleChunks(Sequence[Chunk]):
    """The chunks of a key FSDP2 laid out over ``n`` ranks, made on demand: chunk ``r`` is rank
    ``r``'s rows, its record where ``locate(r, number)`` says (rank ``r``'s manifest file)."""

    def __init__(self, number: int, shape: tuple[int, ...], item: int, n: int, locate: Callable[[int, int], Any], where: str):
        self.number, self.shape, self.item, self.n, self._locate, self.where = number, shape, item, n, locate, where

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, r: Any) -> Any:
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(self.n))]
        if r < 0:
            r += self.n
        if not 0 <= r < self.n:
            raise IndexError(r)
        start, stop = shard_range(self.shape[0], self.n, r)
        offsets, sizes = (start, *(0,) * (len(self.shape) - 1)), (stop - start, *self.shape[1:])
        info = self._locate(r, self.number)
        info.chunk_bytes = math.prod(sizes) * self.item  # (a compressed record decodes to no more than its chunk's bytes)
        if not info.transform_descriptors and info.chunk_bytes > info.length:
            raise CorruptCheckpointError(f"rank {r}'s record of chunk at {list(offsets)} holds {info.length} bytes, "
                                         f"fewer than its {math.prod(sizes) * self.item}", where=self.where, hint=_HINT)
        return Chunk(offsets, sizes, info)

    def __iter__(self) -> Iterator[Chunk]:
        return (self[r] for r in range(self.n))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == self.n and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def touching(self, lo: int, hi: int) -> list[Chunk]:
        """The chunks holding any of rows ``[lo, hi)``: the ranks FSDP2's arithmetic names."""
        rows = self.shape[0]
        size = -(-rows // self.n) if rows else 0
        if hi <= lo or size == 0:
            return []
        return [self[r] for r in range(lo // size, min(self.n - 1, (hi - 1) // size) + 1)]


class LoadIndex:
    """A step's load index, read and checked: :meth:`entries` gives the Index a DcpSource serves."""

    def __init__(self, body: dict[str, Any], loc: Location, world_size: Any, manifests: int):
        where = loc.child(INDEX_FILE).url
        self.where = where

        def bad(what: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"load index {what}", where=where, hint=_HINT)

        if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
            raise bad("is not one ckpttool writes")
        n = body.get("world_size")
        if not (_count(n) and 1 <= n <= MAX_WORLD_SIZE and n == world_size):
            raise bad(f"is for {n!r} ranks, the commit record says {world_size!r}")
        if n != manifests:  # (every rank of the rule wrote a manifest file, which says where its records lie)
            raise bad(f"is for {n} ranks, the commit record names {manifests} ranks' manifest files")
        keys, paths = body.get("keys"), body.get("paths")
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys) and len(set(keys)) == len(keys)
                and isinstance(paths, list) and len(paths) == len(keys)
                and all(isinstance(p, list) and p and all(isinstance(e, (str, int)) and not isinstance(e, bool) for e in p)
                        for p in paths)):
            raise bad("has malformed keys or paths")
        sharded, tensors, objects = body.get("sharded"), body.get("tensors"), body.get("objects")
        if not (isinstance(sharded, dict) and isinstance(sharded.get("digest"), str) and isinstance(sharded.get("keys"), list)
                and isinstance(tensors, dict) and isinstance(objects, dict)):
            raise bad("is malformed")
        rule = sharded["keys"]
        if not all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and _shape(e[1]) and e[1]
                   and _dtype(e[2]) for e in rule):
            raise bad("has a malformed sharded key (each is [name, shape of one dim or more, dtype])")
        self.transforms = sharded.get("transforms")
        if self.transforms is not None:
            check_descriptors(self.transforms, where)
        for key, t in tensors.items():
            if not (isinstance(t, list) and len(t) == 3 and _shape(t[0]) and _dtype(t[1]) and isinstance(t[2], list)
                    and all(isinstance(c, list) and len(c) == 3 and _shape(c[0]) and _shape(c[1])
                            and len(c[0]) == len(c[1]) == len(t[0]) and _record(c[2]) for c in t[2])):
                raise bad(f"has a malformed entry of tensor {key!r}")
        for key, o in objects.items():
            if not _record(o):
                raise bad(f"has a malformed entry of object {key!r}")
        named = [e[0] for e in rule]
        if sorted([*named, *tensors, *objects]) != sorted(keys):
            raise bad("does not list each of its keys once")
        self.world_size, self.digest, self.keys, self.paths = n, sharded["digest"], keys, paths
        self.rule = {name: (i, tuple(shape), dtype) for i, (name, shape, dtype) in enumerate(rule)}
        self.tensors, self.objects = tensors, objects
        self.count = len(rule)

    def entries(self, loc: Location, locate: Callable[[int, int], Any]) -> Index:
        """The Index: sharded keys with :class:`RuleChunks`, the others as written; every file
        name confined to the step (``Location.inside``), every record large enough for its chunk
        (a transformed one is checked as it decodes)."""
        idx = Index()
        files: set[str] = set()

        def info(record: list[Any], key: str) -> _StorageInfo:
            if record[0] not in files:
                loc.inside(record[0], f"{self.where} (entry of {key!r})")
                files.add(record[0])
            if record[3]:
                check_descriptors(record[3], self.where)
            return _StorageInfo(record[0], record[1], record[2], record[3])

        for key, path in zip(self.keys, self.paths):
            if key in self.rule:
                number, shape, dtype = self.rule[key]
                chunks: Sequence[Chunk] = RuleChunks(number, shape, dtype_size(PLAIN[dtype]), self.world_size, locate, self.where)
                idx.add(TensorEntry(key, shape, PLAIN[dtype], chunks), tuple(path), self.where)
            elif key in self.tensors:
                shape, dtype, rows = self.tensors[key]
                made = []
                for offs, sizes, record in rows:
                    at = info(record, key)
                    if not record[3] and math.prod(sizes) * dtype_size(PLAIN[dtype]) > at.length:
                        raise CorruptCheckpointError(f"tensor {key!r}: chunk at {offs} of {sizes} needs more bytes than its "
                                                     f"record's {at.length}", where=self.where, hint=_HINT)
                    made.append(Chunk(tuple(offs), tuple(sizes), at))
                idx.add(TensorEntry(key, tuple(shape), PLAIN[dtype], tuple(made)), tuple(path), self.where)
            else:
                idx.add(ObjectEntry(key, info(self.objects[key], key)), tuple(path), self.where)
        return idx

    def files(self) -> set[str]:
        """The data files the index names outside the sharded keys' (those are the ranks' own)."""
        return {r[2][0] for t in self.tensors.values() for r in t[2]} | {o[0] for o in self.objects.values()}


def read(loc: Location, record: dict[str, Any] | None) -> LoadIndex | None:
    """The step's load index, checked against the commit record's size and digest of it; None
    where the record names none (or hashes with another algorithm than this install's)."""
    manifest = (record or {}).get("manifest") or {}
    entry = (manifest.get("files") or {}).get(INDEX_FILE)
    if entry is None or manifest.get("algorithm") != ALGORITHM:
        return None
    target = loc.inside(INDEX_FILE, loc.child(INDEX_FILE).url)
    where = target.url
    if not target.exists():
        raise CorruptCheckpointError("load index named by the commit record is missing", where=where, hint=_HINT)
    size = target.size()
    if size != entry[0] or size > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"load index holds {size} bytes, the commit record says {entry[0]}", where=where, hint=_HINT)
    raw = target.read_bytes(0, size + 1)
    if len(raw) != entry[0] or hash_bytes(raw) != entry[1]:
        raise CorruptCheckpointError("load index does not match the commit record's checksum of it", where=where, hint=_HINT)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise CorruptCheckpointError("load index is not JSON", where=where, hint=_HINT) from None
    return LoadIndex(body, loc, (record or {}).get("world_size"), len(manifest.get("manifests") or {}))


def check_locations(entry: Any, index: LoadIndex, rank: int, where: str) -> list[int]:
    """Rank ``rank``'s manifest entry ``sharded``, checked against the index: the same keys, the
    same N, a start and a length for each key; returns the flat list."""
    if not (isinstance(entry, list) and len(entry) == 3 and entry[0] == index.digest and entry[1] == index.world_size
            and isinstance(entry[2], list) and len(entry[2]) == 2 * index.count
            and all(_count(x) and x < 1 << 62 for x in entry[2])):  # (held as int64)
        raise CorruptCheckpointError(f"rank {rank}'s manifest file does not say where its records of the load index's "
                                     f"{index.count} sharded keys lie", where=where, hint=_HINT)
    return entry[2]


__all__ = ["INDEX_FILE", "LoadIndex", "RuleChunks", "check_locations", "index_bytes", "rank_locations", "read"]
