"""The ranks' DTensor chunks in bulk: what each rank puts after its index's JSON, and rank 0's
table of every rank's chunks, checked in array operations.

FSDP2 gives every DTensor a chunk on every rank: millions of chunks at thousands of ranks, which
rank 0 cannot afford to read as JSON, check one by one and spell into ``.metadata``. So a rank's
index carries its DTensors (the keys every rank declares) after its JSON, in three sections:

1. its fragment of ``.metadata`` (``metadata_emit.fragment``), which rank 0 copies in;
2. the JSON of those keys, ``[name, shape, dtype]`` in declaration order, which rank 0 reads from
   its own index and from another's only when that one's digest differs (other keys, another
   order: pipeline stages);
3. its chunks as little-endian int64 rows: the key's number, ``width`` offsets, ``width`` sizes
   (padded with 0 and 1 to the keys' largest rank), the record's start and length, and 1 where the
   record lies in the rank's file of frozen tensors.

The index's ``sharded`` entry holds ``[names digest, number of keys, width, [the sections'
lengths], [the fragment's digest, the rows' digest], rule]``: ``rule`` is the world size N when the rank's chunks are
exactly FSDP2's of N ranks (one chunk of every key, rows ``layout.shard_range`` of the rank, the
whole of the other dims: checked by the rank against its own chunks), else None. Rank 0 reads of
a rank's tail the sections it uses, each when it uses it, checked against its digest. Where every rank of N claims the rule for N and numbered the same
keys, the chunks tile every key and come in offset order by the rule's arithmetic: rank 0 reads
no row. Where they numbered the same keys, it stacks the rows into one table whose tiling it
checks per key in a few array operations (row shards end to end along dim 0; any other layout,
key by key, by ``layout.tiles_exactly``). Otherwise it puts each rank's chunks back into its
index as JSON would have held them, and the merge goes key by key as before.
"""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checksums import hash_bytes
from ..rendezvous import Tail
from ..dtypes import PLAIN
from ..errors import CorruptCheckpointError
from ..formats.dcp import metadata_emit
from ..formats.dcp.transforms import transform_names
from ..layout import Box, shard_range, tiles_exactly

# a row's columns after the offsets and sizes: start, length, in the frozen file
_TAIL_COLUMNS = 3


def rank_tail(index: Any, frozen_name: str, world_size: int | None = None) -> tuple[list[Any] | None, bytes]:
    """A rank's ``sharded`` entry and the bytes after its index's JSON (see the module's text);
    (None, b"") where they cannot be spelled (a dtype without a name in torch's namespace, a chunk
    in a file that is neither the rank's data file nor ``frozen_name``): the index then carries
    every chunk as JSON. ``world_size``: the job's, for the rule."""
    keys = list(index.everyone)
    declared = [[k, index.tensors[k]["shape"], index.tensors[k]["dtype"]] for k in keys]
    if not keys or any(dtype not in PLAIN for _, _, dtype in declared):  # (no DTensor: nothing to carry)
        return None, b""
    width = max((len(shape) for _, shape, _ in declared), default=0)
    chunks = [(i, index.tensors[k]["chunks"]) for i, k in enumerate(keys) if index.tensors[k]["chunks"]]
    rows = array("q")
    for i, key_chunks in chunks:
        ndim = len(declared[i][1])
        for c in key_chunks:
            if len(c[0]) != ndim or len(c[1]) != ndim or (len(c) > 4 and c[4] != frozen_name):
                return None, b""
            pad = width - ndim
            rows.extend((i, *c[0], *(0,) * pad, *c[1], *(1,) * pad, c[2], c[3], 1 if len(c) > 4 else 0))
    rule = world_size if world_size and _follows_rule(index, declared, world_size) else None
    if rule is not None:  # (its empty shards: in the load index, by the rule; .metadata needs none: step_writer._commit_metadata)
        chunks = [(i, [c for c in key_chunks if 0 not in c[1]]) for i, key_chunks in chunks]
        chunks = [(i, key_chunks) for i, key_chunks in chunks if key_chunks]
    try:
        fragment = metadata_emit.fragment(len(keys), chunks, index.file, tuple(transform_names(index.compress) or ()))
    except ValueError:
        return None, b""
    if sys.byteorder != "little":
        rows.byteswap()
    names, boxes = json.dumps(declared).encode(), rows.tobytes()
    return ([hash_bytes(names), len(keys), width, [len(fragment), len(names), len(boxes)], [hash_bytes(fragment), hash_bytes(boxes)],
             rule], fragment + names + boxes)


def _follows_rule(index: Any, declared: list[list[Any]], world_size: int) -> bool:
    """Whether this rank's chunks are exactly FSDP2's of ``world_size`` ranks: of every key one,
    in its data file, rows ``shard_range`` of the rank (an empty one at the end), every other dim
    whole."""
    for name, shape, _ in declared:
        chunks = index.tensors[name]["chunks"]
        if not shape or len(chunks) != 1 or len(chunks[0]) != 4:
            return False
        start, stop = shard_range(shape[0], world_size, index.rank)
        if chunks[0][0] != [start, *(0,) * (len(shape) - 1)] or chunks[0][1] != [stop - start, *shape[1:]]:
            return False
    return True


def json_keys(index: Any) -> set[str]:
    """The keys a rank's index leaves out of its JSON (its tail holds them)."""
    return set(index.everyone) if index.sharded is not None else set()


@dataclass
class Table:
    """Every rank's DTensor chunks, when every rank numbered the same keys: key ``i`` is
    ``names[i]`` of ``shapes[i]`` and ``dtypes[i]``; ``fragments``: each rank's; ``rule``: N where
    every rank of N follows FSDP2's layout of N; ``rows`` (read when first used): a row per chunk,
    rank after rank, ``[key, offsets..., sizes..., start, length, frozen, rank]``."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    width: int
    fragments: list[Sections]  # (each rank's fragment: ``fragments[i].fragment()``, read when asked)
    rule: int | None
    _raws: list[Sections] = field(repr=False)
    _ranks: list[int] = field(repr=False)
    _where: Any = field(repr=False)
    _rows: torch.Tensor | None = field(default=None, repr=False)
    _by_key: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)

    @property
    def rows(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = _rows([s.rows() for s in self._raws], self._ranks, self.width, len(self.names), self._where)
        return self._rows

    def boxes(self, i: int) -> list[tuple[Box, int, int, int, int]]:
        """Key ``i``'s chunks in the table's order: (box, start, length, frozen, rank)."""
        if self._by_key is None:  # (the rows grouped by key once, in the table's order within each)
            rows = self.rows
            order = torch.argsort(rows[:, 0], stable=True)
            self._by_key = torch.split(rows[order], torch.bincount(rows[:, 0], minlength=len(self.names)).tolist())
        w, n = self.width, len(self.shapes[i])
        out = []
        for row in self._by_key[i].tolist():
            out.append(((tuple(row[1:1 + n]), tuple(row[1 + w:1 + w + n])), row[1 + 2 * w], row[2 + 2 * w], row[3 + 2 * w], row[-1]))
        return out


class Sections:
    """A rank's three sections, each read from its tail when first asked for and checked against
    its digest (the names' is the entry's first field): rank 0 reads of most ranks the fragment
    only, and holds none of it once copied into ``.metadata``."""

    def __init__(self, index: Any, where: str):
        entry, tail = index.sharded, index.fragment
        self.rank, self.where, self.entry = index.rank, where, entry
        self.tail = tail if isinstance(tail, Tail) else Tail(None, 0, len(tail), tail)
        if not (isinstance(entry, list) and len(entry) == 6 and isinstance(entry[3], list) and len(entry[3]) == 3
                and all(isinstance(n, int) and n >= 0 for n in entry[3]) and sum(entry[3]) == len(self.tail)
                and isinstance(entry[1], int) and entry[1] >= 0 and isinstance(entry[2], int) and entry[2] >= 0
                and isinstance(entry[4], list) and len(entry[4]) == 2):
            raise self._damaged()

    def _damaged(self) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"rank {self.rank}'s index is damaged (what follows its JSON is not what it wrote)",
                                      where=self.where)

    def _read(self, i: int, digest: str) -> memoryview:
        sizes = self.entry[3]
        raw = memoryview(self.tail.read(sum(sizes[:i]), sizes[i]))
        if len(raw) != sizes[i] or hash_bytes(raw) != digest:
            raise self._damaged()
        return raw

    def fragment(self) -> memoryview:
        return self._read(0, self.entry[4][0])

    def names(self) -> memoryview:
        return self._read(1, self.entry[0])

    def rows(self) -> memoryview:
        return self._read(2, self.entry[4][1])


def _sections(index: Any, where: str) -> Sections | None:
    """A rank's sections (read when asked); None where it has none."""
    return Sections(index, where) if index.sharded is not None else None


def _declared(raw: memoryview, entry: list[Any], rank: int, where: str) -> list[list[Any]]:
    try:
        declared = json.loads(bytes(raw))
    except (ValueError, RecursionError):
        declared = None
    if not (isinstance(declared, list) and len(declared) == entry[1] and hash_bytes(raw) == entry[0] and all(
            isinstance(d, list) and len(d) == 3 and isinstance(d[0], str) and isinstance(d[1], list)
            and all(isinstance(s, int) and s >= 0 for s in d[1]) and d[2] in PLAIN for d in declared)):
        raise CorruptCheckpointError(f"rank {rank}'s index is damaged (its DTensor keys)", where=where)
    return declared


def _rows(raws: list[memoryview], ranks: list[int], width: int, count: int, where: Any) -> torch.Tensor:
    """The rows of ranks ``ranks`` (their third sections ``raws``) in one table, each row's rank
    appended; a rank whose rows cannot be one's (a partial row, a key number past ``count``, a
    negative start or length, a frozen flag neither 0 nor 1) is a damaged index."""
    columns = 1 + 2 * width + _TAIL_COLUMNS
    for raw, rank in zip(raws, ranks):
        if len(raw) % (8 * columns):
            raise CorruptCheckpointError(f"rank {rank}'s index is damaged (its chunk rows)", where=where(rank))
    data = bytearray().join(raws)  # (one copy, writable, which torch.frombuffer wants)
    if not data:
        return torch.empty(0, columns + 1, dtype=torch.int64)
    if sys.byteorder != "little":  # (the rows are little-endian)
        values = array("q")
        values.frombytes(data)
        values.byteswap()
        data = bytearray(values.tobytes())
    rows = torch.frombuffer(data, dtype=torch.int64).view(-1, columns)
    of = torch.repeat_interleave(torch.tensor(ranks, dtype=torch.int64),
                                 torch.tensor([len(raw) // (8 * columns) for raw in raws], dtype=torch.int64))
    bad = ((rows[:, 0] < 0) | (rows[:, 0] >= count) | (rows[:, 1 + 2 * width:3 + 2 * width] < 0).any(1)
           | ((rows[:, -1] != 0) & (rows[:, -1] != 1)))
    if bool(bad.any()):
        rank = int(of[bad.nonzero()[0, 0]])
        raise CorruptCheckpointError(f"rank {rank}'s index is damaged (its chunk rows)", where=where(rank))
    return torch.cat([rows, of[:, None]], 1)


def read_tails(indexes: list[Any], where: Any) -> Table | None:
    """Rank 0: every rank's tail checked, and the table of their chunks where every rank numbered
    rank 0's keys; else None, each rank's chunks put back into its index's ``tensors`` (as JSON
    would have held them). ``where(rank)``: the rank's index, for errors."""
    sections = [_sections(index, where(index.rank)) for index in indexes]
    first = indexes[0].sharded
    if all(s is not None for s in sections) and all(i.sharded[:3] == first[:3] for i in indexes):
        declared = _declared(sections[0].names(), first, 0, where(0))
        names = [d[0] for d in declared]
        for index in indexes:
            index.names = names
        ranks = [index.rank for index in indexes]
        rule = len(indexes) if ranks == list(range(len(indexes))) and all(i.sharded[5] == len(indexes) for i in indexes) else None
        return Table(names, [tuple(d[1]) for d in declared], [d[2] for d in declared], first[2],
                     sections, rule, sections, ranks, where)
    for index, s in zip(indexes, sections):
        if s is not None:
            declared = _declared(s.names(), index.sharded, index.rank, where(index.rank))
            index.names = [d[0] for d in declared]
            _restore(index, declared, _rows([s.rows()], [index.rank], index.sharded[2], index.sharded[1], where), index.sharded[2])
    return None


def _restore(index: Any, declared: list[list[Any]], rows: torch.Tensor, width: int) -> None:
    """Put a rank's chunks back into its index's ``tensors``, as its JSON would have held them."""
    for name, shape, dtype in declared:
        index.tensors[name] = {"shape": shape, "dtype": dtype, "chunks": []}
    for row in rows.tolist():
        name, shape, _ = declared[row[0]]
        n = len(shape)
        chunk = [row[1:1 + n], row[1 + width:1 + width + n], row[1 + 2 * width], row[2 + 2 * width]]
        if row[3 + 2 * width]:
            chunk.append(next(iter(index.files), ""))  # (its one file of frozen tensors; a name it lacks is refused)
        index.tensors[name]["chunks"].append(chunk)


def check_tiling(table: Table) -> tuple[dict[int, str], bool]:
    """Which keys' chunks do not tile them (key number -> what is wrong), and whether every key's
    chunks come in the order of their offsets rank after rank (what a stable sort by offsets
    gives). Row shards lying end to end along dim 0 are proved in array operations; every other
    key is checked by ``layout.tiles_exactly``. Under the rule (:class:`Table`) nothing is left to
    check: FSDP2's row ranges of N ranks cover each key's rows once, in rank order."""
    if table.rule is not None:
        return {}, True
    rows, w = table.rows, table.width
    if w == 0:  # (scalars only)
        return _checked(table, range(len(table.shapes)), True)
    key, off, size = rows[:, 0], rows[:, 1:1 + w], rows[:, 1 + w:1 + 2 * w]
    count = len(table.shapes)
    shapes = torch.tensor([list(s) + [1] * (w - len(s)) for s in table.shapes], dtype=torch.int64).view(count, w)
    ndim = torch.tensor([len(s) for s in table.shapes], dtype=torch.int64)
    shape = shapes[key]
    regular = ((off >= 0) & (size >= 0) & (off + size <= shape)).all(1) & (ndim[key] > 0)
    if w > 1:
        regular &= (off[:, 1:] == 0).all(1) & (size[:, 1:] == shape[:, 1:]).all(1)
    bad = torch.zeros(count, dtype=torch.bool)
    bad[key[~regular]] = True
    # every row by key, then offset along dim 0 (one stable sort; a row's offset clamped into the
    # tensor, where only an irregular row's is not, and order-preserving)
    span = int(shapes[:, 0].max()) + 2 if count else 2
    o_all = off[:, 0]
    if count * span < 1 << 62:
        by = torch.argsort(key * span + o_all.clamp(0, span - 1), stable=True)
    else:  # (a tensor of more than 2**42 rows: two sorts)
        by = torch.argsort(o_all, stable=True)
        by = by[torch.argsort(key[by], stable=True)]
    k_all = key[by]
    # in order: within each key, the sort kept the table's order
    in_order = not bool(((k_all[1:] == k_all[:-1]) & (by[1:] < by[:-1])).any()) if len(by) > 1 else True
    # the non-empty rows of each key, by offset: each starts where the one before ends, from 0
    full = size[by, 0] > 0
    k, o, s = k_all[full], o_all[by][full], size[by, 0][full]
    ends = torch.cumsum(s, 0)
    starts = torch.ones_like(k, dtype=torch.bool)
    starts[1:] = k[1:] != k[:-1]
    base = (ends - s)[starts][torch.cumsum(starts.long(), 0) - 1] if len(k) else ends
    bad[k[o != ends - s - base]] = True
    total = torch.zeros(count, dtype=torch.int64).index_add_(0, k, s)
    bad |= total != torch.where(ndim > 0, shapes[:, 0], torch.ones_like(ndim))
    return _checked(table, bad.nonzero().flatten().tolist(), in_order)


def _checked(table: Table, keys: Any, in_order: bool) -> tuple[dict[int, str], bool]:
    """``layout.tiles_exactly`` of each of ``keys``, and ``in_order`` unless one's chunks are out of order."""
    problems = {}
    for i in keys:
        boxes = table.boxes(i)
        problem = tiles_exactly(table.shapes[i], [b for b, *_ in boxes])
        if problem:
            problems[i] = problem
        in_order = in_order and [b for b, *_ in boxes] == sorted((b for b, *_ in boxes), key=lambda b: b[0])
    return problems, in_order
