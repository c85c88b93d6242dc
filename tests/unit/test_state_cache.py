"""The kept get_state_dict answer: served while the model's and optimizer's structure holds, never
stale (every change of structure is noticed; values are always the live ones), and what a save
writes from it loads back bitwise."""

from __future__ import annotations

import pytest
import torch

from ckpttool import Checkpointer
from ckpttool.index import flatten
from ckpttool.training.state import StateCache, torch_state


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model, optimizer) -> None:
    model(torch.randn(16, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _assert_same_state(got: dict, want: dict) -> None:
    """The same keys in the same order; tensors of the same type, shape, placement and bits;
    equal objects."""
    from torch.distributed.tensor import DTensor

    a, _ = flatten(got)
    b, _ = flatten(want)
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert type(x) is type(y), k
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and x.dtype == y.dtype, k
            if isinstance(x, DTensor):
                assert x.placements == y.placements and x.device_mesh == y.device_mesh, k
            assert torch.equal(_local(x).view(torch.uint8) if x.dim() else _local(x), _local(y).view(torch.uint8) if y.dim() else _local(y)), k
        else:
            assert x == y, k


def _check(cache: StateCache, model, optimizer, hits: int, misses: int) -> dict:
    got, _ = cache.state(model, optimizer)
    _assert_same_state(got, torch_state(model, optimizer))
    assert (cache.hits, cache.misses) == (hits, misses)
    return got


def test_served_from_the_cache_while_the_structure_holds_with_the_live_values():
    model, optimizer = _model()
    _step(model, optimizer)
    cache = StateCache()
    first = _check(cache, model, optimizer, 0, 1)
    _step(model, optimizer)  # new values, in place: the same structure
    second = _check(cache, model, optimizer, 1, 1)
    for group in optimizer.param_groups:
        group["lr"] = 0.01  # a scheduler's change: read live
    _check(cache, model, optimizer, 2, 1)
    assert second["model"]["0.weight"] is first["model"]["0.weight"]  # the kept alias, not a new state dict
    assert second["model"] is not first["model"]  # the kept dict itself is never handed out


def _replace_data(model, optimizer):
    model[0].weight.data = torch.randn(8, 8)  # the same parameter object over new memory


def _resize(model, optimizer):
    model[1].running_mean.resize_(4)  # the same tensor object, the same memory, another shape


def _add_buffer(model, optimizer):
    model[1].register_buffer("seen", torch.ones(3))


def _buffer_not_persistent(model, optimizer):
    model[1].register_buffer("running_var", model[1].running_var, persistent=False)


def _rename_buffer(model, optimizer):
    buffers = model[1]._buffers  # the same tensors in the same order, one under another name
    renamed = [("mean" if k == "running_mean" else k, v) for k, v in buffers.items()]
    buffers.clear()
    buffers.update(renamed)


def _add_module(model, optimizer):
    model.add_module("head", torch.nn.Linear(4, 2))


def _replace_buffer(model, optimizer):
    model[1].running_mean = torch.full((8,), 3.0)


def _load_optimizer(model, optimizer):
    optimizer.load_state_dict(optimizer.state_dict())  # new state tensors, a new state container


def _state_hook(model, optimizer):
    model.register_state_dict_post_hook(lambda module, sd, prefix, local_metadata: None)


@pytest.mark.parametrize("change", [_replace_data, _resize, _add_buffer, _buffer_not_persistent, _rename_buffer, _add_module,
                                    _replace_buffer, _load_optimizer])
def test_a_change_of_structure_is_noticed(change):
    model, optimizer = _model()
    _step(model, optimizer)
    cache = StateCache()
    _check(cache, model, optimizer, 0, 1)
    _check(cache, model, optimizer, 1, 1)
    change(model, optimizer)
    _check(cache, model, optimizer, 1, 2)  # a miss: the answer is torch's, as of now
    _check(cache, model, optimizer, 2, 2)  # and kept again


def test_the_optimizer_gaining_state_is_noticed():
    """A parameter frozen at first has no optimizer state; unfrozen, it gains some."""
    model, optimizer = _model()
    model[2].weight.requires_grad_(False)
    _step(model, optimizer)
    cache = StateCache()
    first = _check(cache, model, optimizer, 0, 1)
    assert "2.weight" not in first["optim"]["state"]
    model[2].weight.requires_grad_(True)
    _step(model, optimizer)
    got = _check(cache, model, optimizer, 0, 2)
    assert "2.weight" in got["optim"]["state"]


def test_a_new_state_entry_or_tensor_of_a_parameter_is_read_live():
    """The per-parameter state is the optimizer's own dict, read at every save: what a step puts
    in it, or replaces, is in the next state without a miss."""
    model, optimizer = _model()
    _step(model, optimizer)
    cache = StateCache()
    _check(cache, model, optimizer, 0, 1)
    p = model[0].weight
    optimizer.state[p]["exp_avg"] = torch.full_like(p, 7.0)
    optimizer.state[p]["extra"] = torch.ones(2)
    got = _check(cache, model, optimizer, 1, 1)
    assert torch.equal(got["optim"]["state"]["0.weight"]["exp_avg"], torch.full_like(p, 7.0))


def test_a_param_group_added_is_noticed():
    model, optimizer = _model()
    head = torch.nn.Linear(4, 2)
    model.add_module("head", head)
    optimizer.param_groups[0]["params"] = [p for n, p in model.named_parameters() if not n.startswith("head")]
    _step_all(model, optimizer)
    cache = StateCache()
    _check(cache, model, optimizer, 0, 1)
    optimizer.add_param_group({"params": list(head.parameters()), "lr": 0.5})
    _step_all(model, optimizer)
    got = _check(cache, model, optimizer, 0, 2)
    assert got["optim"]["param_groups"][1]["params"] == ["head.weight", "head.bias"]


def _step_all(model, optimizer):
    model(torch.randn(16, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_never_kept_when_the_answer_may_depend_on_more_than_the_structure():
    """A state-dict hook, an empty optimizer (torch initialises it), a module with extra state:
    every call asks torch."""
    model, optimizer = _model()
    _step(model, optimizer)
    _state_hook(model, optimizer)
    cache = StateCache()
    for n in range(1, 3):
        _check(cache, model, optimizer, 0, n)

    model, optimizer = _model()  # no step yet: no optimizer state
    cache = StateCache()
    for n in range(1, 3):
        _check(cache, model, optimizer, 0, n)
        optimizer.state.clear()

    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calls": 1}

        def set_extra_state(self, state):
            pass

    model = torch.nn.Sequential(Extra(8, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    cache = StateCache()
    for n in range(1, 3):
        _check(cache, model, optimizer, 0, n)


def test_another_model_or_optimizer_is_a_miss():
    model, optimizer = _model()
    _step(model, optimizer)
    cache = StateCache()
    _check(cache, model, optimizer, 0, 1)
    other, other_opt = _model()
    _step(other, other_opt)
    _check(cache, other, other_opt, 0, 2)
    _check(cache, other, None, 0, 3)
    _check(cache, other, None, 1, 3)


def test_fsdp2_unshard_and_reshard_is_noticed(one_rank_mesh):
    """FSDP2 swaps a module's registered parameters when it unshards: a miss, and torch's answer
    (its state-dict hook reshards first); resharded, the kept answer serves again."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model[0], mesh=one_rank_mesh)
    fully_shard(model, mesh=one_rank_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step_all(model, optimizer)
    cache = StateCache()
    _check(cache, model, optimizer, 0, 1)
    _check(cache, model, optimizer, 1, 1)
    model.unshard()
    _check(cache, model, optimizer, 1, 2)
    model.reshard()
    _check(cache, model, optimizer, 2, 2)


def test_a_dtensor_resharded_is_noticed(one_rank_mesh):
    """A parameter given another placement (replicated instead of sharded) over the same module."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), one_rank_mesh, [Shard(0)]))
    model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), one_rank_mesh, [Shard(0)]))
    cache = StateCache()
    _check(cache, model, None, 0, 1)
    _check(cache, model, None, 1, 1)
    with torch.no_grad():
        model.weight._local_tensor = model.weight._local_tensor.clone() + 1  # new local memory, same DTensor
    _check(cache, model, None, 1, 2)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach().full_tensor(), one_rank_mesh, [Replicate()]))
    got = _check(cache, model, None, 1, 3)
    assert got["model"]["weight"].placements == (Replicate(),)


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in optimizer.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.detach().clone() for k, v in st.items()})
    return out


def _loaded(root: str, step: int) -> dict[str, torch.Tensor]:
    model, optimizer = _model()
    _step(model, optimizer)
    Checkpointer(root).load(model, optimizer, step=step)
    return _snapshot(model, optimizer)


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]), k


@pytest.mark.parametrize("async_save", [True, False])
def test_saves_served_from_the_cache_load_back_bitwise(tmp_path, async_save):
    """Saves 2 and 3 are served from the cache (3 after new parameter memory: a miss, then kept);
    every step loads back as it was at its save, bit for bit."""
    root = str(tmp_path / "run")
    model, optimizer = _model()
    _step(model, optimizer)
    expected = {}
    with Checkpointer(root, async_save=async_save) as ckpt:
        for step in range(1, 5):
            if step == 3:
                _replace_data(model, optimizer)
            expected[step] = _snapshot(model, optimizer)
            ckpt.save(step, model, optimizer)
            _step(model, optimizer)  # at once, while an async save may still run
        assert (ckpt.state_cache.hits, ckpt.state_cache.misses) == (2, 2)
    for step, want in expected.items():
        _assert_bitwise(_loaded(root, step), want)
    assert not torch.equal(expected[2]["model.0.weight"], expected[3]["model.0.weight"])
