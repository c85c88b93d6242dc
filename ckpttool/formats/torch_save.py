"""``torch.save`` files of a nested state dict: one file, or an HF-sharded directory
(``pytorch_model-00001-of-0000n.bin`` files and ``pytorch_model.bin.index.json``, as older
transformers and many hub models have them), or a ``save_pretrained`` folder whose weights are
one ``pytorch_model.bin``. The registered format, its Source and Sink.

Reading never materialises the file: the archive's pickle is unpickled through the allow-list with
tensors as references, and each tensor's bytes are read by range. Writing streams each tensor into
its own zip record and writes the pickle last, so ``torch.load(out, weights_only=True)`` returns the
nested dict, and memory holds one slab at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any

from ..buffers import tensor_buffer
from ..checksums import Piece, combine, cover, crc32, new_block, scan
from ..errors import ChecksumError, CkptError, CorruptCheckpointError, FormatError, NotACheckpointError
from ..index import Chunk, Index, ObjectEntry, TensorEntry, dtype_size, flatten, unflatten
from ..layout import Box, whole
from ..report import Report
from ..safe_dtensor import DTensorRef
from ..safe_pickle import TensorRef
from ..storage import Location
from .base import Format, ObjectSpec, Probe, Progress, ReadFn, Sink, SinkOptions, Source, TensorSpec, split, stream_tensor
from .hf_index import ShardedOutput, index_bytes, read_weight_map, shard_files
from .torchzip import (MAX_EXPANDED, ArchiveWriter, StoredStorage, check_ref, expanded_bytes, materialise, read_archive,
                       read_tensor_box, span_bytes)

if TYPE_CHECKING:
    import torch

ZIP_MAGIC = b"PK\x03\x04"
#: a DCP data file (``__<rank>_<i>.distcp``): a run of torch.save records, not one torch file
_DCP_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def _is_ref(value: Any) -> bool:
    return isinstance(value, TensorRef)


#: the index of an HF-sharded torch checkpoint, and what its files are called
INDEX_FILE = "pytorch_model.bin.index.json"
INDEX_SUFFIXES = (".bin.index.json", ".pt.index.json", ".pth.index.json")
#: the one weights file of a save_pretrained folder under the shard size (safe_serialization=False)
SINGLE_FILE = "pytorch_model.bin"


def _index_name(names: tuple[str, ...] | list[str]) -> str | None:
    found = sorted(n for n in names if n.endswith(INDEX_SUFFIXES))
    return found[0] if found else None


def _single_file(names: tuple[str, ...] | list[str]) -> bool:
    """Whether a directory is a save_pretrained folder whose weights are one ``pytorch_model.bin``
    (no index; no safetensors weights, which from_pretrained would read first)."""
    return SINGLE_FILE in names and _index_name(names) is None and not any(n.endswith(".safetensors") for n in names)


class TorchFile:
    """One ``torch.save`` archive: its reader, parsed pickle and storage records; with ``verify``,
    each storage record's CRC-32 is checked before its first read."""

    def __init__(self, location: Location, verify: bool = True):
        self.location = location
        self.crc_checked: set[str] | None = set() if verify else None
        #: checked together (:class:`CrcCheck`): per storage record, the pieces read (start,
        #: end, CRC-32), and the key each record was first read for
        self.pieces: dict[str, list[Piece]] | None = None
        self.read_for: dict[str, str] = {}
        # (key, view) of each view admitted that repeats its record's bytes (check_ref): for that key
        # alone, so the same view inside an object, or under another key, is not expanded uncounted
        self.expanded: set[tuple[str, TensorRef]] = set()
        self.reader = location.open_reader()
        try:
            self.archive = read_archive(self.reader, 0, None, location.url)
        except BaseException:
            self.reader.close()
            raise

    def storage_of(self, ref: TensorRef, key: str) -> StoredStorage:
        """Where the bytes of the storage ``ref`` views lie."""
        storage = self.archive.storages.get(ref.storage.key)
        if storage is None:
            raise CorruptCheckpointError("tensor's storage record is missing from the archive", where=f"{self.location.url} (key {key!r})")
        return storage

    def checked_storage(self, ref: TensorRef, key: str) -> StoredStorage:
        """:meth:`storage_of`, its CRC-32 checked on first use when verifying."""
        storage = self.storage_of(ref, key)
        if self.crc_checked is not None and self.pieces is None and storage.name not in self.crc_checked:
            crc = scan(self.reader, storage.offset, storage.nbytes, new_block())
            if crc != storage.crc32:
                raise _crc_mismatch(key, storage, crc, self.location.url)
            self.crc_checked.add(storage.name)
        return storage

    def read(self, ref: TensorRef, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """``box`` of the tensor ``ref`` (a tensor of this file), checked (or, checked together,
        the CRC-32 of each range read kept for :class:`CrcCheck`)."""
        storage, reader = self.checked_storage(ref, key), self.reader
        if self.pieces is not None:
            reader = _Kept(reader, storage.offset, self.pieces.setdefault(ref.storage.key, []))
            self.read_for.setdefault(ref.storage.key, key)
        return read_tensor_box(reader, ref, storage, box, f"{self.location.url} (key {key!r})", out, (key, ref) in self.expanded)

    def close(self) -> None:
        self.reader.close()


class _Kept:
    """A reader that keeps the CRC-32 of every range it reads, relative to a record at ``base``."""

    def __init__(self, reader: Any, base: int, pieces: list[Piece]):
        self.reader, self.base, self.pieces = reader, base, pieces

    def readinto(self, offset: int, buf: memoryview) -> None:
        self.reader.readinto(offset, buf)
        self.pieces.append((offset - self.base, offset - self.base + len(buf), crc32(buf)))


class TorchSaveSource(Source):
    """With ``verify`` (the default) each storage record's CRC-32 is checked before its first read.
    A directory is an HF-sharded checkpoint: its index names the files, whose dicts are merged (a
    key in two files is refused)."""

    format = "torch"

    def __init__(self, location: Location, verify: bool = True):
        super().__init__(location)
        self._verify = verify
        self.parts: list[TorchFile] = []
        try:
            self._index = self._read_index(location)
        except BaseException:
            self.close()
            raise

    def _read_index(self, location: Location) -> Index:
        if location.isdir():
            names = location.listdir()
            name = _index_name(names)
            if name is not None:
                files = shard_files(location, name)
            elif SINGLE_FILE in names:
                files = [location.inside(SINGLE_FILE, location.url)]
            else:
                raise NotACheckpointError(f"directory holds no {INDEX_FILE} and no {SINGLE_FILE}", where=location.url)
        else:
            files = [location]
        idx = Index()
        self._part_of: dict[str, int] = {}
        self._expanded = 0  # bytes of the views admitted that repeat their records' bytes
        for i, loc in enumerate(files):
            part = TorchFile(loc, self._verify)
            self.parts.append(part)
            obj = part.archive.obj
            if isinstance(obj, TensorRef):
                obj = {"tensor": obj}
            if not isinstance(obj, Mapping):
                raise FormatError(f"top level of the file is a {type(obj).__name__}, not a dict", where=loc.url,
                                  hint="ckpttool reads state dicts")
            flat, paths = flatten(obj, is_tensor=_is_ref)
            for key, value in flat.items():
                if key in self._part_of:
                    raise CorruptCheckpointError(f"key {key!r} is in both {self.parts[self._part_of[key]].location.name} "
                                                 f"and {loc.name}", where=location.url, hint="the shards overlap; the set is damaged")
                self._part_of[key] = i
                if isinstance(value, DTensorRef):
                    raise FormatError(f"key {key!r} is one rank's shard of a DTensor: this file is one rank's part of a "
                                      "per-rank checkpoint folder", where=loc.url,
                                      hint=f"open the folder that holds every rank's file: {loc.parent.url}")
                if isinstance(value, TensorRef):
                    self._admit(part, value, key)
                    idx.add(TensorEntry(key, value.shape, value.element_type, (Chunk(tuple(0 for _ in value.shape), value.shape, value),)), paths[key])
                else:
                    idx.add(ObjectEntry(key, value), paths[key])
        return idx

    def _admit(self, part: TorchFile, ref: TensorRef, key: str) -> None:
        """Check a tensor against its record; a view that repeats the record's bytes (an expanded
        tensor, which ``torch.load`` reads) is read as ``torch.load`` reads it while all such views
        of the checkpoint stay within :data:`MAX_EXPANDED` bytes."""
        where = f"{part.location.url} (key {key!r})"
        storage = part.storage_of(ref, key)
        check_ref(ref, storage, where, expanded=True)  # (sizes, strides and the span first)
        grows = expanded_bytes(ref, storage)
        if grows:
            self._expanded += grows
            if self._expanded > MAX_EXPANDED:
                raise CorruptCheckpointError(
                    f"tensor of shape {list(ref.shape)} (stride {list(ref.stride)}) repeats the {storage.nbytes} bytes of its "
                    f"record (an overlapping view), and the checkpoint's expanded views add up to more than "
                    f"{MAX_EXPANDED >> 20} MiB", where=where,
                    hint="ckpttool expands views that repeat their bytes up to that size; save the tensor with .contiguous()")
            part.expanded.add((key, ref))

    def index(self) -> Index:
        return self._index

    def files(self) -> list[str]:
        return [p.location.name for p in self.parts]

    def aux_files(self) -> list[str]:
        name = _index_name(self.location.listdir()) if self.location.isdir() else None
        return [name] if name else []

    def _chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        return self.part(entry.key).location.name

    def part(self, key: str) -> TorchFile:
        """The file that holds ``key``."""
        i = self._part_of.get(key)
        if i is None:
            raise FormatError(f"{key!r} is not an entry of this checkpoint", where=self.location.url)
        return self.parts[i]

    @property
    def reader(self):
        """The reader of a single-file checkpoint."""
        return self.parts[0].reader

    def storage_of(self, ref: TensorRef, key: str) -> StoredStorage:
        return self.part(key).storage_of(ref, key)

    def _ref(self, key: str) -> TensorRef:
        return self.entry(key, TensorEntry).chunks[0].location

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        ref = self._ref(key)
        return self.part(key).read(ref, key, box if box is not None else whole(ref.shape), out)

    def read_object(self, key: str) -> Any:
        """The value of object ``key``, with the tensors inside it (a tuple of tensors is one object
        to DCP) read from the file, as a DCP object record's are."""
        part = self.part(key)
        return materialise(super().read_object(key), lambda ref: part.read(ref, key, whole(ref.shape)),
                           f"{part.location.url} (object {key!r})")

    def check_together(self) -> bool:
        """With ``verify``: records are no longer scanned whole before their first read; the CRC-32
        of each range read is kept, and the ranks check them together, with the
        ranks' pieces combined (:class:`CrcCheck`). Returns whether there is anything to check."""
        if not self._verify:
            return False
        for part in self.parts:
            part.pieces = {}
        return True

    def pieces_read(self) -> list[tuple[int, str, str, list[Piece]]]:
        """What this rank read of each record since :meth:`check_together`: (file, record, key, pieces)."""
        return [(i, name, part.read_for[name], pieces) for i, part in enumerate(self.parts)
                for name, pieces in (part.pieces or {}).items()]

    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        storage = self.storage_of(self._ref(key), key)
        return [(self.part(key).location, storage.offset, storage.offset + storage.nbytes)]

    def close(self) -> None:
        for p in self.parts:
            p.close()


class TorchSaveSink(ShardedOutput, Sink):
    """One file, or with ``max_shard_size`` an HF-sharded directory: ``pytorch_model-0000k-of-0000n.bin``
    files (each a ``torch.save`` of its tensors, the first also holding the non-tensor entries) and
    ``pytorch_model.bin.index.json``, written last."""

    format = "torch"
    STEM, SUFFIX = "pytorch_model", ".bin"

    def __init__(self, location: Location, max_shard_size: int | None = None):
        super().__init__(location)
        self.max_shard_size = max_shard_size
        self._writer: ArchiveWriter | None = None
        self.plan_shards([])
        self._open = -1  # the shard being written
        self._flat: dict[str, Any] = {}
        self._paths: dict[str, tuple] = {}
        self._objects: dict[str, Any] = {}
        self._started: set[int] = set()
        self._int_keyed: dict[tuple, dict[str, int]] = {}

    def _begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        tensors, objects = split(entries)
        self.plan_shards(tensors)
        for spec in entries:  # the pickled dict keeps the source's key order
            self._flat[spec.key] = spec.value if isinstance(spec, ObjectSpec) else None
            self._paths[spec.key] = tuple(spec.path)
        self._objects = {spec.key: spec.value for spec in objects}
        # optimizer states keyed by index, told from the whole state (a shard may hold a part of one)
        self._int_keyed = optimizer_states(unflatten(self._flat, self._paths))
        if self.sharded:
            self.tmp.makedirs()
        else:
            self._start(0)

    def _start(self, i: int) -> None:
        """Finish the shard being written (its pickle names what it holds) and open shard ``i``."""
        self._finish_open()
        f: IO[bytes] = self._next_file(self.tmp.child(self.shard_file(i)) if self.sharded else self.tmp)
        self._writer = self._enter(ArchiveWriter(f, name="archive"))
        self._open = i
        self._started.add(i)

    def _finish_open(self) -> None:
        if self._writer is None:
            return
        i = self._open
        if self.sharded:
            keys = [k for k in self._flat if self._shard_of.get(k) == i or (i == 0 and k in self._objects)]
        else:
            keys = list(self._flat)
        tree = unflatten({k: self._flat[k] for k in keys}, {k: self._paths[k] for k in keys})
        self._writer.finish(with_int_keys(tree, self._int_keyed))
        self._writer = None

    def _add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        i = self._shard_of[spec.key]
        if self._writer is None or self._open != i:
            self._start(i)  # shards are written in order: the previous one is complete
        if spec.nbytes <= budget:  # one slab: its record in one step
            self._flat[spec.key] = self._writer.put_tensor(spec.dtype, spec.shape,
                                                           tensor_buffer(read(whole(spec.shape)).contiguous()))
            return
        placeholder, stream = self._writer.new_tensor(spec.dtype, spec.shape)
        with stream:
            stream_tensor(stream.write, spec, read, budget)
        self._flat[spec.key] = placeholder

    def finish_files(self) -> None:
        if self.sharded:
            for i in range(len(self._shards)):  # this worker's shards not started (no tensors)
                if i not in self._started and self.share.mine(i, len(self._shards)):
                    self._start(i)
        self._finish_open()
        self._files.close()

    def complete(self) -> None:
        if self.sharded:  # the index, written last, is what makes a sharded output complete
            weight_map = {spec.key: self.shard_file(i) for i, shard in enumerate(self._shards) for spec in shard}
            total = sum(spec.nbytes for shard in self._shards for spec in shard)
            self.tmp.child(INDEX_FILE).write_bytes(index_bytes(total, weight_map))


def optimizer_states(tree: Any, at: tuple = ()) -> dict[tuple, dict[str, int]]:
    """Where ``tree`` holds a ``torch.optim`` state dict whose state is keyed by the decimal strings
    of its parameter indices (DCP's flattened keys and every format turn ``optimizer.state_dict()``'s
    integers into strings): the path of each such dict -> its string keys' integers. Such a dict
    has exactly ``state`` and ``param_groups``; every group lists distinct integer ``params``; every
    state key names one of them and holds a dict (a parameter's state), as torch.optim writes it."""
    found: dict[tuple, dict[str, int]] = {}
    if isinstance(tree, (dict, list)):
        for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            found.update(optimizer_states(v, at + (k,)))
    if not (isinstance(tree, dict) and set(tree) == {"state", "param_groups"} and isinstance(tree["state"], dict)
            and isinstance(tree["param_groups"], list)):
        return found
    groups = tree["param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return found
    ids = [i for g in groups for i in g["params"]]
    if not all(type(i) is int for i in ids) or len(set(ids)) != len(ids):
        return found
    named = {str(i): i for i in ids}
    state = tree["state"]
    if state and all(isinstance(k, str) and k in named and isinstance(v, dict) for k, v in state.items()):
        found[at] = {k: named[k] for k in state}
    return found


def with_int_keys(tree: Any, states: dict[tuple, dict[str, int]]) -> Any:
    """``tree`` (changed in place) with the state of each optimizer :func:`optimizer_states` found
    keyed by integers again, so that ``optimizer.load_state_dict`` of what ``torch.load`` returns
    finds each parameter's state; a part of the tree (one shard's) re-keys what it holds of them."""
    for at, named in states.items():
        node = tree
        for part in at:
            held = part in node if isinstance(node, dict) else isinstance(node, list) and isinstance(part, int) and part < len(node)
            node = node[part] if held else None
        if isinstance(node, dict) and isinstance(node.get("state"), dict):
            node["state"] = {named.get(k, k): v for k, v in node["state"].items()}
    return tree


def int_keyed_optimizers(tree: Any) -> Any:
    """``tree`` with every optimizer state in it keyed as ``optimizer.state_dict()`` keys it."""
    return with_int_keys(tree, optimizer_states(tree))


class CrcCheck:
    """The CRC-32 check of every record some rank read (after :meth:`TorchSaveSource.check_together`),
    split between the ranks (the agreement around it: ``rendezvous.checked_together``): built on
    every rank from every rank's :meth:`TorchSaveSource.pieces_read`, each rank scans its
    :meth:`share` of the bytes no rank read, and :meth:`verdict` from all shares is the same on
    every rank: the :class:`ChecksumError` of the first record that does not match, or None."""

    def __init__(self, source: TorchSaveSource, everyone: list[list[tuple]]):
        self.source = source
        self.world = len(everyone)
        self.records: dict[tuple[int, str], tuple[str, list[Piece]]] = {}
        for i, name, key, pieces in (item for rank_pieces in everyone for item in rank_pieces):
            self.records.setdefault((i, name), (key, []))[1].extend(pieces)
        self.stored = {rec: source.parts[rec[0]].archive.storages[rec[1]] for rec in sorted(self.records)}
        self.plan = {rec: cover(self.records[rec][1], storage.nbytes) for rec, storage in self.stored.items()}

    def share(self, rank: int) -> dict[tuple, tuple[int, int]]:
        """This rank's share of each gap (the bytes no rank read), scanned: ``{(record, lo): (hi, crc)}``."""
        block = new_block()
        shares = {}
        for rec, segments in self.plan.items():
            for start, end, crc in segments:
                lo, hi = _share(start, end, rank, self.world)
                if crc is None and lo < hi:
                    reader = self.source.parts[rec[0]].reader
                    shares[(rec, lo)] = (hi, scan(reader, self.stored[rec].offset + lo, hi - lo, block))
        return shares

    def verdict(self, shares: dict[tuple, tuple[int, int]]) -> ChecksumError | None:
        for rec, segments in self.plan.items():
            parts: list[tuple[int, int, int]] = []
            for start, end, crc in segments:
                if crc is not None:
                    parts.append((start, end, crc))
                    continue
                for lo, hi in (_share(start, end, r, self.world) for r in range(self.world)):
                    if lo < hi:
                        parts.append((lo, *shares[(rec, lo)]))
            crc = combine(parts)
            if crc != self.stored[rec].crc32:
                return _crc_mismatch(self.records[rec][0], self.stored[rec], crc, self.source.parts[rec[0]].location.url)
        return None


def _share(start: int, end: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s part of ``[start, end)`` split evenly between ``world`` ranks."""
    return start + (end - start) * rank // world, start + (end - start) * (rank + 1) // world


def _crc_mismatch(key: str, storage: StoredStorage, crc: int, where: str) -> ChecksumError:
    return ChecksumError(f"data of {key!r} does not match its CRC-32 (stored {storage.crc32:08x}, computed {crc:08x})",
                         where=where, hint="the file changed after it was written; restore it")


def check_record(part: TorchFile, ref: TensorRef, key: str, report: Report, checked: set[tuple[str, str]],
                 buf: memoryview) -> None:
    """verify's check of one tensor of a ``torch.save`` archive: its storage record is there, its
    bytes match the zip's CRC-32 (each record scanned once: ``checked`` holds (file, record)), and
    the tensor lies inside it."""
    try:
        storage = part.storage_of(ref, key)
    except CkptError as exc:
        report.add(exc.what, part.location.url, key)
        return
    if (part.location.url, storage.name) not in checked:
        checked.add((part.location.url, storage.name))
        crc = scan(part.reader, storage.offset, storage.nbytes, buf)
        if crc != storage.crc32:
            report.add(f"data of {storage.name} does not match its CRC-32 (stored {storage.crc32:08x}, computed {crc:08x})",
                       part.location.url, key, hint="the file changed after it was written; restore it")
    if ref.storage_offset * dtype_size(ref.element_type) + span_bytes(ref) > storage.nbytes:
        report.add("tensor extends past its storage record", part.location.url, key)


def check_tensor_records(index: Index, report: Report, only: str | None, progress: Progress | None,
                         records: Callable[[str, TensorEntry], list[tuple[TorchFile, TensorRef]]],
                         before: Callable[[str, TensorEntry], None] | None = None) -> None:
    """verify's pass over the tensors of torch.save archives (one file, or a per-rank folder's):
    ``before(key, entry)`` first (a folder checks the shards' tiling), then :func:`check_record` for
    each (archive, tensor) ``records(key, entry)`` names; objects are counted (their pickles were
    read, through the allow-list, when the source was opened)."""
    buf = new_block()
    checked: set[tuple[str, str]] = set()
    keys = index.under(only)
    total = sum(index[k].nbytes for k in keys if isinstance(index[k], TensorEntry))
    done = 0
    for key in keys:
        entry = index[key]
        if not isinstance(entry, TensorEntry):
            report.objects_checked += 1
            continue
        if before is not None:
            before(key, entry)
        for part, ref in records(key, entry):
            check_record(part, ref, key, report, checked, buf)
        report.checked_tensor(entry.nbytes)
        done += entry.nbytes
        if progress:
            progress(done, total, key)


class TorchSaveFormat(Format):
    name = "torch"
    checksums = True  # the zip's CRC-32 of every storage record

    sink_options = frozenset({"max_shard_size"})

    def sniff(self, probe: Probe) -> bool:
        if probe.is_dir:
            return _index_name(probe.names) is not None or _single_file(probe.names)
        return probe.head[:4] == ZIP_MAGIC and not _DCP_DATA_FILE.match(probe.loc.name)

    def diagnose(self, probe: Probe) -> FormatError | None:
        if not probe.is_dir and _DCP_DATA_FILE.match(probe.loc.name):
            return NotACheckpointError("this is one data file of a DCP checkpoint (its records are pieces of the "
                                       "checkpoint; .metadata beside it says what they are)", where=probe.loc.url,
                                       hint=f"open its directory: {probe.loc.parent.url}")
        if not probe.is_dir and probe.head[:1] == b"\x80":
            return FormatError("legacy (pre-1.6, non-zip) torch.save file", where=probe.loc.url,
                               hint="load and re-save it with a current torch")
        return None

    def open_source(self, loc: Location, verify: bool = True, reading: Any = None) -> TorchSaveSource:
        return TorchSaveSource(loc, verify=verify)

    def make_sink(self, loc: Location, options: SinkOptions) -> TorchSaveSink:
        return TorchSaveSink(loc, max_shard_size=options.max_shard_size)

    def check_integrity(self, source: TorchSaveSource, report: Report, only: str | None, progress: Progress | None) -> None:
        """The zip's CRC-32 of every storage record the entries use, each tensor inside its record,
        and for a sharded directory the index agreeing with the files."""
        index = source.index()
        check_tensor_records(index, report, only, progress, lambda key, entry: [(source.part(key), entry.chunks[0].location)])
        name = _index_name(source.location.listdir()) if source.location.isdir() else None
        if name is not None:
            index_loc = source.location.child(name)
            for key, fname in read_weight_map(index_loc).items():
                held = source.part(key).location.name if key in index else "no file"
                if held != fname:
                    report.add(f"index maps it to {fname} but it is in {held}", index_loc.url, key)


FORMAT = TorchSaveFormat()
