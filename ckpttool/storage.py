"""Paths and bytes: local paths and fsspec URLs behind one small class; the only module that touches files.

A :class:`Location` is a filesystem plus a path on it. It reads byte ranges (straight into a caller's
buffer where the backend allows, so a tensor's bytes are copied once), lists, writes, and commits a
directory that was written under a temporary name: rename where the filesystem has an atomic rename
(local disks), copy-then-marker elsewhere.
"""

from __future__ import annotations

import errno
import os
import posixpath
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import NotFoundError, StorageError


class Location:
    """A path on a filesystem. Cheap to create; no I/O until a method needs it."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str):
        self.fs = fs
        self.path = path.rstrip("/") if len(path) > 1 else path

    # --- naming -------------------------------------------------------------------------------

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def url(self) -> str:
        if self.is_local:
            return self.path
        return self.fs.unstrip_protocol(self.path)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> Location:
        return Location(self.fs, posixpath.dirname(self.path) or "/")

    def child(self, *parts: str) -> Location:
        return Location(self.fs, posixpath.join(self.path, *parts))

    def sibling(self, name: str) -> Location:
        return self.parent.child(name)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.fs is self.fs and other.path == self.path

    def __hash__(self) -> int:
        return hash((id(self.fs), self.path))

    # --- queries ------------------------------------------------------------------------------

    def exists(self) -> bool:
        return self._call(self.fs.exists, self.path)

    def isdir(self) -> bool:
        return self._call(self.fs.isdir, self.path)

    def isfile(self) -> bool:
        return self._call(self.fs.isfile, self.path)

    def size(self) -> int:
        if self.is_local:
            try:
                return os.path.getsize(self.path)
            except FileNotFoundError:
                raise NotFoundError("file does not exist", where=self.url) from None
        return int(self._call(self.fs.size, self.path))

    def listdir(self) -> list[str]:
        """Names (not paths) of the entries directly inside this directory, sorted."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path))
            except FileNotFoundError:
                return []
        if not self.isdir():
            return []
        entries = self._call(self.fs.ls, self.path, detail=False)
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    # --- reading ------------------------------------------------------------------------------

    def read_bytes(self, start: int | None = None, end: int | None = None) -> bytes:
        if self.is_local:
            try:
                with open(self.path, "rb") as f:
                    if start:
                        f.seek(start)
                    return f.read() if end is None else f.read(end - (start or 0))
            except FileNotFoundError:
                raise NotFoundError("file does not exist", where=self.url) from None
            except OSError as exc:
                raise StorageError(f"cannot read: {exc.strerror}", where=self.url) from None
        return self._call(self.fs.cat_file, self.path, start=start, end=end)

    def open_reader(self) -> RangeReader:
        return RangeReader(self)

    # --- writing ------------------------------------------------------------------------------

    def makedirs(self) -> None:
        self._call(self.fs.makedirs, self.path, exist_ok=True)

    @contextmanager
    def open_write(self) -> Iterator[IO[bytes]]:
        """Open for writing; local files are fsync'ed before close so a commit that follows is durable."""
        if self.is_local:
            self.parent.makedirs()
            try:
                with open(self.path, "wb") as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise StorageError(_os_message(exc), where=self.url) from None
            return
        try:
            with self.fs.open(self.path, "wb") as f:
                yield f
        except OSError as exc:
            raise StorageError(_os_message(exc), where=self.url) from None

    def write_bytes(self, data: bytes) -> None:
        with self.open_write() as f:
            f.write(data)

    def remove(self) -> None:
        """Remove a file or a directory tree; a missing path is not an error."""
        if not self.exists():
            return
        self._call(self.fs.rm, self.path, recursive=True)

    def rename_to(self, target: Location) -> None:
        """Move this path to ``target``: one atomic rename on local disks, a copy then delete elsewhere."""
        if self.is_local:
            try:
                os.replace(self.path, target.path)
            except OSError as exc:
                raise StorageError(_os_message(exc), where=target.url) from None
            return
        self._call(self.fs.mv, self.path, target.path, recursive=True)

    # --- helpers ------------------------------------------------------------------------------

    def _call(self, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise NotFoundError("does not exist", where=self.url) from None
        except PermissionError as exc:
            raise StorageError(
                f"permission denied ({exc})",
                where=self.url,
                hint="check the credentials (e.g. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or --storage-option)"
                if not self.is_local
                else "check the file's permissions",
            ) from None
        except OSError as exc:
            raise StorageError(_os_message(exc), where=self.url) from None


def _os_message(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return f"no space to write ({exc.strerror}); free space or write elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write here: {exc.strerror}"
    return exc.strerror or str(exc)


class RangeReader:
    """Reads byte ranges of one file, keeping it open between reads (DCP files hold many records)."""

    def __init__(self, loc: Location):
        self.loc = loc
        self._f: IO[bytes] | None = None
        self._held: tuple[int, bytes] | None = None  # bytes fetched once that later reads may use

    def hold(self, offset: int, data: bytes) -> None:
        """Serve later reads that fall inside ``data`` (the bytes at ``offset``) from memory.

        On an object store every read is a request; a DCP record fetched whole in one request can
        then answer its header and its tensor data reads too. One range at a time; ``release`` frees it.
        """
        self._held = (offset, data)

    def release(self) -> None:
        self._held = None

    def _file(self) -> IO[bytes]:
        if self._f is None:
            try:
                if self.loc.is_local:
                    self._f = open(self.loc.path, "rb", buffering=0)
                else:
                    self._f = self.loc.fs.open(self.loc.path, "rb", block_size=1 << 20, cache_type="none")
            except FileNotFoundError:
                raise NotFoundError("file does not exist", where=self.loc.url) from None
        return self._f

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.readinto(offset, memoryview(buf))
        return bytes(buf)

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short file is a corrupt checkpoint."""
        want = out.nbytes
        if self._held is not None:
            start, data = self._held
            if start <= offset and offset + want <= start + len(data):
                out[:] = memoryview(data)[offset - start : offset - start + want]
                return
        f = self._file()
        got = 0
        if self.loc.is_local:
            fd = f.fileno()
            while got < want:
                n = os.preadv(fd, [out[got:]], offset + got)
                if n == 0:
                    break
                got += n
        else:
            f.seek(offset)
            while got < want:
                chunk = f.read(want - got)
                if not chunk:
                    break
                out[got : got + len(chunk)] = chunk
                got += len(chunk)
        if got != want:
            from .errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"file is truncated: wanted bytes {offset}..{offset + want}, file ends at {offset + got}",
                where=self.loc.url,
                hint="the file was cut short (interrupted copy or save?); restore it from a good copy",
            )

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def resolve(url: str | os.PathLike | Location, storage_options: dict[str, Any] | None = None) -> Location:
    """A local path or an fsspec URL -> :class:`Location`. A missing backend says what to install."""
    if isinstance(url, Location):
        return url
    url = os.fspath(url)
    if "://" not in url:
        return Location(LocalFileSystem(), os.path.abspath(url))
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        protocol = url.split("://", 1)[0]
        raise StorageError(
            f"no filesystem backend for '{protocol}://' ({exc})",
            where=url,
            hint=f"install it: pip install 'ckpttool[{protocol}]' or the fsspec backend for {protocol}",
        ) from None
    except ValueError as exc:
        raise StorageError(str(exc), where=url) from None
    return Location(fs, path)


def temp_sibling(loc: Location, tag: str = "tmp") -> Location:
    """A fresh hidden name beside ``loc`` to write into before committing to ``loc``."""
    return loc.sibling(f".{loc.name}.{tag}-{uuid.uuid4().hex[:8]}")
