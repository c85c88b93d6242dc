"""The state a save writes: the model's and optimizers' (torch's ``get_state_dict`` answer, kept from
save to save while their structure holds) and the caller's ``extra``.

torch's ``get_state_dict`` walks the module tree, maps every parameter to its FQN and checks its
options on every call: tens of milliseconds, most of what an async ``save()`` still spent on the
training thread (docs/benchmarks.md). Its answer depends on the *structure* (which modules, parameters,
buffers and optimizer state exist, and where their memory is), not on the values: the model part
holds detached aliases of the live parameters and buffers, the optimizer part the optimizer's own
per-parameter state dicts. :class:`StateCache` keeps the answer of the last call and serves it
again while a signature of that structure is unchanged:

- every module (identity, class, the identity of each parameter and buffer under its name, the
  non-persistent buffers, the number of state-dict hooks), and for each parameter and buffer
  where its memory is (the local shard's address, shape, strides, dtype; a DTensor's global
  shape, placements and mesh): a parameter replaced, resharded or given new memory is noticed;
- each optimizer (one or several, as ``get_state_dict`` takes them): its state container, which
  parameters have state (in order), each group's parameters and hyper-parameter names. Hyper-parameter values and the per-parameter state are
  read live at every save, so a changed learning rate or a new state entry is never stale.

Only what is known to be a pure function of that structure is cached: a model whose every
state-dict leaf aliases a live parameter or buffer, with no state-dict hooks but FSDP2's own
(which reshard, and are no-ops when the signature holds), no module overriding ``state_dict`` or
keeping extra state; an optimizer with state already (torch initialises an empty one) and no
state-dict hooks. The optimizer part rebuilt from the cache is checked against torch's own
answer when the cache is filled; anything else, or any mismatch, and every save asks torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Union

import torch

from ..compat import local_tensor
from ..errors import UsageError
from .step_writer import Whole

#: what ``save`` and ``load`` take as ``optimizer``: none, one, or a list of them
Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]

#: the FSDP2 state-dict pre-hook (it reshards a module's parameters before a state dict is taken)
_FSDP2_HOOK = "to_sharded_hook"


class StateCache:
    """``get_state_dict(model, optimizer)`` of the last save, served again while the structure holds."""

    def __init__(self) -> None:
        self._entry: _Entry | None = None
        self.hits = 0  # saves served from the cache (tests and benchmarks read them)
        self.misses = 0

    def clear(self) -> None:
        self._entry = None

    def state(self, model: torch.nn.Module, optimizers: Any) -> tuple[dict[str, Any], set[int]]:
        """``({"model": ..., "optim": ...}, addresses of the model's buffers)`` as of now; the
        addresses are those of the buffers' local memory (a forward may change them in place).
        ``optimizers``: None, one or several."""
        optimizers = optimizers_of(optimizers)
        entry = self._entry
        if entry is not None and entry.model() is model and entry.optimizers_are(optimizers):
            sig = _signature(model, optimizers)
            if sig is not None and sig == entry.signature:
                self.hits += 1
                return entry.rebuild(optimizers), entry.buffers
        self.misses += 1
        self._entry = None
        state = torch_state(model, optimizers)
        sig = _signature(model, optimizers)  # after torch's call: its hooks may have resharded the model
        buffers = {local_tensor(b).data_ptr() for b in model.buffers()}
        if sig is not None:
            self._entry = _Entry.build(model, optimizers, state, sig, buffers)
        return state, buffers


def optimizers_of(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    """``None``, one optimizer or several (a list or tuple, as torch's ``get_state_dict`` takes
    them) as a tuple; raises :class:`UsageError` for anything else."""
    if optimizer is None:
        return ()
    found = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)
    for o in found:
        if not isinstance(o, torch.optim.Optimizer):
            raise UsageError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(o).__name__}",
                             hint="pass every optimizer of the model: save(step, model, [opt_a, opt_b])")
    if len({id(o) for o in found}) != len(found):
        raise UsageError("the same optimizer was passed twice")
    return found


def torch_state(model: torch.nn.Module, optimizers: Any) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from torch (sharded, no gather; several optimizers' states
    merged as ``get_state_dict`` merges them); without an optimizer, the model's only."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    optimizers = optimizers_of(optimizers)
    if optimizers:
        msd, osd = get_state_dict(model, optimizers if len(optimizers) > 1 else optimizers[0])
        return {"model": msd, "optim": osd}
    return {"model": get_model_state_dict(model)}


class _Entry:
    def __init__(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], signature: Signature,
                 model_state: dict, fqns: dict[int, str], buffers: set[int]):
        self.model = weakref.ref(model)
        self._optimizers = tuple(weakref.ref(o) for o in optimizers)
        self.signature = signature
        self.model_state = model_state
        self.fqns = fqns  # id(parameter) -> its FQN in the optimizer's state dict
        self.buffers = buffers

    def optimizers_are(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
        return len(optimizers) == len(self._optimizers) and all(r() is o for r, o in zip(self._optimizers, optimizers))

    @classmethod
    def build(cls, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], state: dict[str, Any],
              signature: Signature, buffers: set[int]) -> _Entry | None:
        msd = state["model"]
        if not _aliases_live_tensors(model, msd):
            return None
        fqns: dict[int, str] = {}
        if optimizers:
            osd = state["optim"]
            groups = osd.get("param_groups")
            live = [g for o in optimizers for g in o.param_groups]
            if not isinstance(groups, list) or len(groups) != len(live):
                return None
            for packed, group in zip(groups, live):
                names = packed.get("params")
                if not isinstance(names, list) or len(names) != len(group["params"]):
                    return None
                fqns.update((id(p), n) for p, n in zip(group["params"], names))
        entry = cls(model, optimizers, signature, dict(msd), fqns, buffers)
        if optimizers and not _same_optim_state(entry.rebuild(optimizers)["optim"], state["optim"]):
            return None  # torch's answer is not what the rebuild gives (another torch, an FSDP1 model): never cached
        return entry

    def rebuild(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> dict[str, Any]:
        """The state as torch would give it now: the cached model part (aliases of the live
        tensors) and the optimizer part re-read from the optimizer (values are live)."""
        model_state = dict(self.model_state)  # the kept dict itself is never handed out
        if not optimizers:
            return {"model": model_state}
        fqns = self.fqns
        state = {fqns[id(p)]: value for o in optimizers for p, value in o.state.items()}
        groups = []
        for group in (g for o in optimizers for g in o.param_groups):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [fqns[id(p)] for p in group["params"]]
            groups.append(packed)
        return {"model": model_state, "optim": {"state": state, "param_groups": groups}}


def _where(t: torch.Tensor, keep: list[Any]) -> tuple:
    """Where a tensor's values live, and as what: a tensor given new memory, a new shape or
    another layout has another answer."""
    local = local_tensor(t)
    keep.append(local)
    if local is t:
        return (id(local), local.data_ptr(), tuple(local.shape), local.stride(), local.storage_offset(), local.dtype, local.device)
    mesh = t.device_mesh
    keep.append(mesh)
    return (id(local), local.data_ptr(), tuple(local.shape), local.stride(), local.storage_offset(), local.dtype, local.device,
            tuple(t.shape), tuple(t.placements), id(mesh))


def _signature(model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> Signature | None:
    """The structure get_state_dict's answer depends on, or None when the answer may depend on
    more (hooks, overridden state_dict methods, extra state, an empty optimizer)."""
    parts: list[Any] = []
    keep: list[Any] = []  # every object named by its id, alive while the signature is
    seen: set[int] = set()
    stack = [model]
    base = torch.nn.Module
    while stack:
        m = stack.pop()
        if id(m) in seen:
            parts.append(id(m))
            continue
        seen.add(id(m))
        cls = type(m)
        if (cls.state_dict is not base.state_dict or cls._save_to_state_dict is not base._save_to_state_dict
                or cls.get_extra_state is not base.get_extra_state or m._state_dict_hooks
                or any(getattr(h, "__name__", None) != _FSDP2_HOOK for h in m._state_dict_pre_hooks.values())):
            return None
        params, buffers = m._parameters, m._buffers
        keep.append(m)
        keep.extend(params.values())
        keep.extend(buffers.values())
        parts.append((id(m), cls, tuple(params), tuple(map(id, params.values())), tuple(buffers), tuple(map(id, buffers.values())),
                      tuple(sorted(m._non_persistent_buffers_set)), len(m._state_dict_pre_hooks), tuple(m._modules)))
        for t in params.values():
            if t is not None:
                parts.append(_where(t, keep))
        for t in buffers.values():
            if t is not None:
                parts.append(_where(t, keep))
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    for optimizer in optimizers:
        if (not optimizer.state or type(optimizer).state_dict is not torch.optim.Optimizer.state_dict
                or optimizer._optimizer_state_dict_pre_hooks or optimizer._optimizer_state_dict_post_hooks):
            return None
        state = optimizer.state
        keep.append(state)
        parts.append((id(state), tuple(map(id, state))))
        for group in optimizer.param_groups:
            keep.append(group)
            parts.append((id(group), tuple(group), tuple(map(id, group["params"]))))
    return Signature(tuple(parts), keep)


class Signature:
    """The structure as plain values (objects by their id), and the objects those ids name,
    kept alive so that no other object can take one of their ids while this signature lives."""

    __slots__ = ("parts", "_keep")

    def __init__(self, parts: tuple, keep: list[Any]):
        self.parts = parts
        self._keep = keep

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Signature) and self.parts == other.parts

    __hash__ = None  # type: ignore[assignment]


def _aliases_live_tensors(model: torch.nn.Module, msd: dict[str, Any]) -> bool:
    """Whether every value of the model's state dict is a tensor over the memory of one of the
    live parameters or buffers (then the cached one shows the live values, as long as the
    signature holds); a computed value (extra state, a hook's tensor) is not."""
    live = {}
    for t in [*model.parameters(), *model.buffers()]:
        local = local_tensor(t)
        live[(local.data_ptr(), tuple(local.shape), local.stride(), local.dtype, local.device)] = t
    for value in msd.values():
        if not isinstance(value, torch.Tensor):
            return False
        local = local_tensor(value)
        if local.numel() == 0:
            continue
        t = live.get((local.data_ptr(), tuple(local.shape), local.stride(), local.dtype, local.device))
        if t is None or tuple(t.shape) != tuple(value.shape) or (local is not value) != (local_tensor(t) is not t):
            return False
    return True


def _same_optim_state(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """The rebuilt optimizer state against torch's: the same keys in the same order, the same
    per-parameter state objects, groups with the same keys and values."""
    if list(theirs) != ["state", "param_groups"]:
        return False
    a, b = mine["state"], theirs["state"]
    if list(a) != list(b) or any(a[k] is not b[k] for k in a):
        return False
    ga, gb = mine["param_groups"], theirs["param_groups"]
    if len(ga) != len(gb):
        return False
    for x, y in zip(ga, gb):
        if list(x) != list(y) or x["params"] != y["params"]:
            return False
        if any(not (x[k] is y[k] or (type(x[k]) is type(y[k]) and not isinstance(x[k], torch.Tensor) and _safe_eq(x[k], y[k])))
               for k in x if k != "params"):
            return False
    return True


def _safe_eq(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not known to be equal
        return False


# --- what a save writes of the caller's state ----------------------------------------------------


def training_state(model: torch.nn.Module, optimizer: Optimizers, extra: dict | None) -> dict[str, Any]:
    state = torch_state(model, optimizers_of(optimizer))
    if extra:
        state["extra"] = extra_state(extra)
    return state


def extra_state(extra: dict[str, Any]) -> dict[str, Any]:
    """What is saved of ``extra``: each Stateful value (``state_dict()`` and ``load_state_dict()``:
    an LR scheduler, a stateful data loader, the user's own) as its state dict, as ``dcp.save``
    treats a Stateful; everything else as it is."""
    if not isinstance(extra, dict):
        raise UsageError(f"extra must be a dict, got {type(extra).__name__}")
    out = {}
    for key, value in extra.items():
        value = value.state_dict() if _stateful(value) else value
        # a value keyed by anything but strings (an optimizer's state is keyed by int) is stored as
        # one object: DCP's flattened keys would give its keys back as strings; one holding a
        # DTensor is sharded state and stays traversed
        out[key] = Whole(value) if _odd_keys(value) and not holds_dtensor(value) else value
    return out


def _odd_keys(value: Any) -> bool:
    if isinstance(value, dict):
        return any(not isinstance(k, str) for k in value) or any(_odd_keys(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_odd_keys(v) for v in value)
    return False


def holds_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return True
    if isinstance(value, dict):
        return any(holds_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_dtensor(v) for v in value)
    return False


def _stateful(value: Any) -> bool:
    return (not isinstance(value, (torch.Tensor, type)) and callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None)))
