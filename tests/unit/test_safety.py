"""Hostile pickles are refused with nothing run; outputs are never overwritten or left half-written."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ckpttool import convert
from ckpttool.cli import main
from ckpttool.errors import CorruptCheckpointError, OutputExistsError, UnsafePickleError
from ckpttool.formats import open_source


class Evil:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_dcp_metadata_is_refused_and_nothing_runs(tmp_path, ref_pt):
    ck = tmp_path / "ck"
    convert(str(ref_pt), str(ck))
    marker = tmp_path / "PWNED"
    (ck / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    with pytest.raises(UnsafePickleError) as info:
        open_source(str(ck))
    assert ".metadata" in str(info.value) and "system" in str(info.value)
    result = CliRunner().invoke(main, ["inspect", str(ck)])
    assert result.exit_code == 2 and "refused to unpickle" in result.output and "Traceback" not in result.output
    assert not marker.exists()


def test_hostile_torch_file_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "PWNED"
    bad = tmp_path / "bad.pt"
    torch.save({"model": {"w": torch.ones(2)}, "x": Evil(marker)}, bad)
    for args in (["inspect", str(bad)], ["convert", str(bad), str(tmp_path / "o.safetensors")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "bad.pt" in result.output and "system" in result.output
    assert not marker.exists() and not (tmp_path / "o.safetensors").exists()


def test_hostile_object_inside_dcp_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "PWNED"
    ck = tmp_path / "ck"
    dcp.save({"model": {"w": torch.ones(2)}, "extra": {"evil": Evil(marker)}}, checkpoint_id=str(ck))
    assert not marker.exists()
    with open_source(str(ck)) as src:
        assert torch.equal(src.read_tensor("model.w"), torch.ones(2))
        with pytest.raises(UnsafePickleError, match="extra.evil"):
            src.read_object("extra.evil")
    result = CliRunner().invoke(main, ["convert", str(ck), str(tmp_path / "o.pt")])
    assert result.exit_code == 2 and "extra.evil" in result.output
    assert not marker.exists()


def test_existing_output_is_refused_and_left_untouched(tmp_path, ref_pt):
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"precious")
    with pytest.raises(OutputExistsError):
        convert(str(ref_pt), str(dst))
    assert dst.read_bytes() == b"precious"
    convert(str(ref_pt), str(dst), force=True)
    assert torch.load(dst, weights_only=True)["extra"]["step"] == 10


def test_failed_convert_leaves_no_output_and_no_temp(tmp_path, ref_pt):
    ck = tmp_path / "ck"
    convert(str(ref_pt), str(ck))
    data = ck / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # cut the data file short
    for name in ("out.pt", "out.safetensors", "out_dcp"):
        with pytest.raises(CorruptCheckpointError) as info:
            convert(str(ck), str(tmp_path / "outs" / name))
        assert "__0_0.distcp" in str(info.value)
        assert not (tmp_path / "outs" / name).exists()
    leftovers = [p.name for p in (tmp_path / "outs").iterdir()] if (tmp_path / "outs").exists() else []
    assert leftovers == []


def test_plain_stdlib_values_come_back_as_themselves_and_nothing_named_is_called(tmp_path):
    import collections
    import datetime
    import io

    from ckpttool.safe_pickle import load_torch_pickle, same_value

    losses = io.BytesIO()
    torch.save([1.5, 2.5], losses)
    losses.seek(3)
    value = {"losses": losses, "window": collections.deque([1.0, 2.0], maxlen=4),
             "seen": collections.defaultdict(list, a=[1]), "counts": collections.Counter("aab"),
             "when": datetime.datetime(2026, 11, 23, 3, 4, 5, tzinfo=datetime.timezone.utc),
             "took": datetime.timedelta(seconds=3), "nested": (io.BytesIO(b"x"), [io.BytesIO(b"y")]),
             "torch": torch.__version__}
    back = load_torch_pickle(pickle.dumps(value, protocol=2), "x.pt")
    assert same_value(back, value)
    assert type(back["losses"]) is io.BytesIO and back["losses"].tell() == 3
    assert torch.load(io.BytesIO(back["losses"].getvalue()), weights_only=True) == [1.5, 2.5]
    assert back["window"].maxlen == 4 and back["seen"].default_factory is list
    assert type(back["torch"]) is type(torch.__version__) and back["torch"] == torch.__version__
    assert not same_value(back, {**value, "losses": io.BytesIO(b"other")})
    # what a pickle names is never called: a defaultdict whose factory is not a plain type is refused
    with pytest.raises(UnsafePickleError, match="default factory"):
        load_torch_pickle(pickle.dumps(collections.defaultdict(collections.Counter), protocol=2), "bad.pt")
    with pytest.raises(UnsafePickleError, match="Evil"):
        load_torch_pickle(pickle.dumps(collections.defaultdict(Evil), protocol=2), "bad.pt")


def test_the_new_value_types_give_a_hostile_pickle_nothing_to_expand_or_call():
    """Found by a review: builtins.str was callable (str of a shared structure doubles with each
    level: 226 bytes asked for 25 MB); a BytesIO's attributes escaped every check; a BytesIO in a
    set stayed a stand-in; a position past the end raised a bare OverflowError."""
    import io

    from ckpttool.safe_pickle import load_torch_pickle

    laughs = b"\x80\x02c__builtin__\nstr\n]q\x000"
    for i in range(1, 23):
        laughs += b"(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"lq" + bytes([i]) + b"0"
    laughs += b"h" + bytes([22]) + b"\x85R."
    with pytest.raises(UnsafePickleError, match="refused to call builtins.str"):
        load_torch_pickle(laughs, "laughs.pt")
    buf = io.BytesIO(b"abc")
    buf.extra = [1]
    cases = {"attributes": pickle.dumps(buf, protocol=2), "in a set": pickle.dumps({"s": [1]}, protocol=2)}
    cases["in a set"] = b"\x80\x02c__builtin__\nset\n]c_io\nBytesIO\n)\x81(C\x01aK\x00Nt" + b"ba\x85R."
    cases["past the end"] = b"\x80\x02c_io\nBytesIO\n)\x81C\x01a\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00\x01N\x87b."
    expect = {"attributes": "no attributes", "in a set": "unhashable", "past the end": "a position inside them"}
    for name, data in cases.items():
        with pytest.raises((UnsafePickleError, CorruptCheckpointError), match=expect[name]):
            load_torch_pickle(data, f"{name}.pt")


@pytest.mark.parametrize("items", [(1, 1 << 63), (-(1 << 63) - 1,), (1, 2.0), (1, "2"), (1, None), (1 << 64,), (True, 2),
                                   (), (0, (1 << 63) - 1), (-(1 << 63), 5), (1 << 63,), (True,), (2.0,), ("2",), (None,),
                                   ((1 << 63) - 1,), (-(1 << 63),), (1024,), (3, 4, True), (3, 4, 5)])
def test_a_size_in_a_pickle_is_checked_the_same_on_its_fast_path(items):
    """safe_torch.Size is what a .metadata's torch.Size unpickles to: a tuple of plain ints takes a
    C-speed path; it accepts and refuses exactly what the item-by-item check does (ints of int64's
    range; a bool as the int it is; anything else a TypeError or ValueError, as torch raises)."""
    from ckpttool.safe_torch import Size

    def made(x):
        try:
            got = Size(x)
            assert type(got) is Size and all(type(v) is int for v in got)
            return tuple(got)
        except (TypeError, ValueError) as exc:
            return type(exc)

    fast, slow = made(tuple(items)), made(iter(items))  # (an iterator: never the fast path)
    assert fast == slow, (items, fast, slow)
    if any(type(v) is int and not -(1 << 63) <= v < (1 << 63) for v in items):
        assert fast is ValueError


@pytest.mark.parametrize("put", [b"r\xff\xff\xff\x7f", b"p2147483647\n"])
def test_a_put_of_a_huge_memo_index_allocates_nothing(put):
    """Five bytes of a damaged pickle (LONG_BINPUT or PUT of index 2**31 - 1) made the C unpickler
    allocate and clear a 32 GiB memo (a bit flipped in a .metadata did, in the formats' damage
    test): both readers take it within 256 MiB of memory more than they had."""
    import resource

    from ckpttool.safe_pickle import load_dcp_metadata, load_torch_pickle

    data = b"\x80\x02]" + put + b"."
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) for line in f if line.startswith("VmData:")) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (now + (256 << 20), hard))
    try:
        assert load_torch_pickle(data, "x") == []
        assert load_dcp_metadata(data, "x") == []
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
