"""Every agreement between ranks, each named: what is agreed, among whom, and what every rank
raises when some rank fails. The only module that calls torch.distributed collectives, or waits for
another rank's file in storage.

Collectives (``all_gather``, ``barrier``, ...) also work without a process group: the process is
rank 0 of a world of 1, so the same library code serves a training job, a single-process tool and
a test. torch.distributed is imported by the first call that finds a group (a process that never
imported it has none): a single-process tool that asks ``rank()`` does not import torch.

The agreements:

- ``agreed_failure(doing, error)`` / ``agreed(doing, fn)``: ranks that all take a step (a sync
  save's write, its commit, a load, the check after a load) agree on its outcome: the failing rank
  raises its own error, every other rank a :class:`~ckpttool.errors.RankFailedError` naming the
  failing ranks, what they were doing and the first one's error.
- ``rank0_value(doing, value, error)``: rank 0's value (a step's directory) on every rank, with the
  same agreement on failure, in one exchange.
- ``agreed_gather(doing, fn)``: every rank's result on every rank, once all succeeded (DCP's writer
  path: the per-rank values, NaN counts and records' digests).
- ``checked_together(doing, mine, check)``: ranks that each read part of some records
  split the check of the rest between them (a ``torch.save`` file's CRC-32s after a load): the same
  verdict on every rank, in exactly two gathers whatever fails where.
- ``agreed_error`` / ``agree`` / ``agree_on``: the workers of an offline command (``--nproc``), and
  ``await_every_worker`` before they exit.
- ``new_group``: the process group of a background save through DCP's writer, apart from the
  training's collectives.
- Through storage, without a collective (an async save's ranks may have destroyed their process
  group): every rank publishes its part of a step (``publish_part``) and rank 0 waits for all of
  them (``await_parts``); rank 0 commits the step or says in it why not (``refuse_step``), and the
  other ranks wait for either (``await_commit``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from .storage import Location

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


@contextlib.contextmanager
def _collective(name: str) -> Iterator[None]:
    """A collective that fails (a rank died, its connection broke) raises a :class:`RendezvousError`
    naming it, not torch's bare ``RuntimeError``."""
    from .errors import RendezvousError

    try:
        yield
    except RuntimeError as exc:
        raise RendezvousError(f"{name} failed: {exc}", hint="a rank died or lost its connection") from exc


def barrier(name: str, group: Any = None) -> None:  # noqa: D417
    """Wait for every rank. ``name`` says which barrier in a hang or failure report."""
    if not active():
        return
    with _collective(f"barrier {name!r}"):
        _dist().barrier(group=group)


def broadcast(obj: T, src: int = 0, group: Any = None) -> T:
    """Rank ``src``'s picklable ``obj`` on every rank (our own values only, never checkpoint data)."""
    if not active():
        return obj
    box = [obj]
    with _collective("a broadcast between ranks"):
        _dist().broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(obj: T, group: Any = None) -> list[T]:
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size(group)
    with _collective("an all-gather between ranks"):
        _dist().all_gather_object(out, obj, group=group)
    return out


def gather(obj: T, dst: int = 0, group: Any = None) -> list[T] | None:
    """Every rank's ``obj`` on rank ``dst`` (in rank order), None on the others: for what only one
    rank needs (a reshard's records, millions at a 1024-rank layout, gathered to worker 0 alone)."""
    if not active():
        return [obj]
    out: list[Any] | None = [None] * world_size(group) if rank(group) == dst else None
    with _collective("a gather between ranks"):
        _dist().gather_object(obj, out, dst=dst, group=group)
    return out


def new_group() -> Any:
    """A process group of every rank of its own (gloo), or None without one: collectives of a
    background save must never interleave with the training's on the default group (FSDP's
    all-gathers)."""
    if not active():
        return None
    with _collective("making a process group"):
        return _dist().new_group(backend="gloo")


def destroy_group(group: Any) -> None:
    """Let go of a group :func:`new_group` made (where the default one still exists)."""
    if group is not None and active():
        _dist().destroy_process_group(group)


def await_every_worker(timeout_s: float) -> None:
    """An offline command's workers, before they exit: wait (at most ``timeout_s``) until every
    worker got here, so that none exits before worker 0 has written its report. gloo's own barrier,
    in C++: no tensor made in Python, so nothing for its threads to free while the process ends.
    A peer that died or hung ends the wait (the launcher reports it)."""
    from datetime import timedelta

    try:
        if active():
            _dist().monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except Exception:  # noqa: BLE001 - exit anyway
        pass


_FLAGS: dict[int, torch.Tensor] = {}


def described(error: BaseException) -> tuple[str, str]:
    """An error as the other ranks are told it: its type's name and its one-line text."""
    from .errors import CkptError

    return type(error).__name__, error.message() if isinstance(error, CkptError) else str(error)


def agreed(doing: str, fn: Any, *, rank0_only: bool = False, group: Any = None) -> Any:
    """Run ``fn`` (on rank 0 alone with ``rank0_only``) and agree on its outcome: a :class:`CkptError`
    on any rank is raised on every rank (:func:`agreed_failure`; ``doing`` names the step). Returns
    ``fn``'s result (None where it did not run)."""
    from .errors import CkptError

    error: BaseException | None = None
    result = None
    if not rank0_only or rank() == 0:
        try:
            result = fn()
        except CkptError as exc:
            error = exc
    error = agreed_failure(doing, error, group)
    if error is not None:
        raise error
    return result


def agreed_gather(doing: str, fn: Any, group: Any = None) -> list[Any]:
    """``fn()`` on every rank, and every rank's result on every rank, once every rank succeeded;
    else the agreed failure of ``doing`` (:func:`agreed_failure`) is raised on every rank, before
    any rank waits in the gather for one that will not come."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - agreed on, then raised on every rank
        error = exc
    error = agreed_failure(doing, error, group)
    if error is not None:
        raise error
    return all_gather(result, group)


def checked_together(doing: str, mine: Any, check: Any, group: Any = None) -> BaseException | None:
    """Every rank's ``mine`` (what it read) on every rank; ``check(everyone)`` the same on every
    rank, whose ``share(rank)`` is this rank's part of what none read, checked (a
    :class:`CkptError` there is this rank's failure), and whose ``verdict(shares)``, once every
    rank's share is in, is the same on every rank. Returns the agreed failure of ``doing`` (None
    when the check passed everywhere). Exactly two gathers on every rank, whatever fails where."""
    from .errors import CkptError

    work = check(all_gather(mine, group))
    error: BaseException | None = None
    found = None
    try:
        found = work.share(rank(group))
    except CkptError as exc:
        error = exc
    shares = all_gather(None if error is not None else found, group)
    if error is None and all(s is not None for s in shares):
        error = work.verdict({k: v for s in shares for k, v in s.items()})
    return agreed_failure(doing, error, group)


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank: one all-reduce of a tensor that lives as long as the
    process (see :func:`agreed_failure` for why it must)."""
    if not active():
        return flag
    import torch

    tensor = _FLAGS.setdefault(id(group), torch.zeros(1, dtype=torch.int64))
    tensor.fill_(1 if flag else 0)
    with _collective("an all-reduce between ranks"):
        _dist().all_reduce(tensor, op=_dist().ReduceOp.MAX, group=group)
    return bool(tensor.item())


def agreed_failure(doing: str, error: BaseException | None, group: Any = None) -> BaseException | None:
    """Agree on the outcome of a step every rank takes (``doing``, as "writing its part of step 3"):
    None when every rank succeeded; else, on a failing rank its own ``error``, and on every other
    rank a :class:`~ckpttool.errors.RankFailedError` naming the failing ranks and the first one's
    error. So all ranks raise together instead of some waiting forever in the next collective.

    The common case is one all-reduce of a flag that lives as long as the process: gloo's worker
    threads release a collective's tensors after it completes, and a tensor whose Python object
    died with it would need the GIL there, which a process exiting right after the save cannot give
    (the interpreter finalizing, the thread is torn down inside a noexcept destructor).
    """
    if not active():
        return error
    if not any_rank(error is not None, group):
        return None
    errors = all_gather(None if error is None else described(error), group)
    return error if error is not None else _rank_failed(doing, errors)


def _rank_failed(doing: str, outcomes: list[Any]) -> BaseException | None:
    """The :class:`RankFailedError` of the ranks whose outcome (``(type name, text)``) is not None."""
    from .errors import RankFailedError

    failed = [r for r, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return None
    name, text = outcomes[failed[0]]
    return RankFailedError(failed, doing, name, text)


def rank0_value(doing: str, value: Any, error: BaseException | None, group: Any = None) -> tuple[Any, BaseException | None]:
    """Rank 0's ``value`` on every rank and the agreed failure of ``doing`` (None when every rank
    succeeded: then the value), in one exchange."""
    outcomes = all_gather((None if error is None else described(error), value), group)
    failure = error if error is not None else _rank_failed(doing, [failed for failed, _ in outcomes])
    return (outcomes[0][1] if failure is None else None), failure


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
        name, text = described(error)
        text = text if isinstance(error, CkptError) else f"{name}: {text}"
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


# --- through storage: a step's parts, and its commit ----------------------------------------------

#: what each rank puts in a step's directory once its part is written (its index), or once it failed
PART_FILE = ".ckpttool-rank-{rank}.json"
#: what rank 0 puts in a step it could not commit: the other ranks stop waiting for the commit
REFUSED_FILE = ".ckpttool-failed.json"
MAX_PART_BYTES = 256 << 20


def part_name(rank: int) -> str:
    return PART_FILE.format(rank=rank)


def publish_part(step_dir: Location, rank: int, part: dict[str, Any]) -> None:
    """Put this rank's part (a JSON object; with ``error`` and ``error_type`` when it failed) in
    storage in one step. Rank 0 polls for the name and reads the file as soon as it appears, so a
    file written in place could be read empty or half written: locally it is written under a
    hidden name and renamed; an object store's put is already whole."""
    step_dir.child(part_name(rank)).replace_bytes(json.dumps(part).encode())


def await_parts(step_dir: Location, world_size: int, timeout: float, doing: str) -> list[dict[str, Any]]:
    """Rank 0: every rank's part of the step, once all are in storage, in rank order. A part that
    says its rank failed ends the wait at once with a :class:`RankFailedError` naming it (``doing``:
    what the ranks were doing); ranks whose part is not there after ``timeout`` seconds, with a
    :class:`RendezvousError` naming them."""
    from .errors import RendezvousError

    names = [part_name(r) for r in range(world_size)]
    parts: dict[int, dict[str, Any]] = {}  # each part read once, when it appears (it is whole by then)
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        present = set(step_dir.listdir())
        for r, name in enumerate(names):
            if r not in parts and name in present:
                parts[r] = _read_part(step_dir.child(name))
                _raise_failed(r, parts[r], doing, step_dir.url)
        if len(parts) == world_size:
            return [parts[r] for r in range(world_size)]
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in parts]
            raise RendezvousError(f"no part from rank(s) {missing} after {timeout:.0f} s (while {doing})", where=step_dir.url,
                                  hint="a rank died or its storage stalled; the step stays uncommitted")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _read_part(loc: Location) -> dict[str, Any]:
    from .errors import CorruptCheckpointError

    if loc.size() > MAX_PART_BYTES:
        raise CorruptCheckpointError("a rank's index is too large", where=loc.url)
    try:
        part = json.loads(loc.read_bytes())
    except ValueError as exc:
        raise CorruptCheckpointError(f"a rank's index is damaged ({exc})", where=loc.url) from None
    if not isinstance(part, dict):
        raise CorruptCheckpointError("a rank's index is damaged (not a JSON object)", where=loc.url)
    return part


def _raise_failed(rank_: int, part: dict[str, Any], doing: str, where: str) -> None:
    from .errors import RankFailedError

    if part.get("error"):
        raise RankFailedError([rank_], doing, str(part.get("error_type") or "Error"), str(part["error"]), where=where)


def refuse_step(step_dir: Location, message: str) -> None:
    """Rank 0: say in the step's (uncommitted) directory why it was not committed, so every other
    rank's background save stops waiting for the commit and raises the same message. Best effort:
    a storage that refuses it leaves the others to time out."""
    import contextlib

    with contextlib.suppress(Exception):
        step_dir.child(REFUSED_FILE).write_bytes(json.dumps({"error": message}).encode())


def await_commit(step_dir: Location, commit_record: Location, step: int | None, timeout: float) -> None:
    """Ranks other than 0, after writing their part of an async save: wait until rank 0 committed
    the step (``commit_record`` exists) or refused it (:func:`refuse_step` in ``step_dir``), so
    that ``wait()`` and ``close()`` tell every rank whether the step counts. Raises
    :class:`StepNotCommittedError` with rank 0's reason, or after ``timeout`` seconds."""
    from .errors import CkptError, StepNotCommittedError

    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        if commit_record.exists():
            return
        marker = step_dir.child(REFUSED_FILE)
        if marker.exists():
            try:
                reason = json.loads(marker.read_bytes()[:1 << 16]).get("error", "no reason given")
            except (ValueError, AttributeError, CkptError):
                reason = "its reason could not be read"
            raise StepNotCommittedError(f"step {step} was not committed: {reason}", where=commit_record.parent.url)
        if time.monotonic() > deadline:
            raise StepNotCommittedError(f"rank 0 did not commit step {step} within {timeout:.0f} s", where=commit_record.parent.url,
                                        hint="rank 0 died or its storage stalled; the step stays uncommitted")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


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
