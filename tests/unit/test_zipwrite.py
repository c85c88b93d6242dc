"""ckpttool's zip writer writes the bytes zipfile writes for the same stored entries (its CRC-32 from
the fast module), on streams that cannot seek and streams that can, zip64 entries and offsets
included; torch and zipfile read its archives."""

from __future__ import annotations

import io
import random
import struct
import zipfile

import pytest
import torch

from ckpttool.formats.torchzip import ArchiveWriter
from ckpttool.formats.zipwrite import ZipOut

from ..helpers import FrontToBack


def _entries(seed: int) -> list[tuple[str, bytes, bool]]:
    rng = random.Random(seed)
    out = [(f"archive/data/{i}", rng.randbytes(rng.choice([0, 1, 63, 4096, 70_000])), i == 2) for i in range(6)]
    return out + [("archive/data.pkl", b"\x80\x02}q\x00.", False), ("archive/byteorder", b"little", False), ("archive/version", b"3\n", False)]


def _info(name: str, pad: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    return info


def _by_zipfile(stream, entries) -> None:
    with zipfile.ZipFile(stream, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for i, (name, data, zip64) in enumerate(entries):
            info = _info(name, i % 7)
            info.compress_type, info.file_size = zipfile.ZIP_STORED, len(data)
            with z.open(info, mode="w", force_zip64=zip64) as f:
                f.write(data[:10])
                f.write(memoryview(data)[10:])


def _by_ckpttool(stream, entries, put: bool = False) -> None:
    z = ZipOut(stream)
    for i, (name, data, zip64) in enumerate(entries):
        info = _info(name, i % 7)
        info.file_size = len(data)
        if put:  # the whole entry at once
            z.put(info, zip64, data)
            continue
        with z.open(info, zip64) as f:
            f.write(data[:10])
            f.write(memoryview(data)[10:])
    z.close()


@pytest.mark.parametrize("put", [False, True], ids=["streamed", "put whole"])
@pytest.mark.parametrize("seekable", [False, True], ids=["front to back", "seekable"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_bytes_are_zipfiles(seekable, seed, put):
    entries = _entries(seed)
    ours, theirs = (io.BytesIO(), io.BytesIO()) if seekable else (FrontToBack(), FrontToBack())
    _by_zipfile(theirs, entries)
    _by_ckpttool(ours, entries, put)
    got, want = (ours.getvalue(), theirs.getvalue()) if seekable else (bytes(ours.buf), bytes(theirs.buf))
    assert got == want
    with zipfile.ZipFile(io.BytesIO(got)) as z:
        assert z.testzip() is None  # every entry's CRC-32 checked by zipfile (zlib)
        assert [z.read(n) for n, _, _ in entries] == [d for _, d, _ in entries]


def test_zip64_end_records_when_entries_outnumber_the_plain_field():
    # 65,536 entries need zip64's end records (count over 0xFFFF), as zipfile writes them
    entries = [(f"e{i}", b"x" if i % 2 else b"", False) for i in range(65_536)]
    ours, theirs = FrontToBack(), FrontToBack()
    _by_zipfile(theirs, entries)
    _by_ckpttool(ours, entries)
    assert bytes(ours.buf) == bytes(theirs.buf)


def test_torch_loads_an_archive_written_by_archive_writer(tmp_path):
    t = torch.randn(33, 17)
    path = tmp_path / "a.pt"
    with open(path, "wb") as fh:
        w = ArchiveWriter(fh)
        p, stream = w.new_tensor(torch.float32, (33, 17))
        with stream:
            stream.write(t.numpy().tobytes())
        w.finish({"t": p, "step": 3, "pair": (torch.arange(4), "x")})
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["t"], t) and loaded["step"] == 3 and torch.equal(loaded["pair"][0], torch.arange(4))


class _Hashed(io.RawIOBase):
    """A front-to-back stream that keeps only a hash of what it was given (gigabytes, no memory)."""

    def __init__(self) -> None:
        import xxhash

        self.h, self.n = xxhash.xxh3_128(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        return len(b)

    def tell(self) -> int:
        return self.n


def test_an_archive_past_2_gib_gets_zip64_sizes_offsets_and_end_records_as_zipfiles():
    block = memoryview(random.Random(3).randbytes(64 << 20))
    size = (2 << 30) + 12345  # over zipfile's 2 GiB limit: zip64 sizes; the entries after it: zip64 offsets

    def write(z_open, close):
        for i, (n, zip64) in enumerate([(size, True), (100, False), (0, False)]):
            info = _info(f"archive/data/{i}", i)
            info.file_size = n
            with z_open(info, zip64) as f:
                left = n
                while left:
                    left -= f.write(block[:min(left, len(block))])
        close()

    theirs, ours = _Hashed(), _Hashed()
    z = zipfile.ZipFile(theirs, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)
    write(lambda info, zip64: z.open(info, mode="w", force_zip64=zip64), z.close)
    mine = ZipOut(ours)
    write(mine.open, mine.close)
    assert (ours.n, ours.h.hexdigest()) == (theirs.n, theirs.h.hexdigest())
