"""Checksums over byte ranges: torch's CRC-32 and the manifest's xxh3, in one read of each byte.

xxh3 for the manifest because it hashes at memory speed, several times faster than CRC-32 or
SHA-256 on one core (figures: docs/benchmarks.md, from ``bench/hashes.py``); CRC-32 because
torch's zip records carry one.
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import Any

import xxhash



def _fastest_crc32() -> tuple[Any, str]:
    """zlib's CRC-32 function, from the fastest module installed that has it: ISA-L's (``isal``,
    SIMD carry-less multiplication, several times zlib's speed: docs/benchmarks.md), zlib-ng's,
    else zlib's. Same values (``tests/unit/test_checksums.py``); all release the GIL. ``CKPTTOOL_CRC32=zlib``
    picks zlib's (a comparison, or a doubt)."""
    if os.environ.get("CKPTTOOL_CRC32") != "zlib":
        try:
            from isal.isal_zlib import crc32 as isal_crc32

            return isal_crc32, "isal"
        except ImportError:
            pass
        try:
            from zlib_ng.zlib_ng import crc32 as ng_crc32

            return ng_crc32, "zlib-ng"
        except ImportError:
            pass
    return zlib.crc32, "zlib"


#: ``crc32(data, value=0)``, as zlib's; ``CRC32_FROM`` names the module it comes from
crc32, CRC32_FROM = _fastest_crc32()

ALGORITHM = "xxh3_64"
BLOCK = 8 << 20  # bytes read at a time

#: The manifest hashes a record's tensor data in blocks of this many bytes (from the data's first
#: byte), so a load that needs part of a record reads and checks only the blocks its box touches,
#: and an incremental save can tell unchanged data from its blocks' hashes. 64 KiB: a box's edges
#: cost at most a block of reading beyond what it needs each, so smaller blocks read less beyond
#: what a load needs (docs/benchmarks.md: load bytes), while the manifest costs 16 hex digits per
#: block and xxh3's per-call cost must stay small beside hashing the block.
HASH_BLOCK = 64 << 10
DIGEST_CHARS = 16  # hex digits of one xxh3_64 digest


def new_hasher() -> Any:
    return xxhash.xxh3_64()


def new_block() -> memoryview:
    return memoryview(bytearray(BLOCK))


def scan(reader: Any, offset: int, length: int, buf: memoryview, crc_span: tuple[int, int] | None = None,
         hasher: Any = None) -> int:
    """Read ``length`` bytes at ``offset`` once, feeding every block to ``hasher`` (if any) and the
    part inside the absolute byte span ``crc_span`` (default: all of it) to CRC-32; returns the CRC.

    One pass serves both checks of a DCP record (torch's CRC-32 of the tensor data, ckpttool's
    manifest hash of the whole record), so a cold verify reads each byte from disk once.
    """
    lo, hi = crc_span if crc_span is not None else (offset, offset + length)
    crc = 0
    done = 0
    while done < length:
        n = min(len(buf), length - done)
        block = buf[:n]
        start = offset + done
        reader.readinto(start, block)
        if hasher is not None:
            hasher.update(block)
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            crc = crc32(block[a - start:b - start], crc)
        done += n
    return crc


def block_count(nbytes: int, block: int = HASH_BLOCK) -> int:
    return -(-nbytes // block)


def hex64(value: int) -> str:
    return f"{value:016x}"


class BlockHasher:
    """The manifest's digests of consecutive ``HASH_BLOCK``-byte blocks of a byte stream fed in
    pieces of any size; :meth:`finish` returns them concatenated (16 hex digits per block)."""

    __slots__ = ("_digests", "_partial", "_fill", "_block")

    def __init__(self, block: int = HASH_BLOCK) -> None:
        self._digests: list[str] = []
        self._partial: Any = None
        self._fill = 0
        self._block = block

    def update(self, view: memoryview) -> None:
        at, n, block = 0, len(view), self._block
        while at < n:
            if self._fill == 0 and n - at >= block:  # a whole block in hand: one call
                self._digests.append(hex64(xxhash.xxh3_64_intdigest(view[at:at + block])))
                at += block
                continue
            if self._partial is None:
                self._partial = new_hasher()
            take = min(block - self._fill, n - at)
            self._partial.update(view[at:at + take])
            self._fill += take
            at += take
            if self._fill == block:
                self._digests.append(self._partial.hexdigest())
                self._partial, self._fill = None, 0

    def finish(self) -> str:
        if self._fill:
            self._digests.append(self._partial.hexdigest())
            self._partial, self._fill = None, 0
        return "".join(self._digests)


def hash_bytes(data: bytes) -> str:
    h = new_hasher()
    h.update(data)
    return h.hexdigest()


def hash_range(reader: Any, offset: int, length: int, buf: memoryview, extra: Any = None, block: int = HASH_BLOCK) -> str:
    """The manifest hash (hex) of the record of ``length`` bytes at ``offset`` whose manifest row
    has ``extra`` as its fourth element (:class:`RecordHasher`; None: the xxh3 of the bytes)."""
    h = RecordHasher(extra, block)
    scan(reader, offset, length, buf, crc_span=(offset, offset), hasher=h)
    return h.hexdigest()


# --- a record's digest, as its manifest row defines it ---------------------------------------------

#: A tensor record's manifest row saying that its digest is :func:`parts_digest` of the digests of
#: its parts (the bytes around its data, and its data's blocks) rather than the xxh3 of the record
#: as one stream: the writer then hashes each data byte once, not twice. Written by ckpttool's own
#: training save since the issue "one pass over each byte"; rows without it are hashed whole.
PARTS = "parts"


def parts_digest(rest: str, blocks: str) -> str:
    """A record's digest from its parts' digests: the xxh3 of ``rest`` and ``blocks`` (hex) joined."""
    return hash_bytes(f"{rest}/{blocks}".encode("ascii"))


def by_parts(extra: Any) -> bool:
    """Whether a manifest row's fourth element (``extra``; None for a row of three) says the
    record's digest is :func:`parts_digest` of its parts."""
    return isinstance(extra, dict) and extra.get("digest") == PARTS


class RecordHasher:
    """The digest of one record as its manifest row defines it, fed the record's bytes front to
    back in pieces of any size (``update``), from its first byte: the xxh3 of every byte, or (a row
    :func:`by_parts`) :func:`parts_digest` of the xxh3 of the bytes around the data ``[start,
    start + nbytes)`` and the data's ``block``-byte blocks."""

    __slots__ = ("_whole", "_rest", "_blocks", "_lo", "_hi", "_pos")

    def __init__(self, extra: Any = None, block: int = HASH_BLOCK):
        if by_parts(extra):
            self._whole = None
            self._rest, self._blocks = new_hasher(), BlockHasher(block)
            self._lo, self._hi = extra["data"][0], extra["data"][0] + extra["data"][1]
        else:
            self._whole = new_hasher()
        self._pos = 0

    def update(self, view: Any) -> None:
        if self._whole is not None:
            self._whole.update(view)
            return
        view = memoryview(view).cast("B")
        n = view.nbytes
        a, b = max(0, self._lo - self._pos), min(n, self._hi - self._pos)
        if a >= b:
            self._rest.update(view)
        else:
            if a > 0:
                self._rest.update(view[:a])
            self._blocks.update(view[a:b])
            if b < n:
                self._rest.update(view[b:])
        self._pos += n

    def hexdigest(self) -> str:
        if self._whole is not None:
            return self._whole.hexdigest()
        return parts_digest(self._rest.hexdigest(), self._blocks.finish())


# --- one CRC-32 from pieces read apart (by several ranks) ----------------------------------------

def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.cache
def _zeros_operators() -> list[list[int]]:
    """Operator k advances a CRC-32 register over 2**k zero bytes (zlib's crc32_combine, its
    matrices squared once here instead of on every call)."""
    op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # -> one zero byte
        op = [_gf2_times(op, op[n]) for n in range(32)]
    ops = [op]
    for _ in range(63):
        op = [_gf2_times(op, op[n]) for n in range(32)]
        ops.append(op)
    return ops


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from A's CRC ``crc1``, B's ``crc2`` and B's length (zlib's own
    crc32_combine, which Python's zlib does not expose)."""
    zeros, k = _zeros_operators(), 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(zeros[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


Piece = tuple[int, int, int]  # (start, end, CRC-32 of those bytes) inside one record


def cover(pieces: list[Piece], length: int) -> list[tuple[int, int, int | None]]:
    """``[0, length)`` as consecutive segments: pieces read (their CRC) where one starts where
    the last ended (the longest), gaps (CRC None) where none does (not read, or read only in a
    piece that straddles another's end): the bytes still to read before the whole can be checked."""
    by_start: dict[int, Piece] = {}
    for p in pieces:
        if 0 <= p[0] < p[1] <= length and (p[0] not in by_start or p[1] > by_start[p[0]][1]):
            by_start[p[0]] = p
    starts = sorted(by_start)
    out: list[tuple[int, int, int | None]] = []
    pos, i = 0, 0
    while pos < length:
        if pos in by_start:
            p = by_start[pos]
            out.append(p)
            pos = p[1]
            continue
        while i < len(starts) and starts[i] <= pos:
            i += 1
        nxt = starts[i] if i < len(starts) else length
        out.append((pos, nxt, None))
        pos = nxt
    return out


def combine(segments: list[tuple[int, int, int]]) -> int:
    """The CRC-32 of consecutive segments ``(start, end, crc)``."""
    crc = 0
    for start, end, part in segments:
        crc = crc32_combine(crc, part, end - start)
    return crc
