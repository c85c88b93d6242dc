"""Property-based fuzzing of every registered format (hypothesis): random bit flips, truncations,
spliced bytes, and field mutations of pickles, headers and paths. Whatever the input, every
command either gives the original data bitwise (or, where the format cannot know, at least
finishes), or raises a typed error (exit 1/2, one line); it never crashes with another exception,
never hangs, never allocates past a bound and never writes outside its output.

The default run takes about a minute; ``-m slow`` runs many more examples (``FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import resource
import signal
import struct
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpttool
from ckpttool import convert, formats
from ckpttool.offline.describe import inspect_path
from ckpttool.errors import CkptError
from ckpttool.offline.verify import verify_path

from ..helpers import FIXTURES, Hang, assert_same_checkpoint, output_name, reference_state, time_limit

sys.path.insert(0, FIXTURES)
from make_hostile import _patch_once, tensor_pickle, torch_file  # noqa: E402

#: the read-only formats, fuzzed from a committed fixture: per-rank folders (the FSDP guide's)
READ_ONLY = {"torch-ranks": os.path.join(FIXTURES, "rankfolders", "guide"),
             "trainer": os.path.join(FIXTURES, "trainers", "hf-trainer")}

CASE_SECONDS = 20  # one command on a tiny checkpoint takes well under a second
MEMORY_BOUND = 2 << 30  # more address space than this for a few-KB input is a failure
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
PATHS = ["../x", "/etc/passwd", "", ".", "..", "a/b", "x\x00y", "__0_0.distcp", "\\\\evil"]
INTS = st.one_of(st.integers(-4, 40), st.integers(-(2**40), 2**40), st.sampled_from([2**31, 2**63 - 1, -(2**63)]))


@contextlib.contextmanager
def memory_bound(extra: int):
    """RLIMIT_DATA at the current data size plus ``extra``: an allocation a tiny file should not
    cause fails at once (and fails the property, as an untyped error) instead of swapping."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    with open("/proc/self/status") as f:
        data_kib = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    limit = data_kib * 1024 + extra
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def snapshot(path: str) -> dict[str, bytes]:
    """name -> bytes of a checkpoint file, or of every file of a checkpoint directory."""
    if os.path.isdir(path):
        return {n: Path(path, n).read_bytes() for n in sorted(os.listdir(path))}
    return {"": Path(path).read_bytes()}


def materialise(files: dict[str, bytes], path: str) -> None:
    if "" in files:
        with open(path, "wb") as f:
            f.write(files[""])
        return
    os.makedirs(path)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


class References(dict):
    """format -> (its checkpoint of the reference state, that checkpoint's files); a short repr
    keeps hypothesis' failure reports readable."""

    def __repr__(self) -> str:
        return f"<reference checkpoints of {sorted(self)}>"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzzref")
    src = base / "ref.pt"
    torch.save(reference_state(), src)
    out = References()
    for fmt in formats.output_names():
        dst = base / output_name(fmt)
        convert(str(src), str(dst))
        out[fmt] = (str(dst), snapshot(str(dst)))
    for fmt, path in READ_ONLY.items():
        out[fmt] = (path, snapshot(path))
    return out


# --- mutations -----------------------------------------------------------------------------------


def bytes_mutation(data: st.DataObject, files: dict[str, bytes]) -> tuple[dict[str, bytes], set[str]]:
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    raw = bytearray(files[name])
    how = data.draw(st.sampled_from(["flip", "truncate", "splice"]), label="how")
    if how == "truncate" or not raw:
        raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)), label="cut")]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
            raw[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    else:
        pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
        blob = data.draw(st.binary(min_size=1, max_size=24), label="blob")
        raw[pos : pos + len(blob)] = blob
    return {**files, name: bytes(raw)}, {name}


def dcp_field_mutation(data: st.DataObject, files: dict[str, bytes]) -> tuple[dict[str, bytes], set[str]]:
    """One field of .metadata (ours: plain pickle is fine here) set to a hostile value."""
    md = pickle.loads(files[".metadata"])
    tensors = sorted(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks"))
    what = data.draw(st.sampled_from(["size", "chunk_offset", "chunk_size", "storage_offset", "storage_length",
                                      "relative_path", "dtype", "planner_path"]), label="field")
    key = data.draw(st.sampled_from(tensors), label="key")
    entry = md.state_dict_metadata[key]
    if what == "size":
        size = list(entry.size)
        if size:
            size[0] = data.draw(INTS, label="size")
        entry.size = size
    elif what in ("chunk_offset", "chunk_size") and entry.chunks and entry.size:
        c = entry.chunks[0]
        attr = "offsets" if what == "chunk_offset" else "sizes"
        setattr(c, attr, [data.draw(INTS)] + list(getattr(c, attr))[1:])
    elif what in ("storage_offset", "storage_length", "relative_path"):
        mi = data.draw(st.sampled_from(sorted(md.storage_data, key=str)), label="record")
        info = md.storage_data[mi]
        new = type(info).__new__(type(info))
        new.__dict__.update(info.__dict__)
        field, value = {"storage_offset": ("offset", INTS), "storage_length": ("length", INTS),
                        "relative_path": ("relative_path", st.sampled_from(PATHS))}[what]
        setattr(new, field, data.draw(value, label=field))
        md.storage_data[mi] = new
    elif what == "dtype":
        entry.properties.dtype = data.draw(st.sampled_from([torch.float64, torch.int8, torch.bool, torch.complex64, torch.quint8]))
    else:
        md.planner_data[key] = tuple(data.draw(st.lists(st.one_of(st.text(max_size=4), INTS), max_size=4), label="path"))
    return {**files, ".metadata": pickle.dumps(md)}, {".metadata"}


def safetensors_field_mutation(data: st.DataObject, files: dict[str, bytes]) -> tuple[dict[str, bytes], set[str]]:
    raw = files[""]
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    key = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")), label="key")
    what = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "metadata"]), label="field")
    if what == "dtype":
        header[key]["dtype"] = data.draw(st.sampled_from(["F32", "F16", "I64", "BOOL", "Q4", "", "F8_E4M3"]))
    elif what == "shape":
        header[key]["shape"] = data.draw(st.lists(INTS, max_size=3))
    elif what == "data_offsets":
        header[key]["data_offsets"] = [data.draw(INTS), data.draw(INTS)]
    else:
        meta = header.setdefault("__metadata__", {})
        name = data.draw(st.sampled_from(["ckpttool.paths", "ckpttool.objects", "format"]))
        meta[name] = data.draw(st.sampled_from(['{"a": [1]}', "[", '{"extra.step": {"__dict__": [[[1], 2]]}}', '{"x": 5}', "null"]))
    body = json.dumps(header).encode()
    return {"": struct.pack("<Q", len(body)) + body + raw[8 + n :]}, {""}


def torch_field_mutation(data: st.DataObject, files: dict[str, bytes]) -> tuple[dict[str, bytes], set[str]]:
    """A torch.save file whose tensor has hostile storage offset, shape and stride (CRCs valid)."""
    shape = tuple(data.draw(st.lists(INTS, max_size=3), label="shape"))
    stride = tuple(data.draw(st.lists(INTS, min_size=len(shape), max_size=len(shape)), label="stride"))
    clamp = lambda v: max(-(2**31), min(2**31 - 1, v))  # noqa: E731 - BININT holds 32 bits
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.pt")
        torch_file(path, tensor_pickle(clamp(data.draw(INTS, label="offset")), tuple(map(clamp, shape)), tuple(map(clamp, stride))))
        return {"": Path(path).read_bytes()}, {""}


def _repickled(raw: bytes, edit) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.pt")
        Path(path).write_bytes(raw)
        from make_hostile import _repickle

        _repickle(path, edit)
        return Path(path).read_bytes()


#: where a DTensor's pickle spells the numbers a folder's reader trusts least: the rank's coordinate,
#: the local tensor's shape, the mesh's shape, a shard dim, the global size, the saving rank
_DTENSOR_FIELDS = [b"_coordinate_on_dim", b"_local_tensor", b"X\x05\x00\x00\x00shape", b"X\x03\x00\x00\x00dim",
                   b"DTensor\n", b"X\x05\x00\x00\x00_rank"]


def ranks_field_mutation(data: st.DataObject, files: dict[str, bytes]) -> tuple[dict[str, bytes], set[str]]:
    """One small integer of one DTensor field of one rank's file set to another value (CRCs valid)."""
    name = data.draw(st.sampled_from(sorted(n for n in files if "_rank_" in n)), label="file")
    marker = data.draw(st.sampled_from(_DTENSOR_FIELDS), label="field")
    value = data.draw(st.integers(0, 255), label="value")

    def edit(pkl: bytes) -> bytes:
        at = pkl.find(marker)
        k = pkl.find(b"K", at + len(marker)) if at >= 0 else -1
        return pkl if k < 0 else _patch_once(pkl, marker, pkl[k:k + 2], b"K" + bytes([value]))

    return {**files, name: _repickled(files[name], edit)}, {name}


FIELD_MUTATIONS = {"dcp": dcp_field_mutation, "safetensors": safetensors_field_mutation, "torch": torch_field_mutation,
                   "torch-ranks": ranks_field_mutation,
                   # a trainer folder's parts are each one of the formats above: its field mutations are theirs
                   "trainer": bytes_mutation}


# --- the property --------------------------------------------------------------------------------


def run_everything(fmt: str, path: str, work: str, reference: str, exact: bool) -> None:
    """Every command on ``path``: a result or a typed error; a successful convert equals the
    reference bitwise when ``exact`` (the damage was somewhere the format's checks cover)."""
    outputs = os.path.join(work, "out")
    os.makedirs(outputs)
    calls = [("inspect", lambda: inspect_path(path)), ("verify", lambda: verify_path(path))]
    for other in formats.output_names():
        dst = os.path.join(outputs, output_name(other))
        calls.append((f"convert->{other}", lambda dst=dst: convert(path, dst)))
    if fmt in ("dcp", "torch-ranks"):
        calls.append(("load", lambda: ckpttool.load(path, torch.nn.Linear(1, 1))))
    for name, call in calls:
        try:
            with time_limit(CASE_SECONDS):
                result = call()
        except CkptError:
            continue
        if name.startswith("convert") and exact:
            assert_same_checkpoint(reference, os.path.join(outputs, output_name(name.split("->")[1])), name, result.dropped)
    left = set(os.listdir(outputs)) - {output_name(o) for o in formats.output_names()}
    assert not left, f"temporary output left behind: {left}"
    assert set(os.listdir(work)) <= {"in", os.path.basename(path), "out"}, os.listdir(work)


def exactness(fmt: str, touched: set[str]) -> bool:
    """Whether the format's checks cover every byte the mutation touched: torch's zip CRC-32s cover
    the pickle and the data; a DCP's .metadata has no checksum outside a ckpttool step;
    safetensors has none at all."""
    if fmt in ("torch", "torch-ranks"):
        return True
    if fmt == "trainer":  # its safetensors model and JSON state carry no checksums
        return not any(name.endswith((".safetensors", ".json")) for name in touched)
    if fmt == "dcp":
        return ".metadata" not in touched
    return False


def fuzz_settings(default: int):
    return settings(max_examples=EXAMPLES or default, deadline=None, derandomize=not EXAMPLES,
                    suppress_health_check=list(HealthCheck), database=None)


def _property(fmt: str, references, data: st.DataObject, field: bool) -> None:
    reference, files = references[fmt]
    mutated, touched = (FIELD_MUTATIONS[fmt] if field else bytes_mutation)(data, files)
    with tempfile.TemporaryDirectory(prefix="ckpttool-fuzz-") as work:
        path = os.path.join(work, "in" if os.path.isdir(reference) else os.path.basename(reference))
        materialise(mutated, path)
        with memory_bound(MEMORY_BOUND):
            run_everything(fmt, path, work, reference, exactness(fmt, touched) and not field)
        assert snapshot(path) == mutated, "a command changed its input"


@pytest.mark.parametrize("fmt", formats.names())
@fuzz_settings(default=150)
@given(data=st.data())
def test_byte_damage(fmt, references, data):
    _property(fmt, references, data, field=False)


@pytest.mark.parametrize("fmt", formats.names())
@fuzz_settings(default=100)
@given(data=st.data())
def test_field_mutations(fmt, references, data):
    _property(fmt, references, data, field=True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", formats.names())
@settings(max_examples=EXAMPLES or 2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data(), field=st.booleans())
def test_long_run(fmt, references, data, field):
    _property(fmt, references, data, field)


def _numpy_pickle() -> bytes:
    import numpy as np

    rng = np.random.RandomState(3)
    return pickle.dumps({"rng": rng.get_state(), "seen": np.int64(12), "f": np.float32(0.5), "mask": np.array([True, False]),
                         "grid": np.arange(12, dtype=">f4").reshape(3, 4).T, "c": np.complex64(1 - 2j)}, protocol=2)


@fuzz_settings(default=300)
@given(data=st.data())
def test_numpy_values_rebuild_or_refuse(data):
    """A pickle of numpy values with bytes flipped, cut or spliced: the allow-listed unpickler
    gives a value or a typed error, and never allocates past the bound."""
    from ckpttool.safe_pickle import load_torch_pickle

    mutated, _ = bytes_mutation(data, {"": _numpy_pickle()})
    with memory_bound(MEMORY_BOUND), time_limit(CASE_SECONDS):
        try:
            load_torch_pickle(mutated[""], "fuzz.pkl")
        except CkptError:
            pass


def test_numpy_values_rebuild_bitwise():
    from ckpttool.safe_pickle import load_torch_pickle, same_value

    raw = _numpy_pickle()
    assert same_value(load_torch_pickle(raw, "numpy.pkl"), pickle.loads(raw))


def test_the_bounds_are_enforced(references):
    """The harness itself: an allocation past the bound fails, a hang is cut short."""
    with pytest.raises((MemoryError, RuntimeError)), memory_bound(MEMORY_BOUND):
        torch.empty(MEMORY_BOUND * 2, dtype=torch.uint8).fill_(1)
    with pytest.raises(Hang), time_limit(0.5):
        signal.pause()
