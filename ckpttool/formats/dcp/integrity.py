"""DCP's part of ``verify``: files present, records inside them, chunks tiling each shape, records
decoding to what ``.metadata`` says, torch's CRC-32 of the tensor data, and ckpttool's manifest.

Each record is read once for both checksums (CRC-32 over its tensor data, the manifest's xxh3 over
the whole record), so a cold verify reads each byte from disk once.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from ...checksums import RecordHasher, by_parts, hash_range, new_block, scan
from ...errors import CkptError, UnsafePickleError
from ...index import TensorEntry, dtype_size
from ...layout import tiles_exactly
from ...report import Report
from ...steps import read_commit_record
from ..base import Progress
from .manifest import Finding, Manifest, check_crc
from .load_index import INDEX_FILE
from .metadata import METADATA_FILE
from .source import LOCAL_HELD, LOCAL_SPAN, DcpSource

def check_integrity(source: DcpSource, report: Report, only: str | None, progress: Progress | None,
                    share: tuple[int, int] | None = None) -> list[tuple[int, Report]] | None:
    """With ``share`` (worker, workers) the checks are split between workers: those of the whole
    checkpoint (manifest, files) are worker 0's, and each worker checks the entries whose position
    falls in its share (contiguous runs of entries of about equal bytes, so each reads on through
    its files); what it finds about entry ``i`` is returned as ``(i, Report)`` in order, for
    worker 0 to put back in the order one process finds it."""
    segments: list[tuple[int, Report]] | None = None
    whole = report
    if share is not None:
        segments = []
        if share[0] != 0:
            whole = Report(report.path, report.kind)  # found by worker 0 as well: reported once
    by_index = source.read_by_metadata()  # (the walk below is .metadata's; the load index is compared with it)
    manifest = _load_manifest(source, whole)  # first: it says whether .metadata itself is the one saved
    index = source.index()
    source.will_read(None)  # every record (a share: those of its entries; a span's neighbours may be another's)
    if by_index is not None and (share is None or share[0] == 0):
        _compare_load_index(source, by_index, index, whole)
    keys = index.under(only)
    sizes: dict[str, int | None] = {}
    for name in source.files():
        loc = source.file(name)
        sizes[name] = loc.size() if loc.exists() else None
        if sizes[name] is None:
            lost = sorted(k for k in index if name in _files_of(index[k]))
            whole.add("data file is missing", loc.url, lost[0] if lost else None,
                       hint=f"{len(lost)} entries lose their data; restore the file")
    buf = new_block()
    total = sum(index[k].nbytes for k in keys if isinstance(index[k], TensorEntry))
    done = 0
    owners = split_by_bytes([index[k].nbytes if isinstance(index[k], TensorEntry) else 0 for k in keys], share[1]) if share else []
    small = _SmallRuns(source, manifest, index, [k for i, k in enumerate(keys) if share is None or owners[i] == share[0]])
    for position, key in enumerate(keys):
        if share is not None:
            if owners[position] != share[0]:
                continue
            report = Report(whole.path, whole.kind)
            segments.append((position, report))
        entry = index[key]
        infos = [c.location for c in entry.chunks] if isinstance(entry, TensorEntry) else [entry.location]
        if not _records_inside_files(source, key, infos, sizes, report):
            continue
        if isinstance(entry, TensorEntry):
            gap = tiles_exactly(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
            if gap:
                report.add(f"chunks do not tile the shape {list(entry.shape)}: {gap}", source.location.child(METADATA_FILE).url,
                           key, hint="the .metadata is inconsistent; the checkpoint cannot be trusted")
            for chunk in entry.chunks:
                if not small.checked(entry, chunk):
                    _check_chunk(source, key, entry, chunk, manifest, report, buf)
            report.checked_tensor(entry.nbytes)
            done += entry.nbytes
            if progress:
                progress(done, total, key)
        else:
            _check_object(source, key, entry.location, manifest, report, buf)
    return segments


def _compare_load_index(source: DcpSource, by_index: Any, index: Any, report: Report) -> None:
    """The step's load index (what loads read) says what ``.metadata`` says, entry by entry: the
    same keys in the same order, paths, shapes, dtypes, and every chunk at the same record."""
    url = source.location.child(INDEX_FILE).url
    hint = "loads read the load index: the step cannot be trusted; load an earlier one"
    if isinstance(by_index, CkptError):
        report.add(f"load index cannot be read: {by_index.what}", by_index.where, None, hint=by_index.hint)
        return
    if list(by_index) != list(index):
        report.add("load index lists other keys than .metadata, or in another order", url, None, hint=hint)
        return

    def described(ix: Any, key: str) -> Any:
        entry = ix[key]
        if isinstance(entry, TensorEntry):
            # (empty chunks hold nothing: .metadata written from fragments under FSDP2's rule lists
            # none, the index makes one for every rank past the rows)
            return (ix.path(key), entry.shape, entry.element_type, [
                (c.offsets, c.sizes, c.location.relative_path, c.location.offset, c.location.length,
                 list(c.location.transform_descriptors or ())) for c in entry.chunks if c.numel])
        info = entry.location
        return ix.path(key), info.relative_path, info.offset, info.length, list(info.transform_descriptors or ())

    for key in index:
        try:
            same = described(by_index, key) == described(index, key)
        except CkptError as exc:  # (a rank's manifest file that does not say where its records are)
            report.add(f"load index cannot be read: {exc.what}", exc.where, key, hint=exc.hint)
            return
        if not same:
            report.add("load index does not say what .metadata says", url, key, hint=hint)


def split_by_bytes(sizes: list[int], workers: int) -> list[int]:
    """The worker of each item: contiguous runs of about ``sum(sizes) / workers`` bytes each (an
    item goes to the worker whose run its first byte falls in; items of no bytes count as one)."""
    sizes = [max(1, s) for s in sizes]
    total = sum(sizes)
    owners, start = [], 0
    for size in sizes:
        owners.append(min(workers - 1, start * workers // total))
        start += size
    return owners


def _records_inside_files(source: DcpSource, key: str, infos: list[Any], sizes: dict[str, int | None], report: Report) -> bool:
    ok = True
    for info in infos:
        size = sizes.get(info.relative_path)
        if size is None:
            ok = False
        elif info.offset < 0 or info.offset + info.length > size:
            report.add(f"record at bytes {info.offset}..{info.offset + info.length} lies past the end of the file ({size} bytes)",
                       source.file(info.relative_path).url, key, hint="the file is truncated; restore it from a good copy")
            ok = False
    return ok


def _files_of(entry: Any) -> set[str]:
    if isinstance(entry, TensorEntry):
        return {c.location.relative_path for c in entry.chunks}
    return {entry.location.relative_path}


def _load_manifest(source: DcpSource, report: Report) -> Manifest | None:
    """The manifest of the step's commit record, when ckpttool wrote one (a damaged record is a
    problem, never a reason to skip the check silently)."""
    try:
        record = read_commit_record(source.location)
    except CkptError as exc:
        report.add(exc.what, exc.where, hint=exc.hint)
        return None
    manifest, note = Manifest.of((record or {}).get("manifest"), source.location)
    if note:
        report.note(note)
    if manifest is not None:
        _add(report, manifest.check_metadata(source.metadata_size, source.metadata_digest,
                                             source.location.child(METADATA_FILE).url), None)
    return manifest


def _add(report: Report, finding: Finding | None, key: str | None) -> None:
    if finding is not None:
        report.add(finding.message(), finding.where, key, finding.hint)


def _manifest_row(manifest: Manifest | None, info: Any, url: str, key: str, report: Report) -> Any:
    """The manifest's row of this record; reports a record the manifest does not know."""
    if manifest is None:
        return None
    row, finding = manifest.row(info, url)
    _add(report, finding, key)
    return row


def _compare_digest(manifest: Manifest, digest: str, info: Any, url: str, key: str, report: Report) -> None:
    _add(report, manifest.check_digest(info, digest, url), key)


def _check_object(source: DcpSource, key: str, info: Any, manifest: Manifest | None, report: Report, buf: memoryview) -> None:
    url = source.file(info.relative_path).url
    row = _manifest_row(manifest, info, url, key, report)
    try:
        if row is not None and not source.transformed(info):  # read once: hashed, then unpickled from the same bytes
            source.prefetch(info)
            record = source.reader(info.relative_path).read(info.offset, info.length)
            hasher = RecordHasher(row[2], manifest.block)
            hasher.update(record)
            _compare_digest(manifest, hasher.hexdigest(), info, url, key, report)
            source.parse_object(key, record)
        else:
            if row is not None:
                _compare_digest(manifest, hash_range(source.reader(info.relative_path), info.offset, info.length, buf, row[2],
                                                     manifest.block), info, url, key, report)
            source.read_object(key)
        report.objects_checked += 1
    except UnsafePickleError as exc:  # a value ckpttool refuses to read: unreadable input, not damage
        report.add(exc.what, exc.where or url, key, exc.hint, unreadable=True)
    except CkptError as exc:
        report.add(exc.what, exc.where or url, key, exc.hint)


class _SmallRuns:
    """The small records (a chunk's, read whole: ``DcpSource.read_whole``) of the keys checked,
    checked a run at a time: the records that lie back to back in a file from the one the
    walk meets, up to LOCAL_SPAN, in one read, each checked from those bytes where its parse is the
    kept one of its length (``DcpSource.small_record``: the manifest's digest, torch's CRC-32 where
    no digest of its blocks proves the data). A record that does not pass ends its run and is
    checked on its own (``_check_chunk``, which says what is wrong with it; its parse then becomes
    the kept one), as is every other record."""

    def __init__(self, source: DcpSource, manifest: Manifest | None, index: Any, keys: list[str]):
        self.source, self.manifest = source, manifest
        self.small: dict[tuple[str, int], tuple[TensorEntry, Any]] = {}  # record -> (entry, chunk) it is examined as
        offsets: dict[str, list[int]] = {}
        for key in keys:
            entry = index[key]
            # (a tensor of a few ranks' chunks: one a rank of a large job's is checked on its own, and
            # its chunks are not held here, so many as the job has ranks)
            if not isinstance(entry, TensorEntry) or len(entry.chunks) > LOCAL_HELD:
                continue
            for chunk in entry.chunks:
                info = chunk.location
                if not source.transformed(info) and source.read_whole(info):
                    name = (info.relative_path, info.offset)
                    if name not in self.small:
                        offsets.setdefault(info.relative_path, []).append(info.offset)
                    self.small[name] = (entry, chunk)
        self.offsets = {name: sorted(found) for name, found in offsets.items()}
        self.examined: set[tuple[str, int]] = set()
        self.ok: set[tuple[str, int]] = set()

    def checked(self, entry: TensorEntry, chunk: Any) -> bool:
        """Whether ``chunk``'s record was checked here as that chunk of ``entry``'s, and passed (a
        record that a damaged ``.metadata`` gives two keys, or two chunks, is this walk's for one of
        them only)."""
        name = (chunk.location.relative_path, chunk.location.offset)
        got = self.small.get(name)
        if got is None or got[0] is not entry or (got[1].offsets, got[1].sizes) != (chunk.offsets, chunk.sizes):
            return False
        if name not in self.examined:
            try:
                self._examine(*name)
            except (CkptError, OSError):  # (a file missing or cut short: each record's own check says so)
                self.examined.add(name)
        return name in self.ok

    def _examine(self, path: str, start: int) -> None:
        offsets, reader = self.offsets[path], self.source.reader(path)
        size, end, run = reader.size(), start, []
        for at in offsets[bisect.bisect_left(offsets, start):]:
            entry, chunk = self.small[(path, at)]
            info = chunk.location
            if (at != end or (path, at) in self.examined or at + info.length > size
                    or at + info.length - start > LOCAL_SPAN):
                break
            run.append((entry, chunk))
            end = at + info.length
        if not run:
            self.examined.add((path, start))
            return
        span = self.source.read_span(path, start, end - start)
        manifest = self.manifest
        rows, block = (manifest.rows_or_none_of(path), manifest.block) if manifest is not None else (None, 0)
        for entry, chunk in run:
            info = chunk.location
            name = (path, info.offset)
            self.examined.add(name)
            record = span[info.offset - start: info.offset - start + info.length]
            if self.source.small_record(entry, info, record, rows, block, True, tuple(chunk.sizes)) is None:
                return  # (checked on its own when the walk meets it; the next one starts a run)
            self.ok.add(name)


def _hash_by_layout(source: DcpSource, info: Any, extra: dict, buf: memoryview, hasher: RecordHasher) -> list[tuple[int, bytes]]:
    """Feed a record hashed by parts to ``hasher`` as its manifest row lays it out (its head, its
    data in ``buf``-sized reads, its rest: in file order); returns the head and the rest, from
    which the record is then parsed (its zip directory and pickle lie after its data)."""
    source.prefetch(info)
    reader = source.reader(info.relative_path)
    start, nbytes = extra["data"]  # (inside the record: the manifest's rows are checked as they are read)
    end = info.offset + start + nbytes
    head = reader.read(info.offset, start)
    hasher.update(head)
    scan(reader, info.offset + start, nbytes, buf, crc_span=(end, end), hasher=hasher)
    rest = reader.read(end, info.offset + info.length - end)
    hasher.update(rest)
    return [(info.offset, head), (end, rest)]


def _check_chunk(source: DcpSource, key: str, entry: TensorEntry, chunk: Any, manifest: Manifest | None, report: Report,
                 buf: memoryview) -> None:
    """Decode the chunk's record header, then read the record once for its CRC-32 and manifest hash."""
    info = chunk.location
    url = source.file(info.relative_path).url
    row = _manifest_row(manifest, info, url, key, report)
    hasher = RecordHasher(row[2], manifest.block) if row is not None else None
    try:
        laid = None  # (a record hashed by parts: read and hashed in file order first, then parsed from its head and rest)
        if hasher is not None and by_parts(row[2]) and not source.transformed(info) and not source.read_whole(info):
            laid = _hash_by_layout(source, info, row[2], buf, hasher)
        arch = source.archive(info, key, spans=laid)
        ref = arch.obj
        if not hasattr(ref, "shape") or tuple(ref.shape) != tuple(chunk.sizes) or getattr(ref, "element_type", None) != entry.element_type:
            report.add(f"record at byte {info.offset} holds {getattr(ref, 'element_type', type(ref).__name__)}"
                       f"{list(getattr(ref, 'shape', []))}, .metadata says {entry.element_type}{list(chunk.sizes)}", url, key)
            return
        storage = arch.storages.get(ref.storage.key)
        item = dtype_size(ref.element_type)
        need = (ref.storage_offset + math.prod(ref.shape)) * item if ref.shape else item
        if storage is None or storage.nbytes < need:
            report.add("record's data is shorter than its tensor", url, key)
            return
        if laid is not None:
            start, nbytes = row[2]["data"]
            if (storage.offset != info.offset + start or storage.nbytes != nbytes or not ref.is_contiguous()
                    or ref.storage_offset != 0):
                report.add(f"record at byte {info.offset} is not laid out as the manifest written at commit says", url, key,
                           "the file or its .metadata changed after the save")
                return
            crc = 0  # (a record hashed by parts carries no CRC-32: its digests prove it)
        elif source.transformed(info):  # the manifest covers the compressed bytes, the CRC-32 the decoded record
            if hasher is not None:
                _compare_digest(manifest, hash_range(source.reader(info.relative_path), info.offset, info.length, buf, row[2],
                                                     manifest.block), info, url, key, report)
                hasher = None
            crc = scan(source.record(info, key)[0], storage.offset, storage.nbytes, buf)
        elif hasher is not None:
            crc = scan(source.reader(info.relative_path), info.offset, info.length, buf,
                       crc_span=(storage.offset, storage.offset + storage.nbytes), hasher=hasher)
        else:
            crc = scan(source.reader(info.relative_path), storage.offset, storage.nbytes, buf)
        proven = row is not None and by_parts(row[2])  # a record hashed by parts carries no CRC-32: its digests prove it
        unknown = manifest is not None and row is None and not storage.crc32  # nor may one whose row is missing (said)
        if not (proven or unknown):
            _add(report, check_crc(chunk.offsets, crc, storage.crc32, url), key)
        if hasher is not None:
            _compare_digest(manifest, hasher.hexdigest(), info, url, key, report)
    except CkptError as exc:
        report.add(exc.what, exc.where or url, key, exc.hint)
    except Exception as exc:  # noqa: BLE001 - a corrupt record must be reported, never crash the check
        report.add(f"cannot decode the record at byte {info.offset}: {type(exc).__name__}: {exc}", url, key)
