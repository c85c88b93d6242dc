"""Checking every DCP record a read touches, once: the manifest's xxh3 of the whole record when the
step has one (it covers the CRC-32's bytes and the record's headers, at four times the speed), else
torch's CRC-32 of the record's tensor data. ``.metadata`` is checked against the manifest too.

Loads, and offline reads of a whole chunk into contiguous memory of its dtype (a convert's usual
case), read a record straight into its destination and check it there (one pass). An offline read
that takes a record in consecutive parts, in byte order (a reshard's row ranges), checks it as the
parts go by once the caller allowed it (``Source.checked_in_parts``): one pass again, the check complete at
the last part, and the caller settles every check before its commit. Other reads scan a record
before its first use (a second pass over its bytes). A mismatch is a :class:`ChecksumError` naming
the key, file and rank.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from ...buffers import SlabBuffers, tensor_buffer
from ...checksums import (DIGEST_CHARS, HASH_BLOCK, RecordHasher, block_count, crc32, hash_range, new_block, new_hasher,
                          scan)
from ...errors import ChecksumError
from ...index import Chunk, TensorEntry, dtype_size
from ...layout import Box, relative
from ..torchzip import check_ref
from .manifest import Manifest, check_crc
from .metadata import METADATA_FILE

if TYPE_CHECKING:
    import torch


class RecordSource(Protocol):
    """What the checks need of the reader whose records they check (the DCP source): where each
    record's bytes are, and what ``.metadata`` hashed to."""

    location: Any
    metadata_size: int
    metadata_digest: str

    def file(self, relative_path: str) -> Any: ...
    def reader(self, relative_path: str) -> Any: ...
    def record(self, info: Any, key: str) -> tuple[Any, int, int]: ...
    def tensor_record(self, key: str, entry: TensorEntry, chunk: Chunk, by_layout: bool = False) -> tuple[Any, Any]: ...
    def confirm(self, key: str, entry: TensorEntry, chunk: Chunk) -> None: ...
    def transformed(self, info: Any) -> bool: ...
    def record_bytes(self, info: Any, offset: int, length: int) -> bytes: ...
    def read_data(self, info: Any, storage: Any, data: memoryview) -> None: ...
    def prefetch(self, info: Any) -> None: ...

class _Stream:
    """The check of a record being read in consecutive parts: the next data byte it expects and
    the running checksum (the manifest's hasher, fed the record's header first, or CRC-32)."""

    __slots__ = ("key", "entry", "chunk", "next", "hasher", "crc")

    def __init__(self, key: str, entry: TensorEntry, chunk: Chunk, hasher: Any):
        self.key, self.entry, self.chunk = key, entry, chunk
        self.next = 0
        self.hasher = hasher
        self.crc = 0


def _byte_range(part: Box, chunk: Chunk, item: int) -> tuple[int, int, list[int]]:
    """[lo, hi) bytes of ``part`` in its chunk's C-order record (the bytes from its first
    element to its last), with the record's strides in elements."""
    rel = relative(part, (chunk.offsets, chunk.sizes))
    strides = [math.prod(chunk.sizes[i + 1:]) for i in range(len(chunk.sizes))]
    first = sum(sl.start * st for sl, st in zip(rel, strides))
    last = sum((sl.stop - 1) * st for sl, st in zip(rel, strides))
    return first * item, (last + 1) * item, strides


def _plain(ref: Any, storage: Any, dst: torch.Tensor, numel: int) -> bool:
    """Whether a record's bytes are ``numel`` C-order elements from its start, and ``dst`` is
    contiguous CPU memory of its dtype: bytes read from the record can land in ``dst`` as they are."""
    return (dst.device.type == "cpu" and dst.dtype == ref.dtype and dst.is_contiguous() and ref.is_contiguous()
            and ref.storage_offset == 0 and storage.nbytes == numel * dtype_size(ref.dtype))


class RecordChecks:
    """The checks of one reader: which records were checked, and the manifest to check them against."""

    def __init__(self, source: RecordSource, manifest: dict[str, Any] | None, rank: int | None = None):
        # (a proxy: the source holds its checks; a cycle would leave the source's whole index, one
        # object graph per record, to the cyclic collector: 45 ms after a convert of 5,000 records)
        self.source = weakref.proxy(source)
        self.on = f" on rank {rank}" if rank is not None else ""
        self.manifest: Manifest | None = None
        self._done: set[tuple[str, int]] = set()
        self._streams: dict[tuple[str, int], _Stream] = {}
        self.in_parts = False  # set inside Source.checked_in_parts: see the module's docstring
        self._scratch = SlabBuffers(1)
        self._block: memoryview | None = None
        self.block = HASH_BLOCK
        self._rest_ok: set[tuple[str, int]] = set()  # records whose bytes around the data were checked
        self.manifest = Manifest.of(manifest, source.location)[0]
        if self.manifest is not None:
            self.block = self.manifest.block
            if getattr(source, "metadata_read", True):  # (a reader of the load index may never read it)
                self.check_metadata()

    def check_metadata(self) -> None:
        """``.metadata`` as read against the manifest's size and digest of it."""
        if self.manifest is None:
            return
        source = self.source
        finding = self.manifest.check_metadata(source.metadata_size, source.metadata_digest, source.location.child(METADATA_FILE).url)
        if finding is not None:
            raise finding.error(None, self.on)

    def done(self, info: Any) -> bool:
        return (info.relative_path, info.offset) in self._done

    def mark_done(self, info: Any) -> None:
        """A record checked by its reader (a run of small records read together: the source's
        ``read_tensors``), as :meth:`read_chunk` checks it."""
        self._done.add((info.relative_path, info.offset))

    def scan_chunk(self, key: str, entry: TensorEntry, chunk: Chunk) -> None:
        """Read a chunk's record once for its checksums (before an offline read uses it)."""
        source, info = self.source, chunk.location
        ref, storage = source.tensor_record(key, entry, chunk)
        if self._block is None:
            self._block = new_block()
        if self.manifest is None:  # torch's CRC-32 of the (decoded) record's tensor data
            reader = source.record(info, key)[0]
            self._compare_crc(key, chunk, scan(reader, storage.offset, storage.nbytes, self._block), storage.crc32)
        else:  # the manifest's hash of the record as stored (compressed or not)
            self._compare_digest(key, info, hash_range(source.reader(info.relative_path), info.offset, info.length, self._block,
                                                       self._extra(info), self.block))
        self._done.add((info.relative_path, info.offset))
        self._streams.pop((info.relative_path, info.offset), None)

    def read_part(self, key: str, entry: TensorEntry, chunk: Chunk, part: Box, dst: torch.Tensor) -> bool:
        """With ``in_parts``: when ``part`` of a plain record is the byte range that follows what
        was read of it so far (rows of a row-major record, into contiguous memory of its dtype),
        read it into ``dst``, feed it to the record's running check, and finish the check at the
        record's last byte; returns whether it did (else the caller scans the record)."""
        source, info = self.source, chunk.location
        if not self.in_parts or source.transformed(info) or not chunk.sizes:
            return False
        ref, storage = source.tensor_record(key, entry, chunk)
        item = dtype_size(ref.dtype)
        local = [o - c for o, c in zip(part[0], chunk.offsets)]
        row = math.prod(chunk.sizes[1:]) * item
        if not (_plain(ref, storage, dst, math.prod(chunk.sizes)) and dst.numel() > 0
                and all(o == 0 for o in local[1:]) and tuple(part[1][1:]) == tuple(chunk.sizes[1:])):
            return False
        name = (info.relative_path, info.offset)
        stream = self._streams.get(name)
        if local[0] * row != (stream.next if stream is not None else 0):
            return False  # not the next bytes: the caller scans the whole record
        where = f"{source.file(info.relative_path).url} (key {key!r}, chunk at {list(chunk.offsets)})"
        check_ref(ref, storage, where)
        reader = source.record(info, key)[0]
        if stream is None:
            stream = self._streams[name] = _Stream(key, entry, chunk, self._hasher(info) if self.manifest is not None else None)
            if stream.hasher is not None:
                stream.hasher.update(source.record_bytes(info, info.offset, storage.offset - info.offset))
        data = tensor_buffer(dst)
        reader.readinto(storage.offset + stream.next, data)
        if stream.hasher is not None:
            stream.hasher.update(data)
        else:
            stream.crc = crc32(data, stream.crc)
        stream.next += len(data)
        if stream.next == storage.nbytes:
            del self._streams[name]
            if stream.hasher is None:
                self._compare_crc(key, chunk, stream.crc, storage.crc32)
            else:
                end = storage.offset + storage.nbytes
                stream.hasher.update(source.record_bytes(info, end, info.offset + info.length - end))
                self._compare_digest(key, info, stream.hasher.hexdigest())
            self._done.add(name)
        return True

    def settle(self) -> None:
        """Complete the checks of records read in parts but not to their end: scan each whole."""
        for stream in list(self._streams.values()):
            self.scan_chunk(stream.key, stream.entry, stream.chunk)
        self._streams.clear()

    def straight(self, key: str, entry: TensorEntry, chunk: Chunk, part: Box, dst: torch.Tensor) -> tuple[Any, Any] | None:
        """The (reference, storage) of ``chunk``'s record when :meth:`read_chunk` reads it straight
        into ``dst`` (``part`` is the whole chunk, ``dst`` contiguous CPU memory of the stored dtype
        and the record's exact size), else None."""
        record = self.source.tensor_record(key, entry, chunk, by_layout=True)
        return record if part == (chunk.offsets, chunk.sizes) and _plain(record[0], record[1], dst, dst.numel()) else None

    def read_chunk(self, key: str, entry: TensorEntry, chunk: Chunk, part: Box, dst: torch.Tensor,
                   straight: tuple[Any, Any] | None = None) -> None:
        """Read the whole record of ``chunk`` once, check it, and copy ``part`` of it into ``dst``:
        straight into ``dst`` when :meth:`straight` says so (``straight``: what the caller's call of
        it returned, not None; else asked here), else through a scratch buffer of the record."""
        import torch

        source, info = self.source, chunk.location
        # (a large record of a ckpttool step by its manifest's layout: head, data, rest read in file
        # order, then parsed from them: source.confirm)
        if straight is None:
            straight = self.straight(key, entry, chunk, part, dst)
            ref, storage = straight or source.tensor_record(key, entry, chunk, by_layout=True)
        else:
            ref, storage = straight
        check_ref(ref, storage, f"{source.file(info.relative_path).url} (key {key!r}, chunk at {list(chunk.offsets)})")
        reader = source.record(info, key)[0]
        packed = source.transformed(info)
        item = dtype_size(ref.dtype)
        if not straight and self.read_blocks(key, entry, chunk, part, dst):
            return  # only the blocks the part touches were read, and each of them checked
        if straight:  # the common case: a rank loads the very shard it saved
            data = tensor_buffer(dst)
        else:
            raw = self._scratch.view((storage.nbytes,), torch.uint8, 0)
            data = tensor_buffer(raw)
        if packed:
            reader.readinto(storage.offset, data)
        else:  # (with the record's head and rest in the same read where its parse has not read them)
            source.read_data(info, storage, data)
        if not straight:
            full = raw[: storage.nbytes // item * item].view(ref.dtype).as_strided(ref.shape, ref.stride, ref.storage_offset)
            dst.copy_(full[relative(part, (chunk.offsets, chunk.sizes))])
        if self.manifest is None:
            self._compare_crc(key, chunk, crc32(data), storage.crc32)
        elif packed:  # the manifest hashed the compressed bytes: hash them as stored, and check the CRC too
            if self._block is None:
                self._block = new_block()
            self._compare_digest(key, info, hash_range(source.reader(info.relative_path), info.offset, info.length, self._block,
                                                       self._extra(info), self.block))
            self._compare_crc(key, chunk, crc32(data), storage.crc32)
        else:
            h = self._hasher(info)  # the record's head and tail as its parse (or read_data) read them: not read again
            h.update(source.record_bytes(info, info.offset, storage.offset - info.offset))
            h.update(data)
            end = storage.offset + storage.nbytes
            h.update(source.record_bytes(info, end, info.offset + info.length - end))
            self._compare_digest(key, info, h.hexdigest())
        source.confirm(key, entry, chunk)
        self._done.add((info.relative_path, info.offset))

    def read_blocks(self, key: str, entry: TensorEntry, chunk: Chunk, part: Box, dst: torch.Tensor) -> bool:
        """When the manifest has block digests for ``chunk``'s record (a plain C-order record written
        by ckpttool): read only the blocks of its data that ``part`` touches (the part's bytes straight
        into ``dst`` when they are one range and ``dst`` is contiguous CPU memory of the dtype, else the
        blocks into a scratch buffer), check each block and, once per record, the bytes around the data
        (headers, pickle), then put ``part`` into ``dst``. Returns whether it did; the record is marked
        checked only where the part read all of its blocks."""
        import torch

        source, info = self.source, chunk.location
        row = None
        if self.manifest is not None:
            rows, finding = self.manifest.rows_of(info.relative_path)
            if finding is not None:
                raise finding.error(key, self.on)
            row = rows.get(info.offset)
        if row is None or row[2] is None or source.transformed(info) or not chunk.sizes:
            return False
        ref, storage = source.tensor_record(key, entry, chunk, by_layout=True)  # (confirmed once read: source.confirm)
        url = source.file(info.relative_path).url
        check_ref(ref, storage, f"{url} (key {key!r}, chunk at {list(chunk.offsets)})")
        item = dtype_size(ref.dtype)
        data_start, nbytes = row[2]["data"]
        digests: str = row[2]["blocks"]
        block = self.block
        if (row[0] != info.length or info.offset + data_start != storage.offset or nbytes != storage.nbytes
                or not ref.is_contiguous() or ref.storage_offset != 0 or nbytes != math.prod(chunk.sizes) * item
                or len(digests) != DIGEST_CHARS * block_count(nbytes, block)):
            raise ChecksumError(f"record of {key!r} at byte {info.offset} is not laid out as the manifest written at "
                                f"commit says{self.on}", where=url, hint="the file or its .metadata changed after the save")
        reader = source.record(info, key)[0]
        name = (info.relative_path, info.offset)
        if name not in self._rest_ok:  # the record's head before its blocks (file order); its check after them
            source.record_bytes(info, info.offset, storage.offset - info.offset)
        lo, hi, strides = _byte_range(part, chunk, item)
        blo, bhi = lo // block * block, min(-(-hi // block) * block, nbytes)
        base = storage.offset
        raw = None
        if hi - lo == dst.numel() * item and _plain(ref, storage, dst, math.prod(chunk.sizes)):
            # one byte range: read it into dst, and only the rest of its first and last blocks beside it
            head, body, tail = memoryview(bytearray(lo - blo)), tensor_buffer(dst), memoryview(bytearray(bhi - hi))
            reader.readinto_parts(base + blo, [head, body, tail])  # (one read)
            pieces = [(blo, head), (lo, body), (hi, tail)]
        else:
            raw = self._scratch.view((bhi - blo,), torch.uint8, 0)
            pieces = [(blo, tensor_buffer(raw))]
            reader.readinto(base + blo, pieces[0][1])
        self._check_blocks(key, chunk, url, pieces, blo, bhi, digests)
        self._check_rest(key, info, storage, row[2]["rest"])
        source.confirm(key, entry, chunk)
        if blo == 0 and bhi == nbytes:  # every block of it read and checked (a reshard's part of a small record)
            self._done.add(name)  # (its other parts are read without a check)
            self._streams.pop(name, None)
        if raw is not None:
            whole = raw[: (bhi - blo) // item * item].view(ref.dtype)
            dst.copy_(whole.as_strided(part[1], strides, (lo - blo) // item))
        return True

    def _check_rest(self, key: str, info: Any, storage: Any, expected: str) -> None:
        """The manifest's digest of a record's bytes around its data (zip headers, pickle), once
        (the bytes its parse read: not read again)."""
        name = (info.relative_path, info.offset)
        if name in self._rest_ok:
            return
        h = new_hasher()
        h.update(self.source.record_bytes(info, info.offset, storage.offset - info.offset))
        end = storage.offset + storage.nbytes
        h.update(self.source.record_bytes(info, end, info.offset + info.length - end))
        if h.hexdigest() != expected:
            raise ChecksumError(f"the headers of the record of {key!r} at byte {info.offset} do not match the manifest's "
                                f"checksum{self.on}", where=self.source.file(info.relative_path).url,
                                hint="the bytes changed after the save committed; restore the file or use another step")
        self._rest_ok.add(name)

    def _check_blocks(self, key: str, chunk: Chunk, url: str, pieces: list[tuple[int, memoryview]], lo: int, hi: int,
                      digests: str) -> None:
        """Check the blocks covering data bytes ``[lo, hi)`` (block-aligned, or the data's end),
        whose bytes are ``pieces``: (data offset, bytes) back to back."""
        block = self.block
        at = 0  # index into pieces
        for k in range(lo // block, -(-hi // block)):
            a, b = k * block, min((k + 1) * block, hi)
            h = new_hasher()
            while a < b:
                start, view = pieces[at]
                end = start + len(view)
                if a >= end:
                    at += 1
                    continue
                take = min(b, end)
                h.update(view[a - start:take - start])
                a = take
            if h.hexdigest() != digests[k * DIGEST_CHARS:(k + 1) * DIGEST_CHARS]:
                raise ChecksumError(f"tensor data of {key!r} (chunk at {list(chunk.offsets)}), block {k} (data bytes "
                                    f"{k * block}-{min((k + 1) * block, hi)}), does not match the manifest's checksum{self.on}",
                                    where=url,
                                    hint="the bytes changed after the save committed; restore the file or use another step")

    def check_object(self, key: str, info: Any) -> bytes | None:
        """The manifest's hash of an object's record (its pickle's CRC-32 is checked as it is read):
        the record's bytes once checked, for the caller to unpickle (one read, and the very bytes
        the hash proved), or None where nothing was read here."""
        if self.manifest is None or self.done(info):
            return None
        h = self._hasher(info)
        self.source.prefetch(info)
        data = self.source.reader(info.relative_path).read(info.offset, info.length)
        h.update(data)
        self._compare_digest(key, info, h.hexdigest())
        self._done.add((info.relative_path, info.offset))
        return data

    def _extra(self, info: Any) -> Any:
        """The fourth element of the manifest's row of the record at ``info`` (None: a row of three,
        or a record the manifest does not know, whose comparison then names it)."""
        row = self.manifest.rows_of(info.relative_path)[0].get(info.offset)
        return row[2] if row is not None else None

    def _hasher(self, info: Any) -> RecordHasher:
        """The hasher of the record at ``info`` as its manifest row defines its digest."""
        return RecordHasher(self._extra(info), self.block)

    def _compare_crc(self, key: str, chunk: Chunk, crc: int, stored: int) -> None:
        if crc == stored:
            return  # (the common case, once per record read: no file URL built for it)
        raise check_crc(chunk.offsets, crc, stored, self.source.file(chunk.location.relative_path).url).error(key, self.on)

    def _compare_digest(self, key: str, info: Any, digest: str) -> None:
        finding = self.manifest.check_digest(info, digest, self.source.file(info.relative_path).url)
        if finding is not None:
            raise finding.error(key, self.on)
