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

from . import liveness
from .bulk import no_gc

if TYPE_CHECKING:
    import torch

    from .liveness import Roll

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


def new_roll(dead_after: float, straggler_after: float) -> Roll | None:
    """The beats of this job's ranks (``liveness.Roll``), for a Checkpointer's saves; None for a
    world of one, or where torch hides the default group's store. Made by every rank at its first
    save: rank 0 names the keys (fresh ones: another job or a restart on the same store never reads
    them), every rank beats once, and a barrier: no rank looks at a beat not yet there."""
    import uuid

    from .compat import default_store

    if not active() or world_size() == 1:
        return None
    store = default_store()
    if store is None:
        return None
    key = None
    if rank() == 0:  # rank 0 decides for every rank (a store without what the beats need: saves go on without them)
        try:
            store.multi_get([])
            key = f"ckpttool/{uuid.uuid4().hex}"
        except Exception as exc:  # noqa: BLE001
            import logging

            logging.getLogger("ckpttool").warning("ckpttool: the job's store (%s) cannot serve the ranks' beats (%s): a "
                                                  "dead rank is not named", type(store).__name__, exc)
    key = broadcast(key)
    if key is None:
        return None
    roll = liveness.Roll(store, rank(), world_size(), key, dead_after=dead_after, straggler_after=straggler_after)
    barrier("ckpttool: every rank beats")
    if roll.rank == 0:
        import atexit

        atexit.register(roll.linger)
    return roll


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


def agreed(doing: str, fn: Any, *, rank0_only: bool = False, group: Any = None, roll: Roll | None = None,
           step: int | None = None, timeout: float | None = None) -> Any:
    """Run ``fn`` (on rank 0 alone with ``rank0_only``) and agree on its outcome: a :class:`CkptError`
    on any rank is raised on every rank (:func:`agreed_failure`; ``doing`` names the step). Returns
    ``fn``'s result (None where it did not run). With ``roll``, through the job's store, watching
    the ranks' beats (a save's agreements: a dead rank is named, not waited for)."""
    from .errors import CkptError

    error: BaseException | None = None
    result = None
    if not rank0_only or rank() == 0:
        try:
            result = fn()
        except CkptError as exc:
            error = exc
    error = agreed_failure(doing, error, group, roll=roll, step=step, timeout=timeout)
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


def agreed_failure(doing: str, error: BaseException | None, group: Any = None, roll: Roll | None = None,
                   step: int | None = None, timeout: float | None = None) -> BaseException | None:
    """Agree on the outcome of a step every rank takes (``doing``, as "writing its part of step 3"):
    None when every rank succeeded; else, on a failing rank its own ``error``, and on every other
    rank a :class:`~ckpttool.errors.RankFailedError` naming the failing ranks and the first one's
    error. So all ranks raise together instead of some waiting forever in the next collective.

    The common case is one all-reduce of a flag that lives as long as the process: gloo's worker
    threads release a collective's tensors after it completes, and a tensor whose Python object
    died with it would need the GIL there, which a process exiting right after the save cannot give
    (the interpreter finalizing, the thread is torn down inside a noexcept destructor).
    """
    if roll is not None:
        outcomes, _ = store_exchange(roll, doing, None if error is None else _outcome(error), None, step, timeout)
        return error if error is not None else _rank_failed(doing, outcomes)
    if not active():
        return error
    if not any_rank(error is not None, group):
        return None
    errors = all_gather(None if error is None else _outcome(error), group)
    return error if error is not None else _rank_failed(doing, errors)


def _outcome(error: BaseException) -> tuple[Any, ...]:
    """A rank's failure as the other ranks are told it in an agreement: :func:`described`, and for
    a rank found dead, whom and where (so every rank raises the same :class:`RankDeadError`)."""
    from .errors import RankDeadError

    if isinstance(error, RankDeadError):
        return (*described(error), {"ranks": error.ranks, "phases": error.phases, "doing": error.doing})
    return described(error)


def _rank_failed(doing: str, outcomes: list[Any]) -> BaseException | None:
    """The error of the ranks whose outcome (:func:`_outcome`) is not None: the
    :class:`RankDeadError` the first of them raised for a dead rank, else a :class:`RankFailedError`."""
    from .errors import RankDeadError, RankFailedError

    failed = [r for r, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return None
    # a rank that failed for another's failure (rank 0 refusing a step) comes after the one that caused it
    failed.sort(key=lambda r: outcomes[r][0] in ("RankFailedError", "StepNotCommittedError"))
    name, text, *detail = outcomes[failed[0]]
    if name == "RankDeadError" and detail and isinstance(detail[0], dict):
        try:
            return RankDeadError(detail[0]["ranks"], detail[0]["phases"], detail[0]["doing"])
        except (KeyError, TypeError, ValueError):
            pass  # (damaged: named as the rank's failure below)
    return RankFailedError(failed, doing, name, text)


def rank0_value(doing: str, value: Any, error: BaseException | None, group: Any = None,
                roll: Roll | None = None, step: int | None = None, timeout: float | None = None) -> tuple[Any, BaseException | None]:
    """Rank 0's ``value`` on every rank and the agreed failure of ``doing`` (None when every rank
    succeeded: then the value), in one exchange (with ``roll``, through the job's store)."""
    if roll is not None:
        failed, value0 = store_exchange(roll, doing, None if error is None else _outcome(error), value, step, timeout)
        failure = error if error is not None else _rank_failed(doing, failed)
        return (value0 if failure is None else None), failure
    outcomes = all_gather((None if error is None else _outcome(error), value), group)
    failure = error if error is not None else _rank_failed(doing, [failed for failed, _ in outcomes])
    return (outcomes[0][1] if failure is None else None), failure


def store_exchange(roll: Roll, doing: str, outcome: Any, value: Any, step: int | None = None,
                   timeout: float | None = None) -> tuple[list[Any], Any]:
    """Every rank's ``outcome`` (None where it succeeded; JSON) and rank 0's ``value``, on every
    rank, through the job's store: each rank adds itself to a counter (and, failing, its outcome)
    and polls the counter until every rank is in, watching the beats of those that are not (rank
    0 all of them, the others rank 0): a dead rank, or one whose beat says its part of ``step``
    failed before it could come, ends the wait on every live rank (:class:`RankDeadError`,
    :class:`RankFailedError`), rank 0 telling the others; after ``timeout`` seconds a
    :class:`RendezvousError` names the ranks still missing. Keys of the exchange before are deleted
    (every rank is past it once this one is complete)."""
    from .errors import RankDeadError, RankFailedError, RendezvousError

    roll.seq += 1
    seq, me, world, store = roll.seq, roll.rank, roll.world_size, roll.store
    base = f"{roll.key}/x/{seq}"
    roll.mine.seq = seq

    def call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - the store's host is gone
            raise roll._store_gone(exc) from None

    call(_enter_exchange, roll, base, outcome, value)
    verdict = f"{base}/dead"

    def done() -> bool:
        return call(store.add, f"{base}/n", 0) >= world or (me != 0 and call(store.check, [verdict]))

    late: list[int] = []

    def missing() -> list[int]:
        if me != 0:
            return [0]
        late[:] = [r for r, b in roll.look(list(range(world))).items() if b.seq < seq]
        return late

    def too_late() -> BaseException:
        who = f"rank(s) {late}" if me == 0 else "some rank (rank 0 names it)"
        return RendezvousError(f"{who} did not come after {timeout:.0f} s (while {doing})",
                               hint="a rank is alive but stuck elsewhere (a collective of its own?); the step is not committed")

    try:
        # polls of one counter in the store: at most every 20 ms in a small job, 200 ms at 16k ranks
        liveness.wait_until(done, roll.watch(doing, step), missing, timeout, too_late, longest=min(0.2, 0.02 + world / 80000))
    except (RankDeadError, RankFailedError) as exc:
        if me == 0:
            said = {"dead": [exc.ranks, exc.phases]} if isinstance(exc, RankDeadError) else \
                {"failed": [exc.ranks, exc.error_type, exc.text]}
            with contextlib.suppress(Exception):
                store.set(verdict, json.dumps(said))
        raise
    if me != 0 and call(store.check, [verdict]) and call(store.add, f"{base}/n", 0) < world:
        raise _verdict_error(json.loads(call(store.get, verdict)), doing)
    outcomes, value0 = _exchanged(store, base, world, call)
    call(store.add, f"{base}/seen", 1)  # (rank 0 leaves the job's store up until every rank got here: Roll.linger)
    _forget_exchange(roll, seq - 1)
    return outcomes, value0


def _exchanged(store: Any, base: str, world: int, call: Any) -> tuple[list[Any], Any]:
    """A complete exchange's outcomes (the failures' only, where a rank counted one) and rank 0's value."""
    outcomes: list[Any] = [None] * world
    if call(store.add, f"{base}/bad", 0):
        for r in range(world):
            if call(store.check, [f"{base}/f/{r}"]):
                outcomes[r] = json.loads(call(store.get, f"{base}/f/{r}"))
    return outcomes, json.loads(call(store.get, f"{base}/v"))


def _enter_exchange(roll: Roll, base: str, outcome: Any, value: Any) -> None:
    """This rank's outcome (a failure's) and rank 0's value in the store, then this rank counted in."""
    if outcome is not None:
        roll.store.set(f"{base}/f/{roll.rank}", json.dumps(outcome))
        roll.store.add(f"{base}/bad", 1)
    if roll.rank == 0:
        roll.store.set(f"{base}/v", json.dumps(value))
    roll.store.add(f"{base}/n", 1)
    roll.beat()


def _verdict_error(said: dict[str, Any], doing: str) -> BaseException:
    """The error rank 0's verdict on an exchange names (a dead rank, or one whose part failed)."""
    from .errors import RankDeadError, RankFailedError

    if "dead" in said:
        return RankDeadError(*said["dead"], doing)
    return RankFailedError(said["failed"][0], doing, *said["failed"][1:])


def _forget_exchange(roll: Roll, seq: int) -> None:
    """This rank's keys of exchange ``seq`` (rank 0: all of its keys) leave the store: every rank
    is past it once the next one is complete."""
    old = f"{roll.key}/x/{seq}"
    for key in [f"{old}/f/{roll.rank}"] + ([f"{old}/n", f"{old}/bad", f"{old}/v", f"{old}/dead", f"{old}/seen"]
                                           if roll.rank == 0 else []):
        with contextlib.suppress(Exception):
            roll.store.delete_key(key)


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
TAIL = "tail"  # the key of a part read back under which its tail is (publish_part)


def part_name(rank: int) -> str:
    return PART_FILE.format(rank=rank)


def publish_part(step_dir: Location, rank: int, part: dict[str, Any], tail: bytes = b"") -> None:
    """Put this rank's part (a JSON object; with ``error`` and ``error_type`` when it failed) in
    storage in one step, ``tail`` after it (bytes of the part's own, after a NUL: JSON holds none).
    Rank 0 polls for the name and reads the file as soon as it appears, so a file written in place
    could be read empty or half written: locally it is written under a hidden name and renamed;
    an object store's put is already whole."""
    step_dir.child(part_name(rank)).replace_bytes(part_bytes(part, tail))


def part_bytes(part: dict[str, Any], tail: bytes = b"") -> bytes:
    """A part file's bytes: its JSON, then a NUL and ``tail`` where there is one."""
    return json.dumps(part).encode() + (b"\0" + tail if tail else b"")


def await_parts(step_dir: Location, world_size: int, timeout: float, doing: str,
                roll: Roll | None = None, step: int | None = None, read: bool = True) -> list[dict[str, Any]]:
    """Rank 0: every rank's part of the step, once all are in storage, in rank order. A part that
    says its rank failed ends the wait at once with a :class:`RankFailedError` naming it (``doing``:
    what the ranks were doing); with ``roll``, a rank whose beat stopped ends it with a
    :class:`RankDeadError`, and ranks that trail the rest are logged; ranks whose part is not there
    after ``timeout`` seconds end it with a :class:`RendezvousError` naming them. ``read=False``:
    return none, and read only the parts of at most :data:`PART_HEAD` bytes, where a failed rank's
    part is (its error's text is cut to :data:`FAILED_TEXT` characters): a failure is named as
    promptly, and the others are read by whoever commits (the writer process)."""
    from .errors import RendezvousError

    names = [part_name(r) for r in range(world_size)]
    parts: dict[int, dict[str, Any]] = {}  # each part read once, when it appears (it is whole by then)

    def done() -> bool:
        present = set(step_dir.listdir())
        with no_gc():  # (parts: JSON, no cycle; the collector would walk every part read so far, again and again)
            for r, name in enumerate(names):
                if r not in parts and name in present:
                    loc = step_dir.child(name)
                    parts[r] = _read_part(loc) if read or loc.size() <= PART_HEAD else {}
                    _raise_failed(r, parts[r], doing, step_dir.url)
        return len(parts) == world_size

    def missing() -> list[int]:
        return [r for r in range(world_size) if r not in parts]

    def too_late() -> BaseException:
        return RendezvousError(f"no part from rank(s) {missing()} after {timeout:.0f} s (while {doing})", where=step_dir.url,
                               hint="a rank died or its storage stalled; the step stays uncommitted")

    watch = roll.watch(doing, step) if roll is not None else None
    if watch is not None:
        watch.where = step_dir.url
    liveness.wait_until(done, watch, missing, timeout, too_late)
    return [parts[r] for r in range(world_size)] if read else []


#: the most characters of a failed rank's error its part says: a failed rank's part stays under
#: PART_HEAD bytes (JSON spells a character in 12 at most), read when it appears whoever reads the others
FAILED_TEXT = 1000

#: the bytes of a part read when it appears: its JSON (a few KB, rank 0's its keys' paths too) and
#: the start of its tail; the rest of the tail is read by range when asked (:class:`Tail`)
PART_HEAD = 16 << 10


class Tail:
    """What follows a part's JSON: ``read(offset, length)`` from the bytes read with it, else from
    the file (rank 0 reads of a rank's tail only the sections it uses, each checked by its digest)."""

    def __init__(self, loc: Location | None, start: int, size: int, held: Any):
        self.loc, self.start, self.size, self.held = loc, start, size, memoryview(held)

    def __len__(self) -> int:
        return self.size

    def read(self, offset: int, length: int) -> Any:
        if offset + length <= len(self.held):
            return self.held[offset:offset + length]
        return self.loc.read_bytes(self.start + offset, self.start + offset + length)


def _read_part(loc: Location) -> dict[str, Any]:
    from .errors import CorruptCheckpointError

    size = loc.size()
    if size > MAX_PART_BYTES:
        raise CorruptCheckpointError("a rank's index is too large", where=loc.url)
    data = loc.read_bytes(0, min(size, PART_HEAD))
    cut = data.find(b"\0")
    if cut < 0 and len(data) < size:
        data = loc.read_bytes(0, size)
        cut = data.find(b"\0")
    raw, tail = (data, b"") if cut < 0 else (data[:cut], Tail(loc, cut + 1, max(0, size - cut - 1), memoryview(data)[cut + 1:]))
    try:
        with no_gc():  # (a rank's index: thousands of small objects, none in a cycle)
            part = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"a rank's index is damaged ({exc})", where=loc.url) from None
    if not isinstance(part, dict):
        raise CorruptCheckpointError("a rank's index is damaged (not a JSON object)", where=loc.url)
    part[TAIL] = tail
    return part


def _raise_failed(rank_: int, part: dict[str, Any], doing: str, where: str) -> None:
    from .errors import RankFailedError

    if part.get("error"):
        raise RankFailedError([rank_], doing, str(part.get("error_type") or "Error"), str(part["error"]), where=where)


def outcome_key(roll: Roll, step_dir: Location) -> str:
    return f"{roll.key}/outcome/{step_dir.name}"


def announce_commit(roll: Roll | None, step_dir: Location) -> None:
    """Rank 0, once the step in ``step_dir`` is committed: the others waiting for it learn so from
    the job's store at once (the commit record in storage says it too, for a process with none)."""
    if roll is not None:
        with contextlib.suppress(Exception):
            roll.store.set(outcome_key(roll, step_dir), json.dumps({"committed": True}))


def cause_type(error: BaseException) -> str:
    """The type's name of the error behind ``error``: another rank's, where it says whose."""
    return getattr(error, "error_type", None) or type(error).__name__


def forget_outcome(roll: Roll | None, step_dir: Location) -> None:
    """Rank 0: a step's outcome leaves the job's store once every rank has judged it."""
    if roll is not None:
        with contextlib.suppress(Exception):
            roll.store.delete_key(outcome_key(roll, step_dir))


def refuse_step(step_dir: Location, error: BaseException, roll: Roll | None = None) -> None:
    """Rank 0: say why the step in ``step_dir`` was not committed (``error``), in the job's store
    (with ``roll``) and in the step's uncommitted directory, so every other rank's background save
    stops waiting for the commit and raises the same message (a dead rank, as the same
    :class:`RankDeadError`). Best effort: where both refuse it, the others see rank 0's beat say
    that its save failed."""
    from .errors import CkptError, RankDeadError

    said: dict[str, Any] = {"error": error.message() if isinstance(error, CkptError) else f"{type(error).__name__}: {error}",
                            "error_type": cause_type(error)}
    if isinstance(error, RankDeadError):
        said["dead"] = [error.ranks, error.phases, error.doing]
    if roll is not None:
        with contextlib.suppress(Exception):
            roll.store.set(outcome_key(roll, step_dir), json.dumps(said))
    with contextlib.suppress(Exception):  # in one step: a rank that sees the file reads all of it
        step_dir.child(REFUSED_FILE).replace_bytes(json.dumps(said).encode())


def await_commit(step_dir: Location, commit_record: Location, step: int | None, timeout: float,
                 roll: Roll | None = None) -> None:
    """Ranks other than 0, after writing their part of an async save: wait until rank 0 committed
    the step (``commit_record`` exists) or refused it (:func:`refuse_step` in ``step_dir``), so
    that ``wait()`` and ``close()`` tell every rank whether the step counts. Raises
    :class:`StepNotCommittedError` with rank 0's reason (a :class:`RankDeadError` where rank 0
    found a rank dead, or with ``roll`` finds rank 0 dead), or after ``timeout`` seconds."""
    from .errors import RankDeadError, StepNotCommittedError

    marker = step_dir.child(REFUSED_FILE)
    told: dict[str, Any] = {}

    def done() -> bool:  # (the job's store first; then storage: a rank 0 that committed and exited is no death)
        if roll is not None and not told:
            with contextlib.suppress(Exception):
                key = outcome_key(roll, step_dir)
                if roll.store.check([key]):
                    told.update(json.loads(roll.store.get(key)))
        return bool(told) or commit_record.exists() or marker.exists()

    def too_late() -> BaseException:
        return StepNotCommittedError(f"rank 0 did not commit step {step} within {timeout:.0f} s", where=commit_record.parent.url,
                                     hint="rank 0 died or its storage stalled; the step stays uncommitted")

    watch = roll.watch(f"waiting for rank 0 to commit step {step}", step) if roll is not None else None
    try:
        liveness.wait_until(done, watch, [0], timeout, too_late)
    except RankDeadError:
        if not done():  # (rank 0 said the outcome, then died or exited: the outcome stands)
            raise
    if told.get("committed") or (not told and commit_record.exists()):
        return
    said = told or _refusal(marker)
    reason = said.get("error", "no reason given") if said else "its reason could not be read"
    dead = said.get("dead") if isinstance(said, dict) else None
    # (the refusal file is in storage: its shape is checked before it names anyone)
    if (isinstance(dead, list) and len(dead) == 3 and isinstance(dead[0], list) and all(isinstance(r, int) for r in dead[0])
            and isinstance(dead[1], dict) and all(str(r).isdigit() and isinstance(p, str) for r, p in dead[1].items())
            and isinstance(dead[2], str)):
        raise RankDeadError(dead[0], {int(r): p for r, p in dead[1].items()}, dead[2], where=commit_record.parent.url)
    raise StepNotCommittedError(f"step {step} was not committed: {reason}", where=commit_record.parent.url,
                                error_type=said.get("error_type") if isinstance(said.get("error_type"), str) else None)


#: how long a rank waits for a refusal it saw appear to become readable
REFUSAL_READ_S = 2.0


def _refusal(marker: Location) -> dict[str, Any]:
    """Rank 0's refusal of a step (:func:`refuse_step`) from the step's refusal file; a file seen
    mid-write (a storage that cannot replace a file in one step, or an older ckpttool's) is read
    again for up to :data:`REFUSAL_READ_S`. Empty when it could not be read."""
    from .errors import CkptError

    deadline = time.monotonic() + REFUSAL_READ_S
    while True:
        try:
            said = json.loads(marker.read_bytes()[:1 << 16])
            if isinstance(said, dict):
                return said
        except (ValueError, CkptError):
            pass
        if time.monotonic() >= deadline:
            return {}
        time.sleep(0.05)


_FAILS: dict[str, int] = {}
_HITS: dict[str, int] = {}


def pausing() -> bool:
    """Whether any :func:`pause_point` is set now: a caller that passes one for every record (the
    offline engine) asks this once, at its start, instead of reading the environment three times
    a record."""
    return any(os.environ.get(v) for v in ("CKPTTOOL_DELAY_AT", "CKPTTOOL_FAIL_AT", "CKPTTOOL_PAUSE_AT"))


def pause_point(name: str, who: int | None = None) -> None:
    """Crash tests stop a rank (or an offline command's worker) here (CKPTTOOL_PAUSE_AT=name, or
    name:N the Nth time it gets here) to kill it at a known moment, or slow it down (CKPTTOOL_DELAY_AT=name:seconds) to make a save
    still pending at a known moment; failure tests make the storage fail here as a full disk
    does (CKPTTOOL_FAIL_AT=name, or name:N for the first N times). ``who``: the rank, where the
    caller is not the rank's own process (its writer process)."""
    delay = os.environ.get("CKPTTOOL_DELAY_AT", "")
    if delay.partition(":")[0] == name:
        time.sleep(float(delay.partition(":")[2] or 1))
    fail = os.environ.get("CKPTTOOL_FAIL_AT", "")
    if fail.partition(":")[0] == name and _FAILS.get(name, 0) < int(fail.partition(":")[2] or 1 << 30):
        _FAILS[name] = _FAILS.get(name, 0) + 1
        import errno

        raise OSError(errno.ENOSPC, f"No space left on device (CKPTTOOL_FAIL_AT={fail})")
    at, _, nth = os.environ.get("CKPTTOOL_PAUSE_AT", "").partition(":")
    if at != name:
        return
    _HITS[name] = _HITS.get(name, 0) + 1
    if nth and _HITS[name] < int(nth):
        return
    marker = os.environ.get("CKPTTOOL_PAUSE_FILE", "/tmp/ckpttool-paused")
    with open(f"{marker}.{rank() if who is None else who}", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)
