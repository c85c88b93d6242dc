"""Every dtype torch and safetensors share, numpy values and torch.save storage sharing, through
every format and command, bitwise against what plain torch (and the safetensors library) read."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ckpttool.formats.safetensors import DTYPES as SAFETENSORS_DTYPES
from ckpttool.safe_pickle import same_value

from ..helpers import cli as run, assert_bitwise, assert_same_checkpoint

#: every plain dtype this torch has; float8_e8m0fnu and complex128 have no safetensors name
DTYPE_NAMES = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "bfloat16", "float16",
               "float32", "float64", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool",
               "complex64", "complex128"]
DTYPES = [getattr(torch, n) for n in DTYPE_NAMES if hasattr(torch, n)]


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor per dtype, of random bytes (every bit pattern, NaNs and all; bools 0 or 1)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (3, 5 * size), dtype=torch.uint8, generator=g)
        out[str(dtype).removeprefix("torch.")] = (raw % 2 if dtype == torch.bool else raw).view(dtype)
    return out


@pytest.fixture
def dtypes_pt(tmp_path):
    path = tmp_path / "dtypes.pt"
    torch.save({"model": every_dtype()}, path)
    return path


@pytest.mark.parametrize("to", ["dcp", "torch"])
def test_every_dtype_through_dcp_and_torch_bitwise(dtypes_pt, tmp_path, to):
    out = tmp_path / ("out" if to == "dcp" else "out.pt")
    run("convert", dtypes_pt, out)
    back = tmp_path / "back.pt"
    run("convert", out, back)
    if to == "dcp":  # plain torch reads what ckpttool wrote
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(out), str(tmp_path / "plain.pt"))
        plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    else:
        plain = torch.load(out, weights_only=True)
    for name, value in every_dtype().items():
        assert_bitwise(plain["model"][name], value, name)
    assert_same_checkpoint(dtypes_pt, back, "round trip")
    assert run("verify", out).startswith("OK")
    assert run("verify", out, "--against", dtypes_pt).startswith("OK")
    run("reshard", out if to == "dcp" else _dcp(out, tmp_path), tmp_path / "w3", "--world-size", "3")
    assert run("verify", tmp_path / "w3", "--against", dtypes_pt).startswith("OK")


def _dcp(src, tmp_path):
    out = tmp_path / "as-dcp"
    run("convert", src, out)
    return out


def test_every_dtype_safetensors_holds_bitwise_and_the_others_named(dtypes_pt, tmp_path):
    held = {n: t for n, t in every_dtype().items() if t.dtype in SAFETENSORS_DTYPES.values()}
    assert {"float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64", "bfloat16"} <= set(held)
    out = run("convert", dtypes_pt, tmp_path / "x.safetensors", code=2)
    missing = sorted(set(every_dtype()) - set(held))
    assert len(out.strip().splitlines()) == 1 and "cannot hold dtype" in out
    assert any(f"'model.{m}'" in out and f"torch.{m}" in out for m in missing), out
    torch.save({"model": held}, tmp_path / "held.pt")
    run("convert", tmp_path / "held.pt", tmp_path / "m.safetensors", "--only", "model")
    reference = load_file(str(tmp_path / "m.safetensors"))  # the safetensors library reads what we wrote
    for name, value in held.items():
        assert_bitwise(reference[name], value, name)
    assert run("verify", tmp_path / "m.safetensors", "--against", tmp_path / "held.pt", "--against-only", "model").startswith("OK")


def test_views_and_shared_storage_convert_and_verify_bitwise(tmp_path):
    base = torch.arange(48, dtype=torch.float32)
    state = {"a": base[:12], "b": base[12:36].view(4, 6), "bt": base[12:36].view(4, 6).t(), "tail": base[40:],
             "strided": base[::3], "whole": base}
    torch.save({"model": state}, tmp_path / "shared.pt")
    for out in ("s_dcp", "s.pt", "s.safetensors"):
        run("convert", tmp_path / "shared.pt", tmp_path / out)
        assert run("verify", tmp_path / out, "--against", tmp_path / "shared.pt").startswith("OK")
    plain = torch.load(tmp_path / "s.pt", weights_only=True)["model"]
    for key, value in state.items():
        assert_bitwise(plain[key], value, key)


def numpy_state() -> dict:
    rng = np.random.RandomState(5)
    return {"rng": rng.get_state(), "generator": np.random.default_rng(2).bit_generator.state,
            "scalars": [np.int8(-3), np.uint16(7), np.int64(2**40), np.float16(0.5), np.float32(1e-3), np.float64(-2.5),
                        np.bool_(True), np.complex64(1 + 2j)],
            "array": np.arange(12, dtype=np.int32).reshape(3, 4), "fortran": np.asfortranarray(np.ones((2, 3))),
            "empty": np.zeros((0, 2), dtype=np.float32)}


@pytest.mark.parametrize("dst", ["n.pt", "n_dcp"])
def test_numpy_values_round_trip_bitwise_through_every_object_format(tmp_path, dst):
    values = numpy_state()
    torch.save({"model": {"w": torch.ones(2)}, "extra": values}, tmp_path / "n.src.pt")
    run("convert", tmp_path / "n.src.pt", tmp_path / dst)
    run("convert", tmp_path / dst, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=False)  # plain torch reads what ckpttool wrote
    assert same_value(back["extra"], values)
    assert run("verify", tmp_path / dst, "--against", tmp_path / "n.src.pt").startswith("OK")
    assert "ndarray" in run("inspect", tmp_path / dst)


def test_numpy_values_are_listed_as_dropped_by_safetensors(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "extra": {"seen": np.int64(3), "step": 4}}, tmp_path / "n.pt")
    out = run("convert", tmp_path / "n.pt", tmp_path / "n.safetensors")
    assert "extra.seen" in out and "dropped" in out


def test_an_unreadable_value_exits_2_from_every_command_and_says_what_it_is(tmp_path):
    import fractions
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.ones(2)}, "extra": {"ratio": fractions.Fraction(1, 3)}}
    torch.save(state, tmp_path / "odd.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "odd_dcp"))  # the value in an object record, read by the check
    for path in (tmp_path / "odd.pt", tmp_path / "odd_dcp"):
        for args in (("inspect", path), ("verify", path), ("convert", path, tmp_path / "o.pt")):
            out = run(*args, code=2)
            assert "Fraction" in out and "runs code" not in out and "asks to run code" not in out, out
        assert not os.path.exists(tmp_path / "o.pt")


def test_numpy_values_in_a_checkpointers_extra_come_back_bitwise(tmp_path):
    from ckpttool import Checkpointer

    model = torch.nn.Linear(2, 2)
    extra = numpy_state()
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save(1, model, extra=extra)
    ckpt.save(2, model, extra=extra, blocking=False)  # the async path stages objects too
    ckpt.close()
    for step in (1, 2):
        assert same_value(Checkpointer(tmp_path / "run").load(model, step=step).extra, extra)
