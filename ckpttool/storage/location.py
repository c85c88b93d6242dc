"""A :class:`Location`: a path on a storage backend, with everything the package does with paths
and bytes built on the backend's primitives (ranged readers, writes, listings, confinement of names a
checkpoint gives); :func:`resolve` makes one from a local path or an fsspec URL."""

from __future__ import annotations

import errno
import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import CkptError, CorruptCheckpointError, NotACheckpointError, NotFoundError, StorageError, UnsafePathError
from .backends import Backend, Fsspec, LocalDisk, NoBucket, NotRegular
from .commit import CommitPolicy, temp_sibling

class Location:
    """A path on a storage backend. Cheap to create; no I/O until a method needs it."""

    def __init__(self, backend: Backend, path: str):
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

    def bytes_under(self, enough: int) -> int:
        """The bytes of this file, or of the files below this directory, counted until ``enough``."""
        return int(self._call(self._backend.bytes_under, enough))

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

    def version(self) -> tuple | None:
        """What changes when this file's bytes are rewritten (a local file's device, inode, size
        and modification time; an object's size and ETag), or None where the storage keeps none.
        Damage that keeps it (a disk's own bit rot) is not seen here: only by reading the bytes."""
        try:
            return self._backend.version(self.path)
        except (OSError, NotImplementedError, ValueError, KeyError):
            return None

    def share_from(self, source: Location) -> bool:
        """Make this (absent) file hold ``source``'s bytes without them passing through this
        process: a hard link on a local disk (both names share the bytes; removing either leaves
        the other whole), a server-side copy on an object store. False where the storage cannot
        (another filesystem, no hard links, a store without copy): the caller writes the bytes."""
        try:
            return self._backend.share(source._backend, source.path, self.path)
        except (OSError, NotImplementedError):
            return False

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
        except NoBucket as exc:
            raise NotFoundError(f"bucket {exc} does not exist", where=self.url,
                                hint="create it first; ckpttool never creates buckets") from None
        except (NotRegular, IsADirectoryError):
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


_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


def _kind(errnos: set, text: str) -> str | None:
    """"full", "denied" or None: what an OS error (its errnos, its text lower-cased) says about the storage."""
    if errnos & _FULL or any(t in text for t in ("no space left", "errno 28", "file too large", "errno 27", "quota")):
        return "full"
    if errnos & _DENIED or "permission denied" in text or "read-only file system" in text:
        return "denied"
    return None


def describe_os_error(exc: OSError, verb: str = "access") -> str:
    kind = _kind({exc.errno}, "")
    if kind == "full":
        return f"no space left on device while writing ({exc.strerror}); free space or write elsewhere"
    if kind == "denied":
        return f"permission denied: cannot {verb} here ({exc.strerror})"
    return exc.strerror or str(exc)


def save_error(exc: BaseException, step_dir: Location) -> CkptError:
    """One typed error for a failed save, from any exception (torch's writers wrap the OSError,
    sometimes in text only). torch's zip writer reports a refused write as "unexpected pos ..."
    without the errno, so a nearly full disk is also checked for directly."""
    if isinstance(exc, CkptError):
        return exc
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 20:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    text = " ".join(str(e) for e in chain).lower()
    kind = _kind({getattr(e, "errno", None) for e in chain}, text)
    if kind is None and "unexpected pos" in text and step_dir.local_path is not None:
        try:
            st = os.statvfs(step_dir.local_path)
            kind = "full" if st.f_bavail * st.f_frsize < (1 << 20) else None
        except OSError:
            pass
    if kind == "full":
        return StorageError("no space left on device while saving", where=step_dir.url, hint="free space; earlier steps are intact")
    if kind == "denied":
        return StorageError("permission denied while saving", where=step_dir.url,
                            hint="check the directory's permissions; earlier steps are intact")
    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return StorageError(f"save failed: {last}", where=step_dir.url)


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

    @property
    def held_bytes(self) -> int:
        """The bytes held in memory for later reads (0: none)."""
        return 0 if self._held is None else len(self._held[1])

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
        self.readinto_parts(offset, [out])

    def readinto_parts(self, offset: int, outs: list[memoryview]) -> None:
        """Fill ``outs``, back to back, with the bytes from ``offset``: one read of adjacent ranges
        (a record's head, its data straight into a tensor, its rest) where the storage allows, none
        where the held bytes cover them."""
        want = sum(out.nbytes for out in outs)
        if self.holds(offset, want):
            at = offset - self._held[0]
            for out in outs:
                out[:] = memoryview(self._held[1])[at : at + out.nbytes]
                at += out.nbytes
            return
        if offset < 0:
            self.check_range(offset, want)
        if self._handle is None:
            self._handle = self.loc._call(self.loc._backend.open_read, missing="file does not exist", verb="read")
        got = self.loc._backend.preadv(self._handle, offset, outs, self.loc.path, self.size())
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
    return Location(Fsspec(fs), path)
