"""Storage backends: the few primitives each provides (stat, list, ranged reads into a caller's
buffer, streamed writes, remove, rename), the local disk through ``os`` (positioned reads straight
into tensor memory, write-back as a file grows, fsync before a commit) and everything else through
fsspec (parallel ranged reads; on S3, uploads whose parts go up in the background: upload.py).
``storage.location.Location`` builds everything else on them."""

from __future__ import annotations

import contextlib
import errno
import io
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

from .commit import CommitPolicy, InPlaceCommit, RenameCommit
from .localfile import LocalFile
from .upload import MultipartWriter, Uploads

class Backend(ABC):
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
    def bytes_under(self, path: str, enough: int) -> int:
        """The bytes of the file, or of every file below the directory, counted until ``enough``
        (a sum that reaches it may stop there; :mod:`ckpttool.parallel` sizes a command's input)."""

    @abstractmethod
    def read_bytes(self, path: str, start: int | None, end: int | None) -> bytes: ...

    @abstractmethod
    def open_read(self, path: str) -> Any:
        """A handle for :meth:`pread`."""

    @abstractmethod
    def pread(self, handle: Any, offset: int, out: memoryview, path: str, size: int) -> int:
        """Fill ``out`` from ``offset`` as far as the file goes (``handle`` is ``open_read(path)``
        of a file of ``size`` bytes); returns the bytes read."""

    def preadv(self, handle: Any, offset: int, outs: list[memoryview], path: str, size: int) -> int:
        """Fill ``outs``, back to back, from ``offset`` as far as the file goes (one read where the
        storage can scatter it); returns the bytes read."""
        got = 0
        for out in outs:
            n = self.pread(handle, offset + got, out, path, size)
            got += n
            if n < out.nbytes:
                break
        return got

    @abstractmethod
    def open_write(self, path: str) -> Any:
        """A context manager yielding a binary file; on an exception inside it nothing is committed."""

    @abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abstractmethod
    def remove(self, path: str) -> None: ...

    @abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    def share(self, source: Backend, src: str, dst: str) -> bool:
        """Make ``dst`` hold ``source``'s file ``src`` without the bytes passing through this
        process; False where this storage cannot (the caller then writes them)."""
        return False

    def local_path(self, path: str) -> str | None:
        return None

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; False when it did."""

    def version(self, path: str) -> tuple | None:
        """What changes when the file's bytes are rewritten (not when it gains or loses a link):
        the identity and modification time the storage keeps. None where there is none to read."""
        return None

    def islink(self, path: str) -> bool:
        return False

    def resolved(self, path: str) -> str:
        """The path with every symlink resolved (the same path where there are none)."""
        return path

    def escapes(self, parent: str, child: str) -> bool:
        """Whether ``child`` (named inside ``parent``) resolves to a place outside it (a symlink)."""
        return False


class LocalDisk(Backend):
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

    def bytes_under(self, path: str, enough: int) -> int:
        if not os.path.isdir(path):
            return os.path.getsize(path)
        total, seen = 0, set()

        def fail(exc: OSError) -> None:  # an unreadable directory: an error, not an empty one
            raise exc

        # links to directories are not followed; a link to a file counts as the file (formats read
        # through it), once
        for top, _, files in os.walk(path, onerror=fail):
            for name in files:
                try:
                    st = os.stat(os.path.join(top, name))
                except FileNotFoundError:  # removed while counting, or a dangling link
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
            if total >= enough:
                break
        return total

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
                raise NotRegular(path)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    def pread(self, handle: Any, offset: int, out: memoryview, path: str, size: int) -> int:
        return self.preadv(handle, offset, [out], path, size)

    def preadv(self, handle: Any, offset: int, outs: list[memoryview], path: str, size: int) -> int:
        bufs, got, fd = [out for out in outs if out.nbytes], 0, handle.fileno()
        while bufs:  # one system call (a short one goes on where it stopped)
            n = os.preadv(fd, bufs, offset + got)
            if n == 0:
                break
            got += n
            while bufs and n >= bufs[0].nbytes:
                n -= bufs.pop(0).nbytes
            if n:
                bufs[0] = bufs[0][n:]
        return got

    @contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        f = LocalFile(path)  # O_DIRECT where allowed (localfile.py)
        # small writes (a record's headers and pickle: ~25 a record) gathered in C before LocalFile's Python
        buffered = io.BufferedWriter(f, buffer_size=SMALL_WRITES)
        try:
            yield buffered
            buffered.flush()
            f.finish()  # every byte written and fsync'ed: durable before a commit that follows
        finally:
            with contextlib.suppress(Exception):  # (after an error: what it still holds goes to a file that is discarded)
                buffered.close()
            f.close()

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

    def share(self, source: Backend, src: str, dst: str) -> bool:
        """A hard link (both names share the bytes; removing either leaves the other whole)."""
        if source.local_path(src) is None:
            return False
        os.link(source.local_path(src), dst)
        return True

    def local_path(self, path: str) -> str | None:
        return path

    def version(self, path: str) -> tuple | None:
        st = os.stat(path)
        return ("local", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

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


SMALL_WRITES = 64 << 10  # bytes of small writes gathered before a local file sees them


class NotRegular(OSError):
    """A path that exists but is not a regular file (a FIFO, a device, a directory)."""


class NoBucket(Exception):
    """An object store's bucket (or container) that does not exist."""


#: remote transfers are split into parts of this size: reads of at least two parts into ranged
#: requests (each request costs a round trip whatever its size: docs/benchmarks.md, bench/s3.py),
#: S3 uploads into the parts of a multipart upload (storage/upload.py) ...
PART_BYTES = 16 << 20
#: ... this many in flight at once (bounded: each part is held in memory until copied out, or
#: until uploaded; see storage.upload.Uploads for every upload's memory together)
PARALLEL_PARTS = 4
#: the window of parts in flight, the upload threads and the memory for parts being filled that
#: every S3 upload of this process shares
UPLOADS = Uploads(PART_BYTES, PARALLEL_PARTS * PART_BYTES)


class Fsspec(Backend):
    commit = InPlaceCommit()
    batch_reads = True

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fsspec) and other.fs is self.fs

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

    def bytes_under(self, path: str, enough: int) -> int:
        total = int(self.fs.du(path, total=True))  # one listing of everything below (an object store's is)
        self.fs.invalidate_cache(path)  # (listdir refreshes a directory, not those below it: files written later must show)
        return total

    def version(self, path: str) -> tuple | None:
        info = self.fs.info(path)
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
        return None if tag is None else ("fsspec", info.get("size"), str(tag))

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
        f = self._open_upload(path)
        try:
            yield f
        except BaseException:
            discard_upload(f)
            raise
        f.close()  # completes the upload: only now does the object exist

    def _open_upload(self, path: str) -> Any:
        """S3: a :class:`MultipartWriter`, whose parts upload while the caller produces the next
        (s3fs's own file uploads each part inside ``write()``); elsewhere the filesystem's file.
        An S3 store that wants parts of one fixed size (``fixed_upload_size``, R2) keeps s3fs's."""
        s3fs = sys.modules.get("s3fs")  # an S3FileSystem exists only once s3fs was imported
        if s3fs is not None and isinstance(self.fs, s3fs.S3FileSystem) and not getattr(self.fs, "fixed_upload_size", False):
            return MultipartWriter(self.fs, path, UPLOADS)
        return self.fs.open(path, "wb")

    def makedirs(self, path: str) -> None:
        split = getattr(self.fs, "split_path", None)  # object stores (s3fs, gcsfs, adlfs): bucket first
        if callable(split):
            bucket = split(path)[0]
            if bucket and not self.fs.exists(bucket):
                raise NoBucket(bucket)  # fsspec's makedirs would create it: never do that
        self.fs.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst, recursive=True)

    def share(self, source: Backend, src: str, dst: str) -> bool:
        """A server-side copy, within one store."""
        if source != self:
            return False
        self.fs.copy(src, dst)
        return True

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


def discard_upload(f: Any) -> None:
    """Abort an unfinished upload (S3: the multipart upload) instead of completing it on close."""
    discard = getattr(f, "discard", None)
    if callable(discard):
        discard()
    try:
        f.closed = True  # fsspec's buffered files would otherwise complete the upload when collected
    except (AttributeError, TypeError):
        pass
