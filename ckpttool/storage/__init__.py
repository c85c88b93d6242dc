"""Paths and bytes: local paths and fsspec URLs behind one small class; the only module that touches files.

A :class:`Location` is a path on a *backend*. Backends implement a few primitives (stat, list,
ranged reads into a caller's buffer, streamed writes, remove, rename): the local disk through
``os`` (positioned reads straight into tensor memory, fsync before a commit), everything else
through fsspec. Everything else here is built from those primitives, as fsspec's own base class
builds rich operations from a few.

A :class:`CommitPolicy`, chosen once per backend, says how an output of several files appears all
at once or not at all: a rename of a hidden temporary directory on filesystems, in-place writes
with the file written last as the marker on object stores (which have no atomic rename).
"""

from __future__ import annotations

from .backends import PARALLEL_PARTS, PART_BYTES, Backend, Fsspec, LocalDisk
from .localfile import SYNC_FILE_RANGE, WRITEBACK_WINDOW, LocalFile
from .commit import CommitPolicy, InPlaceCommit, RenameCommit, temp_sibling
from .location import BytesReader, Location, RangeReader, describe_os_error, resolve, save_error

__all__ = ["PARALLEL_PARTS", "PART_BYTES", "SYNC_FILE_RANGE", "WRITEBACK_WINDOW", "Backend", "BytesReader", "CommitPolicy",
           "Fsspec", "InPlaceCommit", "Location", "LocalDisk", "LocalFile", "RangeReader", "RenameCommit", "describe_os_error", "resolve", "save_error",
           "temp_sibling"]
