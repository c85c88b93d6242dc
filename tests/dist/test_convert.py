"""Convert checkpoints written by plain torch at world sizes 1-4, and load our DCP at any world size."""

from __future__ import annotations

import pytest
import torch

from ckpttool import convert

from ..helpers import assert_same_nested
from .harness import run_ranks
from .workloads import plain_torch_load


@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_dcp_to_torch_is_torch_save_of_the_full_state(plain, tmp_path, w):
    path, expected = plain[w]
    out = tmp_path / "full.pt"
    convert(path, str(out))
    got = torch.load(out, weights_only=True)
    assert_same_nested(got["model"], expected["model"], "model")
    assert_same_nested(got["optim"], expected["optim"], "optim")
    assert_same_nested(got["extra"], expected["extra"], "extra")


@pytest.mark.parametrize("w", [2, 3])
def test_every_format_pair_round_trips_plain_dcp(plain, tmp_path, w):
    path, expected = plain[w]
    hops = [("a.safetensors", None), ("b.pt", None), ("c_dcp", None), ("d.safetensors", None), ("e_dcp", None), ("f.pt", None)]
    prev = path
    for name, _ in hops:
        convert(prev, str(tmp_path / name))
        prev = str(tmp_path / name)
    got = torch.load(prev, weights_only=True)
    assert_same_nested(got["model"], expected["model"], "model")
    assert_same_nested(got["optim"], expected["optim"], "optim")


@pytest.mark.parametrize("w_load", [1, 2, 3, 4])
def test_torch_to_dcp_loads_with_plain_dcp_on_any_world_size(plain, tmp_path, w_load):
    path, expected = plain[3]
    full = tmp_path / "full.pt"
    convert(path, str(full))
    back = tmp_path / "dcp"
    convert(str(full), str(back))
    got = run_ranks(plain_torch_load, w_load, str(back))[0]
    assert_same_nested(got["model"], expected["model"], "model")
    assert_same_nested(got["optim"], expected["optim"], "optim")
