"""One conformance suite every format's Source and Sink passes, plus format-specific checks."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttool import convert, formats
from ckpttool.offline.describe import inspect_path
from ckpttool.errors import ChecksumError, CkptError
from ckpttool.formats import detect, open_source
from ckpttool.index import TensorEntry, flatten
from ckpttool.storage import resolve
from ckpttool.offline.verify import verify_path

from ..helpers import (
    assert_bitwise,
    cli,
    assert_same_checkpoint,
    assert_same_nested,
    assert_same_value,
    data_files,
    flip_bit,
    output_name,
    reference_state,
    tensor_data_spans,
)

REF_TENSORS = [k for k, v in flatten(reference_state())[0].items() if isinstance(v, torch.Tensor)]


def copy_of(path, dst):
    if os.path.isdir(path):
        shutil.copytree(path, dst)
    else:
        shutil.copy(path, dst)
    return dst


@pytest.mark.parametrize("fmt", formats.output_names())
class TestConformance:
    """Generated from the registry: every format writes the reference through its Sink (from a plain
    torch.save file), reads it back through its Source, and has its integrity checks and its
    handling of damaged input tested the same way."""

    def written(self, tmp_path, ref_pt, fmt, **kw):
        dst = tmp_path / output_name(fmt)
        report = convert(str(ref_pt), str(dst), **kw)
        return dst, report

    def test_detect_and_every_tensor_bitwise(self, tmp_path, ref_pt, fmt):
        dst, _ = self.written(tmp_path, ref_pt, fmt)
        assert detect(resolve(str(dst))).name == fmt
        flat, _ = flatten(reference_state())
        with open_source(str(dst)) as src:
            assert src.format == fmt
            idx = src.index()
            assert list(idx) == list(flat)  # every key, in the saved order
            for key, value in flat.items():
                if isinstance(value, torch.Tensor):
                    entry = idx[key]
                    assert isinstance(entry, TensorEntry) and entry.shape == tuple(value.shape) and entry.dtype == value.dtype
                    assert_bitwise(src.read_tensor(key), value, key)

    def test_objects_survive(self, tmp_path, ref_pt, fmt):
        dst, report = self.written(tmp_path, ref_pt, fmt)
        assert report.dropped == []
        flat, _ = flatten(reference_state())
        with open_source(str(dst)) as src:
            for key, value in flat.items():
                if not isinstance(value, torch.Tensor):
                    assert_same_value(src.read_object(key), value, key)

    def test_region_reads_equal_slicing(self, tmp_path, ref_pt, fmt):
        dst, _ = self.written(tmp_path, ref_pt, fmt)
        rnd = random.Random(0)
        flat, _ = flatten(reference_state())
        with open_source(str(dst)) as src:
            for key, value in flat.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() == 0:
                    continue
                for _ in range(5):
                    offs = tuple(rnd.randrange(s) for s in value.shape)
                    sizes = tuple(rnd.randrange(1, s - o + 1) for s, o in zip(value.shape, offs))
                    got = src.read_tensor(key, (offs, sizes))
                    assert_bitwise(got, value[tuple(slice(o, o + n) for o, n in zip(offs, sizes))].contiguous(), key)

    def test_tiny_budget_gives_same_bytes(self, tmp_path, ref_pt, fmt):
        big, _ = self.written(tmp_path, ref_pt, fmt)
        small = tmp_path / output_name(fmt, "small")
        convert(str(ref_pt), str(small), memory_budget=8)
        with open_source(str(big)) as a, open_source(str(small)) as b:
            for e in a.index().tensors():
                assert_bitwise(a.read_tensor(e.key), b.read_tensor(e.key), e.key)

    def test_round_trip_through_every_other_format(self, tmp_path, ref_pt, fmt):
        first, _ = self.written(tmp_path, ref_pt, fmt)
        for other in formats.output_names():
            mid = tmp_path / output_name(other, "mid")
            back = tmp_path / output_name(fmt, "back")
            convert(str(first), str(mid), force=True)
            convert(str(mid), str(back), force=True)
            assert_same_checkpoint(first, back, f"{fmt}->{other}->{fmt}")

    def test_memory_filesystem_both_sides(self, tmp_path, ref_pt, fmt):
        import fsspec

        fs = fsspec.filesystem("memory")
        fs.put(str(ref_pt), "/conf/ref.pt")
        dst = f"memory://conf/{fmt}/" + output_name(fmt)
        convert("memory://conf/ref.pt", dst)
        back = tmp_path / "back.pt"
        convert(dst, f"file://{back}")
        assert_same_nested(torch.load(back, weights_only=True), reference_state())
        fs.rm("/conf", recursive=True)

    # --- integrity: what verify must find in every format ----------------------------------------

    def test_fresh_output_verifies(self, tmp_path, ref_pt, fmt):
        dst, _ = self.written(tmp_path, ref_pt, fmt)
        report = verify_path(str(dst))
        assert report.ok, [p.line() for p in report.problems]
        assert report.tensors_checked == len(REF_TENSORS)

    def test_flipped_bit_in_each_tensor(self, tmp_path, ref_pt, fmt):
        """data_spans names every tensor's bytes; a flip there changes what is read and, where the
        format stores checksums, verify names that key and nothing else."""
        dst, _ = self.written(tmp_path, ref_pt, fmt)
        spans = tensor_data_spans(dst)
        flat, _ = flatten(reference_state())
        assert sorted({s[3] for s in spans}) == sorted(k for k in REF_TENSORS if flat[k].numel())
        for i, (file, start, end, key) in enumerate(spans):
            assert end - start == flat[key].numel() * flat[key].element_size(), key  # the span is exactly the data
            work = copy_of(dst, tmp_path / f"flip{i}-{dst.name}")
            flip_bit(os.path.join(work, os.path.relpath(file, dst)) if os.path.isdir(dst) else work, (start, end - 1)[i % 2], 3)
            with open_source(str(work), verify=False) as src:
                assert not torch.equal(src.read_tensor(key).reshape(-1).view(torch.uint8),
                                       flat[key].contiguous().reshape(-1).view(torch.uint8)), key
            report = verify_path(str(work))
            if formats.get(fmt).checksums:
                assert report.problems and {p.key for p in report.problems} == {key}, (key, [p.line() for p in report.problems])
                with open_source(str(work)) as src, pytest.raises(ChecksumError):  # reads check by default
                    src.read_tensor(key)
            else:
                assert report.ok and any("no checksums" in n for n in report.notes)

    def test_truncated_or_missing_file_is_named(self, tmp_path, ref_pt, fmt):
        dst, _ = self.written(tmp_path, ref_pt, fmt)
        for i, file in enumerate(data_files(dst)):
            for damage in ("truncate", "remove"):
                work = copy_of(dst, tmp_path / f"{damage}{i}-{dst.name}")
                victim = os.path.join(work, os.path.basename(file)) if os.path.isdir(dst) else str(work)
                if damage == "truncate":
                    with open(victim, "r+b") as f:
                        f.truncate(os.path.getsize(victim) * 2 // 3)
                else:
                    os.remove(victim)
                try:
                    report = verify_path(str(work))
                except CkptError as exc:
                    assert os.path.basename(victim) in str(exc), (damage, victim, str(exc))
                    continue
                assert not report.ok, (damage, victim)
                assert any(os.path.basename(victim) in (p.file or "") for p in report.problems), (
                    damage, victim, [p.line() for p in report.problems])

    def test_damage_never_crashes_a_command(self, tmp_path, ref_pt, fmt):
        """Flips and cuts anywhere: inspect, verify and convert to every format give a result or a
        typed error (exit 1/2 with one line), never another exception; what verify finds names the
        damaged file; a cut file is always found; a convert that succeeds over a checksummed
        format's damage gives the original bits (the damage lay outside what it reads)."""
        dst, _ = self.written(tmp_path, ref_pt, fmt)
        files = data_files(dst)
        rnd = random.Random(f"damage-{fmt}")
        found = 0
        for i in range(24):
            work = copy_of(dst, tmp_path / f"d{i}-{dst.name}")
            victim = os.path.join(work, os.path.basename(rnd.choice(files))) if os.path.isdir(dst) else str(work)
            size = os.path.getsize(victim)
            cut = i % 3 == 0
            if cut:
                with open(victim, "r+b") as f:
                    f.truncate(rnd.randrange(size))
            else:
                for _ in range(1 + i % 4):
                    flip_bit(victim, rnd.randrange(size), rnd.randrange(8))
            try:
                inspect_path(str(work))
            except CkptError:
                pass
            name = os.path.basename(victim)
            try:
                report = verify_path(str(work))
                named = not report.ok and any(name in (p.file or "") + p.what for p in report.problems)
                assert report.ok or named, (i, name, [p.line() for p in report.problems])
                assert report.ok is False or not cut, (i, name, "a cut file passed verify")
            except CkptError as exc:
                named = True
                assert name in str(exc) or os.path.basename(str(work)) in str(exc), (i, name, str(exc))
            found += named
            for o in formats.output_names():
                out = tmp_path / output_name(o, f"c{i}")
                try:
                    convert(str(work), str(out), force=True)
                except CkptError:
                    continue
                # (torch's zip CRC-32s cover a file's every record; a DCP's .metadata has none)
                if (fmt == "torch" or (fmt == "dcp" and name != ".metadata")) and o != "safetensors":
                    assert_same_checkpoint(dst, out, f"{fmt} damage {i} -> {o}")
        assert found >= 8, found  # every cut (8 of 24) at least


def test_torch_output_is_what_torch_save_would_write(tmp_path, ref_pt):
    for via in ("dcp", "safetensors"):
        mid = tmp_path / output_name(via)
        convert(str(ref_pt), str(mid))
        out = tmp_path / f"from_{via}.pt"
        convert(str(mid), str(out))
        for mmap in (False, True):
            assert_same_nested(torch.load(out, weights_only=True, mmap=mmap), reference_state())


def test_dcp_output_loads_with_plain_torch(tmp_path, ref_pt):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    convert(str(ref_pt), str(out))
    ref = reference_state()
    template = {"model": {k: torch.empty_like(v) for k, v in ref["model"].items()},
                "optim": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.empty(7, 3)}},
                          "param_groups": [{"lr": None, "betas": None, "eps": None, "foreach": 1, "params": None}]}}
    dcp.load(template, checkpoint_id=str(out))
    for k, v in ref["model"].items():
        assert_bitwise(template["model"][k], v.contiguous(), k)
    assert template["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_safetensors_read_by_the_library_and_only_model(tmp_path, ref_pt):
    out = tmp_path / "model.safetensors"
    convert(str(ref_pt), str(out), only="model")
    loaded = load_file(str(out))
    ref = reference_state()["model"]
    assert sorted(loaded) == sorted(ref)
    for k, v in ref.items():
        assert_bitwise(loaded[k], v.contiguous(), k)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["format"] == "pt"
    # --only model output loads straight into a module
    m = torch.nn.Linear(3, 7, bias=False)
    m.load_state_dict({"weight": loaded["w"]})


def test_hf_sharded_output_and_index(tmp_path, ref_pt):
    out = tmp_path / "hf"
    convert(str(ref_pt), str(out), to="safetensors", only="model", max_shard_size="64B")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    ref = reference_state()["model"]
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())
    for key, fname in index["weight_map"].items():
        with safe_open(str(out / fname), "pt") as f:
            assert_bitwise(f.get_tensor(key), ref[key].contiguous(), key)


def test_dtype_cast_floats_only(tmp_path, ref_pt):
    out = tmp_path / "cast.pt"
    convert(str(ref_pt), str(out), dtype="bfloat16")
    got = torch.load(out, weights_only=True)
    ref = reference_state()
    assert got["model"]["w"].dtype == torch.bfloat16 and torch.equal(got["model"]["w"], ref["model"]["w"].bfloat16())
    assert got["model"]["ids"].dtype == torch.int64 and got["model"]["mask"].dtype == torch.bool
    assert got["optim"]["state"]["w"]["step"].dtype == torch.float32  # 0-d counter keeps its dtype
    assert got["model"]["f64"].dtype == torch.bfloat16


def test_non_json_objects_are_reported_as_dropped(tmp_path):
    src = tmp_path / "s.pt"
    torch.save({"model": {"w": torch.ones(2)}, "extra": {"blob": b"\x00\x01", "ok": 1}}, src)
    report = convert(str(src), str(tmp_path / "o.safetensors"))
    assert report.dropped == ["extra.blob"]
    with open_source(str(tmp_path / "o.safetensors")) as s:
        assert s.read_object("extra.ok") == 1


def test_large_reads_through_a_chained_fsspec_url(tmp_path, monkeypatch):
    """A read of several parts through a URL fsspec chains (``simplecache::memory://``: a sync
    filesystem whose open() gives a plain buffered file) arrives bit for bit; only async
    filesystems take the ranged-parts path."""
    import fsspec

    from ckpttool import storage

    monkeypatch.setattr(storage.backends, "PART_BYTES", 4096)  # the 64 KiB tensor is 16 parts
    a = torch.arange(16384, dtype=torch.float32)
    torch.save({"a": a}, tmp_path / "a.pt")
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "a.pt"), "/chained/a.pt")
    try:
        with open_source("simplecache::memory://chained/a.pt") as src:
            assert torch.equal(src.read_tensor("a"), a)
    finally:
        fs.rm("/chained", recursive=True)


def test_a_checked_convert_reads_each_dcp_record_once(tmp_path, monkeypatch):
    """Converting a DCP reads each whole record straight into its slab and checks it there: the
    bytes read are about the data's, not twice (a checksum pass, then the data)."""
    from ckpttool import storage

    # records above torchzip's 1 MiB small-archive size (a smaller one is fetched whole to parse it)
    state = {f"w{i}": torch.randn(512, 1024) for i in range(2)}
    torch.save(state, tmp_path / "s.pt")
    convert(str(tmp_path / "s.pt"), str(tmp_path / "dcp"))
    read = []
    real = storage.RangeReader.readinto_parts  # (every read of a range reader, readinto's too)
    monkeypatch.setattr(storage.RangeReader, "readinto_parts",
                        lambda self, offset, outs: (read.append(sum(o.nbytes for o in outs)), real(self, offset, outs))[1])
    convert(str(tmp_path / "dcp"), str(tmp_path / "out.safetensors"))
    data = sum(t.numel() * 4 for t in state.values())
    assert data <= sum(read) < 1.2 * data, (sum(read), data)
    got = load_file(tmp_path / "out.safetensors")
    assert all(torch.equal(got[k].view(torch.int32), v.view(torch.int32)) for k, v in state.items())
    path, start, end, key = tensor_data_spans(tmp_path / "dcp")[0]  # one pass, still checked
    flip_bit(path, (start + end) // 2)
    with pytest.raises(ChecksumError, match=key):
        convert(str(tmp_path / "dcp"), str(tmp_path / "bad.safetensors"))
    assert not (tmp_path / "bad.safetensors").exists()


def _ckpttool_step(tmp_path):
    """A ckpttool step (its commit record carries the manifest): one rank, records above 1 MiB."""
    from ckpttool import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 1024))
    Checkpointer(tmp_path / "run").save(1, model)
    return tmp_path / "run" / "step-1"


def _plain_dcp(tmp_path):
    """A DCP directory without a manifest (torch's CRC-32 is its only check)."""
    torch.save({"w0": torch.randn(512, 1024), "w1": torch.randn(1024, 512)}, tmp_path / "s.pt")
    convert(str(tmp_path / "s.pt"), str(tmp_path / "dcp"))
    return tmp_path / "dcp"


@pytest.mark.parametrize("make", [_plain_dcp, _ckpttool_step], ids=["crc32", "manifest"])
def test_a_reshard_checks_records_it_reads_in_parts_in_one_pass(tmp_path, monkeypatch, make):
    """Resharding one rank's records to 4 ranks reads each record in 4 consecutive row ranges; each
    is checked as its parts go by (CRC-32, or the manifest's hash of the whole record), so the
    bytes read are about the data's, not twice; a flip anywhere in a record (its first or last
    part, or its header under a manifest) still fails the reshard, and nothing is written."""
    from ckpttool import storage
    from ckpttool.offline.reshard import reshard

    src = make(tmp_path)
    read = []
    real = storage.RangeReader.readinto_parts  # (every read of a range reader, readinto's too)
    monkeypatch.setattr(storage.RangeReader, "readinto_parts",
                        lambda self, offset, outs: (read.append(sum(o.nbytes for o in outs)), real(self, offset, outs))[1])
    reshard(str(src), str(tmp_path / "out"), world_size=4)
    monkeypatch.undo()
    data = sum(end - start for _, start, end, _ in tensor_data_spans(src))
    assert data <= sum(read) < 1.2 * data, (sum(read), data)
    assert_same_checkpoint(src, tmp_path / "out")

    spans = [s for s in tensor_data_spans(src) if s[2] - s[1] >= 1 << 20]
    with open_source(str(src)) as source:
        header = {key: source.index()[key].chunks[0].location.offset for _, _, _, key in spans}
    flips = [(path, start + 5, key) for path, start, _, key in spans[:1]] + [(path, end - 5, key) for path, _, end, key in spans[-1:]]
    if make is _ckpttool_step:
        flips.append((spans[0][0], header[spans[0][3]] + 20, spans[0][3]))  # inside the record's zip header
    for path, byte, key in flips:
        flip_bit(path, byte)
        with pytest.raises(ChecksumError, match=key):
            reshard(str(src), str(tmp_path / "bad"), world_size=4)
        assert not (tmp_path / "bad").exists()
        flip_bit(path, byte)  # undo


def test_a_record_read_only_in_part_is_checked_whole_when_the_reader_settles(tmp_path):
    """A record whose parts were not all read (the rest of it never asked for) is not trusted on
    its first part's word: leaving ``checked_in_parts`` scans it whole and finds the flip in the part
    never read (the read itself passes)."""
    src = _plain_dcp(tmp_path)
    path, start, end, key = next(s for s in tensor_data_spans(src) if s[3] == "w0")
    flip_bit(path, end - 5)
    first = None
    with open_source(str(src)) as source:
        with pytest.raises(ChecksumError, match=key):
            with source.checked_in_parts():
                first = source.read_tensor(key, ((0, 0), (128, 1024)))
        assert first.shape == (128, 1024)


def test_tensors_inside_objects_survive_every_conversion(tmp_path):
    """A tuple holding a tensor is one object to DCP; written to a torch file it must be plain data
    torch.load(weights_only=True) and ckpttool read back (a tensor record of its own, as torch.save
    writes it), and compare equal through torch -> torch -> DCP -> torch."""
    from ckpttool import convert
    from ckpttool.offline.verify import verify_against

    src = tmp_path / "src.pt"
    torch.save({"model": {"w": torch.arange(6.0).reshape(2, 3)},
                "extra": {"pair": ("a", torch.arange(4.0)), "deep": ([torch.ones(2, dtype=torch.bfloat16)], 3)}}, src)
    out, dcp_dir, back = tmp_path / "out.pt", tmp_path / "dcp", tmp_path / "back.pt"
    convert(str(src), str(out))
    convert(str(out), str(dcp_dir))
    convert(str(dcp_dir), str(back))
    for path in (out, back):
        loaded = torch.load(path, weights_only=True)
        assert loaded["extra"]["pair"][0] == "a" and torch.equal(loaded["extra"]["pair"][1], torch.arange(4.0))
        assert torch.equal(loaded["extra"]["deep"][0][0], torch.ones(2, dtype=torch.bfloat16))
        assert verify_against(str(path), str(src)).ok
    changed = tmp_path / "changed.pt"
    torch.save({"model": {"w": torch.arange(6.0).reshape(2, 3)},
                "extra": {"pair": ("a", torch.arange(4.0) + 1), "deep": ([torch.ones(2, dtype=torch.bfloat16)], 3)}}, changed)
    assert not verify_against(str(changed), str(src)).ok  # a tensor inside an object is compared by its bits


def test_an_expanded_view_is_read_as_torch_load_reads_it(tmp_path):
    """``torch.save`` of an expanded view (stride 0: its record holds fewer elements than the view)
    is read as torch.load reads it, by every command and by ckpttool.load, from the record's bytes
    alone; views that repeat their bytes beyond MAX_EXPANDED in one checkpoint are refused."""
    import ckpttool
    from ckpttool.errors import CorruptCheckpointError
    from ckpttool.formats.torchzip import MAX_EXPANDED
    from ckpttool.offline.verify import verify_against

    src = tmp_path / "expanded.pt"
    col = torch.arange(3.0).reshape(3, 1)
    torch.save({"bias": col.expand(3, 4), "pos": torch.arange(5).expand(2, 5), "w": torch.ones(2, 2)}, src)
    plain = torch.load(src, weights_only=True)
    assert plain["bias"].stride() == (1, 0)  # (what torch.load gives back: the view itself)
    for name in ("out.pt", "out.safetensors", "out-dcp"):
        out = tmp_path / name
        cli("convert", src, out)
        with open_source(str(out)) as source:
            for key in ("bias", "pos", "w"):
                assert torch.equal(source.read_tensor(key), plain[key]), (name, key)
        assert verify_against(str(out), str(src)).ok and verify_against(str(src), str(out)).ok
    with open_source(str(src)) as source:  # any box of it, as its rows and columns say
        assert torch.equal(source.read_tensor("bias", ((1, 2), (2, 2))), plain["bias"][1:3, 2:4])
    assert "bias" in cli("inspect", src) and "OK: 3 tensors" in cli("verify", src)
    module = torch.nn.Module()
    module.register_buffer("bias", torch.zeros(3, 4))
    module.register_buffer("pos", torch.zeros(2, 5, dtype=torch.int64))
    module.register_buffer("w", torch.zeros(2, 2))
    ckpttool.load(str(src), module)
    assert all(torch.equal(module.get_buffer(k), plain[k]) for k in ("bias", "pos", "w"))

    big = tmp_path / "big.pt"  # 16 bytes declaring twice the budget
    torch.save({"x": torch.zeros(4).expand(MAX_EXPANDED // 8, 4)}, big)
    with pytest.raises(CorruptCheckpointError, match="overlapping view"):
        open_source(str(big))
    # a view admitted under its key is not expanded again, uncounted, where an object repeats it
    many = tmp_path / "many.pt"
    view = torch.ones(1).expand(MAX_EXPANDED // 8)
    torch.save({"a": view, "b": tuple([view] * 8)}, many)
    with open_source(str(many)) as source, pytest.raises(CorruptCheckpointError, match="overlapping view"):
        source.read_object("b")


def test_an_optimizer_state_keyed_by_index_comes_back_keyed_by_int_in_a_torch_file(tmp_path):
    """``optimizer.state_dict()`` keys its state by int; DCP's flattened keys make them strings, and
    a torch file written with string keys would load into an optimizer with no state at all
    (``load_state_dict`` finds no parameter under "0"). Every torch output keys it as torch does."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    src = tmp_path / "src.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"state": {"0": 1}, "param_groups": []}}, src)
    for route in (["out.pt"], ["dcp", "back.pt"]):
        prev = src
        for name in route:
            convert(str(prev), str(tmp_path / name), force=True)
            prev = tmp_path / name
        loaded = torch.load(prev, weights_only=True)
        assert sorted(loaded["optim"]["state"]) == [0, 1, 2, 3], route
        assert loaded["extra"] == {"state": {"0": 1}, "param_groups": []}  # (not an optimizer's: as it was)
        fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
        fresh.load_state_dict(loaded["optim"])
        assert len(fresh.state) == 4 and fresh.param_groups[0]["lr"] == 0.1
        for p in model.parameters():
            assert all(torch.equal(fresh.state[p][k], opt.state[p][k]) for k in opt.state[p]), route
    shards = tmp_path / "shards"  # split into .bin shards: each holds part of the state, every part keyed by int
    convert(str(src), str(shards), to="torch", max_shard_size=64)
    held = [k for f in sorted(shards.glob("*.bin")) for k in torch.load(f, weights_only=True).get("optim", {}).get("state", {})]
    assert sorted(set(held)) == [0, 1, 2, 3] and all(type(k) is int for k in held) and len(list(shards.glob("*.bin"))) > 2


def test_int_keys_are_given_back_only_to_what_is_shaped_as_an_optimizer_state():
    from ckpttool.formats.torch_save import int_keyed_optimizers

    optim = {"state": {"0": {"step": 1}, "1": {"step": 2}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    assert list(int_keyed_optimizers({"o": optim})["o"]["state"]) == [0, 1]
    for odd in ({**optim, "param_groups": [{"params": 0.5}]}, {**optim, "param_groups": [3]},  # (damaged groups: as they are)
                {**optim, "param_groups": [{"params": [0, 0]}]}, {**optim, "param_groups": [{"params": [0, True]}]},
                {**optim, "state": {"0": {}, "x": {}}}, {**optim, "extra": 1}, {"state": [], "param_groups": []},
                {**optim, "state": {"0": torch.ones(1), "1": torch.ones(1)}}):  # (a parameter's state is a dict)
        assert int_keyed_optimizers({"o": odd}) == {"o": odd}, odd
