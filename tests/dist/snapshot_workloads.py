"""Rank functions for the snapshot tests: async saves followed at once by in-place writes of every
kind a training script makes, and the expected state at each call (module level, so ranks can import them)."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from .workloads import fresh_model, full, optimizer_state

#: what the script does right after save() returns, before anything else (one per save, in turn)
EDITS = ("mul_", "data", "foreach", "load_state_dict", "optim_state", "extra", "other_optimizer", "step_then_edit")


def two_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW over the blocks and SGD with momentum over the embeddings and the head (as Muon +
    AdamW or AdamW + SGD splits are made)."""
    emb = [p for n, p in model.named_parameters() if n.startswith(("tok_embeddings", "pos_embeddings", "output"))]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("tok_embeddings", "pos_embeddings", "output"))]
    assert emb and rest
    return [torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1), torch.optim.SGD(emb, lr=1e-2, momentum=0.9)]


def expected_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], extra: dict) -> dict[str, object]:
    """Every value a step holds, in full and keyed by name (a collective: same on every rank)."""
    out: dict[str, object] = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for i, opt in enumerate(optimizers):
        out.update(optimizer_state(model, opt, f"optim{i}"))
    for k, v in extra.items():
        out[f"extra.{k}"] = v.clone() if isinstance(v, torch.Tensor) else repr(v)
    return out


def _train(model, optimizers, step: int) -> None:
    from ckpttool.training.trainer.model import PRESETS, local_batch

    x, y = local_batch(step, dist.get_rank(), dist.get_world_size(), 12, PRESETS["tiny"], 0)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _edit(kind: str, model, optimizers, other, extra) -> None:
    """An in-place write of ``kind``, made at once after save() returned."""
    params = list(model.parameters())
    with torch.no_grad():
        if kind == "mul_":
            for p in params:
                p.mul_(0.5)
        elif kind == "data":
            for p in params:
                p.data.add_(1.0)  # through .data: no version counter sees it
        elif kind == "foreach":
            torch._foreach_mul_(params, 0.9)  # on DTensors: no version counter moves either
        elif kind == "load_state_dict":  # an EMA written back into the model
            model.load_state_dict({k: v.detach() * 0.9 for k, v in model.state_dict().items()})
        elif kind == "optim_state":
            for opt in optimizers:
                for st in opt.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor) and v.is_floating_point():
                            v.add_(3.0)
        elif kind == "extra":
            dist.all_reduce(extra["ema"])  # a collective: its schema does not say it writes
            extra["history"].append(len(extra["history"]))
    if kind == "other_optimizer":  # an optimizer that was not passed to save() steps at once
        from ckpttool.training.trainer.model import PRESETS, local_batch

        x, y = local_batch(0, dist.get_rank(), dist.get_world_size(), 12, PRESETS["tiny"], 0)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        other.step()
        other.zero_grad()
        for opt in optimizers:
            opt.zero_grad()
    if kind == "step_then_edit":  # a training step, then a manual edit before the next save
        _train(model, optimizers, 99)
        with torch.no_grad():
            params[0].zero_()


def saves_with_edits(root: str, saves: int, two: bool) -> dict[str, object]:
    """``saves`` async saves, each followed at once by one of EDITS (the copy thread starts late:
    CKPTTOOL_DELAY_AT=stage-copy), a training step between saves; then every step loaded into a
    fresh model with fresh optimizers. Returns what each step should hold and what it holds."""
    from ckpttool import Checkpointer

    model, single = fresh_model(seed=0)
    optimizers = two_optimizers(model) if two else [single]
    other = torch.optim.SGD(model.parameters(), lr=0.5)  # never passed to save()
    _train(model, optimizers, 0)
    extra = {"ema": torch.arange(4.0) + dist.get_rank(), "history": [0]}
    ckpt = Checkpointer(root, async_save=True)
    expected = {}
    for i in range(1, saves + 1):
        expected[i] = expected_state(model, optimizers, extra)
        ckpt.save(i, model, optimizers if two else optimizers[0], extra=extra)
        _edit(EDITS[i % len(EDITS)], model, optimizers, other, extra)
        _train(model, optimizers, i)
    ckpt.close()
    steps = Checkpointer(root).steps()
    loaded = {}
    for i in steps:
        fresh, fsingle = fresh_model(seed=7)
        fopts = two_optimizers(fresh) if two else [fsingle]
        _train(fresh, fopts, 50)  # every state exists, with other values
        res = Checkpointer(root).load(fresh, fopts if two else fopts[0], step=i)
        loaded[i] = expected_state(fresh, fopts, res.extra)
    return {"expected": expected, "loaded": loaded, "steps": steps}


def foreign_thread_write(root: str) -> dict[str, object]:
    """Rank 1 writes a parameter from another thread (no guard sees it) before its copy: the step
    must fail on every rank, never commit, and the next save must commit."""
    from ckpttool import Checkpointer
    from ckpttool.errors import CkptError

    model, optimizer = fresh_model(seed=0)
    _train(model, [optimizer], 0)
    ckpt = Checkpointer(root, async_save=True)
    ckpt.save(1, model, optimizer)
    ckpt.wait()
    ckpt.save(2, model, optimizer)
    if dist.get_rank() == 1:
        p = next(model.parameters())

        def write():
            with torch.no_grad():
                p.mul_(2.0)

        t = threading.Thread(target=write)
        t.start()
        t.join()
    errors = []
    try:
        ckpt.wait()
    except CkptError as exc:
        errors.append(f"wait: {type(exc).__name__}: {exc}")
    steps_after_failure = Checkpointer(root).steps()
    ckpt.save(3, model, optimizer)
    ckpt.close()
    return {"errors": errors, "steps_after_failure": steps_after_failure, "steps": Checkpointer(root).steps()}


def two_optimizers_save(root: str) -> dict[str, object]:
    """Train with two optimizers and save them together; returns the state saved (in full)."""
    from ckpttool import Checkpointer

    model, _ = fresh_model(seed=0)
    optimizers = two_optimizers(model)
    for step in range(3):
        _train(model, optimizers, step)
    with Checkpointer(root) as ckpt:
        ckpt.save(3, model, optimizers)
    return expected_state(model, optimizers, {})


def two_optimizers_load(root: str) -> dict[str, object]:
    """Load into a fresh model with its two optimizers (any world size)."""
    from ckpttool import Checkpointer

    model, _ = fresh_model(seed=7)
    optimizers = two_optimizers(model)
    _train(model, optimizers, 40)  # every state exists, with other values
    Checkpointer(root).load(model, optimizers)
    return expected_state(model, optimizers, {})
