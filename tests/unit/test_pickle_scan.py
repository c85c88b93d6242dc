"""The C unpickler reads a pickle only where a scan of its opcodes finds nothing it would size from
the pickle's numbers unchecked (pickle_scan.py); Python's unpickler reads every other."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

from ckpttool.pickle_scan import c_unpickler_may_read
from ckpttool.safe_pickle import C_SCAN_MIN, load_dcp_metadata, load_torch_pickle, same_value

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# opcode bytes inside strings and bytes: a scan that does not walk opcode by opcode calls them a
# LONG_BINPUT of a huge index, a text PUT, a STOP before the end
_TRICKY = {"r\xff\xff\xff\x7f": b"r\xff\xff\xff\x7fp999999\n." * 40, "x" * 300: "y" * 70_000,
           "n": [10**40, 10**1000, -1, 2.5, None, True, (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
           "s": {1, 2}, "f": frozenset({3}), "b": bytearray(b"zz"), "big": b"q" * 300}


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_what_python_s_pickler_writes_at_protocols_2_to_5_is_read_by_the_c_unpickler(protocol):
    data = pickle.dumps(_TRICKY, protocol=protocol)
    assert c_unpickler_may_read(data)


def test_a_dcp_metadata_and_a_torch_save_pickle_are_read_by_the_c_unpickler_with_the_same_value(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {f"layers.{i}.weight": torch.ones(3, 2) for i in range(2000)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    metadata = (tmp_path / "dcp" / ".metadata").read_bytes()
    buf = io.BytesIO()
    torch.save(state, buf)
    data_pkl = zipfile.ZipFile(buf).read("archive/data.pkl")
    assert len(metadata) >= C_SCAN_MIN and len(data_pkl) >= C_SCAN_MIN
    assert c_unpickler_may_read(metadata) and c_unpickler_may_read(data_pkl)
    read = load_dcp_metadata(metadata, "x")
    assert read.state_dict_metadata == pickle.loads(metadata).state_dict_metadata  # (trusted here: our own file)
    refs = load_torch_pickle(data_pkl, "x")
    assert list(refs) == list(state) and refs["layers.7.weight"].shape == (3, 2)


@pytest.mark.parametrize("data", [
    b"\x80\x02]r\x00\x00\x00\x10.",  # LONG_BINPUT of an index past the pickle's length
    b"\x80\x02]p1\n.",  # a text PUT (any index)
    b"\x80\x02X\xff\xff\xff\x00abc.",  # a string counted past the end
    b"\x80\x05\x8e\x00\x00\x00\x00\x01\x00\x00\x00ab.",  # BINBYTES8 of 4 GiB
    b"\x80\x04\x95\x00\x00\x00\x00\x01\x00\x00\x00K\x01.",  # a FRAME of 4 GiB
    b"\x80\x02K\x01.K\x02",  # bytes after STOP
    b"\x80\x02K\x01",  # no STOP
    b"\x80\x02ccopyreg\n_reconstructor\n\x82\x01.",  # EXT1 (the extension registry)
])
def test_a_pickle_the_c_unpickler_would_size_from_its_numbers_is_left_to_python_s(data):
    assert not c_unpickler_may_read(data)


def test_a_hostile_memo_index_costs_no_memory():
    """A LONG_BINPUT of index 2**26 makes the C unpickler allocate and clear a 1 GiB memo array;
    read through the allow-list (a pickle big enough to be scanned), it costs nothing."""
    pad = 40_000
    assert 2 * pad + 16 >= C_SCAN_MIN
    data = b"\x80\x02]r" + (1 << 26).to_bytes(4, "little") + b"(" + b"K\x01" * pad + b"e."
    # (VmHWM: this process's own peak; ru_maxrss would count the pytest process it was forked from)
    code = ("import re, sys; from ckpttool.safe_pickle import load_torch_pickle; "
            "value = load_torch_pickle(sys.stdin.buffer.read(), 'x'); "
            "print(len(value), re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1))")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True, cwd=ROOT).stdout.split()
    assert int(out[0]) == pad and int(out[1]) < 300 * 1024, out  # (KiB: the process without torch is ~20 MiB)


def test_both_unpicklers_give_the_same_value():
    data = pickle.dumps(_TRICKY, protocol=2)
    assert len(data) >= C_SCAN_MIN and c_unpickler_may_read(data)
    assert same_value(load_torch_pickle(data, "x"), _TRICKY)


@pytest.mark.parametrize("index,may", [(65_535, True), (80_010, True), (80_011, False), (131_072, False), (1 << 24, False)])
def test_a_memo_index_is_read_by_the_c_unpickler_only_below_the_pickle_s_length(index, may):
    """A LONG_BINPUT whose index's high bytes are zero below the length is matched by the scan's
    regex, one above 65,535 is checked on its own: either way, below the length (80,011) and no further."""
    data = b"\x80\x02]r" + index.to_bytes(4, "little") + b"(" + b"K\x01" * 40_000 + b"e."
    assert len(data) == 80_011
    assert c_unpickler_may_read(data) is may
