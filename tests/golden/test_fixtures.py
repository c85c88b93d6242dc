"""The committed fixtures still read the same: a format change or torch upgrade that breaks old
checkpoints fails here. Regenerate with `python fixtures/make_fixtures.py` only on purpose."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import ckpttool
from ckpttool import Checkpointer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures")
sys.path.insert(0, FIXTURES)
from make_fixtures import expected  # noqa: E402

with open(os.path.join(FIXTURES, "expected.json")) as f:
    EXPECTED = json.load(f)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_reads_the_same(name):
    assert expected(os.path.join(FIXTURES, name)) == EXPECTED[name]


def plain_model():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 6), torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model.register_buffer("counts", torch.zeros(7, dtype=torch.int64))
    return model


def test_plain_torch_dcp_loads_into_an_unsharded_model_without_a_process_group():
    model = plain_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    res = ckpttool.load(os.path.join(FIXTURES, "plain-dcp-w2"), model, optimizer)
    assert res.extra == {"step": 1, "tag": "plain"}
    ref = torch.load(os.path.join(FIXTURES, "plain.pt"), weights_only=True)
    for k, v in ref["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    sd = optimizer.state_dict()
    assert sd["param_groups"][0]["lr"] == 0.01
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        for k, v in ref["optim"]["state"][name].items():
            assert torch.equal(sd["state"][i][k], v), (name, k)


def test_trainer_fixture_loads_on_a_laptop():
    from ckpttool.training.trainer.model import PRESETS, build_model

    model = build_model(PRESETS["tiny"], seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(os.path.join(FIXTURES, "trainer-w2"))
    assert ckpt.steps() == [2]
    res = ckpt.load(model, optimizer)
    assert res.step == 2 and res.extra["step"] == 2
    from ckpttool.formats import open_source

    with open_source(os.path.join(FIXTURES, "trainer-w2", "step-2")) as src:
        for k, v in model.state_dict().items():
            assert torch.equal(src.read_tensor(f"model.{k}"), v), k
