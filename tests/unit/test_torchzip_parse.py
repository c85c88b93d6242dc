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


def _record_of(t: torch.Tensor) -> bytes:
    """A record as a ckpttool step's writer makes it (0 for its data's CRC-32: the manifest hashes it)."""
    out = FrontToBack()
    write_tensor(out, t.dtype, tuple(t.shape), None, lambda write: write(memoryview(t.numpy()).cast("B")), crc=False)
    return bytes(out.buf)


def test_records_of_one_layout_parse_once_and_each_finds_its_own_data_and_directory():
    """A file of many small records of one dtype and shape repeats the bytes around their data: a
    record whose bytes around its data are those of the record of that length parsed last takes
    its parse, at its own offset, with its own data's CRC-32; another pickle is parsed anew."""
    before = dict(torchzip.parses)

    def counts() -> tuple[int, int]:
        return torchzip.parses["parsed"] - before.get("parsed", 0), torchzip.parses["reused"] - before.get("reused", 0)

    # (a shape no other test saves: a record of its layout parsed before would be reused at once)
    first, second = _record_of(torch.arange(85.0).reshape(17, 5)), _record_of(torch.full((17, 5), 7.0))
    third = _record_of(torch.full((5, 17), 0.5))  # the same length, another pickle
    file = b"\0" * 100 + first + second + third
    reader = BytesReader(file, "x")
    a = torchzip.read_archive(reader, 100, len(first))
    assert counts() == (1, 0)
    b = torchzip.read_archive(reader, 100 + len(first), len(second))
    assert b.obj is a.obj and b.storages["0"].offset == a.storages["0"].offset + len(first)
    assert counts() == (1, 1)  # the second record: not parsed
    for arch, want in ((a, torch.arange(85.0)), (b, torch.full((85,), 7.0))):
        st = arch.storages["0"]
        assert torch.equal(torch.frombuffer(bytearray(file[st.offset:st.offset + st.nbytes]), dtype=torch.float32), want)
    assert len(third) == len(first)
    c = torchzip.read_archive(reader, 100 + 2 * len(first), len(third))
    assert c.obj.shape == (5, 17) and c.storages["0"].offset == a.storages["0"].offset + 2 * len(first)
    assert counts() == (2, 1)
    # the directory's CRC-32 of the data (ckpttool writes 0 there, torch the data's): its own, parsed
    # (after the third record's layout) or not
    crc_at = first.rfind(b"PK\x01\x02", 0, first.rfind(b"archive/data/0")) + 16
    patched = bytearray(second)
    patched[crc_at:crc_at + 4] = (0x12345678).to_bytes(4, "little")
    d = torchzip.read_archive(BytesReader(bytes(patched), "x"))
    e = torchzip.read_archive(BytesReader(second, "x"))
    assert (d.storages["0"].crc32, e.storages["0"].crc32) == (0x12345678, 0) and counts() == (3, 2)


def test_a_record_whose_pickle_lies_in_its_data_is_parsed_every_time():
    """A hostile record can point its directory's pickle into its storage's data: its parse then
    depends on the data, and another record with the same bytes around its data (but a damaged
    pickle inside it) must be parsed, not given the first one's answer."""
    base = _record_of(torch.zeros(512, dtype=torch.uint8))
    entries, (_pkl, _order, storages) = _parse(base)
    name, offset, size, _crc, _m = next(e for e in entries if e[0].endswith("data.pkl"))
    local = base[offset:offset + 30]
    span = 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little") + size
    ds = storages["0"].offset
    hostile = bytearray(base)
    hostile[ds:ds + span] = base[offset:offset + span]  # the pickle's header and bytes, inside the data
    cd = bytes(hostile).rfind(b"PK\x01\x02", 0, bytes(hostile).rfind(name.encode()))
    hostile[cd + 42:cd + 46] = ds.to_bytes(4, "little")  # the directory's pickle: at the copy
    first = torchzip.read_archive(BytesReader(bytes(hostile), "x"))  # parses (the copy's CRC-32 holds)
    assert first.storages["0"].offset == ds
    damaged = bytearray(hostile)
    damaged[ds + span - size // 2] ^= 0x20  # the copy's pickle, inside the data
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        torchzip.read_archive(BytesReader(bytes(damaged), "x"))


def _dcp_records(tmp_path, tensors: dict) -> list[bytes]:
    """The records of a torch ``dcp.save`` of ``tensors`` (one process), in file order."""
    import glob
    import re

    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (name,) = glob.glob(str(tmp_path / "dcp" / "*.distcp"))
    data = open(name, "rb").read()
    ends = [m.end() + 18 for m in re.finditer(rb"PK\x05\x06", data)]  # (each record's end record: no comment)
    return [data[a:b] for a, b in zip([0, *ends], ends)]


def test_torch_s_records_of_one_layout_take_a_kept_parse_with_their_own_crc(tmp_path):
    """torch's records of one dtype and shape differ outside their data too: the data's CRC-32 and a
    serialization id no parse uses. A kept parse still serves them, each with its own CRC-32; a
    record whose pickle's CRC-32 in the directory differs (that one is checked) is parsed."""
    torch.manual_seed(0)
    records = _dcp_records(tmp_path, {f"w{i}": torch.randn(13, 7) for i in range(4)})
    assert len({len(r) for r in records}) == 1 and len(set(records)) == 4
    before = dict(torchzip.parses)
    for record in records:
        archive = torchzip.read_archive(BytesReader(record, "x"))
        assert {k: (s.offset, s.nbytes, s.crc32) for k, s in archive.storages.items()} == _by_zipfile(record)[2]
        assert archive.obj.shape == (13, 7)
    assert torchzip.parses["reused"] - before.get("reused", 0) == 3
    damaged = bytearray(records[2])
    entries, _ = _parse(records[2])
    pkl_entry = bytes(damaged).rfind(b"PK\x01\x02", 0, bytes(damaged).rfind(next(e[0] for e in entries if e[0].endswith("data.pkl")).encode()))
    damaged[pkl_entry + 16] ^= 0x01  # the pickle's CRC-32 in the directory
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        torchzip.read_archive(BytesReader(bytes(damaged), "x"))


def _over_a_directory_crc(pkl: bytes, crc: int) -> bytes:
    """A hostile record whose storage's local header lies over its directory entry's CRC-32 (begun
    in the comment of the entry before): that field's bytes are the header's name and extra
    lengths, so they decide where its data starts."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", b"little")
        version = zipfile.ZipInfo("archive/version")
        version.comment = b"PK\x03\x04" + bytes(6)
        zf.writestr(version, b"3\n")
        zf.writestr("archive/data/0", bytes(range(16)))
    data = bytearray(buf.getvalue())
    entry = bytes(data).rfind(b"PK\x01\x02")  # the storage's directory entry (the last)
    data[entry + 16:entry + 20] = crc.to_bytes(4, "little")
    data[entry + 42:entry + 46] = (entry - 10).to_bytes(4, "little")  # its local header: the one in the comment
    return bytes(data)


def test_a_record_whose_local_header_lies_over_a_directory_crc_is_parsed_every_time():
    """A kept parse compares every byte its parse read but the directory's CRC-32 fields; a record
    whose parse read such a field through another read (a local header over it) is not kept: the
    next record of its length, the field's bytes aside the same, finds its own data."""
    pkl = _parse(_record_of(torch.zeros(4)))[1][0]
    a, b = _over_a_directory_crc(pkl, 0), _over_a_directory_crc(pkl, 8)
    assert len(a) == len(b)
    first = torchzip.read_archive(BytesReader(a, "x"))
    second = torchzip.read_archive(BytesReader(b, "x"))
    own = _parse(b)[1][2]["0"].offset
    assert second.storages["0"].offset == own == first.storages["0"].offset + 8
