"""What a :class:`~ckpttool.Checkpointer` save does, behind its front: the step's temporary
directory and the ranks' agreement on it, the state and its staging, this rank's write
(ckpttool's writer, or DCP's for placements it does not lay out: ``fallback.py``), rank 0's
commit (``.metadata``, health, the commit record written last, the rename), retention, and the
background threads of async saves with their errors and outcomes.

No collective runs in ckpttool's write or commit: rank 0 learns the other ranks' parts from
storage (their indexes), and the other ranks learn the step's fate from storage (the commit
record, or rank 0's ``.ckpttool-failed.json``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Callable

import torch

from .. import health, liveness, rendezvous
from . import fallback, step_writer
from .background import Job, Worker
from ..errors import (CkptError, LeaseError, OutputExistsError, RankDeadError, RankFailedError, SnapshotError,
                      StepNotCommittedError, UnhealthyStepError, UsageError)
from .lease import Lease
from .state import extra_state
from .staging import Stager
from .writer_process import WriterProcess
from .state import StateCache
from ..steps import COMMIT_FILE, commit_record, list_root, parse_step, retention_victims, step_name
from ..storage import Location, save_error

log = logging.getLogger("ckpttool")


@dataclass
class Options:
    """A Checkpointer's settings, as its constructor documents them (checked there)."""

    keep_last: int | None = None
    keep_every: int | None = None
    storage_options: dict[str, Any] | None = None
    commit_timeout: float = 1800.0
    compress: str | None = None
    on_commit: Callable[[int, str], None] | None = None
    on_phase: Callable[[str, float, float], None] | None = None
    writer_nice: int | None = None
    incremental: bool = False
    on_nonfinite: str = "warn"
    health: bool = True
    dead_after: float = liveness.DEAD_AFTER
    straggler_after: float = liveness.STRAGGLER_AFTER
    tolerate_failures: int = 0
    writer: str = "thread"


class Saves:
    """The saves of one Checkpointer (one per rank): see the module's text."""

    def __init__(self, root: Location, options: Options, lease: Lease):
        self.root = root
        self.o = options
        self.lease = lease
        self.job: Job | None = None  # the async save being written (its writer thread's job)
        self._job_error: BaseException | None = None
        self._outcome: tuple[Location, Location] | None = None  # (ranks > 0) the last async step whose commit is not yet seen
        self._group: Any = None  # checkpoint-only process group, made on the first async save through DCP's writer
        self._staged: Any = None  # the last such save's copy of the state, reused by the next
        self.stager = self._new_stager()  # host buffers of async saves, reused while shapes hold
        self.states = StateCache()  # get_state_dict's answer, kept while the model's and optimizer's structure holds
        self._frozen: frozenset[str] = frozenset()  # the state keys of this save's frozen parameters (incremental)
        self._buffers: frozenset[str] = frozenset()  # the state keys of the model's plain-tensor buffers (several ranks)
        self._trainable: set[str] = set()  # the state keys of this save's trainable parameters
        self._last_digests: Any = None  # (step, its final place, this rank's record digests) of its last save
        self._written: Any = None  # what this rank put in its frozen file at its last save (step_writer.Written)
        self._first_save = True
        self.roll: liveness.Roll | None = None  # the ranks' beats (made at the first save of a job of several ranks)
        self._pending_step: int | None = None  # the async save whose outcome this rank has not judged yet
        self._last_async: int | None = None  # the step of the last async save
        self._announced: Location | None = None  # (rank 0) the last async step whose outcome is in the job's store
        self._failures = 0  # failed saves in a row (tolerate_failures)
        self._step: int | None = None  # the step being saved, and the seconds of its phases on this rank so far
        self._phases: dict[str, float] = {}
        # the copy into host memory, at the training thread's priority (the optimizer's next step
        # may wait for it), and the writer, at nice ``writer_nice`` (Linux: per thread)
        self.copier = Worker("ckpttool-stage")
        self.writer = Worker("ckpttool-save", nice=options.writer_nice)
        # writer="process": an async save's write runs there (writer_process.py), this thread waits for it
        self.process = WriterProcess(options.writer_nice) if options.writer == "process" else None

    # --- one save -------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], extra: dict | None,
             blocking: bool) -> str | None:
        """One save: prepare (the step's directory, agreed), the state, then the write and the
        commit, here (``blocking``) or in the background after the state is staged. One switch
        picks the writer: ckpttool's own (no collective), or DCP's for placements it does not lay out."""
        self.stager.fence()  # the last save's copy ends first (and its write guard leaves this thread)
        self._step, self._phases = step, {}
        final = self.root.child(step_name(step))
        with self.timing("prepare"):
            tmp = self._begin_save(step, final)
        if tmp is None:
            return None  # (a failure tolerate_failures let pass: logged on every rank)
        try:
            return self._save_state(step, model, optimizers, extra, blocking, tmp, final)
        except BaseException as exc:
            if self.roll is not None:  # a failure of this rank alone: whoever waits for it learns so from its beat
                self.roll.failed(step, *rendezvous.described(exc))
            raise

    def _save_state(self, step: int, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
                    extra: dict | None, blocking: bool, tmp: Location, final: Location) -> str | None:
        """The state, then the write and the commit (here, or staged for the background). A
        ckpttool error on this rank before the write is this rank's failure of the save: agreed
        with the others in the sync write's agreement, or judged with theirs after an async one."""
        front: CkptError | None = None
        state: dict[str, Any] = {}
        try:
            with self.timing("state"):
                state, buffers = self._training_state(model, optimizers, extra)
            self._note_keys(model, state, buffers)
            if not blocking:
                staged, own = self._stage(state, buffers)
        except CkptError as exc:
            if self.roll is None:
                raise
            front = exc
        if blocking:
            try:
                if front is not None or step_writer.supports(state):
                    with self.timing("sync save"):
                        self._save_own_sync(state, step, tmp, final, front)
                else:
                    self._save_through_dcp(state, step, tmp, final, group=None)
            except CkptError as exc:  # (every rank has it: the write and the commit are agreed)
                self.judge(step, exc)
                return None
            self.judge(step, None)
            return final.url
        self._pending_step = self._last_async = step
        if front is not None:  # (rank 0's wait for this rank's part ends at its beat; judged at the next call)
            self._job_error = front
            with contextlib.suppress(Exception):
                step_writer.publish_failure(tmp, rendezvous.rank(), front)
            if rendezvous.rank() == 0:
                rendezvous.refuse_step(tmp, front, self.roll)
                self._announced = tmp
            return final.url
        rendezvous.pause_point("after-stage")
        if own and self.process is not None:
            self.process.start()  # (its start overlaps the copy)
        if own and self.stager.copying:
            self.copier.submit(self.stager.copy, name="ckpttool-stage")
        rank, world_size, phases = rendezvous.rank(), rendezvous.world_size(), self._phases
        self.job = self.writer.submit(lambda: self._background(staged, step, tmp, final, own, rank, world_size, phases),
                                      name=f"ckpttool-save-{step}")
        return final.url

    def _note_keys(self, model: torch.nn.Module, state: dict[str, Any], buffers: set[int]) -> None:
        """The state keys this save's writer treats apart: the frozen parameters (incremental), the
        trainable ones (health), the plain-tensor buffers (kept per rank). Read by this save's
        writer only: the next save() sets them after joining this one."""
        frozen = [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad]
        self._frozen = frozenset(frozen) if self.o.incremental else frozenset()
        self._trainable = {f"model.{n}" for n, _ in model.named_parameters()} - set(frozen)
        self._buffers = plain_buffers(state["model"], buffers) if rendezvous.world_size() > 1 else frozenset()

    def _stage(self, state: dict[str, Any], buffers: set[int]) -> tuple[dict[str, Any], bool]:
        """An async save's copy of the state, and whether ckpttool's own writer writes it: host
        buffers to be filled in the background, guarded (module buffers, which a forward may
        change in place, at the call: ``buffers`` holds the addresses of their local tensors); for
        a placement ckpttool's writer does not lay out, DCP's writer and a copy made at the call."""
        try:
            with self.timing("stage"):
                staged = self.stager.stage(state, rendezvous.rank(), step_writer.stores, in_order=buffers, background=True)
        except step_writer.UnsupportedPlacement:
            self._make_group()
            staged = self._staged = fallback.stage(state, self._staged)
            return staged, False
        return staged, True

    def _training_state(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
                        extra: dict | None) -> tuple[dict[str, Any], set[int]]:
        """This save's ``{"model", "optim", "extra"}`` and the addresses of the model's buffers:
        torch's ``get_state_dict`` answer, kept from the last save while the structure holds."""
        base, buffers = self.states.state(model, optimizers)
        state = dict(base)
        if extra:
            state["extra"] = extra_state(extra)
        return state, buffers

    def _make_group(self) -> None:
        if self._group is None:
            self._group = rendezvous.new_group()  # DCP's collectives, in the background thread alone

    def _background(self, staged: dict[str, Any], step: int, tmp: Location, final: Location, own: bool, rank: int,
                    world_size: int, phases: dict[str, float]) -> None:
        try:
            if own:
                self._write_and_commit_own(staged, step, tmp, final, rank, world_size, phases)
            else:
                self._save_through_dcp(staged, step, tmp, final, group=self._group)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next save/wait/close
            self._job_error = exc
            if self.roll is not None:  # rank 0 stops waiting for this rank's part even where storage is down
                self.roll.failed(step, *rendezvous.described(exc))
            # also said now: a process whose last save fails and that never calls save/wait/close again
            log.error("ckpttool: rank %d: the background save of step %d failed: %s", rank, step, exc)
        else:
            if self.roll is not None:
                self.roll.at(step, "done")
        finally:
            now = time.perf_counter()
            self.phase("done", now, now)  # the background save is over (rank 0: committed, or failed)

    def _write_and_commit_own(self, staged: dict[str, Any], step: int, tmp: Location, final: Location, rank: int,
                              world_size: int, phases: dict[str, float]) -> None:
        """The background part of an async save (its own step and phases: the training thread's
        next save() may have begun)."""
        try:
            self.stager.wait(run=False)  # the copies are in host memory (CUDA: issued on a side stream)
            with self.timing("write", step, phases):
                self._write_own(staged, tmp, rank, final, step, phases, world_size, staged=True)
            if rank == 0:
                with self.timing("commit", step, phases):
                    self._commit_own(step, tmp, final, world_size, staged=True)
        except BaseException as exc:
            if rank == 0:  # the other ranks wait for the commit: tell them why it will not come
                rendezvous.refuse_step(tmp, exc, self.roll)
                self._announced = tmp
            elif isinstance(exc, SnapshotError):
                with contextlib.suppress(Exception):  # rank 0 stops waiting for this rank's part
                    step_writer.publish_failure(tmp, rank, exc)
            raise
        if rank == 0:
            self._after_commit()
        if rank != 0:
            self._outcome = (tmp, final)  # wait() and close() learn from storage whether rank 0 committed it

    def _save_own_sync(self, state: dict[str, Any], step: int, tmp: Location, final: Location,
                       front: CkptError | None = None) -> None:
        """``front``: this rank's failure before its write (its part of the write's agreement)."""
        def write() -> None:
            if front is not None:
                raise front
            with self.timing("write"):
                self._write_own(state, tmp, rendezvous.rank(), final, step, self._phases, rendezvous.world_size())

        def commit() -> None:
            with self.timing("commit"):
                self._commit_own(step, tmp, final, rendezvous.world_size())

        timeout = self.o.commit_timeout
        rendezvous.agreed(f"writing its part of step {step}", write, roll=self.roll, step=step, timeout=timeout)
        rendezvous.agreed(f"committing step {step}", commit, rank0_only=True, roll=self.roll, step=step, timeout=timeout)
        self._after_commit()

    def _write_own(self, state: dict[str, Any], tmp: Location, rank: int, final: Location, step: int,
                   phases: dict[str, float], world_size: int, staged: bool = False) -> None:
        """This rank's part of the step (``staged``: an async save's staged state, written in the
        writer process where there is one)."""
        previous = self._written
        if previous is not None and not previous.step_dir.child(COMMIT_FILE).exists():
            previous = None  # its step never committed, or retention removed it: nothing to share
        last = self._last_digests
        if last is not None and not last[1].child(COMMIT_FILE).exists():
            last = None  # the stale check compares with the previous committed step only
        check = health.Check(self._trainable, last[2] if last else None, last[0] if last else None) if self.o.health else None
        self._written = None
        self._last_digests = None
        progress = self.roll.wrote if self.roll is not None else None
        kwargs = dict(compress=self.o.compress, frozen=self._frozen, previous=previous, buffers=self._buffers,
                      phases={k: round(v, 6) for k, v in phases.items() if k in OWN_WORK}, world_size=world_size)
        try:
            if staged and self.process is not None:
                written = self.process.write(self.stager.block, tmp, rank, state, step, progress, check, **kwargs)
            else:
                written = step_writer.write_rank(tmp, rank, state, pause=rendezvous.pause_point, health=check,
                                                progress=progress, **kwargs)
            if written is not None:
                written.step_dir = final  # where its files are once the step is committed
        except CkptError:
            raise
        except Exception as exc:  # a write the storage refused: one line naming the step
            raise save_error(exc, tmp) from None
        self._written = written
        if check is not None:
            self._last_digests = (step, final, check.tally.digests)

    def _commit_own(self, step: int, tmp: Location, final: Location, world_size: int, staged: bool = False) -> None:
        """Rank 0: wait for every rank's index in storage, write .metadata, then the commit record
        (last), publish the step and apply retention (``staged``: an async save's; its indexes read
        and merged in the writer process where there is one, this thread watching the beats while
        it waits for them)."""
        timeout = self.o.commit_timeout
        if staged and self.process is not None:
            rendezvous.await_parts(tmp, world_size, timeout, f"writing its part of step {step}", self.roll, step, read=False)
            record = self.process.commit(tmp, world_size, timeout, step)
        else:
            record = step_writer.commit_step(tmp, world_size, timeout, step, self.roll)
        if "health" in record:
            self._judge_health(step, record["health"])
        self._publish(step, tmp, final, world_size, record)

    def _after_commit(self) -> None:
        """Rank 0, the step committed: retention (its failures are logged: the step stands)."""
        try:
            self._apply_retention()
        except CkptError as exc:
            log.warning("ckpttool: retention after the commit failed (the step stands): %s", exc)

    def _save_through_dcp(self, state: dict[str, Any], step: int, tmp: Location, final: Location, group: Any) -> None:
        """DCP's writer (``fallback.py``), then the commit, agreed over ``group``."""
        manifest, per_rank, buffers, found = fallback.write(state, tmp, self.o.storage_options or {}, self.o.compress, group,
                                                            self.o.health, self._buffers)
        rendezvous.barrier("ckpttool.commit", group)

        def commit() -> None:
            record: dict[str, Any] = {"manifest": {**manifest, "files": fallback.metadata_row(tmp)}}  # .metadata's row too
            if per_rank:
                record["per_rank"] = per_rank
            if buffers:
                record["per_rank_buffers"] = buffers
            if found is not None:
                record["health"] = found
                self._judge_health(step, found)
            self._publish(step, tmp, final, rendezvous.world_size(), record)

        rendezvous.agreed(f"committing step {step}", commit, rank0_only=True, group=group)
        self._after_commit()

    def _publish(self, step: int, tmp: Location, final: Location, world_size: int, record: dict[str, Any]) -> None:
        """Rank 0: the commit record, written last, then the step renamed into place; ``on_commit``
        told (an error in it is logged: the step is committed whatever it does)."""
        rendezvous.pause_point("before-commit")
        tmp.child(COMMIT_FILE).write_bytes(commit_record(step, world_size, record))
        rendezvous.pause_point("before-rename")
        self.root.commit_policy.publish(tmp, final)
        if self.writer.running_here():  # (an async save: the others wait for word of it)
            rendezvous.announce_commit(self.roll, tmp)
            self._announced = tmp
        if self.o.on_commit is not None:
            try:
                self.o.on_commit(step, final.url)
            except Exception:  # noqa: BLE001 - a caller's callback must not undo a commit
                log.exception("on_commit callback failed for step %d", step)

    def _judge_health(self, step: int, found: dict[str, Any]) -> None:
        """Rank 0, before the commit: a step with non-finite values is refused with
        ``on_nonfinite="refuse"`` (every rank raises it), else said at once in one line."""
        bad = health.nonfinite_keys(found)
        stale = found.get("unchanged") or []
        if bad:
            said = "; ".join(p for p in health.problems(found) if p.split(":")[0] in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            if self.o.on_nonfinite == "refuse":
                raise UnhealthyStepError(f"step {step} holds non-finite values ({said}{more}); not committed",
                                         hint="the run diverged before this save; resume from an earlier step "
                                              "(ckpttool inspect ROOT shows which are healthy)")
            log.warning("ckpttool: step %d holds non-finite values: %s%s", step, said, more)
        if stale:
            log.warning("ckpttool: step %d: %d trainable tensor(s) unchanged since step %s while their optimizer state "
                        "moved, first %s (a stale copy of the weights, or gradients that never reach them?)",
                        step, len(stale), found.get("compared_with"), stale[0])

    def _apply_retention(self) -> None:
        if rendezvous.rank() != 0 or self.o.keep_last is None:
            return
        for victim in retention_victims(list_root(self.root).committed, self.o.keep_last, self.o.keep_every):
            loc = self.root.child(step_name(victim))
            try:
                # a delete cut short leaves a hidden temporary (filesystems) or an un-committed
                # step (object stores), never something that looks like a step
                self.root.commit_policy.retire(loc, COMMIT_FILE)
            except CkptError as exc:
                log.warning("retention: could not delete %s: %s", loc.url, exc)

    # --- the step's directory and the lease -------------------------------------------------------

    def _begin_save(self, step: int, final: Location) -> Location | None:
        """Join the pending save, hold the lease and make the step's temporary directory (rank 0),
        and agree on the outcome in one exchange: the directory's name, or the first rank's error
        raised on every rank. The async save before it, if its outcome is not known yet, is judged
        first, on every rank alike (:meth:`judge`: a failure there fails this save, unless
        ``tolerate_failures`` lets this one start fresh)."""
        pending = self._pending_step
        error = self.join_job()
        if self.roll is None and self._first_save:
            self._first_save = False
            self.roll = rendezvous.new_roll(self.o.dead_after, self.o.straggler_after)
        if pending is not None or self.roll is not None:
            # (with beats, on every rank at every save: a rank that judged its last save at wait()
            # and one that did not still make the same exchanges)
            last = self._last_async
            # (no step to watch for: a rank whose beat says that save failed brings its failure here)
            failure = rendezvous.agreed_failure(f"saving step {last}", error, roll=self.roll, timeout=self.o.commit_timeout)
            if pending is not None or failure is not None:
                self.judge(last if last is not None else step, failure)
            error = None
            if self._announced is not None and rendezvous.rank() == 0:  # every rank is past its outcome now
                rendezvous.forget_outcome(self.roll, self._announced)
                self._announced = None
        name = None
        if error is None and rendezvous.rank() == 0:
            try:
                self.hold_lease()
                name = self._make_step_dir(final)
            except CkptError as exc:
                error = exc
        agreed_name, failure = rendezvous.rank0_value(f"preparing step {step}", name, error, roll=self.roll, step=step,
                                                      timeout=self.o.commit_timeout)
        if failure is not None:
            if name is not None:  # made here, and no rank writes into it
                with contextlib.suppress(CkptError):
                    self.root.child(name).remove()
            self.judge(step, failure)
            return None
        return self.root.child(agreed_name)

    def _make_step_dir(self, final: Location) -> str:
        check_root(self.root)
        self.root.makedirs()
        if final.exists():
            raise OutputExistsError("step already exists", where=final.url, hint="save under a new step number or delete it first")
        # Filesystems rename a finished temp directory into place; object stores have no
        # atomic rename, so there the step is written in place and the commit record,
        # written last, is what makes it count (the root's commit policy decides).
        tmp = self.root.commit_policy.staging(final)
        tmp.makedirs()
        return tmp.name

    def hold_lease(self) -> None:
        if not self.lease.held:
            check_root(self.root)
            self.root.makedirs()  # a missing bucket is an error here, never created
            self.lease.acquire()
            atexit.register(self.lease.release)  # after the interpreter joined a pending save
        else:
            self.lease.check()

    # --- waiting and closing -----------------------------------------------------------------------

    def join_job(self, outcome: bool = False) -> BaseException | None:
        """Wait for this rank's background save; its error, if it failed. With ``outcome`` (wait and
        close), a rank other than 0 also waits until rank 0 committed the step or refused it (its
        reason is then this rank's error): every rank tells the same story, with no collective.
        (``save`` needs not: its agreement raises any rank's error on every rank.)"""
        if self.job is not None:
            self.job.wait()
            self.job = None
        error, self._job_error = self._job_error, None
        pending, self._outcome = self._outcome, None
        self._pending_step = None
        if outcome and error is None and pending is not None:
            try:
                tmp, final = pending
                rendezvous.await_commit(tmp, final.child(COMMIT_FILE), parse_step(final.name), self.o.commit_timeout, self.roll)
            except CkptError as exc:
                error = exc
        return error

    def wait(self) -> None:
        """This rank's pending background save done, and judged (:meth:`judge`) as every rank judges it."""
        pending = self._pending_step
        with self.timing("wait"):
            error = self.join_job(True)
        if pending is not None:
            self.judge(pending, error)
        elif error is not None:
            raise error

    def writing(self) -> bool:
        """Whether this rank's background save is still being written."""
        return self.job is not None and not self.job.done.is_set()

    def judge(self, step: int, failure: BaseException | None) -> None:
        """The outcome of the save of ``step``, the same on every rank (an agreed failure, or rank
        0's commit or refusal): a failure is raised, unless it is one ``tolerate_failures`` lets
        pass and fewer than that many saves failed in a row before it: then it is logged here,
        naming the failing rank, and training goes on (the step stays uncommitted)."""
        if failure is None:
            self._failures = 0
            return
        self._failures += 1
        if self._failures > self.o.tolerate_failures or not tolerable(failure):
            raise failure
        me = rendezvous.rank()
        named = isinstance(failure, (RankFailedError, RankDeadError, StepNotCommittedError))
        text = failure.message() if isinstance(failure, CkptError) else str(failure)
        said = text if named else f"rank {me} failed: {type(failure).__name__}: {text}"
        log.error("ckpttool: rank %d: step %d was not saved: %s; %d failed save(s) in a row, %d tolerated: training goes on",
                  me, step, said, self._failures, self.o.tolerate_failures)

    def close(self) -> None:
        """After the last wait: threads joined, buffers and the process group let go."""
        self._staged = None
        self.states.clear()
        self.copier.close()
        self.writer.close()  # joins a write still running (wait() interrupted): then the lease may go
        self.stager = self._new_stager()  # (after the join: a write in a writer process reads the old stager's block)
        if self.process is not None:
            self.process.close()
        self.lease.release()
        rendezvous.destroy_group(self._group)
        self._group = None
        if self.roll is not None:
            self.roll.close()
            self.roll = None

    def not_from_the_writer(self, what: str) -> None:
        """``on_commit`` of an async save runs in the writer thread: a ``save``, ``wait`` or
        ``close`` from there would wait for the very save that runs it (forever), or tear the
        Checkpointer down under it."""
        if self.writer.running_here():
            raise UsageError(f"Checkpointer.{what}() was called from the Checkpointer's own background save "
                             "(on_commit runs there)", hint="call it from the training loop; on_commit should only record or notify")

    # --- phases ------------------------------------------------------------------------------------

    def _new_stager(self) -> Stager:
        # (a write that waits for the copy, an optimizer step or a guarded edit, is the phase "fence")
        return Stager(lambda: rendezvous.pause_point("stage-copy"), on_fence=lambda start, end: self.phase("fence", start, end),
                      shared=self.o.writer == "process")

    @contextlib.contextmanager
    def timing(self, name: str, step: int | None = None, phases: dict[str, float] | None = None) -> Iterator[None]:
        """What runs inside is phase ``name`` of this save: said in this rank's beat, its seconds
        kept for the step's commit record, and reported to ``on_phase`` (when set)."""
        start = time.perf_counter()
        step = self._step if step is None else step
        phases = self._phases if phases is None else phases
        if self.roll is not None and name != "wait" and (self.writer.running_here() or not self.writing()):
            self.roll.at(step, name)  # (the beat says where the save is: a background write's phase first)
        try:
            yield
        finally:
            end = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + end - start
            if self.o.on_phase is not None:
                self.phase(name, start, end)

    def phase(self, name: str, start: float, end: float) -> None:
        if self.o.on_phase is not None:
            try:
                self.o.on_phase(name, start, end)
            except Exception:  # noqa: BLE001 - a caller's callback must not fail a save
                log.exception("on_phase callback failed for phase %s", name)


def plain_buffers(model_state: dict[str, Any], buffers: set[int]) -> frozenset[str]:
    """The state keys (``model.<name>``) of the model's buffers that are plain tensors, not DTensors:
    every rank holds a value of its own, which may differ from the others' (``buffers``: the
    addresses of the buffers' memory; a state dict's keys are not the module's names under
    torch.compile or DDP)."""
    from torch.distributed.tensor import DTensor

    return frozenset(f"model.{k}" for k, v in model_state.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
                     and v.numel() and v.data_ptr() in buffers)


#: the phases a rank's index records for its step's commit record: its own work (not "prepare",
#: which holds the wait for the other ranks' agreement, nor "sync save", which holds the others)
OWN_WORK = ("state", "stage", "write")

#: what a failed save can never be let pass with (tolerate_failures): a dead rank (the job cannot go
#: on), a caller's mistake, another job's lease, a step refused for its non-finite values on purpose
NEVER_TOLERATED = (RankDeadError, UsageError, OutputExistsError, LeaseError, UnhealthyStepError)


def tolerable(error: BaseException) -> bool:
    """Whether ``tolerate_failures`` may let this failed save pass: ckpttool's errors (a storage
    error, a full disk, a rank's writer error, a store that is down, a refused snapshot, another
    rank's such failure), never a bug's exception nor one of :data:`NEVER_TOLERATED`."""
    if isinstance(error, NEVER_TOLERATED) or not isinstance(error, CkptError):
        return False
    if isinstance(error, (RankFailedError, StepNotCommittedError)) and error.error_type is not None:
        # another rank's error, by its type's name: judged as that rank judges it
        from .. import errors

        cause = getattr(errors, error.error_type, None)
        return isinstance(cause, type) and issubclass(cause, CkptError) and not issubclass(cause, NEVER_TOLERATED)
    return True


def check_root(root: Location) -> None:
    if root.isfile():
        raise UsageError("checkpoint root is a file, not a directory", where=root.url, hint="pass the directory that holds step-<N>")
