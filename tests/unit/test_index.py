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


def test_chunks_in_finds_exactly_the_chunks_a_box_touches():
    """The row-band bisection (used for tensors of many chunks) agrees with checking every chunk,
    on random grid layouts with empty chunks among them."""
    import random

    from ckpttool.index import Chunk, TensorEntry
    from ckpttool.layout import intersect

    for trial in range(300):
        r = random.Random(trial)
        n0, n1 = r.randrange(1, 30), r.randrange(1, 6)
        cuts0 = sorted({0, n0, *(r.randrange(n0 + 1) for _ in range(r.randrange(12)))})
        cuts1 = sorted({0, n1, *(r.randrange(n1 + 1) for _ in range(r.randrange(3)))})
        chunks = [Chunk((a, c), (b - a, d - c)) for a, b in zip(cuts0, cuts0[1:]) for c, d in zip(cuts1, cuts1[1:])]
        chunks += [Chunk((n0, 0), (0, n1))] * r.randrange(2)  # FSDP2's empty shard
        entry = TensorEntry("k", (n0, n1), torch.float32, tuple(chunks))
        for _ in range(20):
            o0, o1 = r.randrange(n0), r.randrange(n1)
            box = ((o0, o1), (r.randrange(1, n0 - o0 + 1), r.randrange(1, n1 - o1 + 1)))
            want = [(c, intersect((c.offsets, c.sizes), box)) for c in chunks if intersect((c.offsets, c.sizes), box)]
            assert sorted(map(repr, entry.chunks_in(box))) == sorted(map(repr, want)), (chunks, box)


def test_a_plausible_shape_is_non_negative_ints_whose_non_zero_product_stays_under_the_bound():
    from ckpttool.index import MAX_NUMEL, plausible_shape

    assert plausible_shape([1 << 29, 1 << 29]) and plausible_shape((MAX_NUMEL,)) and plausible_shape([])
    assert plausible_shape([0, MAX_NUMEL, 1])  # a zero dim is left out of the product ...
    assert not plausible_shape([0, MAX_NUMEL, 2])  # ... and hides nothing
    assert not plausible_shape([1 << 29, 1 << 30]) and not plausible_shape((MAX_NUMEL + 1,))
    assert not plausible_shape([2, -1]) and not plausible_shape([True, 2]) and not plausible_shape([2.0])
    assert not plausible_shape("12") and not plausible_shape(None)


def test_an_index_refuses_a_path_that_does_not_spell_its_key():
    import pytest

    from ckpttool.errors import CorruptCheckpointError
    from ckpttool.index import Index, ObjectEntry

    index = Index()
    index.add(ObjectEntry("a.0.b", None), ("a", 0, "b"))
    for key, path in (("True", (True,)), ("a.-1", ("a", -1)), ("a.1.0", ("a", 1.0)), ("x.y", ("x", "z"))):
        with pytest.raises(CorruptCheckpointError, match="does not spell it"):
            index.add(ObjectEntry(key, None), path)
