"""Key flattening must equal DCP's own, and nesting must survive the round trip."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ckpttool.index import flatten, strip_prefix, unflatten


def sample_state():
    return {
        "model": {"layers.0.w": torch.ones(2), "emb": torch.zeros(3, 2)},
        "optim": {
            "state": {"layers.0.w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["layers.0.w", "emb"]}],
        },
        "extra": {"step": 7, "names": ["a", "b"], "mixed": [torch.ones(1), 5], "nested": {"x": None}},
    }


def test_keys_and_paths_equal_dcp_flatten():
    state = sample_state()
    ours, our_paths = flatten(state)
    theirs, their_paths = flatten_state_dict(state)
    assert list(ours) == list(theirs)
    assert our_paths == {k: tuple(v) for k, v in their_paths.items()}
    assert "optim.state.layers.0.w.exp_avg" in ours  # FQNs with dots stay one path item
    assert our_paths["optim.state.layers.0.w.exp_avg"] == ("optim", "state", "layers.0.w", "exp_avg")
    assert our_paths["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    assert "extra.names" in ours and "extra.mixed.0" in ours


def test_unflatten_inverts_flatten():
    state = sample_state()
    flat, paths = flatten(state)
    back = unflatten(flat, paths)
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["extra"]["mixed"][1] == 5 and torch.equal(back["extra"]["mixed"][0], torch.ones(1))
    assert back["optim"]["state"]["layers.0.w"]["step"].item() == 3.0
    assert flatten(back)[0].keys() == flat.keys()


def test_strip_prefix_keeps_one_top_level_key():
    _, paths = flatten(sample_state())
    model = strip_prefix(paths, "model")
    assert sorted(v[0] for v in model.values()) == ["emb", "layers.0.w"]
