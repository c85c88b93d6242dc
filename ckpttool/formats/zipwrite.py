"""A stored (uncompressed) zip archive written front to back, entry by entry, with ckpttool's CRC-32.

Every ``torch.save`` archive ckpttool writes (a DCP record, a ``.pt`` file) is a zip of stored
entries. ``zipfile`` hashes each entry's data with zlib's CRC-32, which the CPU of a save then
spends most of its time in; this writer takes :func:`ckpttool.checksums.crc32` (ISA-L's where
installed, several times faster: docs/benchmarks.md) and writes the
bytes ``zipfile`` writes for the same entries: the local header (``ZipInfo.FileHeader``, zipfile's
public encoder), the data, then the sizes and CRC in a data descriptor when the stream cannot seek
back (or, when it can, in the header rewritten in place; an entry whose data is in memory whole,
:meth:`ZipOut.put`, gets its header once, its CRC-32 known), and at the end the central directory and
the end records (zip64 ones where an offset, size or count needs them). ``tests/unit/test_zipwrite.py``
compares the bytes with ``zipfile``'s.
"""

from __future__ import annotations

import struct
import sys
import zipfile
from typing import IO, Any

from ..checksums import crc32

LIMIT = zipfile.ZIP64_LIMIT  # a size or offset above it needs zip64 fields
_DESCRIPTOR = 0x08074B50
_SYSTEM = 0 if sys.platform == "win32" else 3


class ZipOut:
    """Stored entries one at a time into ``out`` (``write``, ``tell``, ``seekable``; ``seek`` when
    seekable), positions counted from where ``out`` stands at the start."""

    def __init__(self, out: IO[bytes]):
        self.out = out
        self.seekable = out.seekable()
        self.entries: list[zipfile.ZipInfo] = []
        self.writing = False

    def open(self, info: zipfile.ZipInfo, zip64: bool, crc: bool = True) -> _Entry:
        """Start ``info``'s entry (its name, date, extra field set) and return its data stream
        (``crc=False``: its CRC-32 is not computed, 0 stands in its place, as torch writes with
        ``torch.serialization.set_crc32_options(False)``: the caller proves the bytes otherwise)."""
        if self.writing:
            raise ValueError("an entry is still open")
        info.compress_type = zipfile.ZIP_STORED
        info.compress_size, info.CRC = 0, 0
        info.flag_bits = 0 if self.seekable else 0x08  # 0x08: sizes and CRC in a data descriptor
        info.external_attr = info.external_attr or 0o600 << 16
        info.header_offset = self.out.tell()
        self.out.write(info.FileHeader(zip64))
        self.writing = True
        return _Entry(self, info, zip64, crc)

    def put(self, info: zipfile.ZipInfo, zip64: bool, data: Any, crc: bool = True) -> None:
        """A whole entry whose data is in memory: the bytes :meth:`open`, a write and a close give,
        with the header written once, its CRC-32 and sizes known (no seek back to rewrite it)."""
        view = memoryview(data).cast("B")
        if not self.seekable:  # (the sizes and CRC go in a data descriptor after the data)
            with self.open(info, zip64, crc) as entry:
                entry.write(view)
            return
        if self.writing:
            raise ValueError("an entry is still open")
        if not zip64 and len(view) > LIMIT:
            raise RuntimeError("an entry outgrew its header: more bytes than it was opened for")
        info.compress_type = zipfile.ZIP_STORED
        info.flag_bits = 0
        info.external_attr = info.external_attr or 0o600 << 16
        info.header_offset = self.out.tell()
        info.CRC = crc32(view, 0) if crc else 0
        info.file_size = info.compress_size = len(view)
        self.out.write(info.FileHeader(zip64))
        self.out.write(view)
        self.entries.append(info)

    def close(self) -> None:
        """The central directory and the end records."""
        start = self.out.tell()
        for info in self.entries:
            self._central(info)
        end = self.out.tell()
        count, size = len(self.entries), end - start
        if count > 0xFFFF or start > LIMIT or size > LIMIT:
            self.out.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start))
            self.out.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1))
            count, size, start = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(start, 0xFFFFFFFF)
        self.out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, size, start, 0))

    def _central(self, info: zipfile.ZipInfo) -> None:
        y, mo, d, h, mi, s = info.date_time
        wide: list[int] = []
        sizes = (info.compress_size, info.file_size)
        if max(sizes) > LIMIT:
            wide += [info.file_size, info.compress_size]
            sizes = (0xFFFFFFFF, 0xFFFFFFFF)
        offset = info.header_offset
        if offset > LIMIT:
            wide.append(offset)
            offset = 0xFFFFFFFF
        extra, version = info.extra, 0
        if wide:  # a zip64 field first, the entry's own fields (but an old zip64 one) after
            extra = struct.pack(f"<HH{len(wide)}Q", 1, 8 * len(wide), *wide) + _without_zip64(extra)
            version = 45
        name = info.filename.encode("ascii") if info.filename.isascii() else info.filename.encode("utf-8")
        flags = info.flag_bits if info.filename.isascii() else info.flag_bits | 0x800
        self.out.write(struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", max(version, info.create_version), _SYSTEM,
                                   max(version, info.extract_version), 0, flags, 0, h << 11 | mi << 5 | s // 2,
                                   (y - 1980) << 9 | mo << 5 | d, info.CRC, sizes[0], sizes[1], len(name), len(extra), 0, 0,
                                   0, info.external_attr, offset))
        self.out.write(name)
        self.out.write(extra)


def _without_zip64(extra: bytes) -> bytes:
    out, at = b"", 0
    while at + 4 <= len(extra):
        kind, n = struct.unpack("<HH", extra[at:at + 4])
        if kind != 1:
            out += extra[at:at + 4 + n]
        at += 4 + n
    return out + extra[at:]


class _Entry:
    """One entry's data: every byte through :func:`crc32` (unless ``crc`` is off); ``close``
    records sizes and CRC."""

    def __init__(self, zip_out: ZipOut, info: zipfile.ZipInfo, zip64: bool, crc: bool = True):
        self.zip, self.info, self.zip64 = zip_out, info, zip64
        self.crc, self.size, self.closed = 0, 0, False
        self._checked = crc

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
        if self._checked:
            self.crc = crc32(view, self.crc)
        self.zip.out.write(view)
        self.size += len(view)
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        info, out = self.info, self.zip.out
        info.CRC, info.file_size, info.compress_size = self.crc, self.size, self.size
        if not self.zip64 and self.size > LIMIT:
            raise RuntimeError("an entry outgrew its header: more bytes than it was opened for")
        if info.flag_bits & 0x08:
            out.write(struct.pack("<LLQQ" if self.zip64 else "<LLLL", _DESCRIPTOR, self.crc, self.size, self.size))
        else:  # rewrite the header in place, now with the CRC and sizes
            end = out.tell()
            out.seek(info.header_offset)
            out.write(info.FileHeader(self.zip64))
            out.seek(end)
        self.zip.entries.append(info)
        self.zip.writing = False

    def __enter__(self) -> _Entry:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
