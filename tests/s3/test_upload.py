"""S3 writes upload their parts in the background (storage/upload.py), against the real server.

Failures and slow requests are injected through botocore's event hooks on the client of an s3fs
instance of the test's own (``before-send``: the request is about to leave; ``after-call``: its
answer arrived): every request that is not failed on purpose goes to the server."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from urllib.parse import parse_qs, urlsplit

import fsspec
import pytest
import torch

from ckpttool import convert
from ckpttool.errors import StorageError
from ckpttool.storage import PARALLEL_PARTS, PART_BYTES, Fsspec, Location
from ckpttool.storage.upload import MAX_PART_BYTES, MAX_PARTS, MIN_PART_BYTES, MultipartWriter, UploadError, Uploads, part_size

MiB = 1 << 20


@contextlib.contextmanager
def traced():
    """The peak of memory allocated (tracemalloc) inside the block, above what it started with."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    result = {}
    try:
        yield lambda: result["peak"]
    finally:
        result["peak"] = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()


def own_fs():
    """An s3fs instance no other test shares (hooks registered on its client stay with it)."""
    return fsspec.filesystem("s3", skip_instance_cache=True)


class PartRequests:
    """The UploadPart requests of one s3fs instance: how many are in flight at once and how many
    bytes they carry, which part numbers were sent and their sizes; optionally each delayed, or
    part ``fail`` failed before it leaves."""

    def __init__(self, fs, delay: float = 0.0, fail: int | None = None):
        self.now = self.most = self.bytes_now = self.most_bytes = 0
        self.numbers: list[int] = []
        self.sizes: list[int] = []
        self.delay, self.fail = delay, fail
        events = fs.s3.meta.events
        events.register("before-send.s3.UploadPart", self._sent)
        events.register("after-call.s3.UploadPart", self._answered)

    async def _sent(self, request, **kwargs):
        number = int(parse_qs(urlsplit(request.url).query)["partNumber"][0])
        size = int(request.headers.get("X-Amz-Decoded-Content-Length") or request.headers["Content-Length"])
        request.context["part_bytes"] = size
        self.numbers.append(number)
        self.sizes.append(size)
        self.now += 1
        self.bytes_now += size
        self.most = max(self.most, self.now)
        self.most_bytes = max(self.most_bytes, self.bytes_now)
        if self.delay:
            await asyncio.sleep(self.delay)
        if number == self.fail:
            self._answered(context=request.context)
            raise ConnectionResetError(errno.ECONNRESET, "connection reset (injected by the test)")

    def _answered(self, context, **kwargs):
        self.now -= 1
        self.bytes_now -= context["part_bytes"]


def server_requests(s3_server, key: str, since: int = 0) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", s3_server.log_text())  # the server colours its log
    return [ln for ln in text.splitlines() if key in ln and '"' in ln][since:]


def pending_uploads(fs, bucket: str, key: str) -> list:
    fs.invalidate_cache()
    return [u for u in fs.list_multipart_uploads(bucket) if u["Key"] == key]


def test_a_multipart_write_round_trips_bitwise(s3_server, bucket):
    """A file of several parts, written in odd-sized pieces (a float tensor's memory among them),
    reads back byte for byte, uploaded as part PUTs and one completion; a small file and an empty
    one are one PUT each."""
    torch.manual_seed(0)
    pieces = [b"head", torch.randn(5 * MiB).numpy().data, os.urandom(3), os.urandom(PART_BYTES + 12345), b"", b"tail"]
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    assert len(expected) > 2 * PART_BYTES  # three parts
    loc = Location(Fsspec(own_fs()), f"{bucket}/big.bin")
    with loc.open_write() as f:
        for p in pieces:
            assert f.write(p) == memoryview(p).nbytes
        assert f.tell() == len(expected)
    assert loc.read_bytes() == expected
    lines = server_requests(s3_server, f"/{bucket}/big.bin")
    assert sum("partNumber=" in ln and '"PUT ' in ln for ln in lines) == 3, lines
    assert sum('"POST ' in ln and "uploadId=" in ln for ln in lines) == 1, lines  # the completion

    for name, data in (("small.bin", os.urandom(1000)), ("empty.bin", b"")):
        small = loc.sibling(name)
        with small.open_write() as f:
            f.write(data)
        assert small.read_bytes() == data
        lines = server_requests(s3_server, f"/{bucket}/{name}")
        assert [ln for ln in lines if '"PUT ' in ln or '"POST ' in ln] and not any("uploadId" in ln for ln in lines), lines


def test_a_converted_checkpoint_on_s3_has_the_bytes_of_the_local_one(s3_server, bucket, tmp_path):
    """The DCP files convert writes to s3 (a data file of several parts, and .metadata) hold the
    bytes it writes to the local disk."""
    torch.manual_seed(0)
    torch.save({"model": {f"w{i}": torch.randn(3 * MiB) for i in range(4)}, "extra": {"step": 3}}, tmp_path / "s.pt")
    convert(str(tmp_path / "s.pt"), str(tmp_path / "local"))
    convert(str(tmp_path / "s.pt"), f"s3://{bucket}/remote")
    fs = own_fs()
    names = sorted(os.listdir(tmp_path / "local"))
    assert sorted(os.path.basename(p) for p in fs.ls(f"{bucket}/remote")) == names
    for name in names:
        assert fs.cat_file(f"{bucket}/remote/{name}") == (tmp_path / "local" / name).read_bytes(), name
    assert os.path.getsize(tmp_path / "local" / "__0_0.distcp") > 2 * PART_BYTES


def test_a_failed_part_upload_is_raised_at_the_next_write_and_leaves_no_object(s3_server, bucket):
    """Part 2 fails on its way to the server while the producer goes on writing: the error comes
    out of a later write (not only at close), names the object and the part, and the upload is
    aborted: no object, no multipart upload left holding parts."""
    fs = own_fs()
    loc = Location(Fsspec(fs), f"{bucket}/failed.bin")
    parts = PartRequests(fs, fail=2)
    chunk = os.urandom(MiB)
    writes = 0
    with pytest.raises(StorageError) as caught:
        with loc.open_write() as f:
            for writes in range(1, 64 * PART_BYTES // MiB):  # far more than the window holds: never reaches close
                f.write(chunk)
    assert writes * MiB < (2 + PARALLEL_PARTS + 1) * PART_BYTES  # raised by a write, once part 2 had failed
    assert str(caught.value) == f"s3://{bucket}/failed.bin: uploading part 2 failed: connection reset (injected by the test)"
    assert 2 in parts.numbers
    assert not fs.exists(f"{bucket}/failed.bin")
    assert pending_uploads(fs, bucket, "failed.bin") == []


def test_a_failure_found_at_close_leaves_no_object(s3_server, bucket):
    """The last part fails: close raises it, naming the object, and completes nothing."""
    fs = own_fs()
    writer = MultipartWriter(fs, f"{bucket}/last.bin", Uploads(MIN_PART_BYTES, 2 * MIN_PART_BYTES))
    PartRequests(fs, fail=3)
    writer.write(os.urandom(2 * MIN_PART_BYTES + 100))  # parts 1, 2 and the start of 3
    with pytest.raises(UploadError, match="uploading part 3 failed") as caught:
        writer.close()
    assert caught.value.filename == f"s3://{bucket}/last.bin" and caught.value.errno == errno.ECONNRESET
    assert writer.closed
    assert not fs.exists(f"{bucket}/last.bin")
    assert pending_uploads(fs, bucket, "last.bin") == []


def test_an_error_while_producing_aborts_the_upload(s3_server, bucket):
    """The code producing the bytes fails after two parts went up: the upload is aborted, never
    completed, and the error that happened is the one raised."""
    fs = own_fs()
    loc = Location(Fsspec(fs), f"{bucket}/aborted.bin")
    with pytest.raises(RuntimeError, match="conversion failed"):
        with loc.open_write() as f:
            f.write(os.urandom(2 * PART_BYTES + 5))
            raise RuntimeError("conversion failed")
    assert not fs.exists(f"{bucket}/aborted.bin")
    assert pending_uploads(fs, bucket, "aborted.bin") == []
    lines = server_requests(s3_server, f"/{bucket}/aborted.bin")
    assert any('"DELETE ' in ln and "uploadId=" in ln for ln in lines), lines  # AbortMultipartUpload


def test_parts_in_flight_are_bounded_by_the_window(s3_server, bucket):
    """Uploads slower than the producer: no more than the window's bytes of parts are uploading
    at once (and parts do overlap), and the memory allocated meanwhile stays under the bound
    Uploads states (the part being filled, the window, the HTTP client's copy of each part it
    sends), plus one part of slack for everything else, however much is written."""
    fs = own_fs()
    part, window = MIN_PART_BYTES, 3 * MIN_PART_BYTES
    parts = PartRequests(fs, delay=0.3)
    writer = MultipartWriter(fs, f"{bucket}/bounded.bin", Uploads(part, window))
    chunk = os.urandom(MiB)
    total = 12 * part + 7
    with traced() as peak:
        for _ in range(total // MiB):
            writer.write(chunk)
        writer.write(chunk[: total % MiB])
        writer.close()
    assert parts.most == window // part and parts.most_bytes <= window, (parts.most, parts.most_bytes, parts.numbers)
    assert sorted(parts.numbers) == list(range(1, 14))
    assert peak() < part + 2 * window + part, peak() / MiB
    assert fs.size(f"{bucket}/bounded.bin") == total


def test_files_open_together_share_the_window_and_the_memory(s3_server, bucket):
    """Four files written together, a piece to each in turn (as a DCP sink writes its ranks'
    files): their parts share one window, and they send smaller parts (down to S3's 5 MiB) so
    that the parts being filled share the window's memory too; each file reads back whole."""
    fs = own_fs()
    uploads = Uploads(2 * MIN_PART_BYTES, 2 * 2 * MIN_PART_BYTES)  # 10 MiB parts, 20 MiB in flight
    parts = PartRequests(fs, delay=0.3)
    names = [f"{bucket}/shared-{i}.bin" for i in range(4)]
    writers = [MultipartWriter(fs, name, uploads) for name in names]
    pieces = [[os.urandom(MiB) for _ in range(17)] for _ in writers]  # 17 MiB each: 4 parts of 5 MiB
    with traced() as peak:
        for k in range(17):
            for writer, own in zip(writers, pieces):
                writer.write(own[k])
        for writer in writers:
            writer.close()
    assert parts.most_bytes <= uploads.window and parts.most > 1, (parts.most, parts.most_bytes)
    assert max(parts.sizes) == MIN_PART_BYTES and len(parts.sizes) == 4 * 4, parts.sizes
    assert peak() < max(uploads.window, 4 * MIN_PART_BYTES) + 2 * uploads.window + MIN_PART_BYTES, peak() / MiB
    for name, own in zip(names, pieces):
        assert fs.cat_file(name) == b"".join(own)


def test_files_opened_through_storage_share_one_window(s3_server, bucket):
    """Every S3 file the storage layer opens in this process takes its parts' place in the same
    window (storage.backends.UPLOADS): four files written together never have more than the
    window's bytes uploading at once."""
    from ckpttool.storage.backends import UPLOADS

    fs = own_fs()
    parts = PartRequests(fs, delay=0.2)
    locs = [Location(Fsspec(fs), f"{bucket}/together-{i}.bin") for i in range(4)]
    chunk = os.urandom(MiB)
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(loc.open_write()) for loc in locs]
        for _ in range(2 * PART_BYTES // MiB + 1):  # two full parts each, and a last one
            for f in files:
                f.write(chunk)
    assert parts.most_bytes <= UPLOADS.window < 4 * 2 * PART_BYTES, (parts.most_bytes, parts.sizes)
    assert len(parts.sizes) == 4 * 3
    for loc in locs:
        assert loc.size() == 2 * PART_BYTES + MiB


def test_a_killed_writer_leaves_no_object(s3_server, bucket, tmp_path):
    """A process killed in the middle of an upload (parts already on the server) leaves no
    object: the incomplete upload is invisible to readers."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from ckpttool.storage import resolve
        with resolve("s3://{bucket}/killed.bin").open_write() as f:
            f.write(os.urandom(3 * {PART_BYTES}))
            print("written", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, **s3_server.env})
    try:
        assert proc.stdout.readline().strip() == "written"
        fs = own_fs()
        deadline = time.monotonic() + 30
        while not any("partNumber=2" in ln for ln in server_requests(s3_server, f"/{bucket}/killed.bin")):
            assert time.monotonic() < deadline, "the parts never reached the server"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert not fs.exists(f"{bucket}/killed.bin")
    assert fs.ls(bucket) == [] or f"{bucket}/killed.bin" not in fs.ls(bucket)
    assert len(pending_uploads(fs, bucket, "killed.bin")) == 1


def test_part_sizes_reach_the_largest_object_s3_allows():
    """16 MiB parts up to part 1,000 (a file of 16 GB uploads in equal parts), doubling after, never
    past S3's 5 GiB part: 10,000 parts hold S3's largest object (5 TiB)."""
    sizes = [part_size(n, PART_BYTES) for n in range(1, MAX_PARTS + 1)]
    assert sizes[0] == sizes[999] == PART_BYTES and sizes[1000] == 2 * PART_BYTES
    assert sizes == sorted(sizes) and max(sizes) == MAX_PART_BYTES
    assert sum(sizes) >= 5 << 40
