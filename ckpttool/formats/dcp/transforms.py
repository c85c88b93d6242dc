"""DCP records stored through one of torch's stream transforms: today zstd, which torch writes with
``FileSystemWriter(..., _extensions=[ZStandard()])`` and names ``stream.zstd/1`` in each record's
``transform_descriptors``. The stored bytes of such a record are a zstd stream whose decoded
content is the plain record (a ``torch.save`` archive, or an object's pickle archive).

Reading decodes a record as a stream, in bounded reads, into memory when small and into an
anonymous temporary file otherwise, so memory stays bounded whatever the record's size; the
decoded size is checked against what the record may hold (a tensor chunk's bytes plus the archive's
headers) while decoding, so a small hostile stream cannot expand without bound. Writing compresses
each record as one zstd frame, as torch does, so plain torch reads it back.

The decompressor is the ``zstandard`` package (an optional extra: ``pip install 'ckpttool[zstd]'``).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from ...errors import CorruptCheckpointError, FormatError, UsageError

ZSTD = "stream.zstd/1"
KNOWN = (ZSTD,)
#: ``--compress`` choices -> the descriptor written into each record's storage entry
COMPRESSIONS = {"zstd": ZSTD}

#: a decoded record up to this size stays in memory; a larger one goes to a temporary file
SPILL_BYTES = 16 << 20
_BLOCK = 1 << 20
#: the most an archive adds to its tensor's bytes (pickle, headers, 64-byte alignment, directory)
ARCHIVE_SLACK = 1 << 20
#: the most an object record may decode to
MAX_OBJECT_BYTES = 256 << 20
#: the most a zstd frame expands: a block holds at most 128 KiB, and the smallest block that
#: decodes to that (an RLE block) is 4 bytes
MAX_ZSTD_RATIO = (128 << 10) // 4


def check_descriptors(descriptors: Sequence[Any], where: str) -> None:
    """Refuse (one line naming it) a transform this version does not read."""
    if not isinstance(descriptors, (list, tuple)) or any(d not in KNOWN for d in descriptors):
        raise FormatError(f"record is stored through transforms {list(descriptors) if isinstance(descriptors, (list, tuple)) else descriptors!r}",
                          where=where, hint=f"ckpttool reads plain records and {', '.join(KNOWN)}")
    if len(descriptors) > 1:
        raise FormatError(f"record is stored through {len(descriptors)} stacked transforms", where=where,
                          hint="ckpttool reads one zstd transform per record, as torch writes it")


def zstandard() -> Any:
    """The ``zstandard`` module, or a one-line error saying how to get it."""
    try:
        import zstandard as module
    except ImportError:
        raise FormatError("checkpoint is zstd-compressed and the zstandard package is not installed",
                          hint="pip install 'ckpttool[zstd]' (or: pip install zstandard)") from None
    return module


class _RangeFile(io.RawIOBase):
    """A read-only stream over ``length`` bytes at ``offset`` of a range reader."""

    def __init__(self, reader: Any, offset: int, length: int):
        self._reader, self._pos, self._end = reader, offset, offset + length

    def readable(self) -> bool:
        return True

    def readinto(self, out: Any) -> int:
        n = min(len(out), self._end - self._pos)
        if n <= 0:
            return 0
        self._reader.readinto(self._pos, memoryview(out)[:n])
        self._pos += n
        return n


class DecodedRecord:
    """The :class:`~ckpttool.storage.RangeReader` interface over a record's decoded bytes."""

    def __init__(self, raw: Any, offset: int, length: int, limit: int, where: str):
        self.where = where
        zstd = zstandard()
        reader = zstd.ZstdDecompressor().stream_reader(_RangeFile(raw, offset, length), read_across_frames=True,
                                                       read_size=_BLOCK)
        buf: BinaryIO = io.BytesIO()
        size = 0
        try:
            while True:
                chunk = reader.read(_BLOCK)  # at most one block out per call: no unbounded expansion
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise CorruptCheckpointError(f"compressed record decodes to more than the {limit} bytes it may hold",
                                                 where=where, hint="the record is damaged or hostile")
                if isinstance(buf, io.BytesIO) and size > SPILL_BYTES:
                    spill = tempfile.TemporaryFile()
                    spill.write(buf.getbuffer())
                    buf = spill
                buf.write(chunk)
        except zstd.ZstdError as exc:
            buf.close()
            raise CorruptCheckpointError(f"cannot decompress the record ({exc})", where=where,
                                         hint="the compressed bytes are damaged; restore the file") from None
        except BaseException:
            buf.close()
            raise
        self._buf = buf
        self._size = size

    def size(self) -> int:
        return self._size

    def hold(self, offset: int, data: bytes) -> None:
        pass

    def release(self) -> None:
        pass

    def check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self._size:
            raise CorruptCheckpointError(
                f"record is truncated: wanted bytes {offset}..{offset + length} of {self._size} decoded", where=self.where)

    def read(self, offset: int, length: int) -> bytes:
        self.check_range(offset, length)
        out = bytearray(length)
        self.readinto(offset, memoryview(out))
        return bytes(out)

    def readinto(self, offset: int, out: memoryview) -> None:
        self.check_range(offset, out.nbytes)
        if isinstance(self._buf, io.BytesIO):
            out[:] = self._buf.getbuffer()[offset : offset + out.nbytes]
            return
        self._buf.seek(offset)
        view = out.cast("B")
        got = 0
        while got < view.nbytes:
            n = self._buf.readinto(view[got:])
            if not n:
                raise CorruptCheckpointError("temporary copy of a decoded record ended early", where=self.where)
            got += n

    def close(self) -> None:
        self._buf.close()


class CompressingWriter(io.RawIOBase):
    """Writes a record compressed as one zstd frame to ``f`` (closing finishes the frame, not ``f``)."""

    def __init__(self, f: BinaryIO, level: int = 3):
        self._f = f
        self._c = zstandard().ZstdCompressor(level=level).compressobj()

        self._pos = 0  # bytes taken in: the record's own offsets (zip headers) count these

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # zipfile then writes sizes and CRCs after each entry's data, never seeking back

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        out = self._c.compress(data)
        if out:
            self._f.write(out)
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._f.write(self._c.flush())
        super().close()


@contextlib.contextmanager
def record_stream(f: Any, compress: str | None) -> Iterator[Any]:
    """Where one record is written: ``f`` itself, or a zstd frame in it (one frame per record, as
    torch writes them, so each record decodes on its own)."""
    if compress is None:
        yield f
        return
    packed = CompressingWriter(f)
    yield packed
    packed.close()


def transform_names(compress: str | None) -> list[str] | None:
    """The transform descriptors of a record written with ``compress``."""
    return None if compress is None else [COMPRESSIONS[compress]]


def storage_info(file: str, offset: int, length: int, compress: str | None) -> Any:
    """DCP's storage entry of a record, naming its transform when it has one."""
    from ... import compat

    return compat.storage_info(file, offset, length, transform_names(compress))


def check_compress(compress: str | None) -> None:
    """A usage error for an unknown method, and a clear one before anything is written when the
    package is missing."""
    if compress is None:
        return
    if compress not in COMPRESSIONS:
        raise UsageError(f"unknown compression {compress!r}", hint=f"choose one of {', '.join(COMPRESSIONS)}")
    zstandard()
    from ... import compat

    if not compat.has_record_transforms():
        import torch

        raise UsageError(f"compressed DCP records need torch >= 2.7; this is torch {torch.__version__}, whose DCP "
                         "has no record transforms (it could not load what would be written)",
                         hint="upgrade torch, or leave out --compress")
