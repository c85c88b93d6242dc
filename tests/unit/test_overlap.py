"""Read-ahead in the pipeline: slab k+1 is read while slab k is written, the output is the same
bits, and a failed write leaves no read running."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool import convert
from ckpttool.formats import open_source
from ckpttool import engine
from ckpttool.engine import ReadAhead
from ckpttool.formats.base import TensorSpec, stream_slabs, stream_tensor


def test_the_next_slab_is_read_while_the_current_one_is_written():
    data = torch.arange(64 * 10, dtype=torch.float32).reshape(64, 10)
    events: list[tuple[str, int, float, float, str]] = []
    lock = threading.Lock()

    def read_into(key, box, which):
        start = time.perf_counter()
        time.sleep(0.02)
        out = data[box[0][0]: box[0][0] + box[1][0]].clone()
        with lock:
            events.append(("read", box[0][0], start, time.perf_counter(), threading.current_thread().name))
        return out

    written = []

    def write(buf):
        start = time.perf_counter()
        time.sleep(0.05)
        written.append(bytes(buf))
        with lock:
            events.append(("write", len(written) - 1, start, time.perf_counter(), threading.current_thread().name))

    spec = TensorSpec("w", ("w",), (64, 10), torch.float32)
    budget = 8 * 10 * 4  # 8 rows a slab
    with ThreadPoolExecutor(1, thread_name_prefix="ckpttool-read") as pool:
        ahead = ReadAhead([("w", b) for b in stream_slabs(spec, budget)], read_into, pool)
        stream_tensor(write, spec, lambda box: ahead.read("w", box), budget)
    assert b"".join(written) == data.numpy().tobytes()
    reads = sorted((e for e in events if e[0] == "read"), key=lambda e: e[1])
    writes = [e for e in events if e[0] == "write"]
    assert len(reads) == len(writes) == 8
    assert all(e[4].startswith("ckpttool-read") for e in reads)
    # the read of slab k+1 began before the write of slab k ended: the two overlapped
    assert all(reads[k + 1][2] < writes[k][3] for k in range(7)), events


def test_stop_waits_for_the_read_in_flight_and_a_request_off_schedule_is_read_directly():
    data = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    finished = threading.Event()

    def read_into(key, box, which):
        time.sleep(0.1)
        if box[0][0] > 0:
            finished.set()
        return data[box[0][0]: box[0][0] + box[1][0]].clone()

    def write(buf):
        raise OSError(28, "No space left on device")

    spec = TensorSpec("w", ("w",), (4, 2), torch.float32)
    with ThreadPoolExecutor(1) as pool:
        ahead = ReadAhead([("w", b) for b in stream_slabs(spec, 2 * 4)], read_into, pool)
        with pytest.raises(OSError):
            stream_tensor(write, spec, lambda box: ahead.read("w", box), 2 * 4)
        ahead.stop()  # as the pipeline does in its finally
        assert finished.is_set()  # the read of slab 1, started ahead, was done before stop returned
        # a sink that asks out of the scheduled order gets the right bytes, read directly
        ahead = ReadAhead([("w", b) for b in stream_slabs(spec, 2 * 4)], read_into, pool)
        assert torch.equal(ahead.read("w", ((2, 0), (1, 2))), data[2:3])
        assert torch.equal(ahead.read("w", ((0, 0), (1, 2))), data[0:1])


def test_small_slabs_are_read_in_the_callers_thread_and_large_ones_ahead():
    """A slab under min_bytes is read when its turn comes, in the thread that asks (handing it to
    the reader thread and back cost more than it hid), and never while a read is in flight (a
    source is read by one thread at a time); the next large one is still read ahead."""
    data = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    boxes = [((r, 0), (1, 4)) for r in range(16)]
    sizes = [1000 if r % 3 == 0 else 16 for r in range(16)]  # rows 0, 3, 6, ... "large"
    readers: dict[int, str] = {}
    sets = [torch.empty(1, 4), torch.empty(1, 4)]  # the two buffer sets: a slab lives in its set until the next read
    lock = threading.Lock()
    active, most = [0], [0]

    def read_into(key, box, which):
        row = box[0][0]
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        readers[row] = threading.current_thread().name
        sets[which].copy_(data[row: row + 1])
        time.sleep(0.03 if sizes[row] >= 100 else 0.01)
        with lock:
            active[0] -= 1
        return sets[which]

    with ThreadPoolExecutor(1, thread_name_prefix="ckpttool-read") as pool:
        ahead = ReadAhead([("w", b) for b in boxes], read_into, pool, sizes, min_bytes=100)
        got = []
        for b in boxes:
            slab = ahead.read("w", b)
            time.sleep(0.02)  # written while the next one is read ahead
            got.append(slab.clone())
    assert torch.equal(torch.cat(got), data)  # each slab in its own set, untouched until the next read
    assert most[0] == 1  # never two reads at once
    me = threading.current_thread().name
    assert {r for r, name in readers.items() if name.startswith("ckpttool-read")} == {r for r in range(16) if r % 3 == 0}
    assert all(readers[r] == me for r in range(16) if r % 3)


@pytest.mark.parametrize("command", ["convert-safetensors", "convert-torch", "reshard-3"])
def test_every_read_follows_the_sinks_schedule_in_the_background(tmp_path, monkeypatch, command):
    """With read-ahead on, every slab is read by the background thread (none falls back to a
    direct read: each sink's read_order is the order it really reads in), and the output is
    the same bits as without."""
    from ckpttool.formats.dcp.source import DcpSource
    from ckpttool.offline.reshard import reshard

    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(300, 64), "b": torch.randn(64).to(torch.bfloat16), "c": torch.arange(7)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "src"))
    threads: list[str] = []
    real = DcpSource.read_tensor

    def spy(self, key, box=None, out=None):
        threads.append(threading.current_thread().name)
        return real(self, key, box, out)

    monkeypatch.setattr(DcpSource, "read_tensor", spy)
    monkeypatch.setattr(engine, "AHEAD_BYTES", 0)  # every slab ahead, however small (these are 4 KiB)
    outs = []
    for ahead in (True, False):
        threads.clear()
        out = str(tmp_path / f"{command}-{ahead}{'.safetensors' if 'safetensors' in command else '.pt' if 'torch' in command else ''}")
        if command.startswith("reshard"):
            reshard(str(tmp_path / "src"), out, world_size=3, memory_budget=4096, read_ahead=ahead)
        else:
            convert(str(tmp_path / "src"), out, memory_budget=4096, read_ahead=ahead)
        assert len(threads) > 10
        assert all(t.startswith("ckpttool-read") for t in threads) if ahead else not any(t.startswith("ckpttool-read") for t in threads)
        outs.append(out)
    for key in ("model.w", "model.b", "model.c"):
        with open_source(outs[0]) as a, open_source(outs[1]) as b:
            assert torch.equal(a.read_tensor(key).view(torch.uint8), b.read_tensor(key).view(torch.uint8)), key


def test_convert_with_read_ahead_reads_in_the_background_and_writes_the_same_bits(tmp_path, monkeypatch):
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(300, 64), "b": torch.randn(64).to(torch.bfloat16)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "src"))
    from ckpttool.formats.dcp.source import DcpSource

    threads = set()
    real = DcpSource.read_tensor

    def spy(self, key, box=None, out=None):
        threads.add(threading.current_thread().name)
        return real(self, key, box, out)

    monkeypatch.setattr(DcpSource, "read_tensor", spy)
    monkeypatch.setattr(engine, "AHEAD_BYTES", 0)
    for ahead in (True, False):
        threads.clear()
        out = tmp_path / f"out-{ahead}.safetensors"
        convert(str(tmp_path / "src"), str(out), memory_budget=4096, read_ahead=ahead)  # many slabs
        assert any(t.startswith("ckpttool-read") for t in threads) == ahead, threads
        with open_source(str(out)) as src:
            assert torch.equal(src.read_tensor("model.w"), state["model"]["w"])
            assert torch.equal(src.read_tensor("model.b").view(torch.int16), state["model"]["b"].view(torch.int16))


def test_a_local_output_written_back_as_it_grows_keeps_every_byte(tmp_path, monkeypatch):
    """Local outputs ask the kernel to write each window back as the file grows (the speed of it
    is measured in bench/); whatever the windows, seeks back to patch a header included, the file
    holds exactly the bytes written."""
    import random
    import sys

    from ckpttool import storage

    if sys.platform.startswith("linux"):
        assert storage.SYNC_FILE_RANGE is not None  # Linux always has it: the hint is really given here
    monkeypatch.setattr(storage.localfile, "WRITEBACK_WINDOW", 4096 * 3)
    rng = random.Random(0)
    expected = bytearray()
    loc = storage.resolve(str(tmp_path / "out.bin"))
    with loc.open_write() as f:
        for i in range(200):
            block = rng.randbytes(rng.choice([1, 100, 4096, 5000, 70000]))
            f.write(block)
            expected += block
            if i % 17 == 0:  # patch an earlier byte, as the archive writers patch a header
                at = rng.randrange(len(expected))
                f.seek(at)
                f.write(b"\x7f")
                expected[at] = 0x7F
                f.seek(len(expected))
    assert (tmp_path / "out.bin").read_bytes() == bytes(expected)
