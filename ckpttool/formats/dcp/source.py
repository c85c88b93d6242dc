"""Reading a DCP directory offline: its index from ``.metadata``, tensor regions and objects by range.

Each chunk or object is a ``torch.save`` archive inside a ``__<rank>_<i>.distcp`` file; we parse
the archive's zip directory and pickle through the allow-list and read only the bytes a region needs.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...buffers import tensor_buffer
from ...bulk import no_gc
from ...checksums import RecordHasher, by_parts, crc32, hash_bytes
from ...errors import ChecksumError, CkptError, CorruptCheckpointError, FormatError, NotFoundError
from ...index import Chunk, Index, ObjectEntry, TensorEntry, dtype_size
from ...layout import Box, relative, whole
from ...storage import BytesReader, Location, RangeReader
from ...steps import COMMIT_FILE, manifest_file_name, read_commit_record
from ..base import Source
from ...refs import StorageRef, TensorRef
from ..torchzip import (REMOTE_RECORD, REMOTE_SPAN, Archive, StoredStorage, contiguous_stride, known_record, load_object_record,
                        read_archive, read_tensor_box)
from .transforms import ARCHIVE_SLACK, MAX_OBJECT_BYTES, MAX_ZSTD_RATIO, DecodedRecord, check_descriptors
from . import load_index
from .manifest import Manifest
from .metadata import (METADATA_FILE, check_tensor_metadata, data_file_name, parse_metadata, read_metadata_bytes, storage_index,
                       writer_world_size)
from .metadata_types import BytesStorageMetadata, TensorStorageMetadata, _StorageInfo

if TYPE_CHECKING:
    import torch

    from .checks import RecordChecks

#: on a local disk, a record up to this size (a 64 KiB manifest block of data and its headers) is
#: read whole in one read and its later reads (header, data, the rest) served from it: a reshard
#: of many small records otherwise made five reads of each, each part read apart
LOCAL_RECORD = 68 << 10
#: on a local disk, adjacent records up to LOCAL_RECORD that the caller will read (``will_read``) are
#: fetched together, in one read of at most this many bytes
LOCAL_SPAN = 1 << 20
#: ... in each of the last this many files read (so at most LOCAL_HELD * LOCAL_SPAN bytes held)
LOCAL_HELD = 8


def _extends(runs: dict[str, list[tuple[str, Any, Any, Any]]], pieces: list[tuple[Any, Any]], span_max: int, files: int) -> bool:
    """Whether a tensor's records (``pieces``, in order) each follow the last record of its file's
    run (or start one), each run within ``span_max`` bytes, the runs in at most ``files`` files."""
    ends: dict[str, tuple[int, int]] = {}
    for info, _ in pieces:
        path = info.relative_path
        got = ends.get(path)
        if got is None:
            run = runs.get(path)
            got = (run[0][2].offset, run[-1][2].offset + run[-1][2].length) if run else None
        if got is not None and (got[1] != info.offset or info.offset + info.length - got[0] > span_max):
            return False
        ends[path] = (got[0] if got is not None else info.offset, info.offset + info.length)
    return len(runs) + sum(1 for path in ends if path not in runs) <= files


class DcpSource(Source):
    """With ``verify`` (the default) every record is checked before its first use: torch's CRC-32
    and, for a ckpttool step, the manifest of its commit record (a damaged record refuses the
    step). ``rank`` names the reader in the errors of a distributed load. ``.metadata`` is read
    into plain classes (``metadata_types.py``): opening, ``index()``, reading objects and checking
    records import no torch."""

    format = "dcp"

    def __init__(self, location: Location, verify: bool = True, rank: int | None = None, by_index: bool = True):
        with no_gc():  # (the commit record of a job of N ranks: a few objects per rank, no cycle)
            self._open(location, verify, rank, by_index)

    def _open(self, location: Location, verify: bool, rank: int | None, by_index: bool) -> None:
        super().__init__(location)
        self._md: tuple[Any, dict, int, str] | None = None  # (.metadata, its storage entries, size, digest) once read
        self._record: tuple[dict | None] | None = None  # (the commit record,) once read
        self.checks: RecordChecks | None = None
        self.rank = rank
        # a ckpttool step's load index (load_index.py): the index without .metadata, which is then
        # read only if something asks for it (verify); ``by_index=False`` reads .metadata as plain DCP
        self.by_index: load_index.LoadIndex | None = None
        if by_index and location.child(COMMIT_FILE).exists():
            try:
                record = self.commit_record()
            except CkptError:
                record = None  # (a damaged record: .metadata is read, and the checks below say what is wrong)
            self.by_index = load_index.read(location, record)
        self._rule = self.by_index  # (what _locate checks the ranks' manifests against, kept by read_by_metadata)
        if self.by_index is None:
            self._metadata_parts()  # (read now: a file that is not DCP metadata fails the open)
        self._located: dict[int, Any] = {}  # rank -> where its records of the index's sharded keys lie
        self._locator: Manifest | None = None
        self._readers: dict[str, RangeReader] = {}
        self._files: dict[str, Location] = {}  # data file name -> its Location (one a file, not one a read)
        self._archives: OrderedDict[tuple[str, int], Archive] = OrderedDict()
        self._fetched: tuple[tuple[str, int], list[tuple[int, bytes]]] | None = None  # the last parse's reads (record_bytes)
        # records read by the layout their manifest rows give, not parsed yet (_manifest_layout, _confirm)
        self._provisional: dict[tuple[str, int], tuple[TensorRef, StoredStorage]] = {}
        self._decoded: OrderedDict[tuple[str, int], DecodedRecord] = OrderedDict()  # compressed records, decoded
        self._chunk_sizes: dict[tuple[str, int], int] | None = None
        self._spans: dict[str, list[tuple[int, int]]] = {}  # per data file: its plain records' (offset, length), sorted
        self._wanted: set[tuple[str, int]] | bool = False  # will_read's records (True: all); False: none said
        self._holding: OrderedDict[str, RangeReader] = OrderedDict()  # files whose reader may hold a span, oldest first
        self._consumed: dict[str, list[list[int]]] = {}  # per data file: the [start, end) of records read, merged
        self._index: Index | None = None
        if verify:
            from . import checks  # (only a checking reader needs it; verify opens without)

            self.checks = checks.RecordChecks(self, (self.commit_record() or {}).get("manifest"), rank)

    def _metadata_parts(self) -> tuple[Any, dict, int, str]:
        if self._md is None:
            raw = read_metadata_bytes(self.location)
            with no_gc():  # (a chunk per rank and tensor: millions of objects at scale)
                metadata = parse_metadata(raw, self.location, plain=True)
                self._md = (metadata, storage_index(metadata, self.location), len(raw), hash_bytes(raw))
            if self.checks is not None:  # (read after the checks began: by a reader of the load index)
                self.checks.check_metadata()
        return self._md

    @property
    def metadata(self) -> Any:
        return self._metadata_parts()[0]

    @property
    def _storage(self) -> dict:
        return self._metadata_parts()[1]

    @property
    def metadata_size(self) -> int:
        return self._metadata_parts()[2]

    @property
    def metadata_digest(self) -> str:
        """The manifest of a ckpttool step covers .metadata too."""
        return self._metadata_parts()[3]

    @property
    def metadata_read(self) -> bool:
        return self._md is not None

    @property
    def located_ranks(self) -> set[int]:
        """The ranks whose manifest file this source read to find where their records of the load
        index's sharded keys lie (a rank's load reads those of the ranks it overlaps only)."""
        return set(self._located)

    def _locate(self, rank: int, number: int) -> Any:
        """Where rank ``rank``'s record of the load index's sharded key ``number`` lies: its
        manifest file says (read and checked once), inside its data file."""
        name = data_file_name(rank)
        flat = self._located.get(rank)
        if flat is None:
            self.location.inside(name, f"{self.location.url} (rank {rank}'s data file)")  # (no symlink out of the step)
            manifest = self._manifest()
            entry, finding = manifest.sharded_of(name, manifest_file_name(rank)) if manifest is not None else (None, None)
            if finding is not None:
                raise finding.error(None, f" on rank {self.rank}" if self.rank is not None else "")
            flat = array("q", load_index.check_locations(entry, self._rule, rank, self.location.child(manifest_file_name(rank)).url))
            self.reader(name).check_range(0, max((a + b for a, b in zip(flat[::2], flat[1::2])), default=0))
            self._located[rank] = flat  # (kept once checked)
        return _StorageInfo(name, flat[2 * number], flat[2 * number + 1], self._rule.transforms)

    def read_by_metadata(self) -> Index | None:
        """From now on, serve the index ``.metadata`` gives (``verify`` walks it); returns the
        load index's Index where the source served that one (for ``verify`` to compare)."""
        if self.by_index is None:
            return None
        self._metadata_parts()  # (first: a .metadata that cannot be read fails here, the source as it was)
        try:
            by_index: Any = self.index()
        except CkptError as exc:  # (a load index that cannot be read: verify says so, and walks .metadata)
            by_index = exc
        self.by_index, self._index, self._chunk_sizes, self._spans = None, None, None, {}
        self._checked.clear()
        return by_index

    def _manifest(self) -> Manifest | None:
        """The step's manifest, for where its records lie (the checks' own when they have one)."""
        if self._locator is None:
            self._locator = (self.checks.manifest if self.checks is not None and self.checks.manifest is not None
                             else Manifest.of((self.commit_record() or {}).get("manifest"), self.location)[0])
        return self._locator

    def commit_record(self) -> dict | None:
        """The commit record of a ckpttool step (None for plain DCP), read once."""
        if self._record is None:
            self._record = (read_commit_record(self.location),)
        return self._record[0]

    def index(self) -> Index:
        if self._index is None:
            with no_gc():
                self._index = self._read_index()
        return self._index

    def _read_index(self) -> Index:
        if self.by_index is not None:
            return self.by_index.entries(self.location, self._locate)
        paths = self.metadata.planner_data if isinstance(self.metadata.planner_data, dict) else {}
        md_url = self.location.child(METADATA_FILE).url
        idx = Index()
        stored = self.metadata.state_dict_metadata
        # the order of the saved state dict (planner_data keeps it), not the order ranks reported in
        order = {k: i for i, k in enumerate(paths)}
        for key in sorted(stored, key=lambda k: order.get(k, len(order))):
            md = stored[key]
            path = tuple(paths.get(key, (key,)))
            if isinstance(md, TensorStorageMetadata):
                check_tensor_metadata(key, md, md_url)
                chunks = []
                item = dtype_size(md.properties.dtype)  # (a DType: checked above)
                for c in md.chunks:
                    offs, sizes = tuple(c.offsets), tuple(c.sizes)
                    info = self._storage.get((key, offs))
                    if info is None:
                        raise CorruptCheckpointError(f"tensor {key!r}: chunk at {offs} has no storage entry in .metadata", where=md_url)
                    transformed = getattr(info, "transform_descriptors", None)
                    if transformed:  # its size is checked as it decodes
                        check_descriptors(transformed, self.file(info.relative_path).url)
                    elif math.prod(sizes) * item > info.length:
                        raise CorruptCheckpointError(
                            f"tensor {key!r}: chunk at {offs} of {list(sizes)} needs more bytes than its record's "
                            f"{info.length}", where=md_url, hint="the .metadata is damaged; restore it")
                    chunks.append(Chunk(offs, sizes, info))
                idx.add(TensorEntry(key, tuple(md.size), md.properties.dtype, tuple(chunks)), path, md_url)
            elif isinstance(md, BytesStorageMetadata):
                info = self._storage.get((key, None))
                if info is None:
                    raise CorruptCheckpointError(f"object {key!r} has no storage entry in .metadata", where=self.location.url)
                if getattr(info, "transform_descriptors", None):
                    check_descriptors(info.transform_descriptors, self.file(info.relative_path).url)
                idx.add(ObjectEntry(key, info), path, md_url)
            else:
                raise FormatError(f"unknown entry type {type(md).__name__} for {key!r}", where=self.location.url)
        return idx

    @property
    def world_size(self) -> int:
        return writer_world_size(self.files())

    def files(self) -> list[str]:
        if self.by_index is not None:
            return sorted({*(data_file_name(r) for r in range(self.by_index.world_size)), *self.by_index.files()})
        return sorted({info.relative_path for info in self._storage.values()})

    def _chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        return entry.chunks[chunk_index].location.relative_path

    def aux_files(self) -> list[str]:
        """``.metadata``, the commit record and the ranks' manifest files it names (a damaged record
        names none: its own error says so where the step is read)."""
        try:
            manifest = (self.commit_record() or {}).get("manifest") or {}
        except CkptError:
            manifest = {}
        extra = [name for name in manifest.get("files", {}) if name == load_index.INDEX_FILE]
        return [METADATA_FILE, COMMIT_FILE, *extra, *manifest.get("manifests", {})]

    def reader(self, relative_path: str) -> RangeReader:
        """The open reader of one data file (kept open: a file holds many records)."""
        r = self._readers.get(relative_path)
        if r is None:
            loc = self.file(relative_path)
            if not loc.exists():
                raise NotFoundError(
                    "data file named in .metadata is missing", where=loc.url, hint="restore the file or use another checkpoint"
                )
            r = self._readers[relative_path] = loc.open_reader()
        return r

    def file(self, relative_path: str) -> Location:
        """A data file named in ``.metadata`` (names were confined to the directory when read)."""
        loc = self._files.get(relative_path)
        if loc is None:
            loc = self._files[relative_path] = self.location.child(relative_path)
        return loc

    def record_where(self, info: Any, key: str) -> str:
        """Where a record lies, for an error; where no manifest proves ``.metadata`` (plain DCP, an
        offline output), a record that is not what it should be may as well be a place
        ``.metadata`` got wrong, and the text says so."""
        proven = ((self.commit_record() or {}).get("manifest") or {}).get("files", {}).get(METADATA_FILE) is not None
        return f"{self.file(info.relative_path).url} (record of {key!r} at byte {info.offset}" + (
            ")" if proven else f", where {METADATA_FILE} places it)")

    @staticmethod
    def transformed(info: Any) -> bool:
        """Whether a record is stored through a transform (compressed) rather than as plain bytes."""
        return bool(getattr(info, "transform_descriptors", None))

    def record(self, info: Any, key: str) -> tuple[Any, int, int]:
        """(reader, offset, length) of a record's plain bytes: a range of its data file, or for a
        compressed record its decoded copy (a few kept: a slab may revisit the chunks of a tensor)."""
        if not self.transformed(info):
            return self.reader(info.relative_path), info.offset, info.length
        cache_key = (info.relative_path, info.offset)
        decoded = self._decoded.get(cache_key)
        if decoded is None:
            raw = self.reader(info.relative_path)
            raw.check_range(info.offset, info.length)
            decoded = self._decoded[cache_key] = DecodedRecord(raw, info.offset, info.length, self._decoded_limit(info, key),
                                                               self.record_where(info, key))
            if len(self._decoded) > 16:
                self._decoded.popitem(last=False)[1].close()
        else:
            self._decoded.move_to_end(cache_key)
        return decoded, 0, decoded.size()

    def _decoded_limit(self, info: Any, key: str) -> int:
        """The most a compressed record may decode to: its chunk's bytes and the archive around
        them (an object: MAX_OBJECT_BYTES), and never more than zstd can expand the bytes present."""
        declared = getattr(info, "chunk_bytes", None)  # (a chunk of the load index's sharded keys)
        if declared is None:
            declared = self._chunk_bytes().get((info.relative_path, info.offset), MAX_OBJECT_BYTES - ARCHIVE_SLACK)
        declared += ARCHIVE_SLACK
        return min(declared, info.length * MAX_ZSTD_RATIO + ARCHIVE_SLACK)

    def _chunk_bytes(self) -> dict[tuple[str, int], int]:
        """(file, offset) of every tensor record -> the bytes of its chunk, built once (a lookup per
        decoded record, not a walk over the tensor's chunks)."""
        if self._chunk_sizes is None:
            self._chunk_sizes = {(c.location.relative_path, c.location.offset): math.prod(c.sizes) * dtype_size(e.element_type)
                                 for e in self.index().tensors() if not isinstance(e.chunks, load_index.RuleChunks)
                                 for c in e.chunks}
        return self._chunk_sizes

    def archive(self, info: Any, key: str, spans: list[tuple[int, bytes]] | None = None) -> Archive:
        """The parsed record behind a storage entry (cached: many reads hit the same chunk);
        ``spans``: (file offset, bytes) of it the caller read already (not read again)."""
        cache_key = (info.relative_path, info.offset)
        arch = self._archives.get(cache_key)
        if arch is None:
            reader, offset, length = self.record(info, key)
            self.prefetch(info)
            whole = 0 if self.transformed(info) else REMOTE_RECORD if self.location.batch_reads else LOCAL_RECORD
            fetched: list[tuple[int, bytes]] = []
            # (what record_bytes read of it before, a read by its manifest's layout: not read again)
            if spans is None and self._fetched is not None and self._fetched[0] == cache_key:
                spans = self._fetched[1]
            arch = read_archive(reader, offset, length, self.record_where(info, key), whole_up_to=whole, fetched=fetched,
                                spans=spans)
            # (kept for a checked read's hash of the record's head and tail: record_bytes)
            self._fetched = (cache_key, fetched) if self.checks is not None and not self.transformed(info) else None
            self._archives[cache_key] = arch
            if len(self._archives) > 4096:
                self._archives.popitem(last=False)
        return arch

    def record_bytes(self, info: Any, offset: int, length: int) -> bytes:
        """``length`` bytes of the file at ``offset``, inside the record at ``info``: from what the
        parse of that record (the last one parsed) read, else read now (and kept for the parse of a
        record read by its manifest's layout: :meth:`confirm`)."""
        cache_key = (info.relative_path, info.offset)
        held = self._fetched[1] if self._fetched is not None and self._fetched[0] == cache_key else None
        for start, data in held or ():
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start: offset - start + length]
        data = self.reader(info.relative_path).read(offset, length)
        if cache_key in self._provisional:
            if held is None:
                self._fetched = (cache_key, held := [])
            held.append((offset, data))
        return data

    def read_data(self, info: Any, storage: StoredStorage, data: memoryview) -> None:
        """A plain record's data (all of it) into ``data``; for a record read by its manifest's
        layout, together with its head and rest, in one read (kept for record_bytes and its parse)."""
        cache_key = (info.relative_path, info.offset)
        reader = self.reader(info.relative_path)
        if (cache_key not in self._provisional or reader.holds(storage.offset, storage.nbytes)
                or (self._fetched is not None and self._fetched[0] == cache_key)):
            reader.readinto(storage.offset, data)
            return
        end = storage.offset + storage.nbytes
        head, rest = bytearray(storage.offset - info.offset), bytearray(info.offset + info.length - end)
        reader.readinto_parts(info.offset, [memoryview(head), data, memoryview(rest)])
        self._fetched = (cache_key, [(info.offset, bytes(head)), (end, bytes(rest))])

    def will_read(self, locations: Iterable[Any] | None) -> None:
        self._wanted = True if locations is None else {(i.relative_path, i.offset) for i in locations
                                                         if getattr(i, "relative_path", None) is not None}

    def prefetch(self, info: Any) -> None:
        """Before a plain record is read: hold it, with the records after it that will be read too
        (:meth:`_fetch_span`), where that saves reads: on an object store always (each read is a
        request), on a local disk among the records ``will_read`` named (each read a syscall, and
        records nobody reads are not fetched)."""
        if self.transformed(info):
            return
        reader = self._holding_in(info.relative_path)
        if not reader.holds(info.offset, info.length):
            if self.location.batch_reads:
                if info.length <= REMOTE_RECORD:
                    self._fetch_span(reader, info, REMOTE_RECORD, REMOTE_SPAN, True)
            elif self._wanted and info.length <= LOCAL_RECORD and (self._wanted is True or (info.relative_path, info.offset) in self._wanted):
                self._fetch_span(reader, info, LOCAL_RECORD, LOCAL_SPAN, self._wanted)
        _add_range(self._consumed.setdefault(info.relative_path, []), info.offset, info.offset + info.length)

    def _holding_in(self, path: str) -> RangeReader:
        """The reader of data file ``path``, which may hold a span from now on: spans held in memory
        are one per source on an object store (up to REMOTE_SPAN), one in each of the LOCAL_HELD
        files read last on a local disk (a tensor's chunks alternate between files)."""
        reader = self.reader(path)
        self._holding.pop(path, None)
        self._holding[path] = reader
        while len(self._holding) > (1 if self.location.batch_reads else LOCAL_HELD):
            self._holding.popitem(last=False)[1].release()
        return reader

    def read_span(self, path: str, start: int, length: int) -> memoryview:
        """``length`` bytes of data file ``path`` from ``start`` (checked to lie in the file), read
        and held (:meth:`_holding_in`): a record of them that is then read on its own (the first of
        its length, one that did not check) is served from memory, not read again; from the span
        held where it holds them."""
        reader = self._holding_in(path)
        reader.check_range(start, length)
        held = reader.holds(start, length)  # (inside a span held before: from it, not read again)
        span = bytearray(length)
        reader.readinto(start, memoryview(span))
        if not held:
            reader.hold(start, span)
        _add_range(self._consumed.setdefault(path, []), start, start + length)
        return memoryview(span)

    def held_spans(self) -> int:
        """How many of its files hold a span of records in memory now (at most LOCAL_HELD locally)."""
        return sum(1 for r in self._readers.values() if r.held_bytes)

    def _fetch_span(self, reader: RangeReader, info: Any, record_max: int, span_max: int,
                    wanted: set[tuple[str, int]] | bool) -> None:
        """Fetch a record together with the records that follow it in its file (back to back, each
        up to ``record_max`` bytes and in ``wanted``, or any with ``True``; up to ``span_max``
        bytes) and hold them: a convert reads them next, and each would otherwise cost a request
        (a round trip on an object store). A span of one record is left to read_archive."""
        runs = self._spans.get(info.relative_path)
        if runs is None and self.by_index is not None:  # (every record of the file, from its manifest: not .metadata)
            manifest = self._manifest()
            rows = manifest.rows_of(info.relative_path)[0] if manifest is not None else {}
            runs = self._spans[info.relative_path] = sorted((off, row[0]) for off, row in rows.items())
        if runs is None:  # every file's records from .metadata, in one pass over its entries
            by_file: dict[str, list[tuple[int, int]]] = {}
            for i in self._storage.values():
                if not self.transformed(i):
                    by_file.setdefault(i.relative_path, []).append((i.offset, i.length))
            for name, records in by_file.items():
                self._spans.setdefault(name, sorted(records))
            runs = self._spans.setdefault(info.relative_path, [])
        at = bisect.bisect_left(runs, (info.offset, info.length))
        end, size = info.offset + info.length, reader.size()
        consumed = self._consumed.get(info.relative_path, [])
        for offset, length in runs[at + 1:]:  # (a record past the file's end is left to its own read, which says so)
            if offset != end or length > record_max or offset + length - info.offset > span_max or offset + length > size:
                break
            if wanted is not True and (info.relative_path, offset) not in wanted:
                break
            if _within(consumed, offset):  # read before (records read out of file order): not fetched again
                break
            end = offset + length
        if end > info.offset + info.length:
            reader.check_range(info.offset, end - info.offset)
            reader.hold(info.offset, reader.read(info.offset, end - info.offset))

    def tensor_record(self, key: str, entry: TensorEntry, chunk: Chunk, by_layout: bool = False):
        """(reference, storage) of a chunk's record, checked against what ``.metadata`` says.
        ``by_layout``: a large record of a ckpttool step may come as its manifest lays it out, not
        parsed yet (:meth:`_manifest_layout`): the caller reads its head, data and rest, in file
        order, and then calls :meth:`confirm`."""
        cache_key = (chunk.location.relative_path, chunk.location.offset)
        if by_layout:
            laid = self._provisional.get(cache_key)
            if laid is None and cache_key not in self._archives:
                laid = self._manifest_layout(key, entry, chunk)
            if laid is not None:
                return laid
        elif cache_key in self._provisional:
            self.confirm(key, entry, chunk)
        return self._parsed_record(key, entry, chunk)

    def _manifest_layout(self, key: str, entry: TensorEntry, chunk: Chunk) -> tuple[TensorRef, StoredStorage] | None:
        """(reference, storage) of a large record of a ckpttool step as its manifest row lays it out:
        the chunk's elements in C order at the row's data range (the layout ckpttool writes). The
        record's parse needs the bytes after its data (torch and ckpttool both write the pickle's and
        the data's sizes only in the zip directory at the end): reading by this layout reads the
        head, the data, then the rest, in file order, and :meth:`confirm` parses the record from
        those bytes and holds it to the layout. None where the row gives no such layout."""
        info = chunk.location
        checks = self.checks
        if checks is None or checks.manifest is None or self.transformed(info) or self.read_whole(info):
            return None
        rows, finding = checks.manifest.rows_of(info.relative_path)
        row = rows.get(info.offset) if finding is None else None
        extra = row[2] if row is not None and row[0] == info.length else None
        numel = math.prod(chunk.sizes)
        if not isinstance(extra, dict) or extra.get("data", [0, -1])[1] != numel * dtype_size(entry.element_type):
            return None
        start, nbytes = extra["data"]  # (inside the record: the manifest's rows are checked as they are read)
        ref = TensorRef(StorageRef("0", entry.element_type, numel), entry.element_type, 0, tuple(chunk.sizes),
                        contiguous_stride(tuple(chunk.sizes)))
        laid = self._provisional[(info.relative_path, info.offset)] = (ref, StoredStorage(info.offset + start, nbytes, 0, "data/0"))
        self.prefetch(info)
        return laid

    def read_whole(self, info: Any) -> bool:
        """Whether a record is small enough to be read whole, in one read, its parse then served
        from memory (with the records after it, where :meth:`prefetch` fetches a span)."""
        return info.length <= (REMOTE_RECORD if self.location.batch_reads else LOCAL_RECORD)

    def confirm(self, key: str, entry: TensorEntry, chunk: Chunk) -> None:
        """Parse a record read by its manifest's layout (from the head and rest already read) and
        hold it to that layout: data read by a layout its archive does not have is refused."""
        info = chunk.location
        laid = self._provisional.pop((info.relative_path, info.offset), None)
        if laid is None:
            return
        ref, storage = self._parsed_record(key, entry, chunk)
        if not (ref.is_contiguous() and ref.storage_offset == 0 and storage.offset == laid[1].offset
                and storage.nbytes == laid[1].nbytes):
            raise ChecksumError(f"record of {key!r} at byte {info.offset} is not laid out as the manifest written at commit "
                                f"says{self.checks.on}", where=self.file(info.relative_path).url,
                                hint="the file or its .metadata changed after the save")

    def _parsed_record(self, key: str, entry: TensorEntry, chunk: Chunk):
        arch = self.archive(chunk.location, key)
        ref = arch.obj
        if tuple(getattr(ref, "shape", ())) != chunk.sizes or getattr(ref, "element_type", None) != entry.element_type:
            where = f"{self.file(chunk.location.relative_path).url} (key {key!r})"
            raise CorruptCheckpointError(
                f"record of {key!r} at {chunk.offsets} holds {getattr(ref, 'element_type', '?')}{list(getattr(ref, 'shape', []))}, "
                f".metadata says {entry.element_type}{list(chunk.sizes)}",
                where=where,
            )
        storage = arch.storages.get(ref.storage.key)
        if storage is None:
            raise CorruptCheckpointError(f"record of {key!r} lacks its data", where=f"{self.file(chunk.location.relative_path).url} (key {key!r})")
        return ref, storage

    def _check(self, key: str, entry: TensorEntry) -> None:
        """Also: its records lie inside their files (so its declared size is backed by bytes present
        before anything is allocated for it)."""
        super()._check(key, entry)
        if isinstance(entry.chunks, load_index.RuleChunks):
            return  # (each rank's records are checked to lie in its file when its manifest file is read: _locate)
        for chunk in entry.chunks:
            self.reader(chunk.location.relative_path).check_range(chunk.location.offset, chunk.location.length)

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.entry(key, TensorEntry, checked=True)
        # every chunk the box needs, first: one the load index's rule makes is placed and checked against
        # its rank's file here, before anything is allocated for the box
        parts = list(entry.chunks_in(box if box is not None else whole(entry.shape)))
        entry, box, out = self._destination(key, box, out)
        for chunk, part in parts:
            dst = out[relative(part, box)]
            if self.checks is not None and not self.checks.done(chunk.location):
                straight = self.checks.straight(key, entry, chunk, part, dst)
                if straight is not None:
                    self.checks.read_chunk(key, entry, chunk, part, dst, straight)  # one pass: read into dst, checked there
                    continue
                if part != (chunk.offsets, chunk.sizes) and self.checks.read_blocks(key, entry, chunk, part, dst):
                    continue  # only the manifest blocks the part touches: read and checked
                if self.checks.read_part(key, entry, chunk, part, dst):  # the next part: checked as it goes by
                    continue
                self.checks.scan_chunk(key, entry, chunk)  # another part of the record: check it all first
            ref, storage = self.tensor_record(key, entry, chunk)
            where = f"{self.file(chunk.location.relative_path).url} (key {key!r})"
            local = tuple(s.start for s in relative(part, (chunk.offsets, chunk.sizes)))
            # read straight into the destination when its slice is contiguous (whole rows)
            read_tensor_box(self.record(chunk.location, key)[0], ref, storage, (local, part[1]), where, out=dst)
        return out

    def read_tensors(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Whole tensors, each into its ``out``: where every chunk of a tensor is a small record
        (:meth:`read_whole`) whose rows of ``out`` are contiguous (one chunk, or a chunk per rank's
        rows, as FSDP2 lays a tensor out), the records that lie back to back in a file are read in
        one read (up to LOCAL_SPAN, REMOTE_SPAN on an object store; one such run per file at a
        time) and each is taken from those bytes when its parse is one made before
        (``torchzip.known_record``) and it checks (:meth:`_from_record`). A tensor any of whose
        records is not taken so is read by :meth:`read_tensor` (from the spans held: not read
        again), which says what is wrong with one that does not check; so is any other tensor,
        after the runs before it (each file is read in its records' order)."""
        span_max = REMOTE_SPAN if self.location.batch_reads else LOCAL_SPAN
        files = self._run_files()
        runs: dict[str, list[tuple[str, TensorEntry, Any, torch.Tensor]]] = {}  # file -> its records back to back
        batch: list[tuple[str, torch.Tensor]] = []  # the tensors whose records the runs hold
        for key, out in items:
            entry = self.entry(key, TensorEntry, checked=True)  # (its records lie inside their files)
            pieces = self._pieces(entry, out)
            if pieces is None:
                self._read_runs(runs, batch)
                self.read_tensor(key, None, out=out)
                continue
            if not _extends(runs, pieces, span_max, files):  # (all its records join the runs, or none)
                self._read_runs(runs, batch)
                if not _extends(runs, pieces, span_max, files):  # (its own records are not back to back)
                    self.read_tensor(key, None, out=out)
                    continue
            for info, dst in pieces:
                runs.setdefault(info.relative_path, []).append((key, entry, info, dst))
            batch.append((key, out))
        self._read_runs(runs, batch)

    def _pieces(self, entry: TensorEntry, out: torch.Tensor) -> list[tuple[Any, torch.Tensor]] | None:
        """(record, the rows of ``out`` it holds) for each chunk of ``entry``, where each is a small
        plain record and its rows a contiguous part of ``out`` (of the entry's dtype and shape, on
        the CPU); else None."""
        if (out.dtype != entry.dtype or not out.is_contiguous() or out.device.type != "cpu"
                or tuple(out.shape) != tuple(entry.shape)):
            return None
        chunks = entry.chunks
        if len(chunks) == 1:
            info = chunks[0].location
            return [(info, out)] if not self.transformed(info) and self.read_whole(info) else None
        if not entry.shape or len(chunks) > self._run_files():
            return None
        pieces = []
        for chunk in chunks:
            info = chunk.location
            if self.transformed(info) or not self.read_whole(info) or any(chunk.offsets[1:]) \
                    or tuple(chunk.sizes[1:]) != tuple(entry.shape[1:]):
                return None
            rows = out[chunk.offsets[0]:chunk.offsets[0] + chunk.sizes[0]]
            if tuple(rows.shape) != tuple(chunk.sizes):
                return None
            pieces.append((info, rows))
        return pieces

    def _run_files(self) -> int:
        """The files whose runs :meth:`read_tensors` holds at once: the spans held (:meth:`_holding_in`)."""
        return 1 if self.location.batch_reads else LOCAL_HELD

    def _read_runs(self, runs: dict[str, list[tuple[str, TensorEntry, Any, torch.Tensor]]],
                   batch: list[tuple[str, torch.Tensor]]) -> None:
        """Read each run (a span of a file) and take its records; then the tensors of ``batch``
        with a record not taken, each on its own. Empties both."""
        left: set[str] = set()
        for run in runs.values():
            left.update(self._read_run(run))
        for key, out in batch:
            if key in left:
                self.read_tensor(key, None, out=out)
        runs.clear()
        batch.clear()

    def _read_run(self, run: list[tuple[str, TensorEntry, Any, torch.Tensor]]) -> list[str]:
        """The records of ``run`` (back to back in one file) from one read, each into its rows;
        returns the keys of those not taken (nothing was put for them)."""
        if not run:
            return []
        path, start, last = run[0][2].relative_path, run[0][2].offset, run[-1][2]
        span = self.read_span(path, start, last.offset + last.length - start)
        manifest = self.checks.manifest if self.checks is not None else None
        rows = manifest.rows_or_none_of(path) if manifest is not None else None
        left = []
        for key, entry, info, dst in run:
            record = span[info.offset - start: info.offset - start + info.length]
            if self._from_record(entry, info, record, dst, rows):
                continue
            if known_record(record) is None:  # the first of its layout: parsed (from the span held), then taken
                try:
                    self.archive(info, key)
                except CkptError:  # (said by read_tensor)
                    left.append(key)
                    continue
                if self._from_record(entry, info, record, dst, rows):
                    continue
            left.append(key)
        return left

    def _from_record(self, entry: TensorEntry, info: Any, record: memoryview, out: torch.Tensor,
                     rows: dict[int, tuple[int, str, Any]] | None) -> bool:
        """Put a small record's chunk of ``entry`` into ``out`` (its rows: contiguous, of the
        chunk's shape) from its bytes, read, where it checks as :meth:`RecordChecks.read_chunk`
        checks it (the manifest's digest of the record, else its data's CRC-32):
        :meth:`small_record`; returns whether it did (else nothing was put)."""
        checks = self.checks
        data = self.small_record(entry, info, record, rows, checks.block if checks is not None else 0,
                                 checks is not None and rows is None, tuple(out.shape))
        if data is None:
            return False
        if checks is not None:
            checks.mark_done(info)
        if out.numel():
            tensor_buffer(out)[:] = data
        return True

    @staticmethod
    def small_record(entry: TensorEntry, info: Any, record: memoryview, rows: dict[int, tuple[int, str, Any]] | None,
                     block: int, crc: bool, shape: tuple[int, ...] | None = None) -> memoryview | None:
        """The tensor data of a whole small record (``record``: its bytes, read) where its parse is
        the kept one of its length (``torchzip.known_record``), its tensor is ``entry``'s (its
        chunk of ``shape``, default the whole), in C order from its data's start, and it checks: against its row of the manifest (``rows``: its
        file's, by offset, ``block`` the manifest's; a record they do not hold does not check; None:
        no manifest) and, with ``crc`` where no row proves the data by its blocks, torch's CRC-32
        of the data; else None (nothing is said: the caller reads it on its own)."""
        known = known_record(record)
        if known is None:
            return None
        layout, stored = known
        ref = layout.obj
        shape = tuple(entry.shape) if shape is None else shape
        if (type(ref) is not TensorRef or ref.storage.key != layout.key or ref.element_type != entry.element_type
                or tuple(ref.shape) != shape or ref.storage_offset != 0 or not ref.is_contiguous()
                or layout.nbytes != math.prod(shape) * dtype_size(entry.element_type)
                or layout.data + layout.nbytes > len(record)):
            return None
        data = record[layout.data: layout.data + layout.nbytes]
        if rows is not None:
            row = rows.get(info.offset)
            if row is None or row[0] != info.length:
                return None
            hasher = RecordHasher(row[2], block)
            hasher.update(record)
            if hasher.hexdigest() != row[1]:
                return None
            crc = crc and not by_parts(row[2])
        if crc and crc32(data) != stored:
            return None
        return data

    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        entry = self.entry(key, TensorEntry)
        spans = []
        for chunk in entry.chunks:
            if self.transformed(chunk.location):
                raise FormatError(f"{key!r} is stored compressed: its data has no byte span in the file", where=self.location.url)
            _, storage = self.tensor_record(key, entry, chunk)
            spans.append((self.file(chunk.location.relative_path), storage.offset, storage.offset + storage.nbytes))
        return spans

    def read_object(self, key: str) -> Any:
        info = self.entry(key, ObjectEntry).location
        checked = self.checks.check_object(key, info) if self.checks is not None else None
        if checked is not None and not self.transformed(info):  # parsed from the bytes just checked: no second read
            return self.parse_object(key, checked)
        self.prefetch(info)
        reader, offset, length = self.record(info, key)
        return load_object_record(reader, offset, length, f"{self.file(info.relative_path).url} (object {key!r})")

    def parse_object(self, key: str, record: bytes) -> Any:
        """The value of object ``key`` from its (uncompressed) record's bytes, read and checked by
        the caller: the value comes from the very bytes the check proved."""
        where = f"{self.file(self.entry(key, ObjectEntry).location.relative_path).url} (object {key!r})"
        return load_object_record(BytesReader(record, where), 0, len(record), where)

    def _check_in_parts(self) -> None:
        if self.checks is not None:
            self.checks.in_parts = True

    def _settle(self) -> None:
        if self.checks is not None:
            self.checks.settle()

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._holding.clear()
        for d in self._decoded.values():
            d.close()
        self._decoded.clear()


def _within(ranges: list[list[int]], offset: int) -> bool:
    """Whether ``offset`` lies in one of the sorted, disjoint ``[start, end)`` ``ranges``."""
    at = bisect.bisect_right(ranges, [offset, float("inf")]) - 1
    return at >= 0 and ranges[at][0] <= offset < ranges[at][1]


def _add_range(ranges: list[list[int]], start: int, end: int) -> None:
    """Add ``[start, end)`` to the sorted, disjoint ``ranges``, merging it with those it touches."""
    at = bisect.bisect_left(ranges, [start, start])
    if at > 0 and ranges[at - 1][1] >= start:
        at -= 1
    while at < len(ranges) and ranges[at][0] <= end:
        start, end = min(start, ranges[at][0]), max(end, ranges[at][1])
        del ranges[at]
    ranges.insert(at, [start, end])
