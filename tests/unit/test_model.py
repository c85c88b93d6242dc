"""Single-process tests of the trainer's model, initialisation and synthetic data (no process group)."""

from __future__ import annotations

import pytest
import torch

from ckpttool.training.trainer.model import PRESETS, ModelConfig, Transformer, build_model, derive_seed, init_weights, local_batch, synthetic_batch

TINY = PRESETS["tiny"]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_forward_shape_and_dtype():
    model = build_model(TINY, seed=0)
    inputs, _ = synthetic_batch(0, 3, TINY, seed=0)
    logits = model(inputs)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_forward_is_causal():
    model = build_model(TINY, seed=0)
    inputs, _ = synthetic_batch(0, 2, TINY, seed=0)
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % TINY.vocab_size
    # Changing the last token must not change the logits of any earlier position.
    torch.testing.assert_close(model(inputs)[:, :-1], model(changed)[:, :-1], rtol=0, atol=0)


def test_forward_rejects_too_long_sequence():
    model = build_model(TINY, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))


def test_layers_is_module_list_of_blocks():
    model = Transformer(TINY)
    assert isinstance(model.layers, torch.nn.ModuleList)
    assert len(model.layers) == TINY.n_layers


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_model(name):
    config = PRESETS[name]
    with torch.device("meta"):
        model = Transformer(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_1g_preset_holds_about_1gb_of_fp32_adamw_state():
    assert 0.9e9 < PRESETS["1g"].num_params() * 12 < 1.1e9


def test_tiny_preset_has_uneven_shards():
    for size in (TINY.vocab_size, TINY.dim, TINY.seq_len):
        assert size % 3 and size % 4


def test_config_rejects_bad_heads():
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(vocab_size=10, dim=10, n_layers=1, n_heads=3, seq_len=4)


def test_init_weights_same_seed_same_weights():
    a, b = build_model(TINY, seed=5), build_model(TINY, seed=5)
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_init_weights_other_seed_other_weights():
    sa, sb = _state(build_model(TINY, seed=0)), _state(build_model(TINY, seed=1))
    assert not torch.equal(sa["tok_embeddings.weight"], sb["tok_embeddings.weight"])
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sb["layers.0.attention.wq.weight"])


def test_init_weights_rules():
    state = _state(build_model(TINY, seed=0))
    assert torch.equal(state["norm.weight"], torch.ones(TINY.dim))
    assert torch.equal(state["layers.1.ffn_norm.bias"], torch.zeros(TINY.dim))
    assert torch.equal(state["layers.0.feed_forward.w1.bias"], torch.zeros(4 * TINY.dim))
    weight = state["output.weight"]
    assert 0.015 < weight.std().item() < 0.025
    # Each parameter has its own stream: same-shaped weights differ.
    assert not torch.equal(state["layers.0.attention.wq.weight"], state["layers.0.attention.wk.weight"])


def test_init_weights_overwrites_existing_values():
    model = build_model(TINY, seed=3)
    expected = _state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    init_weights(model, seed=3)
    for name, value in _state(model).items():
        assert torch.equal(value, expected[name]), name


def test_derive_seed_is_stable():
    # Pinned: a change here silently changes every model and batch the tests build.
    assert derive_seed(1, "x") == 0x962A97D6
    assert derive_seed(0, "a") != derive_seed(0, "b")
    # The CPU generator keeps only the low 32 bits of a seed: different seeds must differ there.
    assert derive_seed(0, "x") % 2**32 != derive_seed(1, "x") % 2**32


def test_synthetic_batch_deterministic_and_shifted():
    x1, y1 = synthetic_batch(4, 12, TINY, seed=0)
    x2, y2 = synthetic_batch(4, 12, TINY, seed=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (12, TINY.seq_len)
    assert x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert int(x1.min()) >= 0 and int(x1.max()) < TINY.vocab_size
    x3, _ = synthetic_batch(5, 12, TINY, seed=0)
    x4, _ = synthetic_batch(4, 12, TINY, seed=1)
    assert not torch.equal(x1, x3)
    assert not torch.equal(x1, x4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_local_batches_concatenate_to_global(world_size):
    gx, gy = synthetic_batch(7, 12, TINY, seed=2)
    parts = [local_batch(7, r, world_size, 12, TINY, seed=2) for r in range(world_size)]
    assert all(p[0].shape[0] == 12 // world_size for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_local_batch_rejects_uneven_split():
    with pytest.raises(ValueError, match="divisible"):
        local_batch(0, 0, 5, 12, TINY, seed=0)
    with pytest.raises(ValueError, match="rank"):
        local_batch(0, 4, 4, 12, TINY, seed=0)
