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

import contextlib
import ctypes
import errno
import io
import logging
import os
import posixpath
import stat
import sys
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CorruptCheckpointError, NotACheckpointError, NotFoundError, StorageError, UnsafePathError

log = logging.getLogger("ckpttool")


# --- commit policies --------------------------------------------------------------------------


class CommitPolicy(ABC):
    """How an output written as several files becomes visible whole, or not at all."""

    @abstractmethod
    def staging(self, final: Location) -> Location:
        """Where to write the output before it is committed (no I/O)."""

    def prepare(self, staged: Location, final: Location) -> None:
        """Called before the first byte is written, once replacing ``final`` was allowed (--force)."""

    @abstractmethod
    def publish(self, staged: Location, final: Location) -> None:
        """Make the written output appear at ``final``."""

    def retire(self, final: Location, marker: str) -> None:
        """Delete a committed output so that a delete cut short never leaves something that looks
        like it: here, remove its commit ``marker`` first (it is then incomplete), then the rest."""
        final.child(marker).remove()
        final.remove()

    def discard(self, staged: Location) -> None:
        """Remove a failed output. A removal that fails is logged with the path, not hidden."""
        try:
            staged.remove()
        except Exception as exc:  # noqa: BLE001 - already failing; the original error matters more
            log.warning("could not remove the partial output %s (%s); remove it by hand", staged.url, exc)


class RenameCommit(CommitPolicy):
    """Filesystems: write under a hidden sibling name, then rename it into place in one step."""

    def staging(self, final: Location) -> Location:
        return temp_sibling(final)

    def publish(self, staged: Location, final: Location) -> None:
        if final.exists():
            final.remove()  # only reached when replacing was allowed; checked before writing began
        staged.rename_to(final)

    def retire(self, final: Location, marker: str) -> None:
        """Rename out of sight in one step (to a hidden temporary name that ``clean`` removes),
        then delete: a delete cut short leaves no visible, half-deleted step."""
        hidden = self.staging(final)
        final.rename_to(hidden)
        hidden.remove()


class InPlaceCommit(CommitPolicy):
    """Object stores: write at the final name, the file that makes the output complete last
    (``.metadata``, an index, a commit record, or a single object, which does not exist until its
    upload completes; a failed upload is aborted, never completed)."""

    def staging(self, final: Location) -> Location:
        return final

    def prepare(self, staged: Location, final: Location) -> None:
        if final.exists():
            final.remove()  # replacing an old output: its files must not mix with the new ones

    def publish(self, staged: Location, final: Location) -> None:
        return None


# --- backends -------------------------------------------------------------------------------


class _Backend(ABC):
    """The primitives a storage backend provides; :class:`Location` builds on them."""

    commit: CommitPolicy
    #: every read is a network request: callers fetch a whole small record in one read
    batch_reads: bool

    @abstractmethod
    def url(self, path: str) -> str: ...

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abstractmethod
    def isfile(self, path: str) -> bool: ...

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Sorted names inside a directory; [] when it is missing or not a directory."""

    @abstractmethod
    def read_bytes(self, path: str, start: int | None, end: int | None) -> bytes: ...

    @abstractmethod
    def open_read(self, path: str) -> Any:
        """A handle for :meth:`pread`."""

    @abstractmethod
    def pread(self, handle: Any, offset: int, out: memoryview, path: str, size: int) -> int:
        """Fill ``out`` from ``offset`` as far as the file goes (``handle`` is ``open_read(path)``
        of a file of ``size`` bytes); returns the bytes read."""

    @abstractmethod
    def open_write(self, path: str) -> Any:
        """A context manager yielding a binary file; on an exception inside it nothing is committed."""

    @abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abstractmethod
    def remove(self, path: str) -> None: ...

    @abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    def local_path(self, path: str) -> str | None:
        return None

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; False when it did."""

    def islink(self, path: str) -> bool:
        return False

    def resolved(self, path: str) -> str:
        """The path with every symlink resolved (the same path where there are none)."""
        return path

    def escapes(self, parent: str, child: str) -> bool:
        """Whether ``child`` (named inside ``parent``) resolves to a place outside it (a symlink)."""
        return False


class LocalDisk(_Backend):
    """The local filesystem through os: positioned reads into caller buffers, fsync before a commit
    (public for tests that slow or fail its writes)."""

    commit = RenameCommit()
    batch_reads = False

    def url(self, path: str) -> str:
        return path

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def read_bytes(self, path: str, start: int | None, end: int | None) -> bytes:
        with self.open_read(path) as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def open_read(self, path: str) -> Any:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; then refuse anything not a regular file
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _NotRegular(path)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    def pread(self, handle: Any, offset: int, out: memoryview, path: str, size: int) -> int:
        got, want, fd = 0, out.nbytes, handle.fileno()
        while got < want:
            n = os.preadv(fd, [out[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    @contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with io.BufferedWriter(_WritebackFile(path), buffer_size=1 << 20) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # durable before a commit that follows

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil

            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def local_path(self, path: str) -> str | None:
        return path

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # Whole or not at all: the content goes to a hidden file that is then hard-linked to the
        # name (link fails when the name exists). An O_EXCL create followed by a write would let
        # another job read the name while it is still empty, and take it for a damaged lease.
        directory = os.path.dirname(path) or "/"
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.new-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                return self._create_excl_in_place(path, data)  # a filesystem without hard links
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    @staticmethod
    def _create_excl_in_place(path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def islink(self, path: str) -> bool:
        return os.path.islink(path)

    def resolved(self, path: str) -> str:
        return os.path.realpath(path)

    def escapes(self, parent: str, child: str) -> bool:
        real_parent = os.path.realpath(parent)
        return os.path.commonpath([real_parent, os.path.realpath(child)]) != real_parent


def _sync_file_range() -> Any:
    """Linux's sync_file_range(2) from libc (os does not wrap it), or None elsewhere."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


SYNC_FILE_RANGE = _sync_file_range() if sys.platform.startswith("linux") else None
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4
WRITEBACK_WINDOW = 64 << 20


class _WritebackFile(io.FileIO):
    """A file written back to the disk as it grows: after each ``WRITEBACK_WINDOW`` bytes the
    kernel is asked to start writing that window and to finish the window before it. Left alone,
    Linux keeps gigabytes dirty until the final fsync (dirty_ratio 20% of RAM here), and reading,
    writing and flushing then happen one after the other; written back as it goes, the disk writes
    while the next bytes are produced and the fsync finds little left (a 3.8 GB write plus fsync
    took 5.3-5.6 s instead of 8.4-11.7 s here). It also bounds the dirty pages one output holds
    to about two windows. Only a hint: where the call is missing or fails, nothing changes."""

    def __init__(self, path: str):
        super().__init__(path, "wb")
        self._started = 0  # writeback was started for [_waited, _started)
        self._waited = 0  # ... and is complete below _waited

    def write(self, data: Any) -> int:
        n = super().write(data)
        if SYNC_FILE_RANGE is not None and n:
            end = self.tell()
            if end - self._started >= WRITEBACK_WINDOW:
                fd = self.fileno()
                if self._started > self._waited:
                    SYNC_FILE_RANGE(fd, self._waited, self._started - self._waited, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
                SYNC_FILE_RANGE(fd, self._started, end - self._started, _WRITE)
                self._waited, self._started = self._started, end
        return n


class _NotRegular(OSError):
    """A path that exists but is not a regular file (a FIFO, a device, a directory)."""


class _NoBucket(Exception):
    """An object store's bucket (or container) that does not exist."""


#: remote reads of at least two parts are split into ranged requests of this size (each request
#: costs a round trip, and on the test server about 0.2 s whatever its size: bench/s3.py) ...
PART_BYTES = 16 << 20
#: ... this many in flight at once (bounded: each part is held in memory until copied out)
PARALLEL_PARTS = 4


class _Fsspec(_Backend):
    commit = InPlaceCommit()
    batch_reads = True

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Fsspec) and other.fs is self.fs

    def __hash__(self) -> int:
        return id(self.fs)

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.fs.isfile(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def listdir(self, path: str) -> list[str]:
        # fsspec caches listings (s3fs's dircache); files another process wrote since (the other
        # ranks' indexes that rank 0 polls for at commit, another job's steps) must show up
        self.fs.invalidate_cache(path)
        if not self.fs.isdir(path):
            return []
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in self.fs.ls(path, detail=False))

    def read_bytes(self, path: str, start: int | None, end: int | None) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def open_read(self, path: str) -> Any:
        return self.fs.open(path, "rb", block_size=1 << 20, cache_type="none")

    def pread(self, handle: Any, offset: int, out: memoryview, path: str, size: int) -> int:
        if out.nbytes >= 2 * PART_BYTES and getattr(self.fs, "async_impl", False):
            return self._pread_parts(path, size, offset, out)
        handle.seek(offset)
        got, want = 0, out.nbytes
        while got < want:
            chunk = handle.read(want - got)
            if not chunk:
                break
            out[got : got + len(chunk)] = chunk
            got += len(chunk)
        return got

    def _pread_parts(self, path: str, size: int, offset: int, out: memoryview) -> int:
        """A large read as ranged requests of PART_BYTES, PARALLEL_PARTS of them at once (an async
        filesystem such as s3fs sends them concurrently: an object store answers each request
        after a round trip, so one at a time leaves the link idle; a sync one's ``cat_ranges``
        would only loop). At most PARALLEL_PARTS parts are held beside ``out``; returns the bytes
        read, short at the first short part."""
        want, got = min(out.nbytes, max(size - offset, 0)), 0
        while got < want:  # never a range past the end: a server may answer it with an error, not a short read
            group = min(want - got, PART_BYTES * PARALLEL_PARTS)
            starts = list(range(offset + got, offset + got + group, PART_BYTES))
            ends = [min(start + PART_BYTES, offset + got + group) for start in starts]
            datas = self.fs.cat_ranges([path] * len(starts), starts, ends, on_error="raise")
            for start, end, data in zip(starts, ends, datas):
                n = min(len(data), end - start)
                out[start - offset : start - offset + n] = memoryview(data)[:n]
                if n < end - start:
                    return start - offset + n
            got += group
        return got

    @contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        f = self.fs.open(path, "wb")
        try:
            yield f
        except BaseException:
            _discard_upload(f)
            raise
        f.close()  # completes the upload: only now does the object exist

    def makedirs(self, path: str) -> None:
        split = getattr(self.fs, "split_path", None)  # object stores (s3fs, gcsfs, adlfs): bucket first
        if callable(split):
            bucket = split(path)[0]
            if bucket and not self.fs.exists(bucket):
                raise _NoBucket(bucket)  # fsspec's makedirs would create it: never do that
        self.fs.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst, recursive=True)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            with self.fs.open(path, "xb") as f:  # s3fs: a conditional put (If-None-Match)
                f.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError, TypeError):  # the backend has no exclusive create
            if self.fs.exists(path):
                return False
            with self.fs.open(path, "wb") as f:
                f.write(data)
            return True


def _discard_upload(f: Any) -> None:
    """Abort an unfinished upload (S3: the multipart upload) instead of completing it on close."""
    discard = getattr(f, "discard", None)
    if callable(discard):
        discard()
    try:
        f.closed = True  # fsspec's buffered files would otherwise complete the upload when collected
    except (AttributeError, TypeError):
        pass


# --- Location -----------------------------------------------------------------------------------


class Location:
    """A path on a storage backend. Cheap to create; no I/O until a method needs it."""

    def __init__(self, backend: _Backend, path: str):
        self._backend = backend
        self.path = path.rstrip("/") if len(path) > 1 else path

    # --- naming -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._backend.url(self.path)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> Location:
        return Location(self._backend, posixpath.dirname(self.path) or "/")

    def child(self, *parts: str) -> Location:
        return Location(self._backend, posixpath.join(self.path, *parts))

    def sibling(self, name: str) -> Location:
        return self.parent.child(name)

    def inside(self, name: Any, named_by: str) -> Location:
        """The file ``name`` inside this directory, where ``name`` comes from a checkpoint (a DCP
        storage path, an HF weight map): every such name goes through here. One plain path
        component only (no ``/``, ``\\``, ``..``, absolute or empty names) and, on a local disk,
        not a symlink that leads out of this directory; else :class:`UnsafePathError` naming
        ``named_by`` (the file and entry that gave the name)."""
        if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
                or "\0" in name or any(ord(c) < 32 for c in name)):
            raise UnsafePathError(
                f"names a path outside the checkpoint: {name!r}", where=named_by,
                hint="a checkpoint may only name files inside its own directory; nothing was read from that path",
            )
        loc = self.child(name)
        if self._backend.escapes(self.path, loc.path):
            raise UnsafePathError(
                f"{name!r} is a symlink that leads out of the checkpoint", where=named_by,
                hint="copy the file into the checkpoint instead of linking it; nothing was read through the link",
            )
        return loc

    def islink(self) -> bool:
        return self._backend.islink(self.path)

    def contains(self, other: Location) -> bool:
        """Whether ``other`` is this path or lies under it (on a local disk, after resolving symlinks)."""
        if other._backend != self._backend:
            return False
        mine, theirs = self._backend.resolved(self.path), self._backend.resolved(other.path)
        return theirs == mine or theirs.startswith(mine.rstrip("/") + "/")

    @property
    def commit_policy(self) -> CommitPolicy:
        return self._backend.commit

    @property
    def batch_reads(self) -> bool:
        """True where every read is a network request (object stores): read small records whole."""
        return self._backend.batch_reads

    @property
    def local_path(self) -> str | None:
        """The path the operating system can open, or None for a remote location."""
        return self._backend.local_path(self.path)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other._backend == self._backend and other.path == self.path

    def __hash__(self) -> int:
        return hash((self._backend, self.path))

    # --- queries ------------------------------------------------------------------------------

    def exists(self) -> bool:
        return self._call(self._backend.exists)

    def isdir(self) -> bool:
        return self._call(self._backend.isdir)

    def isfile(self) -> bool:
        return self._call(self._backend.isfile)

    def size(self) -> int:
        return int(self._call(self._backend.size, missing="file does not exist"))

    def listdir(self) -> list[str]:
        """Names (not paths) of the entries directly inside this directory, sorted."""
        return self._call(self._backend.listdir)

    # --- reading ------------------------------------------------------------------------------

    def read_bytes(self, start: int | None = None, end: int | None = None) -> bytes:
        return self._call(self._backend.read_bytes, start, end, missing="file does not exist", verb="read")

    def open_reader(self) -> RangeReader:
        return RangeReader(self)

    # --- writing ------------------------------------------------------------------------------

    def makedirs(self) -> None:
        self._call(self._backend.makedirs, verb="write")

    @contextmanager
    def open_write(self) -> Iterator[IO[bytes]]:
        """Open for writing. Local files are fsync'ed before close so a commit that follows is
        durable; an object store's upload completes only if the block exits without an error."""
        try:
            with self._backend.open_write(self.path) as f:
                yield f
        except OSError as exc:
            raise StorageError(describe_os_error(exc, "write"), where=self.url) from None

    def write_bytes(self, data: bytes) -> None:
        with self.open_write() as f:
            f.write(data)

    def create_exclusive(self, data: bytes) -> bool:
        """Create this file with ``data`` unless it exists (atomically where the storage can:
        O_EXCL locally, a conditional put on S3); False when it existed."""
        try:
            return bool(self._backend.create_exclusive(self.path, data))
        except OSError as exc:
            raise StorageError(describe_os_error(exc, "write"), where=self.url) from None

    def replace_bytes(self, data: bytes) -> None:
        """Replace this file's content in one step (local: a temporary file renamed over it)."""
        if self.local_path is None:
            self.write_bytes(data)
            return
        tmp = temp_sibling(self)
        tmp.write_bytes(data)
        tmp.rename_to(self)

    def remove(self) -> None:
        """Remove a file or a directory tree; a missing path is not an error."""
        self._call(self._backend.remove, verb="remove")

    def rename_to(self, target: Location) -> None:
        """Move this path to ``target``: one atomic rename on local disks, a copy then delete elsewhere."""
        try:
            self._backend.rename(self.path, target.path)
        except OSError as exc:
            raise StorageError(describe_os_error(exc, "write"), where=target.url) from None

    # --- helpers ------------------------------------------------------------------------------

    def _call(self, fn, *args: Any, missing: str = "does not exist", verb: str = "access") -> Any:
        try:
            return fn(self.path, *args)
        except FileNotFoundError:
            raise NotFoundError(missing, where=self.url) from None
        except _NoBucket as exc:
            raise NotFoundError(f"bucket {exc} does not exist", where=self.url,
                                hint="create it first; ckpttool never creates buckets") from None
        except (_NotRegular, IsADirectoryError):
            raise NotACheckpointError("not a regular file (a directory, FIFO or device?)", where=self.url,
                                      hint="name a checkpoint file or directory") from None
        except PermissionError as exc:
            raise StorageError(
                f"permission denied ({exc})",
                where=self.url,
                hint="check the credentials (e.g. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or --storage-option)"
                if self.local_path is None
                else "check the file's permissions",
            ) from None
        except OSError as exc:
            raise StorageError(describe_os_error(exc, verb), where=self.url) from None


def describe_os_error(exc: OSError, verb: str = "access") -> str:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return f"no space left on device while writing ({exc.strerror}); free space or write elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied: cannot {verb} here ({exc.strerror})"
    return exc.strerror or str(exc)


class RangeReader:
    """Reads byte ranges of one file, keeping it open between reads (DCP files hold many records)."""

    def __init__(self, loc: Location):
        self.loc = loc
        self.where = loc.url
        self._handle: Any = None
        self._size: int | None = None
        self._held: tuple[int, bytes] | None = None  # bytes fetched once that later reads may use

    def size(self) -> int:
        if self._size is None:
            self._size = self.loc.size()
        return self._size

    def check_range(self, offset: int, length: int) -> None:
        """Refuse a range that does not lie inside the file, before anything is allocated for it."""
        if offset < 0 or length < 0 or offset + length > self.size():
            raise CorruptCheckpointError(
                f"file is truncated: wanted bytes {offset}..{offset + length}, file ends at {self.size()}",
                where=self.where,
                hint="the file was cut short (interrupted copy or save?) or its metadata is damaged; restore it from a good copy",
            )

    def hold(self, offset: int, data: bytes) -> None:
        """Serve later reads that fall inside ``data`` (the bytes at ``offset``) from memory.

        On an object store every read is a request; a DCP record fetched whole in one request can
        then answer its header and its tensor data reads too. One range at a time; ``release`` frees it.
        """
        self._held = (offset, data)

    def release(self) -> None:
        self._held = None

    def holds(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset+length)`` is served from the held bytes (no request)."""
        return self._held is not None and self._held[0] <= offset and offset + length <= self._held[0] + len(self._held[1])

    def read(self, offset: int, length: int) -> bytes:
        self.check_range(offset, length)
        buf = bytearray(length)
        self.readinto(offset, memoryview(buf))
        return bytes(buf)

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short file is a corrupt checkpoint."""
        want = out.nbytes
        if offset < 0:
            self.check_range(offset, want)
        if self.holds(offset, want):
            start, data = self._held
            out[:] = memoryview(data)[offset - start : offset - start + want]
            return
        if self._handle is None:
            self._handle = self.loc._call(self.loc._backend.open_read, missing="file does not exist", verb="read")
        got = self.loc._backend.pread(self._handle, offset, out, self.loc.path, self.size())
        if got != want:
            raise CorruptCheckpointError(
                f"file is truncated: wanted bytes {offset}..{offset + want}, file ends at {offset + got}",
                where=self.where,
                hint="the file was cut short (interrupted copy or save?); restore it from a good copy",
            )

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class BytesReader:
    """The :class:`RangeReader` interface over bytes already in memory (a record DCP handed us)."""

    def __init__(self, data: bytes, where: str):
        self._data = memoryview(data)
        self.where = where

    def size(self) -> int:
        return self._data.nbytes

    def hold(self, offset: int, data: bytes) -> None:
        pass

    def release(self) -> None:
        pass

    def check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self._data.nbytes:
            raise CorruptCheckpointError(
                f"record is truncated: wanted bytes {offset}..{offset + length} of {self._data.nbytes}", where=self.where)

    def read(self, offset: int, length: int) -> bytes:
        self.check_range(offset, length)
        return bytes(self._data[offset : offset + length])

    def readinto(self, offset: int, out: memoryview) -> None:
        self.check_range(offset, out.nbytes)
        out[:] = self._data[offset : offset + out.nbytes]

    def close(self) -> None:
        pass


_LOCAL = LocalDisk()


def resolve(url: str | os.PathLike | Location, storage_options: dict[str, Any] | None = None) -> Location:
    """A local path or an fsspec URL -> :class:`Location`. A missing backend says what to install."""
    if isinstance(url, Location):
        return url
    url = os.fspath(url)
    if "://" not in url:
        return Location(_LOCAL, os.path.abspath(url))
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        protocol = url.split("://", 1)[0]
        raise StorageError(
            f"no filesystem backend for '{protocol}://' ({exc})",
            where=url,
            hint=f"install it: pip install 'ckpttool[{protocol}]' or the fsspec backend for {protocol}",
        ) from None
    except (ValueError, TypeError) as exc:
        raise StorageError(str(exc), where=url) from None
    if isinstance(fs, LocalFileSystem):
        return Location(_LOCAL, os.path.abspath(path))
    return Location(_Fsspec(fs), path)


def temp_sibling(loc: Location, tag: str = "tmp") -> Location:
    """A fresh hidden name beside ``loc`` to write into before committing to ``loc``."""
    return loc.sibling(f".{loc.name}.{tag}-{uuid.uuid4().hex[:8]}")
