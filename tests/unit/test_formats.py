"""One conformance suite every format's Source and Sink passes, plus format-specific checks."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttool import convert
from ckpttool.formats import FORMATS, detect, open_source
from ckpttool.index import TensorEntry, flatten
from ckpttool.storage import resolve

from ..conftest import reference_state


def bits(t):
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_bitwise(a, b, key=""):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    assert torch.equal(bits(a), bits(b)), key


OUTPUT_NAMES = {"dcp": "out_dcp", "torch": "out.pt", "safetensors": "out.safetensors"}


@pytest.mark.parametrize("fmt", FORMATS)
class TestConformance:
    """Write the reference through each Sink (from a plain torch.save file), read back through its Source."""

    def written(self, tmp_path, ref_pt, fmt, **kw):
        dst = tmp_path / OUTPUT_NAMES[fmt]
        report = convert(str(ref_pt), str(dst), **kw)
        return dst, report

    def test_detect_and_every_tensor_bitwise(self, tmp_path, ref_pt, fmt):
        dst, _ = self.written(tmp_path, ref_pt, fmt)
        assert detect(resolve(str(dst))) == fmt
        flat, _ = flatten(reference_state())
        with open_source(str(dst)) as src:
            idx = src.index()
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
                    got = src.read_object(key)
                    assert got == value or (value != value and got != got), key
                    assert type(got) is type(value), key

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
        small = tmp_path / ("small_" + OUTPUT_NAMES[fmt])
        convert(str(ref_pt), str(small), memory_budget=8)
        with open_source(str(big)) as a, open_source(str(small)) as b:
            for e in a.index().tensors():
                assert_bitwise(a.read_tensor(e.key), b.read_tensor(e.key), e.key)

    def test_round_trip_through_every_other_format(self, tmp_path, ref_pt, fmt):
        first, _ = self.written(tmp_path, ref_pt, fmt)
        for other in FORMATS:
            mid = tmp_path / ("mid_" + OUTPUT_NAMES[other])
            back = tmp_path / ("back_" + OUTPUT_NAMES[fmt])
            convert(str(first), str(mid))
            convert(str(mid), str(back), force=True)
            with open_source(str(first)) as a, open_source(str(back)) as b:
                assert list(a.index()) == list(b.index()) or sorted(a.index()) == sorted(b.index())
                for key in a.index():
                    if isinstance(a.index()[key], TensorEntry):
                        assert_bitwise(a.read_tensor(key), b.read_tensor(key), f"{fmt}->{other}->{fmt}: {key}")
                    else:
                        assert a.read_object(key) == b.read_object(key) or key.endswith("inf") is False

    def test_memory_filesystem_both_sides(self, tmp_path, ref_pt, fmt):
        import fsspec

        fs = fsspec.filesystem("memory")
        fs.put(str(ref_pt), "/conf/ref.pt")
        dst = f"memory://conf/{fmt}/" + OUTPUT_NAMES[fmt]
        convert("memory://conf/ref.pt", dst)
        back = tmp_path / "back.pt"
        convert(dst, f"file://{back}")
        assert_same_nested(torch.load(back, weights_only=True), reference_state())
        fs.rm("/conf", recursive=True)


def assert_same_nested(a, b, where="state"):
    if isinstance(b, torch.Tensor):
        assert_bitwise(a, b, where)
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), f"{where}: {list(a)} vs {list(b)}"
        for k in b:
            assert_same_nested(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} vs {b!r}"


def test_torch_output_is_what_torch_save_would_write(tmp_path, ref_pt):
    for via in ("dcp", "safetensors"):
        mid = tmp_path / OUTPUT_NAMES[via]
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
