"""The only module that calls torch.distributed collectives; every call also works without a group.

With no initialised process group the process is rank 0 of a world of 1, so the same library code
serves a training job, a single-process tool and a test. Barriers carry a name for error messages.
torch.distributed is imported by the first call that finds a group (a process that never imported
it has none): a single-process tool that asks ``rank()`` does not import torch.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def _dist() -> Any:
    import torch.distributed

    return torch.distributed


def active(group: Any = None) -> bool:
    if "torch.distributed" not in sys.modules:  # no process group without it
        return False
    return _dist().is_available() and _dist().is_initialized()


def rank(group: Any = None) -> int:
    return _dist().get_rank(group) if active() else 0


def world_size(group: Any = None) -> int:
    return _dist().get_world_size(group) if active() else 1


def barrier(name: str, group: Any = None) -> None:  # noqa: D417
    """Wait for every rank. ``name`` says which barrier in a hang or failure report."""
    if not active():
        return
    try:
        _dist().barrier(group=group)
    except RuntimeError as exc:
        raise RuntimeError(f"barrier {name!r} failed: {exc}") from exc


def broadcast(obj: T, src: int = 0, group: Any = None) -> T:
    """Rank ``src``'s picklable ``obj`` on every rank (our own values only, never checkpoint data)."""
    if not active():
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(obj: T, group: Any = None) -> list[T]:
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size(group)
    _dist().all_gather_object(out, obj, group=group)
    return out


def gather(obj: T, dst: int = 0, group: Any = None) -> list[T] | None:
    """Every rank's ``obj`` on rank ``dst`` (in rank order), None on the others: for what only one
    rank needs (a reshard's records, millions at a 1024-rank layout, gathered to worker 0 alone)."""
    if not active():
        return [obj]
    out: list[Any] | None = [None] * world_size(group) if rank(group) == dst else None
    _dist().gather_object(obj, out, dst=dst, group=group)
    return out


_FLAGS: dict[int, torch.Tensor] = {}


def agreed(fn: Any, *, rank0_only: bool = False, group: Any = None) -> Any:
    """Run ``fn`` (on rank 0 alone with ``rank0_only``) and agree on failure: a :class:`CkptError`
    on any rank is raised on every rank. Returns ``fn``'s result (None where it did not run)."""
    from .errors import CkptError

    error: BaseException | None = None
    result = None
    if not rank0_only or rank() == 0:
        try:
            result = fn()
        except CkptError as exc:
            error = exc
    error = first_error(error, group)
    if error is not None:
        raise error
    return result


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank: one all-reduce of a tensor that lives as long as the
    process (see :func:`first_error` for why it must)."""
    if not active():
        return flag
    import torch

    tensor = _FLAGS.setdefault(id(group), torch.zeros(1, dtype=torch.int64))
    tensor.fill_(1 if flag else 0)
    _dist().all_reduce(tensor, op=_dist().ReduceOp.MAX, group=group)
    return bool(tensor.item())


def first_error(error: BaseException | None, group: Any = None) -> BaseException | None:
    """Agree on failure: every rank gets the lowest rank's error (or None when all succeeded).

    Used after a step that may fail on some ranks only, so that all ranks raise together instead of
    some waiting forever in the next collective. The common case is one all-reduce of a flag that
    lives as long as the process: gloo's worker threads release a collective's tensors after it
    completes, and a tensor whose Python object died with it would need the GIL there, which a
    process exiting right after the save cannot give (the interpreter finalizing, the thread is
    torn down inside a noexcept destructor: "terminate called without an active exception").
    """
    if not active():
        return error
    if not any_rank(error is not None, group):
        return None
    errors = all_gather(None if error is None else (type(error).__name__, str(error)), group)
    for r, item in enumerate(errors):
        if item is not None:
            if error is not None:
                return error
            name, text = item
            return RuntimeError(f"rank {r} failed: {name}: {text}")
    return None


# Workers run the same sequence of collectives whatever fails where: every step that may fail on
# some workers only is followed by one agreement (a failure anywhere is raised everywhere, marked
# as agreed so that it is not agreed on again), and nothing else waits on the others.


def agreed_error(error: BaseException | None) -> BaseException | None:
    """Agree on the outcome of a step: the failure this worker raises (its own, or the first
    failed worker's as a :class:`WorkerError` with its message and exit code), or None when every
    worker succeeded."""
    from .errors import CkptError, WorkerError

    mine = None
    if error is not None:
        text = error.message() if isinstance(error, CkptError) else f"{type(error).__name__}: {error}"
        mine = (text, getattr(error, "exit_code", 2) if isinstance(error, CkptError) else 2)
    if not any_rank(mine is not None):  # the common case: one all-reduce, no objects
        return None
    failures = all_gather(mine)
    if error is None:
        r, (text, code) = next((r, f) for r, f in enumerate(failures) if f is not None)
        error = WorkerError(f"worker {r} of {len(failures)} failed: {text}", code)
    error._agreed = True  # type: ignore[attr-defined]
    return error


def agree(error: BaseException | None) -> None:
    agreed = agreed_error(error)
    if agreed is not None:
        raise agreed


def agree_on(fn: Any) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - agreed on, then raised on every worker
        agree(exc)
        raise
    agree(None)


def pause_point(name: str) -> None:
    """Crash tests stop a rank (or an offline command's worker) here (CKPTTOOL_PAUSE_AT=name) to
    kill it at a known moment, or slow it down (CKPTTOOL_DELAY_AT=name:seconds) to make a save
    still pending at a known moment."""
    delay = os.environ.get("CKPTTOOL_DELAY_AT", "")
    if delay.partition(":")[0] == name:
        time.sleep(float(delay.partition(":")[2] or 1))
    if os.environ.get("CKPTTOOL_PAUSE_AT") != name:
        return
    marker = os.environ.get("CKPTTOOL_PAUSE_FILE", "/tmp/ckpttool-paused")
    with open(f"{marker}.{rank()}", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)
