"""Saving live training state as a DCP step with no collective in the write or the commit.

Every rank writes its own data file (``__<rank>_0.distcp``: its DTensor shards, each box once; the
plain tensors and objects on rank 0) and then a small JSON index of what it wrote, with the
manifest rows of its records hashed as they were written. Rank 0 waits for every rank's index in
storage, merges them into ``.metadata`` and returns the manifest for the commit record. A
background save therefore needs no process group (the user may destroy theirs before it ends),
and the output is the layout torch's ``FileSystemWriter`` writes: plain ``dcp.load`` reads it.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from .. import rendezvous
from ..buffers import tensor_buffer
from ..bulk import no_gc
from ..checksums import (ALGORITHM, HASH_BLOCK, PARTS, BlockHasher, hash_bytes, hash_range, new_block, new_hasher,
                         parts_digest)
from ..compat import DCP_VERSION, local_shard_box
from ..errors import CkptError, CorruptCheckpointError, StepTooLargeError
from ..formats.dcp import load_index, metadata_emit
from ..formats.dcp import metadata_pickle as mp
from ..formats.dcp.metadata import MAX_METADATA_BYTES, METADATA_FILE, PER_RANK, PER_RANK_BUFFERS, data_file_name
from ..formats.dcp.records import write_object, write_tensor
from ..formats.dcp.transforms import transform_names
from ..health import Check, Tally, merge_ranks, numbered
from ..index import dtype_size, flatten
from ..layout import Box, relative, slabs, tiles_exactly
from ..steps import manifest_file_bytes, manifest_file_name
from ..storage import Location, save_error
from . import shared_chunks

log = logging.getLogger("ckpttool")
_HEAD_MAX = 64 << 10  # bytes of a record kept until its tensor data begins (a zip entry's header: ~100)
MID_WRITE = 20 << 20  # the pause point "mid-write" comes after the first record that ends past this byte
SLAB = 64 << 20  # bytes of a tensor copied to the host at a time (GPU shards)
PIECE = 4 << 20  # bytes of a slab counted (NaN, Inf) and hashed together while in the cache


@dataclass
class HostShard:
    """A rank's piece of one tensor, copied to the host for a background write (what an async
    save's stager hands the writer in place of the tensor)."""

    local: torch.Tensor  # the host copy of this rank's local shard (contiguous)
    box: Box  # where it lies in the global tensor
    shape: tuple[int, ...]  # the global tensor's shape
    store: bool  # whether this rank writes it (the first holder of a replicated box)
    plain: bool = False  # a plain tensor (not a DTensor): every rank holds a value of its own


def stores(value: Any) -> bool:
    """Whether this rank stores its box of a DTensor: once per box, by the rank whose coordinate
    is 0 on every mesh dim the tensor is replicated over. Raises for placements the writer does
    not lay out (``Partial``, strided shards), on every rank alike (whatever its coordinate: the
    ranks must all choose the same writer)."""
    from torch.distributed.tensor import Replicate, Shard

    for placement in value.placements:
        if type(placement) not in (Replicate, Shard):
            raise UnsupportedPlacement(placement)
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:
        return False  # this rank is not on the tensor's mesh
    return all(c == 0 for placement, c in zip(value.placements, coordinate) if type(placement) is Replicate)


def _is_staged_or_tensor(value: Any) -> bool:
    """A tensor, or a tensor an async save staged (it stands where the tensor stood)."""
    return isinstance(value, (HostShard, torch.Tensor))


class UnsupportedPlacement(Exception):
    """A DTensor placement this writer cannot lay out; the caller falls back to ``dcp.save``."""


def supports(state: dict[str, Any]) -> bool:
    """Whether every DTensor of ``state`` has only Shard and Replicate placements."""
    from torch.distributed.tensor import DTensor

    flat, _ = flatten(state)
    try:
        for value in flat.values():
            if isinstance(value, DTensor):
                stores(value)
    except UnsupportedPlacement:
        return False
    return True


class _HashingWriter(io.RawIOBase):
    """A write-only, non-seekable stream over ``out`` that hashes each record as it is written:
    the whole record, and for a tensor record declared with :meth:`data`, its tensor data in
    ``HASH_BLOCK`` blocks plus the record's other bytes (headers, pickle, zip directory) apart, so
    a reader can check any block it reads on its own (see ``checks.py``).

    Non-seekable on purpose: zipfile then writes sizes and CRCs in data descriptors after the data
    (as torch's own writer does) instead of seeking back into bytes already hashed.
    """

    def __init__(self, out: IO[bytes]):
        self._out = out
        self._pos = 0
        self._hasher: Any = None
        self._start = 0
        self._data: tuple[int, int] | None = None  # (absolute start, length) of the record's tensor data
        self._blocks: BlockHasher | None = None
        self._ahead = 0  # data bytes hashed by :meth:`hash_ahead`, not yet written
        self._rest: Any = None
        self._head = bytearray()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._out.write(view)
        if self._data is not None:  # a tensor record's data and what follows: hashed once, by parts
            self._split(view)
        elif self._hasher is not None:
            self._hasher.update(view)
            if len(self._head) < _HEAD_MAX:  # a record's header, kept for the rest's digest should data follow
                self._head += view
        self._pos += view.nbytes
        return view.nbytes

    def _split(self, view: memoryview) -> None:
        """Feed the data bytes of ``view`` (written at ``self._pos``) to the block hasher, the rest to the rest's."""
        lo, hi = self._data[0] - self._pos, self._data[0] + self._data[1] - self._pos
        a, b = max(0, lo), min(view.nbytes, hi)
        if a >= b:
            self._rest.update(view)
            return
        if a > 0:
            self._rest.update(view[:a])
        ahead = min(self._ahead, b - a)  # (bytes hash_ahead hashed already)
        self._ahead -= ahead
        if a + ahead < b:
            self._blocks.update(view[a + ahead:b])
        if b < view.nbytes:
            self._rest.update(view[b:])

    def begin(self) -> None:
        self._hasher = new_hasher()
        self._start = self._pos
        self._data = self._blocks = self._rest = None
        self._head = bytearray()

    def data(self, nbytes: int) -> None:
        """The next ``nbytes`` written are the record's tensor data: hash them in blocks, and the
        record's other bytes apart; the record's digest is then :func:`parts_digest` of the two
        (each byte hashed once), and the record is written without a CRC-32 (its row says so)."""
        if len(self._head) != self._pos - self._start:
            raise AssertionError("a record's header outgrew what the writer keeps")  # pragma: no cover - a writer bug
        self._rest = new_hasher()
        self._rest.update(self._head)
        self._head = bytearray()
        self._data = (self._pos, nbytes)
        self._blocks = BlockHasher()

    def hash_ahead(self, view: memoryview) -> None:
        """Hash the next data bytes to be written now (the caller writes exactly these next): a
        piece of a large tensor hashed while its NaN count has it in the cache, one pass over it."""
        self._blocks.update(view)
        self._ahead += view.nbytes

    def digest(self) -> str:
        digest, self._hasher = self._hasher.hexdigest(), None
        return digest

    def row(self, start: int, length: int) -> list[Any]:
        """The record's manifest row, ended: ``[offset, length, digest]``, and for a tensor record
        with blocks ``{"data": [start in the record, bytes], "rest": digest, "blocks": digests}``."""
        data, blocks, rest = self._data, self._blocks, self._rest
        if data is None:
            row: list[Any] = [start, length, self.digest()]
        else:
            self._hasher = None
            rest_digest, block_digests = rest.hexdigest(), blocks.finish()
            row = [start, length, parts_digest(rest_digest, block_digests),
                   {"data": [data[0] - start, data[1]], "rest": rest_digest, "blocks": block_digests, "digest": PARTS}]
        self._data = self._blocks = self._rest = None
        self._head = bytearray()
        return row


@dataclass
class RankIndex:
    """What one rank wrote (JSON in storage): its tensors' chunks and objects, where each record
    lies in its file, the manifest rows, and (rank 0) the nesting of every key. A chunk's entry is
    ``[offsets, sizes, start, length]`` in ``file``, or with a fifth element the file it lies in
    (an incremental save's file of frozen tensors, whose rows are in ``files``)."""

    rank: int
    file: str
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    objects: dict[str, list[int]] = field(default_factory=dict)
    records: list[list[Any]] = field(default_factory=list)
    paths: dict[str, list[Any]] = field(default_factory=dict)
    error: str | None = None  # (a rank that failed: its error, and the error's type)
    error_type: str | None = None
    compress: str | None = None  # every record of this rank stored through this transform
    files: dict[str, list[list[Any]]] = field(default_factory=dict)  # other files' manifest rows
    written: int = 0  # bytes this rank wrote
    shared: int = 0  # bytes this rank's step got from the previous step without writing them
    # this rank's own value of every plain value of ``extra``: key in extra -> [its per-rank key,
    # the xxh3 of its record]; rank 0 keeps those that differ between ranks (commit_metadata)
    per_rank: dict[str, list[Any]] = field(default_factory=dict)
    per_rank_paths: dict[str, list[Any]] = field(default_factory=dict)
    # the same for the model's plain-tensor buffers: state key -> [[its per-rank key], the xxh3 of its record]
    per_rank_buffers: dict[str, list[Any]] = field(default_factory=dict)
    health: dict[str, Any] | None = None  # this rank's findings for the step's health (health.Check.findings)
    phases: dict[str, float] = field(default_factory=dict)  # seconds this rank spent in each phase of the save
    # the rank's manifest file, which holds ``records`` and ``files``' rows (published without them):
    # [its name, bytes, digest, the data files whose rows it holds]
    manifest: list[Any] | None = None
    # what the rank's DTensors put after the index's JSON (``fragment``: its fragment of ``.metadata``,
    # their names, their chunks as rows) and its entry saying what (``sharded``): shared_chunks.rank_tail
    sharded: list[Any] | None = None
    fragment: bytes | memoryview = field(default=b"", repr=False)
    # the keys every rank declares (DTensors), in declaration order: the fragment's key numbers
    everyone: dict[str, None] = field(default_factory=dict, repr=False)
    # (rank 0, reading the tails) the names of this rank's numbered keys: ranks that numbered the same keys share one list
    names: list[str] | None = field(default=None, repr=False)


@dataclass
class Written:
    """What a rank wrote into its file of frozen tensors: kept by an incremental Checkpointer, so
    its next save can tell whether that file would come out the same (every record's key, box,
    dtype and block digests) and share it instead of writing it."""

    step_dir: Location
    file: str
    records: list[tuple[str, list[int], list[int], str, list[Any]]]  # (key, offsets, sizes, dtype, manifest row)
    nonfinite: dict[str, list[int]] = field(default_factory=dict)  # NaN and Inf counted in its records, per key
    # the file's storage version (Location.version) when its records were last known to hold these
    # digests (written, or read and checked): an unchanged version is what a later link trusts
    proof: tuple | None = None


def frozen_file_name(rank: int) -> str:
    """The file of a rank's frozen tensors in an incremental save (``__<rank>_1.distcp``: torch's
    readers take any file ``.metadata`` names)."""
    return f"__{rank}_1.distcp"


def write_rank(step_dir: Location, rank: int, state: dict[str, Any],
               pause: Callable[[str], None] | None = None, compress: str | None = None,
               frozen: frozenset[str] = frozenset(), previous: Written | None = None,
               health: Check | None = None, buffers: frozenset[str] = frozenset(),
               progress: Callable[[int], None] | None = None, phases: dict[str, float] | None = None,
               world_size: int | None = None) -> Written | None:
    """Write this rank's part of the step into ``step_dir``: its data file, then its index (the
    index's appearance in storage tells rank 0 this rank is done). On failure the index carries
    the error instead, so rank 0 stops waiting, and the error is raised here too.

    Tensors whose keys are in ``frozen`` go to a file of their own; when ``previous`` (what this
    rank wrote there at the previous committed step) has the same records with the same block
    digests, the new step gets that file by a hard link (a server-side copy on an object store)
    instead of a write. Returns what is in the frozen file now (None when there is none).

    With ``health``, every record's NaN and Inf are counted as it is written and its data digest
    kept; the index carries this rank's findings (``health.py``). ``buffers``: the state keys of
    the model's plain-tensor buffers (:func:`_write_own_buffers`). ``pause(name)`` is called at the
    points crash tests stop a rank at (``dist.pause_point``); ``progress(bytes)`` after each record
    of the data file (the rank's beat says how far it is); ``phases``: the seconds of the save's
    phases so far, carried in the index with the write's own; ``world_size``: the job's, whose
    FSDP2 layout the index says its DTensor chunks follow where they do (``shared_chunks``)."""
    started = time.perf_counter()
    flat, paths = flatten(state, is_tensor=_is_staged_or_tensor)  # a list of staged tensors is traversed, as one of tensors
    index = RankIndex(rank, data_file_name(rank), compress=compress)
    tally = health.tally if health is not None else None
    written: Written | None = None
    try:
        with step_dir.child(index.file).open_write() as raw:
            out = _HashingWriter(raw)
            _write_records(out, index, flat, frozen, tally, pause, progress)
            _write_per_rank(out, index, flat, paths, tally)
            _write_own_buffers(out, index, flat, paths, buffers, tally)
            index.written += out.tell()
        frozen_parts = _frozen_parts(index, flat, frozen)
        if frozen_parts:
            written = _write_frozen(step_dir, index, frozen_parts, previous, tally)
        finish_index(step_dir, index, world_size)
        if health is not None:
            index.health = health.findings(flat, rank)
            number_health(index)
        if rank == 0:
            index.paths = {k: list(p) for k, p in paths.items()}
        if pause is not None:
            pause("after-write")
        index.phases = {**(phases or {}), "write": time.perf_counter() - started}
    except BaseException as exc:
        # as this rank's save reports it (a storage error, whatever the writer raised): every rank judges the same error
        index.error_type, index.error = rendezvous.described(save_error(exc, step_dir) if isinstance(exc, Exception) else exc)
        try:
            publish_index(step_dir, index)
        except Exception:  # noqa: BLE001 - the storage refuses writes; rank 0 times out instead
            pass
        raise
    if pause is not None:
        pause("before-index")
    publish_index(step_dir, index)
    return written


def _write_records(out: _HashingWriter, index: RankIndex, flat: dict[str, Any], frozen: frozenset[str],
                   tally: Tally | None, pause: Callable[[str], None] | None, progress: Callable[[int], None] | None) -> None:
    """The data file's records of the tensors this rank stores (but the frozen ones) and, on rank
    0, of the objects; ``progress(bytes)`` after each tensor record."""
    for key, value in flat.items():
        if _is_staged_or_tensor(value):
            if key in frozen:
                continue  # declared and stored by _write_frozen
            part = _declare_part(index, key, value)
            if part is not None:
                _write_local(out, index, key, *part, tally=tally)
                if progress is not None:
                    progress(out.tell())
                if pause is not None and out.tell() >= MID_WRITE:
                    pause("mid-write")  # (crash tests: a kill with the file's first buffers on disk)
        elif index.rank == 0:
            _write_object(out, index, key, value, tally)


def _write_per_rank(out: _HashingWriter, index: RankIndex, flat: dict[str, Any], paths: dict[str, Any],
                    tally: Tally | None = None) -> None:
    """This rank's own records of every value of ``extra`` that holds no DTensor, entry by entry as
    DCP lays ``extra`` out (a tensor a tensor record, anything else an object), under
    ``per_rank.<rank>.<key>``: every rank writes its own, no collective. Rank 0 keeps, in
    ``.metadata``, the records of each top-level key whose records differ between ranks, or that
    some rank lacks (:func:`commit_metadata`): per top-level key, so a rank's value comes back whole
    (a list one rank made longer, a tensor on one rank and a string on another)."""
    tops: dict[str, list[tuple[str, tuple, Any]]] = {}
    for key, value in flat.items():
        path = paths[key]
        if path[0] == "extra" and len(path) > 1:
            tops.setdefault(str(path[1]), []).append((key, tuple(path[1:]), value))
    for top, leaves in tops.items():
        if any((isinstance(v, HostShard) and not v.plain) or _is_dtensor(v) for _, _, v in leaves):
            continue  # sharded state, not a rank's own value
        digest = new_hasher()
        mine = []
        for key, sub, value in leaves:
            name = f"{PER_RANK}.{index.rank}.{key[len('extra.'):]}"
            if isinstance(value, (HostShard, torch.Tensor)):
                local = value.local if isinstance(value, HostShard) else value.detach()
                shape = tuple(local.shape)
                _declare(index, name, shape, local.dtype)
                _write_local(out, index, name, shape, local, ((0,) * len(shape), shape))
                if tally is not None:
                    tally.count(name, local)
            else:
                _write_object(out, index, name, value, tally)
            digest.update(f"{sub!r}={index.records[-1][2]};".encode())
            index.per_rank_paths[name] = [PER_RANK, str(index.rank), *sub]
            mine.append(name)
        index.per_rank[top] = [mine, digest.hexdigest()]


def _write_object(out: _HashingWriter, index: RankIndex, key: str, value: Any, tally: Tally | None) -> None:
    """One object record (a value kept :class:`Whole` as the value itself), its NaN and Inf counted."""
    value = value.value if isinstance(value, Whole) else value
    out.begin()
    start, length = write_object(out, value, index.compress)
    index.objects[key] = [start, length]
    index.records.append(out.row(start, length))
    if tally is not None:
        tally.count_object(key, value)


def _write_own_buffers(out: _HashingWriter, index: RankIndex, flat: dict[str, Any], paths: dict[str, Any],
                       buffers: frozenset[str], tally: Tally | None = None) -> None:
    """This rank's own record of each of the model's plain-tensor buffers (``buffers``), under
    ``per_rank_buffers.<rank>.<name>``, as :func:`_write_per_rank` keeps ``extra``'s: rank 0 keeps in
    ``.metadata`` the records of those whose values differ between ranks (a BatchNorm's running
    statistics without SyncBatchNorm), so each rank's own comes back to it."""
    for key in buffers:
        value = flat.get(key)
        if not (isinstance(value, HostShard) and value.plain) and not (isinstance(value, torch.Tensor) and not _is_dtensor(value)):
            continue
        local = value.local if isinstance(value, HostShard) else value.detach()
        shape = tuple(local.shape)
        name = f"{PER_RANK_BUFFERS}.{index.rank}.{key[len('model.'):]}"
        _declare(index, name, shape, local.dtype)
        _write_local(out, index, name, shape, local, ((0,) * len(shape), shape))
        if tally is not None:
            tally.count(name, local)
        index.per_rank_paths[name] = [PER_RANK_BUFFERS, str(index.rank), *paths[key][1:]]
        index.per_rank_buffers[key] = [[name], index.records[-1][2]]


class Whole:
    """A value of ``extra`` stored as one object, not entry by entry: one whose dict keys are not
    all strings (an optimizer's state dict, in ``extra`` or as a Stateful's), which DCP's flattened
    keys cannot give back. Exists only between ``save()`` and the write: the record holds
    ``value`` itself, so plain ``dcp.load`` and ckpttool read back exactly what was saved."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __deepcopy__(self, memo: dict) -> Whole:
        import copy

        return Whole(copy.deepcopy(self.value, memo))


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _frozen_parts(index: RankIndex, flat: dict[str, Any], frozen: frozenset[str]) -> list[tuple[str, tuple, torch.Tensor, Box]]:
    """Declare every frozen tensor; return the boxes of them this rank stores, in state order:
    (key, global shape, host-side local tensor, box)."""
    parts = []
    for key, value in flat.items():
        if key in frozen and _is_staged_or_tensor(value):
            part = _declare_part(index, key, value)
            if part is not None:
                parts.append((key, *part))
    return parts


def _write_frozen(step_dir: Location, index: RankIndex, parts: list[tuple[str, tuple, torch.Tensor, Box]],
                  previous: Written | None, tally: Tally | None = None) -> Written:
    """This rank's file of frozen tensors: shared from ``previous`` when every record would come
    out the same and the file still holds what was written (:func:`_intact`), else written."""
    name = frozen_file_name(index.rank)
    dst = step_dir.child(name)
    if index.compress is None and previous is not None and previous.file == name and _unchanged(parts, previous):
        src = previous.step_dir.child(name)
        damage = _intact(src, previous)
        if damage is not None:
            log.warning("ckpttool: %s no longer holds what was written (%s): this step writes its frozen tensors afresh "
                        "from memory; the steps that hold it fail verify", src.url, damage)
        elif not dst.share_from(src):
            _cannot_share(dst)
        else:
            rows = index.files[name] = []
            for key, offsets, sizes, _dtype, row in previous.records:
                index.tensors[key]["chunks"].append([list(offsets), list(sizes), row[0], row[1], name])
                rows.append(list(row))
            index.shared += src.size()
            if tally is not None:  # counted when it was written: the same bytes
                for key, counts in previous.nonfinite.items():
                    tally.nonfinite[key] = list(counts)
            return Written(step_dir, name, previous.records, previous.nonfinite, dst.version())
    if dst.exists():  # (a failed share left a name: unlink it, never write through it into the step it came from)
        dst.remove()
    rows = index.files[name] = []
    records = []
    with dst.open_write() as raw:
        out = _HashingWriter(raw)
        for key, shape, local, box in parts:
            _write_local(out, index, key, shape, local, box, tally=tally)
            row = index.records.pop()  # the record's row belongs to this file
            chunk = index.tensors[key]["chunks"][-1]
            chunk.append(name)
            rows.append(row)
            records.append((key, list(box[0]), list(box[1]), str(local.dtype).removeprefix("torch."), row))
        index.written += out.tell()
    counted = {key: list(tally.nonfinite[key]) for key, *_ in records if tally is not None and key in tally.nonfinite}
    return Written(step_dir, name, records, counted, dst.version())


def _intact(src: Location, previous: Written) -> str | None:
    """Why the previous step's frozen file cannot be shared (None: it can). A link never spreads a
    damaged file: the file must still be the one this rank wrote (or last read and checked), told by
    its storage version (inode, size and modification time; an object's ETag), or else by reading
    every record again and matching the digests written at the time. What an unchanged version
    cannot show (the disk's own bit rot, with no write) is what verify and every load check."""
    version = src.version()
    if version is not None and version == previous.proof:
        return None
    try:
        if src.size() != sum(row[1] for *_, row in previous.records) or not previous.records:
            return "its size changed"
        reader = src.open_reader()
        try:
            buf = new_block()
            for key, _offsets, _sizes, _dtype, row in previous.records:
                if hash_range(reader, row[0], row[1], buf, row[3] if len(row) > 3 else None) != row[2]:
                    return f"the record of {key!r} at byte {row[0]} does not match its digest"
        finally:
            reader.close()
    except (CkptError, OSError) as exc:
        return f"it cannot be read: {exc}"
    previous.proof = src.version()  # read and checked: the proof from this read
    return None


_warned: set[str] = set()


def _cannot_share(dst: Location) -> None:
    """Say once per process that this storage cannot share files, so every incremental save writes all."""
    if "share" not in _warned:
        _warned.add("share")
        log.warning("ckpttool: %s cannot share a file with the previous step (no hard links or server-side copy): "
                    "incremental saves write every byte", dst.parent.url)


def _unchanged(parts: list[tuple[str, tuple, torch.Tensor, Box]], previous: Written) -> bool:
    """Whether the frozen records would be those of ``previous``: the same keys, boxes and dtypes in
    the same order, and every block of the data hashing to the previous step's digest (the tensors
    are hashed in memory here, on the writing rank: no collective)."""
    if len(parts) != len(previous.records):
        return False
    for (key, _shape, local, box), (pkey, offsets, sizes, dtype, row) in zip(parts, previous.records):
        if (key != pkey or list(box[0]) != list(offsets) or list(box[1]) != list(sizes)
                or str(local.dtype).removeprefix("torch.") != dtype or len(row) < 4):
            return False
        hasher = BlockHasher()
        host = local.to("cpu").contiguous() if local.numel() else local
        for slab in slabs(box[1], dtype_size(local.dtype), SLAB):
            hasher.update(tensor_buffer(host[relative(slab, ((0,) * len(box[1]), box[1]))].contiguous()))
        if hasher.finish() != row[3]["blocks"]:
            return False
    return True


def publish_failure(step_dir: Location, rank: int, error: BaseException) -> None:
    """A rank that failed before it wrote anything: an index that carries only the error."""
    error_type, text = rendezvous.described(error)
    publish_index(step_dir, RankIndex(rank, data_file_name(rank), error=text[:rendezvous.FAILED_TEXT],
                                      error_type=error_type[:200]))


def finish_index(step_dir: Location, index: RankIndex, world_size: int | None) -> None:
    """Once the rank's records are written: its tail (``shared_chunks.rank_tail``) and its
    manifest file, which, where its DTensor chunks follow FSDP2's layout of ``world_size``, says
    where each of their records lies (a load index's reader finds them there)."""
    index.sharded, index.fragment = shared_chunks.rank_tail(index, frozen_file_name(index.rank), world_size)
    index.manifest = _write_manifest(step_dir, index, load_index.rank_locations(index))


def number_health(index: RankIndex) -> None:
    """The rank's health findings with its DTensor keys by number (``health.numbered``), where its
    tail names them for rank 0."""
    if index.health is not None and index.sharded is not None:
        index.health = numbered(index.health, list(index.everyone))


def _write_manifest(step_dir: Location, index: RankIndex, sharded: list[Any] | None = None) -> list[Any]:
    """This rank's manifest file (the rows of its records, block digests and all): rank 0 never
    reads or merges the rows, and a reader loads those of the files it reads only."""
    name = manifest_file_name(index.rank)
    records = {index.file: index.records, **index.files}
    raw = manifest_file_bytes(records, step_dir.child(name).url, sharded)
    step_dir.child(name).write_bytes(raw)
    return [name, len(raw), hash_bytes(raw), sorted(records)]


def publish_index(step_dir: Location, index: RankIndex) -> None:
    """Put a rank's index in storage, whole, where rank 0 waits for it (``rendezvous.publish_part``)."""
    rendezvous.publish_part(step_dir, index.rank, *published_part(index))


def published_part(index: RankIndex) -> tuple[dict[str, Any], bytes]:
    """A rank's index as it is published: its JSON, without the rows its manifest file holds and
    the DTensor chunks its tail holds, and its tail (``shared_chunks.rank_tail``)."""
    part = dict(index.__dict__)
    del part["fragment"], part["everyone"], part["names"]
    if index.manifest is not None:
        part["records"], part["files"] = [], {name: [] for name in index.files}
    if index.sharded is not None:
        part["tensors"] = {k: t for k, t in index.tensors.items() if k not in index.everyone}
    return part, index.fragment


def _declare(index: RankIndex, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any]:
    """The tensor's entry in this rank's index (every rank declares every tensor, storing or not)."""
    return index.tensors.setdefault(key, {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "chunks": []})


def _declare_part(index: RankIndex, key: str, value: Any) -> tuple[tuple[int, ...], torch.Tensor, Box] | None:
    """Declare a tensor (or a staged one) in this rank's index; return what this rank stores of it
    (global shape, local tensor, box), or None when another rank stores it."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, HostShard):  # staged by an async save
        if value.plain and index.rank != 0:
            return None  # (as below)
        _declare(index, key, value.shape, value.local.dtype)
        if not value.plain:
            index.everyone[key] = None
        return (value.shape, value.local, value.box) if value.store else None
    if not isinstance(value, DTensor) and index.rank != 0:
        # a plain tensor: rank 0 stores it and alone declares it (another rank's value of the key
        # may be anything, an object included: it is that rank's, kept by _write_per_rank)
        return None
    _declare(index, key, tuple(value.shape), value.dtype)
    if isinstance(value, DTensor):
        index.everyone[key] = None
    if isinstance(value, DTensor) and not stores(value):
        return None
    local, box = local_shard_box(value)
    return tuple(value.shape), local.detach(), box


def _write_local(out: _HashingWriter, index: RankIndex, key: str, shape: tuple[int, ...], local: torch.Tensor, box: Box,
                 tally: Tally | None = None) -> None:
    """One record: this rank's box of tensor ``key``, streamed to the host slab by slab (each slab's
    NaN and Inf counted into ``tally`` on its way)."""
    entry = _declare(index, key, shape, local.dtype)

    def fill(write: Callable[[Any], Any]) -> None:
        for slab in slabs(box[1], dtype_size(local.dtype), SLAB):
            part = local[relative(slab, ((0,) * len(box[1]), box[1]))].to("cpu").contiguous()
            data = tensor_buffer(part)
            if tally is not None and blocks is not None and data.nbytes > PIECE:
                # one pass: each piece counted and hashed while in the cache, then the slab written
                # whole (from its buffer by O_DIRECT, LocalFile: no byte of it read by this CPU again)
                flat, step = part.view(-1), PIECE // part.element_size()
                for at in range(0, flat.numel(), step):
                    tally.count(key, flat[at:at + step])
                    out.hash_ahead(data[at * part.element_size():(at + step) * part.element_size()])
            elif tally is not None:
                tally.count(key, part)
            write(data)

    out.begin()
    # (a compressed record is checked whole: its data is not a byte range of the file)
    blocks = None if index.compress is not None else (lambda: out.data(math.prod(box[1]) * dtype_size(local.dtype)))
    # (at: a large record's data at a page of the file, sent there from a staged buffer by O_DIRECT)
    start, length = write_tensor(out, local.dtype, box[1], index.compress, fill, blocks, crc=blocks is None, at=out.tell())
    entry["chunks"].append([list(box[0]), list(box[1]), start, length])
    index.records.append(out.row(start, length))
    if tally is not None:
        tally.digest(key, box[0], index.records[-1])


def read_rank_indexes(step_dir: Location, world_size: int, timeout: float, step: int | None = None,
                      roll: Any = None) -> list[RankIndex]:
    """Rank 0: every rank's index, once all are in storage (``rendezvous.await_parts``: a rank whose
    part failed ends the wait, named; with ``roll``, so does a dead one)."""
    indexes = []
    doing = "writing its part of the step" if step is None else f"writing its part of step {step}"
    parts = rendezvous.await_parts(step_dir, world_size, timeout, doing, roll, step)
    with no_gc():  # (an object a rank, no cycle)
        for r, part in enumerate(parts):
            fragment = part.pop(rendezvous.TAIL)
            try:
                indexes.append(RankIndex(**part, fragment=fragment))
            except TypeError as exc:
                raise CorruptCheckpointError(f"a rank's index is damaged ({exc})",
                                             where=step_dir.child(rendezvous.part_name(r)).url) from None
    return indexes


def _keep_differing_per_rank(indexes: list[RankIndex]) -> dict[str, list[Any]]:
    """Of every rank's own records of the values of ``extra``, keep (in the indexes) those of the
    top-level keys whose records differ between ranks, or that some rank lacks, and drop the others
    (every rank holds the same value, which ``extra.<key>`` already holds); returns the kept
    records' paths, rank by rank."""
    paths: dict[str, list[Any]] = {}
    for own in (lambda index: index.per_rank, lambda index: index.per_rank_buffers):  # extra's values, the model's buffers
        digests: dict[str, set[str]] = {}
        for index in indexes:
            for top, (_, digest) in own(index).items():
                digests.setdefault(top, set()).add(digest)
        differing = {top for top, found in digests.items() if len(found) > 1 or any(top not in own(index) for index in indexes)}
        for index in indexes:
            for top, (names, _) in own(index).items():
                for name in names:
                    if top in differing:
                        paths[name] = index.per_rank_paths[name]
                    else:
                        index.objects.pop(name, None)
                        index.tensors.pop(name, None)
                        if index.health is not None:  # (a record not kept is no part of the step's health)
                            index.health.get("nonfinite", {}).pop(name, None)
    return paths


def per_rank_keys(indexes: list[RankIndex]) -> list[str]:
    """The keys of ``extra`` whose values differ between the ranks of a step (after commit_metadata)."""
    return sorted({top for index in indexes for top, (names, _) in index.per_rank.items()
                   if any(n in index.objects or n in index.tensors for n in names)})


def per_rank_buffer_keys(indexes: list[RankIndex]) -> list[str]:
    """The model's buffers (state keys) whose values differ between the ranks of a step (after
    commit_metadata): each rank's own is kept."""
    return sorted({key for index in indexes for key, (names, _) in index.per_rank_buffers.items()
                   if any(n in index.tensors for n in names)})


def commit_fields(step_dir: Location, indexes: list[RankIndex], manifest: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Rank 0: the commit record's fields from the ranks' indexes (its manifest, bytes, every
    rank's phase times with rank 0's commit ``seconds`` so far, the keys kept per rank, the
    step's health). Built with the collector held off: a dict or two a rank, no cycle, beside
    every rank's index (a collection would walk them all, again and again)."""
    with no_gc():
        record = {"manifest": manifest, **step_bytes(indexes)}  # bytes written, and shared with the step before
        # each rank's seconds per phase (rank 0's commit up to here): inspect names the slowest rank
        record["phases"] = {str(index.rank): dict(index.phases) for index in indexes}
        record["phases"]["0"]["commit"] = round(seconds, 6)
        per_rank = per_rank_keys(indexes)
        if per_rank:
            record["per_rank"] = per_rank  # keys of extra whose values differ between ranks: each rank's own is kept
        buffers = per_rank_buffer_keys(indexes)
        if buffers:
            record["per_rank_buffers"] = buffers  # the model's buffers whose values differ between ranks: idem
        found = step_health(step_dir, indexes)
        if found is not None:
            record["health"] = found
    return record


def step_health(step_dir: Location, indexes: list[RankIndex]) -> dict[str, Any] | None:
    """Rank 0: the commit record's ``health`` from every rank's findings (``health.merge_ranks``)."""
    try:
        return merge_ranks([index.health for index in indexes], [index.names for index in indexes])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"a rank's index is damaged (its health findings: {exc})", where=step_dir.url) from None


def step_bytes(indexes: list[RankIndex]) -> dict[str, int]:
    """What the step cost to write, for its commit record: bytes written, and bytes an incremental
    save shared with the previous step instead."""
    return {"bytes_written": sum(i.written for i in indexes), "bytes_shared": sum(i.shared for i in indexes)}


def commit_step(step_dir: Location, world_size: int, timeout: float, step: int, roll: Any = None) -> dict[str, Any]:
    """Rank 0: every rank's index (:func:`read_rank_indexes`), merged into ``.metadata``; returns
    the commit record's fields. Run by rank 0's writer process where it has one (the training
    process has waited for the indexes' names by then, with the beats)."""
    indexes = read_rank_indexes(step_dir, world_size, timeout, step, roll)
    started = time.perf_counter()  # (the commit's own time: the wait for the others is theirs)
    manifest = commit_metadata(step_dir, indexes)
    return commit_fields(step_dir, indexes, manifest, time.perf_counter() - started)


def commit_metadata(step_dir: Location, indexes: list[RankIndex]) -> dict[str, Any]:
    """Merge the ranks' indexes into ``.metadata`` (after checking that every tensor's chunks tile
    it), remove the indexes, and return the step's manifest."""
    rendezvous.pause_point("before-metadata")  # (rank 0, in its writer process or its own)
    with no_gc():  # (a chunk or more per rank and tensor: millions of objects at scale)
        return _commit_metadata(step_dir, indexes)


def _commit_metadata(step_dir: Location, indexes: list[RankIndex]) -> dict[str, Any]:
    per_rank_paths = _keep_differing_per_rank(indexes)
    table = shared_chunks.read_tails(indexes, lambda r: step_dir.child(rendezvous.part_name(r)).url)
    described = mp.Described()
    described.order = list(indexes[0].paths) + list(per_rank_paths)
    described.paths = {k: tuple(p) for k, p in indexes[0].paths.items()}
    described.paths.update((k, tuple(p)) for k, p in per_rank_paths.items())
    shapes, chunks = _merge_json(step_dir, indexes, described)
    in_order = table is not None
    if table is not None:
        shapes.update((name, (shape, dtype)) for name, shape, dtype in zip(table.names, table.shapes, table.dtypes))
        in_order = _check_table(step_dir, indexes, table)
    for key in described.order:
        if key in chunks:
            boxes = sorted(chunks[key], key=lambda c: c[0][0])
            problem = tiles_exactly(shapes[key][0], [b for b, *_ in boxes])
            if problem:  # a writer bug, never a checkpoint to commit
                raise CorruptCheckpointError(f"the ranks' chunks of {key!r} do not tile it: {problem}", where=step_dir.url)
            chunks[key] = boxes
    described.tensors = {key: (*shapes[key], []) for key in described.order if key in shapes}
    fragments = None
    # (a rank under FSDP2's rule spells no empty shard: rank 0 copies such fragments only where every rank is under it,
    # so the step's load index has the empty shards; else where no rank is; else it spells every chunk itself)
    spelled_alike = table is not None and (table.rule is not None or not any(index.sharded[5] for index in indexes))
    if spelled_alike and in_order and all(k in described.tensors for k in table.names) and metadata_emit.streamable(described):
        fragments = (table.names, table.fragments)  # (the shared keys' chunks are in the ranks' fragments)
    elif table is not None:
        by_rank = {index.rank: index for index in indexes}
        for i, name in enumerate(table.names):
            chunks[name] = sorted(((box, frozen_file_name(r) if frozen else by_rank[r].file, start, length)
                                   for box, start, length, frozen, r in table.boxes(i)), key=lambda c: c[0][0])
    compress_of = {name: index.compress for index in indexes for name in (index.file, *index.files)}
    for key, (_, _, described_chunks) in described.tensors.items():
        described_chunks.extend((box[0], box[1], (file, off, n, transform_names(compress_of[file])))
                                for box, file, off, n in chunks.get(key, ()))
    manifests = _manifest_files(step_dir, indexes)
    if fragments is not None:  # rank 0's ends of the stream, each rank's fragment between, read as it is written
        ends = metadata_emit.metadata_ends(described, str(uuid.uuid4()), DCP_VERSION, table.names)
        size = len(ends[0]) + sum(len(s.tail) - sum(s.entry[3][1:]) for s in table.fragments) + len(ends[1])
        pieces: Callable[[], Iterator[Any]] = lambda: itertools.chain((ends[0],), (s.fragment() for s in table.fragments), (ends[1],))
    else:
        raw = mp.metadata_bytes(described, str(uuid.uuid4()))
        size, pieces = len(raw), lambda: iter((raw,))
    if size > MAX_METADATA_BYTES:  # (read_metadata_bytes refuses it: never commit what cannot be loaded)
        raise StepTooLargeError(f".metadata would hold {size} bytes, more than the {MAX_METADATA_BYTES >> 30} GiB ckpttool "
                                "reads", where=step_dir.url, hint="the step is not committed")
    written = _write_pieces(step_dir.child(METADATA_FILE), pieces())
    files = {}
    by_rule = None
    if fragments is not None and table.rule == len(indexes) and all(index.compress == indexes[0].compress for index in indexes):
        by_rule = load_index.index_bytes(described, table.rule, indexes[0].sharded[0], table.names, table.shapes, table.dtypes,
                                         transform_names(indexes[0].compress))
    elif table is None:  # no DTensor: every key's chunks in the index (JSON: a load or a convert unpickles no .metadata)
        by_rule = load_index.index_bytes(described, len(indexes), "", [], [], [], None)
    if by_rule is not None:
        step_dir.child(load_index.INDEX_FILE).write_bytes(by_rule)
        files[load_index.INDEX_FILE] = [len(by_rule), hash_bytes(by_rule)]
    for index in indexes:
        step_dir.child(rendezvous.part_name(index.rank)).remove()
    return {"algorithm": ALGORITHM, "block": HASH_BLOCK, "manifests": manifests, "files": {METADATA_FILE: written, **files}}


def _write_pieces(loc: Location, pieces: Iterator[Any]) -> list[Any]:
    """Write a file piece after piece (no joined copy of it in memory), hashing as it goes; returns
    ``[bytes, xxh3]``. A piece that cannot be had (a rank's fragment found damaged) removes what
    was written, so no half file is left under the name."""
    hasher, size = new_hasher(), 0
    try:
        with loc.open_write() as f:
            for piece in pieces:
                f.write(piece)
                hasher.update(piece)
                size += len(piece)
    except BaseException:
        with contextlib.suppress(Exception):
            loc.remove()
        raise
    return [size, hasher.hexdigest()]


def _merge_json(step_dir: Location, indexes: list[RankIndex], described: Any) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The shapes and chunks of the tensors the ranks' JSON holds; every object into ``described``."""
    chunks: dict[str, list[tuple[Box, str, int, int]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for index in indexes:
        if any(name != frozen_file_name(index.rank) for name in index.files) or any(
                len(c) > 4 and c[4] not in index.files for t in index.tensors.values() for c in t["chunks"]):
            raise CorruptCheckpointError(f"rank {index.rank}'s index names a data file that is not its own",
                                         where=step_dir.child(rendezvous.part_name(index.rank)).url)
        for key, t in index.tensors.items():
            shapes.setdefault(key, (tuple(t["shape"]), t["dtype"]))
            chunks.setdefault(key, []).extend(((tuple(c[0]), tuple(c[1])), c[4] if len(c) > 4 else index.file, c[2], c[3])
                                              for c in t["chunks"])
        for key, (off, n) in index.objects.items():
            described.objects[key] = (index.file, off, n, transform_names(index.compress))
    return shapes, chunks


def _check_table(step_dir: Location, indexes: list[RankIndex], table: shared_chunks.Table) -> bool:
    """The ranks' DTensor chunks tile every key and lie in their ranks' files; returns whether they
    come in the order of their offsets, rank after rank."""
    by_rank = {index.rank: index for index in indexes}
    frozen = [] if table.rule is not None else table.rows[table.rows[:, -2] == 1][:, -1].unique().tolist()  # (none under the rule)
    for r in frozen:
        if frozen_file_name(r) not in by_rank[r].files:
            raise CorruptCheckpointError(f"rank {r}'s index names a data file that is not its own",
                                         where=step_dir.child(rendezvous.part_name(r)).url)
    problems, in_order = shared_chunks.check_tiling(table)
    for i, problem in problems.items():  # a writer bug, never a checkpoint to commit
        raise CorruptCheckpointError(f"the ranks' chunks of {table.names[i]!r} do not tile it: {problem}", where=step_dir.url)
    return in_order


def _manifest_files(step_dir: Location, indexes: list[RankIndex]) -> dict[str, list[Any]]:
    """The commit record's entry of every rank's manifest file: ``[bytes, digest, data files]``."""
    manifests = {}
    for index in indexes:
        entry = index.manifest
        own = sorted({index.file, *index.files})
        if not (isinstance(entry, list) and len(entry) == 4 and entry[0] == manifest_file_name(index.rank)
                and isinstance(entry[1], int) and isinstance(entry[2], str) and entry[3] == own):
            raise CorruptCheckpointError(f"rank {index.rank}'s index does not name its manifest file",
                                         where=step_dir.child(rendezvous.part_name(index.rank)).url)
        manifests[entry[0]] = [entry[1], entry[2], own]
    return manifests
