"""CRC-32: the fast module's values are zlib's, the fallback works without it, and CRC-32s of pieces
combine into the whole's."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib

import pytest

from ckpttool.checksums import CRC32_FROM, combine, cover, crc32, crc32_combine


def test_the_crc32_in_use_gives_zlibs_bits_for_any_size_and_start_value():
    rng = random.Random(0)
    data = rng.randbytes(3 << 20)
    for size in (0, 1, 7, 63, 64, 65, 4095, 4096, 65537, 1 << 20, 3 << 20):
        for start in (0, 1, 0xFFFFFFFF, rng.getrandbits(32)):
            assert crc32(data[:size], start) == zlib.crc32(data[:size], start), (CRC32_FROM, size, start)
    view = memoryview(bytearray(data)).cast("B")
    assert crc32(view[5:100_005]) == zlib.crc32(data[5:100_005])  # a slice of a memoryview, as the readers pass


def test_the_fast_module_is_used_where_installed():
    import importlib.util

    if importlib.util.find_spec("isal") is None:
        pytest.skip("isal is not installed here")
    assert CRC32_FROM == "isal"


@pytest.mark.parametrize("how", ["modules missing", "CKPTTOOL_CRC32=zlib"])
def test_without_the_fast_modules_zlib_is_used_and_checks_still_work(tmp_path, how):
    code = ("import sys\n"
            + ("sys.modules['isal'] = None\nsys.modules['zlib_ng'] = None\n" if how == "modules missing" else "")
            + "import zlib, torch, ckpttool\nfrom ckpttool.checksums import CRC32_FROM, crc32\n"
              "assert CRC32_FROM == 'zlib' and crc32 is zlib.crc32, CRC32_FROM\n"
              "from ckpttool.formats.torch_save import TorchSaveSource\nfrom ckpttool.storage import resolve\n"
              f"torch.save({{'w': torch.arange(1000.0)}}, {str(tmp_path / 'f.pt')!r})\n"
              f"with TorchSaveSource(resolve({str(tmp_path / 'f.pt')!r})) as s:\n"
              "    assert torch.equal(s.read_tensor('w'), torch.arange(1000.0))\n"
              "print('ok')\n")
    env = {**os.environ, **({"CKPTTOOL_CRC32": "zlib"} if how != "modules missing" else {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_crc32_combine_is_the_crc_of_the_concatenation():
    rng = random.Random(1)
    for _ in range(300):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = 3 << 30  # a length with high bits set: zero-byte operators up to 2**31
    assert crc32_combine(0x12345678, 0, big) == crc32_combine(crc32_combine(0x12345678, 0, 1 << 31), 0, big - (1 << 31))


def test_cover_takes_pieces_that_abut_and_leaves_the_rest_as_gaps():
    data = random.Random(2).randbytes(10_000)
    pieces = [(0, 3000), (2000, 6000), (3000, 5000), (5000, 5000), (9000, 12000), (7000, 8000), (7000, 8500)]
    segs = cover([(s, e, zlib.crc32(data[s:e])) for s, e in pieces], len(data))
    assert [(s, e, c is None) for s, e, c in segs] == [(0, 3000, False), (3000, 5000, False), (5000, 7000, True),
                                                     (7000, 8500, False), (8500, 10_000, True)]
    filled = [(s, e, c if c is not None else zlib.crc32(data[s:e])) for s, e, c in segs]
    assert combine(filled) == zlib.crc32(data)
