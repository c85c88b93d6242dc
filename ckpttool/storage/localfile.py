"""A local output file written without the page cache's copy where the file system allows it.

Every byte of a buffered write is copied into the page cache, written back from there, and the
pages are reclaimed later, all on the writer's CPU; the same bytes written with ``O_DIRECT`` from
an aligned buffer cost a small part of that system time at the same speed (docs/benchmarks.md:
O_DIRECT). A save in the background competes with training for the cores, so that system time is
the save's cost.

:class:`LocalFile` gathers what is written into one page-aligned buffer (``BUFFER`` bytes) and
writes each full buffer at an aligned offset with ``O_DIRECT``. Where the file system refuses
``O_DIRECT`` (when it is turned on, or at a write), the file goes on through the page cache, written
back window by window as it grows (``sync_file_range``: the disk writes while the next bytes are
produced, and the final fsync finds little left). A file smaller than the buffer is written
through the page cache at the end. ``CKPTTOOL_DIRECT_IO=0`` turns ``O_DIRECT`` off (a comparison,
or a file system that accepts it and misbehaves).

The file is seekable: a write below the buffer (an archive writer patching a header it wrote
before) goes through the page cache with ``O_DIRECT`` off for that write; the kernel keeps the
cached pages and the direct writes coherent. Bytes are on disk only after :meth:`LocalFile.finish`
(every byte written, then fsync); closing without it discards nothing and promises nothing: the
caller removes an output whose write failed.
"""

from __future__ import annotations

import ctypes
import errno
import io
import logging
import mmap
import os
import sys
from typing import Any, Callable

log = logging.getLogger("ckpttool")

ALIGN = 4096  # offsets and lengths of direct writes: a page, a multiple of every disk's logical block
BUFFER = 8 << 20  # bytes gathered before a write (large enough that the write's size is not what limits its speed)
try:
    import fcntl
except ImportError:  # (Windows: no fcntl, no O_DIRECT either)
    fcntl = None  # type: ignore[assignment]
O_DIRECT = getattr(os, "O_DIRECT", 0) if fcntl is not None else 0  # Linux and a few others; 0: never direct


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
#: through the page cache, the kernel is asked to write each window back once written, and to have
#: finished the window before it: Linux otherwise keeps gigabytes dirty until the final fsync,
#: which then writes them all at once (slower: docs/benchmarks.md), and the dirty pages one output
#: holds stay about two windows
WRITEBACK_WINDOW = 64 << 20


#: a write of at least this many bytes goes to the file from the caller's memory where it can
#: (:meth:`LocalFile._from_source`): no copy into the buffer
FROM_SOURCE = 1 << 20


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def _address(view: memoryview) -> int:
    """The address of a contiguous view's first byte (read-only ones included: io.BufferedWriter
    hands a large write on to its raw file as a read-only view of the caller's memory)."""
    buf = _PyBuffer()
    _get_buffer(view, ctypes.byref(buf), 0)  # PyBUF_SIMPLE (raises for a view that is not contiguous)
    try:
        return buf.buf or 0
    finally:
        _release_buffer(ctypes.byref(buf))


def direct_wanted() -> bool:
    return bool(O_DIRECT) and os.environ.get("CKPTTOOL_DIRECT_IO", "1") != "0"


class LocalFile(io.RawIOBase):
    """A file created (truncated) at ``path`` for writing: see the module's text."""

    def __init__(self, path: str, direct: bool | None = None,
                 pwrite: Callable[[int, memoryview, int], int] = os.pwrite):
        """``pwrite``: the system call that writes (``os.pwrite``'s signature; one that refuses a
        write as a file system would, for a test)."""
        self._sys_pwrite = pwrite
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.path = path
        #: None: not tried yet (a file under one buffer never is); True: on; False: refused or off
        self.direct: bool | None = None if (direct_wanted() if direct is None else direct) else False
        self._buf: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._base = 0  # the file offset of the buffer's first byte (a multiple of ALIGN); below it, written
        self._fill = 0  # bytes of the buffer holding data
        self._pos = 0  # the stream's position
        self._started = self._waited = 0  # write-back through the page cache: started for [_waited, _started)
        self.from_source = 0  # bytes written straight from the caller's memory (:meth:`_from_source`)

    # --- io.RawIOBase ---------------------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        return self._fd

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        end = self._base + self._fill
        new = pos if whence == io.SEEK_SET else self._pos + pos if whence == io.SEEK_CUR else end + pos
        if not 0 <= new <= end:
            raise OSError(errno.EINVAL, f"seek to {new} outside the {end} bytes written")
        self._pos = new
        return new

    def flush(self) -> None:
        """Nothing: the bytes are written as buffers fill and at :meth:`finish`."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._pos < self._base:  # below the buffer: a patch of bytes already written
            k = min(n, self._base - self._pos)
            self._patch(view[:k], self._pos)
            self._pos += k
            view = view[k:]
        if view.nbytes >= FROM_SOURCE and self._pos == self._base + self._fill:
            view = self._from_source(view)
        if view.nbytes:
            self._gather(view)
        return n

    def finish(self) -> None:
        """Write what the buffer holds and fsync: every byte written is then on disk."""
        if self._fill:
            end = self._base + self._fill
            if self.direct:
                size = -(-self._fill // ALIGN) * ALIGN
                self._view[self._fill:size] = bytes(size - self._fill)  # never a byte of an older buffer
                self._out(self._view[:size], self._base)
                if size != self._fill:
                    os.ftruncate(self._fd, end)
            else:
                self._out(self._view[:self._fill], self._base)
            self._base, self._fill = end, 0
        os.fsync(self._fd)

    def close(self) -> None:
        if self.closed:
            return
        try:
            os.close(self._fd)
        finally:
            # the buffer is unmapped once nothing holds a view of it (an error's traceback may, a while)
            self._view = self._buf = None
            super().close()

    # --- the buffer -------------------------------------------------------------------------------

    def _from_source(self, view: memoryview) -> memoryview:
        """Write the middle of ``view`` (appended at the end of the file) straight from its memory,
        not through the buffer, where its address and the file offset agree modulo ``ALIGN`` (a
        staged tensor's page-aligned buffer written to a record whose data the writer put at a page
        of the file: ``ArchiveWriter(at=)``), or where the file is not direct; its head, up to the
        first aligned offset, joins the buffer, which is written out first. Returns what is left
        for the buffer (the tail under ``ALIGN``; all of ``view`` where the two do not agree)."""
        if self.direct is not False and (_address(view) - self._pos) % ALIGN:
            return view
        head = (-self._pos) % ALIGN
        middle = (view.nbytes - head) // ALIGN * ALIGN
        if middle <= 0:
            return view
        if head:
            self._gather(view[:head])
        if self._fill:  # (ends at an aligned offset now: written whole, direct where direct)
            self._out(self._view[:self._fill], self._base)
        start = self._base + self._fill
        self._out(view[head:head + middle], start)
        self._base = self._pos = start + middle
        self._fill = 0
        self.from_source += middle
        return view[head + middle:]

    def _gather(self, view: memoryview) -> None:
        """``view`` written at the position, which lies in the buffer (at most at its end)."""
        if self._buf is None:
            self._buf = mmap.mmap(-1, BUFFER)  # page-aligned, as O_DIRECT wants its memory
            self._view = memoryview(self._buf)
        done = 0
        while done < view.nbytes:
            at = self._pos - self._base
            k = min(view.nbytes - done, BUFFER - at)
            self._view[at:at + k] = view[done:done + k]
            done += k
            self._pos += k
            self._fill = max(self._fill, at + k)
            if self._fill == BUFFER and self._pos == self._base + BUFFER:
                self._out(self._view, self._base)
                self._base += BUFFER
                self._fill = 0

    def _out(self, view: memoryview, offset: int) -> None:
        """One buffer's bytes at ``offset``: directly if allowed (tried at the first full buffer),
        else through the page cache, written back as the file grows."""
        if self.direct is None:
            self.direct = self._set_direct(True)
        if self.direct:
            try:
                self._pwrite(view, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.debug("O_DIRECT write refused for %s (%s): through the page cache", self.path, exc)
                self.direct = False
                self._set_direct(False)
        self._pwrite(view, offset)
        self._write_back(offset + view.nbytes)

    def _patch(self, view: memoryview, offset: int) -> None:
        if self.direct:
            self._set_direct(False)
            try:
                self._pwrite(view, offset)
            finally:
                self._set_direct(True)
        else:
            self._pwrite(view, offset)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < view.nbytes:  # a short write goes on where it stopped
            done += self._sys_pwrite(self._fd, view[done:], offset + done)

    def _set_direct(self, on: bool) -> bool:
        """Turn O_DIRECT on or off for the file; whether it is on now (a file system that refuses it
        says EINVAL here, or at the first write)."""
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)
        except OSError as exc:
            if on and exc.errno == errno.EINVAL:
                log.debug("O_DIRECT refused for %s (%s): through the page cache", self.path, exc)
                return False
            raise
        return on

    def _write_back(self, end: int) -> None:
        if SYNC_FILE_RANGE is None or end - self._started < WRITEBACK_WINDOW:
            return
        if self._started > self._waited:
            SYNC_FILE_RANGE(self._fd, self._waited, self._started - self._waited, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        SYNC_FILE_RANGE(self._fd, self._started, end - self._started, _WRITE)
        self._waited, self._started = self._started, end
