"""The one writer of DCP records, for the training save (``training/step_writer.py``, each rank's file) and the
offline sink (``sink.py``, convert and reshard): each record a ``torch.save`` archive as torch's
``FileSystemWriter`` lays it out (an object's pickle; a tensor's zip with its data streamed slab by
slab), through the record's transform (zstd) when there is one.

``out`` is written front to back only (its ``seekable()`` is False): zipfile then puts each
entry's sizes and CRC-32 in a data descriptor after its data, as torch's own writer does.

A small tensor's record (up to ``TEMPLATE_BYTES`` of data, not compressed) is written from a
template: :class:`ArchiveWriter`'s own record for the same dtype and shape, made once with zeros,
whose bytes differ from any other data's record only in the data and the data's CRC-32 (in the
entry's data descriptor and in the central directory). Three writes a record instead of ~25, and
no pickling, ZipInfo or directory built per record, where a checkpoint of many small tensors
spends most of its time (docs/benchmarks.md: the mix of tensor sizes).
"""

from __future__ import annotations

import functools
import io
import math
import struct
from collections.abc import Callable
from typing import IO, Any

import torch

from ...checksums import crc32
from ...index import dtype_size
from ..torchzip import ArchiveWriter
from .transforms import record_stream

#: data bytes up to which a tensor record is written from a template (cached per dtype and shape)
TEMPLATE_BYTES = 1 << 20
_TEMPLATES = 4096  # dtypes and shapes whose templates are kept (each holds ~1 KB: its bytes bar the data)


def write_object(out: IO[bytes], value: Any, compress: str | None) -> tuple[int, int]:
    """One object's record at ``out``'s position; returns (start, length)."""
    start = out.tell()
    buf = io.BytesIO()
    torch.save(value, buf)
    with record_stream(out, compress) as rec:
        rec.write(buf.getbuffer())
    return start, out.tell() - start


def write_tensor(out: IO[bytes], dtype: torch.dtype, shape: tuple[int, ...], compress: str | None,
                 fill: Callable[[Callable[[Any], Any]], None], before_data: Callable[[], None] | None = None,
                 crc: bool = True, at: int | None = None) -> tuple[int, int]:
    """One tensor's record (a C-order tensor of ``shape`` and ``dtype``) at ``out``'s position:
    ``fill(write)`` writes its data bytes in order; ``before_data()`` runs once the header is
    written and the data comes next. ``crc=False``: the data's CRC-32 is not computed, 0 stands in
    its place (torch's ``set_crc32_options(False)``; torch's reader never checks it): for a writer
    whose manifest proves every byte. ``at``: the record's offset in its file (an uncompressed
    record only): the data of a record over ``TEMPLATE_BYTES`` then starts at a page of the file
    (``ArchiveWriter``'s ``at``). Returns (start, length)."""
    start = out.tell()
    template = _template(dtype, tuple(shape)) if compress is None else None
    if template is not None:
        template.write(out, fill, before_data, crc)
        return start, out.tell() - start
    with record_stream(out, compress) as rec, ArchiveWriter(rec, at=at if compress is None else None) as writer:
        placeholder, stream = writer.new_tensor(dtype, shape, crc)
        if before_data is not None:
            before_data()
        with stream:
            fill(stream.write)
        writer.finish(placeholder)
    return start, out.tell() - start


def write_small_tensor(out: IO[bytes], dtype: torch.dtype, shape: tuple[int, ...],
                       data: Callable[[], Any]) -> tuple[int, int] | None:
    """:func:`write_tensor` (uncompressed, with its CRC-32) of a tensor whose data ``data()`` returns
    whole (its bytes, C order), from the template; None, neither reading nor writing anything, where
    no template serves it."""
    template = _template(dtype, shape)
    if template is None:
        return None
    start = out.tell()
    template.write_data(out, data())
    return start, out.tell() - start


class _Template:
    """A tensor record's bytes bar its data: ``head`` before the data, ``tail`` after it, and where
    in ``tail`` the data's CRC-32 goes."""

    def __init__(self, head: bytes, tail: bytes, nbytes: int, crc_at: tuple[int, ...]):
        self.head, self.tail, self.nbytes, self.crc_at = head, tail, nbytes, crc_at

    def write(self, out: IO[bytes], fill: Callable[[Callable[[Any], Any]], None],
              before_data: Callable[[], None] | None, checked: bool = True) -> None:
        out.write(self.head)
        if before_data is not None:
            before_data()
        crc, size = 0, 0

        def write(data: Any) -> int:
            nonlocal crc, size
            view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
            if checked:
                crc = crc32(view, crc)
            out.write(view)
            size += len(view)
            return len(view)

        fill(write)
        self._end(out, size, crc)

    def write_data(self, out: IO[bytes], data: Any) -> None:
        view = memoryview(data).cast("B")
        out.write(self.head)
        out.write(view)
        self._end(out, len(view), crc32(view, 0))

    def _end(self, out: IO[bytes], size: int, crc: int) -> None:
        if size != self.nbytes:  # a writer bug: the record would not hold its tensor
            raise RuntimeError(f"a tensor record got {size} bytes of data for {self.nbytes}")
        tail = bytearray(self.tail)
        for at in self.crc_at:
            struct.pack_into("<L", tail, at, crc)
        out.write(tail)


class Appending(io.RawIOBase):
    """``f`` written front to back only: zipfile then puts each entry's sizes and CRC-32 in a data
    descriptor after its data (as torch's own writer does) instead of seeking back to patch the
    entry's header, and each such seek flushed the output's buffer (one per record: tens of
    thousands in a reshard of a large checkpoint)."""

    def __init__(self, f: IO[bytes]):
        self._f = f

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._f.tell()

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        return len(memoryview(b).cast("B")) if n is None else n


@functools.lru_cache(maxsize=_TEMPLATES)
def _template(dtype: torch.dtype, shape: tuple[int, ...]) -> _Template | None:
    """The template of a record of ``dtype`` and ``shape``: :class:`ArchiveWriter`'s record of zeros,
    split around the data; the data's CRC-32 found where the zip format puts it (its data
    descriptor, right after the data; its central directory entry, the directory's first) and
    checked to hold the zeros' CRC there. None for a record too large for one, or one laid out
    otherwise (zip64: records over 4 GiB)."""
    nbytes = math.prod(shape) * dtype_size(dtype)
    if nbytes > TEMPLATE_BYTES:
        return None
    buf = io.BytesIO()
    out = Appending(buf)
    zeros = bytes(nbytes)
    with ArchiveWriter(out) as writer:
        placeholder, stream = writer.new_tensor(dtype, shape)
        head = out.tell()
        with stream:
            stream.write(zeros)
        writer.finish(placeholder)
    record = buf.getvalue()
    crc = struct.pack("<L", crc32(zeros))
    end = head + nbytes
    eocd = len(record) - 22
    if record[eocd:eocd + 4] != b"PK\x05\x06" or record[end:end + 4] != b"PK\x07\x08" or record[end + 4:end + 8] != crc:
        return None
    directory = struct.unpack_from("<L", record, eocd + 16)[0]
    if record[directory:directory + 4] != b"PK\x01\x02" or record[directory + 16:directory + 20] != crc:
        return None
    return _Template(record[:head], record[end:], nbytes, (4, directory + 16 - end))
