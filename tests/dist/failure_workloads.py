"""Workloads of the failure tests (every rank runs them): saves that fail on one rank while
training goes on (``tolerate_failures``), and a rank that trails the others."""

from __future__ import annotations

import os

import torch.distributed as dist

from .workloads import _train_steps, fresh_model, full_state, keep_warnings


def failing_saves(root: str, async_save: bool, tolerate: int, fails: int, victim: int, point: str = "after-write",
                  steps: tuple[int, ...] = (4, 6, 8), writer: str = "thread") -> dict:
    """Save step 2; then on ``victim`` the storage fails at ``point`` for the next ``fails`` saves
    (an ENOSPC raised inside the real write); train and save ``steps``. Returns what each save
    returned, what was raised (and at which step's call), the lines logged, and the full state at
    each save (what a committed step must hold)."""
    from ckpttool import Checkpointer

    lines, handler = keep_warnings()
    model, optimizer = fresh_model(seed=0)
    ckpt = Checkpointer(root, async_save=async_save, tolerate_failures=tolerate, writer=writer)
    _train_steps(model, optimizer, 0, 1)
    ckpt.save(2, model, optimizer, extra={"step": 2})
    ckpt.wait()
    if dist.get_rank() == victim:
        os.environ["CKPTTOOL_FAIL_AT"] = f"{point}:{fails}"
    out: dict = {"returned": {}, "raised": None, "states": {}}
    at = None
    try:
        for step in steps:
            _train_steps(model, optimizer, step - 2, 2)
            out["states"][step] = full_state(model, optimizer)
            at = step
            out["returned"][step] = ckpt.save(step, model, optimizer, extra={"step": step})
        at = "wait"
        ckpt.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["raised"] = (type(exc).__name__, str(exc), at)
    finally:
        os.environ.pop("CKPTTOOL_FAIL_AT", None)
    ckpt.close()
    out["logged"] = [line for line in lines if "was not saved" in line]
    out["steps"] = ckpt.steps()
    logging_off(handler)
    return out


def logging_off(handler) -> None:
    import logging

    logging.getLogger("ckpttool").removeHandler(handler)


def straggling_save(root: str, async_save: bool, delay: float, straggler_after: float) -> list[str]:
    """Save step 2, then step 4 with rank 1 held ``delay`` seconds after its data is written (a
    slow disk); returns the straggler lines this rank logged."""
    from ckpttool import Checkpointer

    lines, handler = keep_warnings()
    model, optimizer = fresh_model(seed=0)
    ckpt = Checkpointer(root, async_save=async_save, straggler_after=straggler_after)
    _train_steps(model, optimizer, 0, 1)
    ckpt.save(2, model, optimizer)
    ckpt.wait()
    if dist.get_rank() == 1:
        os.environ["CKPTTOOL_DELAY_AT"] = f"after-write:{delay}"
    try:
        ckpt.save(4, model, optimizer)
        ckpt.wait()
    finally:
        os.environ.pop("CKPTTOOL_DELAY_AT", None)
    ckpt.close()
    logging_off(handler)
    return [line for line in lines if "still at work" in line]


def one_rank_fails_before_its_write(root: str, async_save: bool, writer: str = "thread", slow: int | None = None,
                                    delay: float = 0.0) -> dict:
    """Save step 2; at step 4 rank 1 alone passes ``extra`` that is no dict (its save fails before
    it writes anything, a caller's mistake: never tolerated), and rank ``slow`` (if any) is held
    ``delay`` seconds after its data is written; train and save step 6. Returns what was raised on
    this rank, at which call, and the seconds from step 4's save() to its background save's
    failure (logged as it happens)."""
    import logging
    import time

    from ckpttool import Checkpointer

    failed_at: list[float] = []

    class When(logging.Handler):
        def emit(self, record):
            if "background save of step 4 failed" in record.getMessage():
                failed_at.append(time.monotonic())

    handler = When(level=logging.ERROR)
    logging.getLogger("ckpttool").addHandler(handler)

    model, optimizer = fresh_model(seed=0)
    ckpt = Checkpointer(root, async_save=async_save, tolerate_failures=2, writer=writer)
    _train_steps(model, optimizer, 0, 1)
    ckpt.save(2, model, optimizer, extra={"step": 2})
    ckpt.wait()
    at, start = None, time.monotonic()
    try:
        for step in (4, 6):
            at = step
            extra = ["not", "a", "dict"] if step == 4 and dist.get_rank() == 1 else {"step": step}
            if step == 4 and dist.get_rank() == slow:
                os.environ["CKPTTOOL_DELAY_AT"] = f"after-write:{delay}"
            ckpt.save(step, model, optimizer, extra=extra)
            if "CKPTTOOL_DELAY_AT" in os.environ:  # (once its writer has read it: it is at the point by then)
                time.sleep(2)
                os.environ.pop("CKPTTOOL_DELAY_AT")
        at = "wait"
        ckpt.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": (type(exc).__name__, str(exc), at), "steps": ckpt.steps(),
                "seconds": failed_at[0] - start if failed_at else None}
    finally:
        logging_off(handler)
    return {"raised": None, "steps": ckpt.steps()}
