"""The archive's directory is read by ckpttool for archives laid out as torch and ckpttool write
them (``torchzip._plain_entries``), by zipfile for any other: the same answer either way, the same
refusals of damage."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from ckpttool.errors import CorruptCheckpointError
from ckpttool.formats import torchzip
from ckpttool.formats.dcp.records import write_tensor
from ckpttool.storage import BytesReader

from ..helpers import FrontToBack


def _torch_archive() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(12.0).reshape(3, 4), "i": torch.ones(5, dtype=torch.int16), "step": 3}, buf)
    return buf.getvalue()


def _ckpttool_record() -> bytes:
    out = FrontToBack()
    t = torch.arange(40, dtype=torch.float32)
    write_tensor(out, t.dtype, tuple(t.shape), None, lambda write: write(memoryview(t.numpy()).cast("B")))
    return bytes(out.buf)


def _by_zipfile(data: bytes) -> tuple[bytes, str, dict]:
    """What zipfile says: the pickle, the byte order, and each storage's (data offset, size, CRC)."""
    zf = zipfile.ZipFile(io.BytesIO(data))
    pkl_name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
    prefix = pkl_name[: -len("data.pkl")]
    storages = {}
    for info in zf.infolist():
        if info.filename.startswith(prefix + "data/"):
            with zf.open(info) as f:
                f.read()  # (checks the local header against the directory, and the CRC-32)
            local = data[info.header_offset:info.header_offset + 30]
            start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
            assert data[start:start + info.file_size] == zf.read(info)
            storages[info.filename[len(prefix + "data/"):]] = (start, info.file_size, info.CRC)
    return zf.read(pkl_name), zf.read(prefix + "byteorder").decode(), storages


def _parse(data: bytes):
    window = torchzip._Window(BytesReader(data, "x"), 0, len(data), [(0, data)])
    return torchzip._plain_entries(window, len(data)), torchzip._parse_zip(window, 0, len(data), "x")


@pytest.mark.parametrize("make", [_torch_archive, _ckpttool_record], ids=["torch.save", "ckpttool record"])
def test_torch_and_ckpttool_archives_are_read_from_their_directory_with_zipfile_s_answer(make):
    data = make()
    entries, (pkl, byteorder, storages) = _parse(data)
    assert entries is not None  # the directory read here, not by zipfile
    want_pkl, want_order, want = _by_zipfile(data)
    assert (pkl, byteorder) == (want_pkl, want_order)
    assert {k: (s.offset, s.nbytes, s.crc32) for k, s in storages.items()} == want


def test_an_archive_with_a_comment_goes_to_zipfile_and_reads_the_same():
    data = _torch_archive()
    buf = io.BytesIO(data)
    with zipfile.ZipFile(buf, "a") as zf:
        zf.comment = b"a comment"
    odd = buf.getvalue()
    entries, (pkl, _order, storages) = _parse(odd)
    assert entries is None
    assert pkl == _by_zipfile(data)[0] and set(storages) == set(_by_zipfile(data)[2])


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x20
    return bytes(out)


@pytest.mark.parametrize("make", [_torch_archive, _ckpttool_record], ids=["torch.save", "ckpttool record"])
def test_a_flipped_byte_in_the_pickle_or_a_local_name_is_refused(make):
    data = make()
    entries, _ = _parse(data)
    name, offset, size, _crc, _m = next(e for e in entries if e[0].endswith("data.pkl"))
    local = data[offset:offset + 30]
    start = offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        torchzip.read_archive(BytesReader(_flip(data, start + size // 2), "x"))
    with pytest.raises(CorruptCheckpointError, match="differ"):
        torchzip.read_archive(BytesReader(_flip(data, offset + 31), "x"))  # the local header's copy of the name


def test_a_directory_entry_pointing_past_the_archive_is_refused():
    data = bytearray(_torch_archive())
    cd = bytes(data).rfind(b"PK\x01\x02", 0, bytes(data).rfind(b"archive/data/0"))  # the directory entry of a storage
    data[cd + 42:cd + 46] = (len(data) - 40).to_bytes(4, "little")  # its local header offset, near the end
    with pytest.raises(CorruptCheckpointError):
        torchzip.read_archive(BytesReader(bytes(data), "x"))


def test_a_storage_whose_size_runs_past_the_archive_is_refused():
    data = bytearray(_torch_archive())
    cd = bytes(data).rfind(b"PK\x01\x02", 0, bytes(data).rfind(b"archive/data/0"))
    big = (len(data) * 2).to_bytes(4, "little")
    data[cd + 20:cd + 28] = big + big  # its compressed and uncompressed sizes
    with pytest.raises(CorruptCheckpointError, match="runs past the end"):
        torchzip.read_archive(BytesReader(bytes(data), "x"))


@pytest.mark.parametrize("make", [_torch_archive, _ckpttool_record], ids=["torch.save", "ckpttool record"])
def test_reading_torch_and_ckpttool_archives_needs_no_zipfile(make, monkeypatch):
    data = make()

    def refuse(*args, **kwargs):
        raise AssertionError("zipfile parsed an archive of the plain layout")

    monkeypatch.setattr(torchzip.zipfile, "ZipFile", refuse)
    archive = torchzip.read_archive(BytesReader(data, "x"))
    assert archive.storages and archive.byteorder == "little"
