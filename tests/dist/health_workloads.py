"""Rank functions for the health tests: steps that hold NaN/Inf, and a stale copy of the weights."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .snapshot_workloads import _train
from .workloads import fresh_model, keep_warnings


def nan_steps(root: str, on_nonfinite: str, async_save: bool) -> dict:
    """Step 1 healthy; then rank 1 puts 3 NaN and an Inf into its shard of one weight and step 2 is
    saved; then a load of the newest step."""
    from ckpttool import Checkpointer
    from ckpttool.errors import CkptError

    records, handler = keep_warnings()
    try:
        model, optimizer = fresh_model(seed=0)
        _train(model, [optimizer], 0)
        errors = []
        with Checkpointer(root, async_save=async_save, on_nonfinite=on_nonfinite) as ckpt:
            ckpt.save(1, model, optimizer)
            ckpt.wait()
            if dist.get_rank() == 1:
                w = model.layers[0].feed_forward.w1.weight.to_local()
                with torch.no_grad():
                    w.view(-1)[:3] = float("nan")
                    w.view(-1)[5] = float("-inf")
            try:
                ckpt.save(2, model, optimizer)
                ckpt.wait()
            except CkptError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        at_save = list(records)
        records.clear()
        fresh, fopt = fresh_model(seed=4)
        res = Checkpointer(root).load(fresh, fopt)
        return {"errors": errors, "at_save": at_save, "at_load": list(records), "loaded": res.step,
                "steps": Checkpointer(root).steps()}
    finally:
        logging.getLogger("ckpttool").removeHandler(handler)


def stale_steps(root: str) -> dict:
    """Two optimizer groups, one with learning rate 0. Step 1; a training step; then one weight of
    the trained group is put back to its step-1 value (a stale copy) and step 2 is saved."""
    from ckpttool import Checkpointer

    records, handler = keep_warnings()
    try:
        model, _ = fresh_model(seed=0)
        head = [model.output.weight]
        rest = [p for n, p in model.named_parameters() if n != "output.weight"]
        optimizer = torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 0.0}], lr=1e-2)
        _train(model, [optimizer], 0)
        w = model.layers[1].attention.wq.weight.to_local()
        with Checkpointer(root) as ckpt:
            ckpt.save(1, model, optimizer)
            before = w.clone()
            _train(model, [optimizer], 1)
            with torch.no_grad():
                w.copy_(before)
            ckpt.save(2, model, optimizer)
            _train(model, [optimizer], 2)
            ckpt.save(3, model, optimizer)
        return {"warnings": list(records)}
    finally:
        logging.getLogger("ckpttool").removeHandler(handler)


def nonfinite_objects(root: str, async_save: bool) -> None:
    """Step 1: rank 1's own loss is inf, rank 0's finite (kept per rank), and a DTensor inside a tuple
    (counted on its local part: a DTensor's own sum would be a collective only one rank joins);
    step 2: every rank's loss is the same NaN (kept once, as rank 0's)."""
    from ckpttool import Checkpointer

    model, optimizer = fresh_model(seed=0)
    with Checkpointer(root, async_save=async_save) as ckpt:
        ckpt.save(1, model, optimizer, extra={"loss": float("inf") if dist.get_rank() == 1 else 0.5, "epoch": 1,
                                              "pair": (model.norm.weight.detach(), "norm")})
        ckpt.save(2, model, optimizer, extra={"loss": float("nan"), "epoch": 2})
