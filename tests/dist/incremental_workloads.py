"""Rank functions of the incremental-checkpoint tests: the trainer's tiny model under FSDP2 with a
frozen base (every parameter but the norms and the output head), AdamW over the rest."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .workloads import _train_steps, fresh_model, full_state


def trainable(name: str) -> bool:
    return "norm" in name or name.startswith("output")


def frozen_model(seed: int = 0):
    model, _ = fresh_model(seed=seed)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    return model, optimizer


def incremental_run(root: str, expected_dir: str, steps: tuple[int, ...] = (1, 2, 3), keep_last: int | None = 2,
                    async_save: bool = False) -> dict[str, object]:
    """Train with a frozen base and save every step incrementally; rank 0 keeps each step's full
    state in ``expected_dir/<step>.pt``."""
    from ckpttool import Checkpointer

    model, optimizer = frozen_model()
    ckpt = Checkpointer(root, keep_last=keep_last, incremental=True, async_save=async_save)
    for i, step in enumerate(steps):
        _train_steps(model, optimizer, i, 1)
        ckpt.save(step, model, optimizer, extra={"step": step})
        ckpt.wait()
        state = full_state(model, optimizer)
        if dist.get_rank() == 0:
            torch.save(state, os.path.join(expected_dir, f"{step}.pt"))
    ckpt.close()
    return {"steps": Checkpointer(root).steps()}


def plain_load(path: str) -> dict[str, object]:
    """A step loaded by plain torch.distributed.checkpoint alone (no ckpttool code on the load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = frozen_model(seed=999)
    _train_steps(model, optimizer, 0, 1)  # the optimizer's state exists, with other values
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"state": full_state(model, optimizer)}


def ckpttool_load(root: str, step: int) -> dict[str, object]:
    """Checkpointer.load of one step; the error's text when it refuses."""
    from ckpttool import Checkpointer

    model, optimizer = frozen_model(seed=999)
    _train_steps(model, optimizer, 0, 1)
    try:
        Checkpointer(root).load(model, optimizer, step=step)
    except Exception as exc:  # noqa: BLE001 - the rank that read the record raises it; the others name it
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"state": full_state(model, optimizer)}


def crash_during_incremental_save(root: str, expected_path: str) -> None:
    """Save steps 1 and 2 incrementally (step 2 shares step 1's frozen files), record step 2, then
    save step 3 with CKPTTOOL_PAUSE_AT set: the test kills every rank while they are paused in it."""
    import time

    from ckpttool import Checkpointer

    pause = os.environ.pop("CKPTTOOL_PAUSE_AT")
    model, optimizer = frozen_model()
    ckpt = Checkpointer(root, incremental=True, keep_last=1)
    for step in (1, 2):
        _train_steps(model, optimizer, step, 1)
        ckpt.save(step, model, optimizer, extra={"step": step})
    state = full_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(state, expected_path)
    dist.barrier()
    _train_steps(model, optimizer, 3, 1)
    os.environ["CKPTTOOL_PAUSE_AT"] = pause
    ckpt.save(3, model, optimizer, extra={"step": 3})
    while True:
        time.sleep(1)


def resume_and_save(root: str, expected_dir: str, steps: tuple[int, ...]) -> dict[str, object]:
    """Resume from the newest step (saved on another world size) and save ``steps`` incrementally;
    rank 0 keeps each step's full state in ``expected_dir/<step>.pt``."""
    from ckpttool import Checkpointer

    model, optimizer = frozen_model(seed=999)
    _train_steps(model, optimizer, 0, 1)  # the optimizer's state exists, with other values
    ckpt = Checkpointer(root, incremental=True)
    resumed = ckpt.load(model, optimizer).step
    for i, step in enumerate(steps):
        _train_steps(model, optimizer, 10 + i, 1)
        ckpt.save(step, model, optimizer, extra={"step": step})
        state = full_state(model, optimizer)  # (a collective: every rank)
        if dist.get_rank() == 0:
            torch.save(state, os.path.join(expected_dir, f"{step}.pt"))
    ckpt.close()
    return {"resumed": resumed}


def damaged_shared_files(root: str, expected_dir: str) -> dict[str, object]:
    """Save step 1; every rank flips a bit in its frozen file of step 1; save step 2 (which would have
    shared that file); flip a bit in step 2's; save step 3; save step 4 (shares step 3's again).
    Returns the warnings each rank logged."""
    import logging

    from ckpttool import Checkpointer

    from ..helpers import flip_bit

    from .workloads import keep_warnings

    said, handler = keep_warnings()
    rank = dist.get_rank()
    loaded: list[object] = []
    try:
        model, optimizer = frozen_model()
        ckpt = Checkpointer(root, incremental=True)
        for i, step in enumerate((1, 2, 3, 4)):
            _train_steps(model, optimizer, i, 1)
            ckpt.save(step, model, optimizer, extra={"step": step})
            ckpt.wait()
            state = full_state(model, optimizer)
            if rank == 0:
                torch.save(state, os.path.join(expected_dir, f"{step}.pt"))
            newest = ckpttool_load(root, step)  # the newest step, as a resume would take it now
            loaded.append(newest.get("error") or all(
                torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(state.values(), newest["state"].values())))
            dist.barrier()
            if step in (1, 2):  # damage after the step committed, before the next save
                path = os.path.join(root, f"step-{step}", f"__{rank}_1.distcp")
                flip_bit(path, os.path.getsize(path) // 3)
            dist.barrier()
        ckpt.close()
    finally:
        logging.getLogger("ckpttool").removeHandler(handler)
    return {"warnings": said, "loaded": loaded, "inodes": [os.stat(os.path.join(root, f"step-{s}", f"__{rank}_1.distcp")).st_ino for s in (1, 2, 3, 4)]}
