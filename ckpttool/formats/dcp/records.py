"""The one writer of DCP records, for the training save (``save.py``, each rank's file) and the
offline sink (``sink.py``, convert and reshard): each record a ``torch.save`` archive as torch's
``FileSystemWriter`` lays it out (an object's pickle; a tensor's zip with its data streamed slab by
slab), through the record's transform (zstd) when there is one.

``out`` is written front to back only (its ``seekable()`` is False): zipfile then puts each
entry's sizes and CRC-32 in a data descriptor after its data, as torch's own writer does.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO, Any

import torch

from ..torchzip import ArchiveWriter
from .transforms import record_stream


def write_object(out: IO[bytes], value: Any, compress: str | None) -> tuple[int, int]:
    """One object's record at ``out``'s position; returns (start, length)."""
    start = out.tell()
    buf = io.BytesIO()
    torch.save(value, buf)
    with record_stream(out, compress) as rec:
        rec.write(buf.getbuffer())
    return start, out.tell() - start


def write_tensor(out: IO[bytes], dtype: torch.dtype, shape: tuple[int, ...], compress: str | None,
                 fill: Callable[[Callable[[Any], Any]], None], before_data: Callable[[], None] | None = None) -> tuple[int, int]:
    """One tensor's record (a C-order tensor of ``shape`` and ``dtype``) at ``out``'s position:
    ``fill(write)`` writes its data bytes in order; ``before_data()`` runs once the header is
    written and the data comes next. Returns (start, length)."""
    start = out.tell()
    with record_stream(out, compress) as rec, ArchiveWriter(rec) as writer:
        placeholder, stream = writer.new_tensor(dtype, shape)
        if before_data is not None:
            before_data()
        with stream:
            fill(stream.write)
        writer.finish(placeholder)
    return start, out.tell() - start
