"""Streamed uploads to S3 whose parts go up in the background while the caller produces the next
bytes: multipart uploads fed through one bounded window of parts per process, completed at close,
aborted on any failure, so that an object appears at its key whole or not at all.

s3fs's own writer uploads each part inside ``write()``: the conversion producing the bytes waits
for every part. Here ``write()`` only appends to the part being filled; a full part is handed to
a few upload threads (each part one request through s3fs's ``call_s3``) and ``write()`` returns
at once, unless the parts uploading fill the window, when it waits for one to finish. The window
and the threads are shared by every file being uploaded (a DCP sink keeps many open at once), and
so is the memory for parts being filled: with many files open, each sends smaller parts.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("ckpttool")

#: S3's limits: a part (but the last) of at least 5 MiB, at most 5 GiB, at most 10,000 parts
MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
MAX_PARTS = 10_000
#: the part size doubles after every this many parts (see part_size)
PARTS_PER_SIZE = 1_000


def part_size(number: int, first: int) -> int:
    """The size of part ``number`` (from 1) of an upload whose first parts are ``first`` bytes: the
    same up to part 1,000 (16 GB with 16 MiB parts, any checkpoint file but the largest), then
    doubling every 1,000 parts, so that 10,000 parts reach S3's 5 TiB object limit. A part larger
    than the window uploads alone (memory then grows with the part: 3 parts of 256 MiB past 250 GB)."""
    return min(first << ((number - 1) // PARTS_PER_SIZE), MAX_PART_BYTES)


class UploadError(OSError):
    """An upload that failed (in the background or at its completion); ``filename`` is the object's URL."""


class Uploads:
    """What the uploads of one process share: the window of parts in flight (at most ``window``
    bytes, or one part when a part is larger), the threads that send them, and the memory for
    parts being filled (``window`` bytes split between the files open, each part at least S3's
    5 MiB and at most ``part_bytes``).

    Memory held by all uploads together: the parts being filled, the window, and the HTTP client's
    copy of each part it is sending (aiohttp copies a request body): at most
    ``max(window, files * 5 MiB) + 2 * window``; with one file open, ``part_bytes + 2 * window``
    (144 MiB for 4 parts of 16 MiB in flight), with 64 open (a DCP reshard to 64 ranks) 448 MiB.
    s3fs's own writer holds, per open file, its 50 MiB block, the part read out of it and the HTTP
    client's copy: 64 open files held gigabytes."""

    def __init__(self, part_bytes: int, window: int):
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be at least {MIN_PART_BYTES} (S3's smallest part), got {part_bytes}")
        self.part_bytes = part_bytes
        self.window = max(window, part_bytes)
        self.threads = max(1, self.window // MIN_PART_BYTES)  # as many as parts fit in the window
        self._pid = -1
        self._start()

    def _start(self) -> None:
        """The lock, the counts and the threads, made again in a forked child (the parent's threads
        do not exist there)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self.lock = threading.Condition()
        self.uploading = 0  # bytes of the parts in flight
        self.files = 0  # uploads open
        self._pool: ThreadPoolExecutor | None = None

    def first_part(self) -> int:
        """The size of the next parts of an open upload: the filling memory split between the files."""
        return max(MIN_PART_BYTES, min(self.part_bytes, self.window // max(1, self.files)))

    def opened(self) -> None:
        self._start()
        with self.lock:
            self.files += 1

    def closed(self) -> None:
        with self.lock:
            self.files -= 1

    def reserve(self, size: int, failed: Any) -> bool:
        """Take ``size`` bytes of the window, waiting while the parts in flight leave too little;
        False, without waiting longer, once ``failed()`` is true."""
        with self.lock:
            while self.uploading and self.uploading + size > self.window and not failed():
                self.lock.wait()
            if failed():
                return False
            self.uploading += size
            return True

    def submit(self, fn: Any, *args: Any) -> Future:
        """Run ``fn(*args)`` on an upload thread (after :meth:`reserve`)."""
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpttool-upload")
            pool = self._pool
        return pool.submit(fn, *args)

    def done(self, size: int) -> None:
        """A part of ``size`` bytes has left the window (sent or failed)."""
        with self.lock:
            self.uploading -= size
            self.lock.notify_all()

    def wake(self) -> None:
        """Wake the writers waiting for the window (one of them has failed)."""
        with self.lock:
            self.lock.notify_all()


class MultipartWriter:
    """A write-only, non-seekable binary file on S3 whose parts upload while the next is filled,
    within the window ``uploads`` shares between every upload of the process.

    A file smaller than one part is one PUT at :meth:`close`; a larger one is a multipart upload
    created at its first full part. :meth:`close` uploads the last part, waits for the others and
    completes the upload: only then does the object exist. A failed part upload is raised (as
    :class:`UploadError`, naming the object and the part) at the next ``write()`` or at
    ``close()``; after any failure, and on :meth:`discard`, the multipart upload is aborted, so no
    object appears. Not an ``io.IOBase`` on purpose: a writer dropped without :meth:`close` (a
    crash) leaves an incomplete multipart upload, invisible to readers, never a completed object
    (``s3fs``'s ``clear_multipart_uploads(bucket)`` or a bucket lifecycle rule removes its parts)."""

    def __init__(self, fs: Any, path: str, uploads: Uploads):
        self.fs = fs
        self.path = path
        self.url = fs.unstrip_protocol(path)
        self.bucket, self.key = fs.split_path(path)[:2]
        self.uploads = uploads
        self.closed = False
        self._buf = bytearray()  # the part being filled: grows as it fills (a small file costs its size), then is reused
        self._fill = 0  # ... filled up to here
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: dict[int, dict[str, Any]] = {}  # part number -> what complete_multipart_upload needs
        self._sent = 0  # parts handed to the upload threads
        self._error: UploadError | None = None
        self._futures: list[Future] = []
        uploads.opened()

    # --- the file interface the writers use ------------------------------------------------------

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        return None

    def write(self, data: Any) -> int:
        """Append ``data`` to the part being filled, sending each part that fills; raises the
        error of any part that failed since."""
        self._check()
        view = memoryview(data).cast("B")
        n = view.nbytes
        while view.nbytes:
            size = self._part_size()
            if self._fill >= size:  # the parts got smaller since (more files open)
                self._send()
                continue
            take = min(view.nbytes, size - self._fill)
            self._buf[self._fill : self._fill + take] = view[:take]  # grows the buffer where it must
            self._fill += take
            view = view[take:]
            if self._fill == size:
                self._send()
        self._pos += n
        return n

    def close(self) -> None:
        """Upload what is left and complete the upload (the object appears now); on any failure
        abort it and raise :class:`UploadError`."""
        if self.closed:
            return
        try:
            if self._upload_id is None:  # smaller than one part: one PUT
                self._check()
                self._request("uploading", self.fs.pipe_file, self.path, bytes(memoryview(self._buf)[: self._fill]))
            else:
                if self._fill:
                    self._send()
                self._wait_all()
                self._check()
                parts = [self._parts[n] for n in range(1, self._sent + 1)]
                self._request("completing the upload", self.fs.call_s3, "complete_multipart_upload", Bucket=self.bucket,
                              Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": parts})
                self._upload_id = None  # complete: nothing left to abort
            self.fs.invalidate_cache(self.path)
        except BaseException:
            self.discard()
            raise
        self._finish()

    def discard(self) -> None:
        """Abort the upload: parts not started are dropped, the ones uploading are waited for (a
        part that lands after the abort would keep its bytes stored), then the multipart upload
        is aborted. A failing abort is logged with the object, not raised: the object never
        appears either way."""
        if self.closed:
            return
        for future in self._futures:
            future.cancel()
        self._wait_all()
        if self._upload_id is not None:
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
            except Exception as exc:  # noqa: BLE001 - already failing; the object was never completed
                log.warning("could not abort the multipart upload %s of %s (%s); its parts stay stored until "
                            "aborted (s3fs: clear_multipart_uploads)", self._upload_id, self.url, exc)
        self._finish()

    # --- the parts -------------------------------------------------------------------------------

    def _part_size(self) -> int:
        return part_size(self._sent + 1, self.uploads.first_part())

    def _send(self) -> None:
        """Hand the part being filled to the upload threads (waiting while the window is full) and
        start a new one in the same buffer. The part goes as ``bytes`` of its own: immutable, so a
        request sent again (a retry, by botocore or s3fs) sends the same bytes, and sent by the
        HTTP client (aiohttp) through one copy read out in small chunks, where a ``bytearray``
        body would be copied whole and its unsent rest copied again into the socket's buffer."""
        number = self._sent + 1
        if number > MAX_PARTS:
            self._error = UploadError(errno.EFBIG, f"too large for one S3 object ({MAX_PARTS} parts)", self.url)
        self._check()
        if self._upload_id is None:
            mpu = self._request("starting the upload", self.fs.call_s3, "create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self._upload_id = mpu["UploadId"]
        size = self._fill
        reserved = self.uploads.reserve(size, lambda: self._error is not None)
        self._check()  # (reserve gives up only once a part failed: raised here)
        if not reserved:
            raise UploadError(errno.EIO, "no room for a part in the upload window", self.url)
        # copied once its place in the window is taken: no more parts exist than the window holds
        future = self.uploads.submit(self._upload_part, number, [bytes(memoryview(self._buf)[:size])], size)
        self._sent = number
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(future)
        self._fill = 0
        size = self._part_size()
        if len(self._buf) > size:  # smaller parts now (more files open): hold no more than one
            del self._buf[size:]

    def _upload_part(self, number: int, holder: list[bytes], size: int) -> None:
        """One part (the bytes in ``holder``, taken out so that they are freed before the window
        lets the next part in), on an upload thread: a failure is kept for the writer to raise."""
        try:
            out = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                  PartNumber=number, Body=holder.pop())
            part = {"PartNumber": number, "ETag": out["ETag"]}
            if "ChecksumSHA256" in out:  # as s3fs's own writer completes its parts
                part["ChecksumSHA256"] = out["ChecksumSHA256"]
            self._parts[number] = part
        except BaseException as exc:  # noqa: BLE001 - handed to the writer, raised there
            if self._error is None:
                self._error = self._failure(f"uploading part {number}", exc)
            self.uploads.wake()
        finally:
            self.uploads.done(size)

    def _request(self, doing: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, one request; its failure becomes (and stays) this upload's error."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self._error = self._failure(doing, exc)
            raise self._error from exc

    def _wait_all(self) -> None:
        for future in self._futures:
            if not future.cancelled():
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - a part's error is in self._error
                    pass
        self._futures = []

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self.closed:
            raise ValueError(f"write to a closed upload ({self.url})")

    def _failure(self, doing: str, exc: BaseException) -> UploadError:
        """An :class:`UploadError` naming the object (its ``filename``; ``Location`` puts it
        before the message), keeping the errno of an ``OSError`` cause (a permission error still
        reads as one)."""
        code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
        text = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or type(exc).__name__
        error = UploadError(code, f"{doing} failed: {text}", self.url)
        error.__cause__ = exc
        return error

    def _finish(self) -> None:
        self.closed = True
        self._buf = bytearray()
        self.uploads.closed()
