"""The training-loop API: save sharded state to ``ROOT/step-<N>``, commit atomically, keep the last K,
and load the newest committed step into a model on any world size or mesh.

    ckpt = Checkpointer("runs/exp1", keep_last=3)
    res = ckpt.load(model, optimizer)          # None on a fresh start
    start = res.step if res else 0             # a step number counts optimizer steps done
    for step in range(start, total):
        ...
        ckpt.save(step + 1, model, optimizer, extra={"data_seed": 7})

Saves go through ``torch.distributed.checkpoint`` (no all-gather: each rank writes its own shards),
so a step directory is a plain DCP checkpoint that ``torch.distributed.checkpoint.load`` reads.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import io
import logging
import os
import time
import warnings
from typing import Any, Callable, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from . import dist, health
from .checksums import hash_bytes
from .background import Job, Worker
from .errors import (CkptError, CorruptCheckpointError, NotFoundError, OutputExistsError, SnapshotError, StorageError,
                     UnhealthyStepError, UsageError)
from .formats import dcp as dcp_format
from .formats.dcp import check_compress, dcp_writer, hash_records, metadata_row
from .formats.dcp.metadata import PER_RANK
from .formats.dcp.save import Whole
from .lease import Lease
from .staging import Stager, frozen
from .state_cache import StateCache, optimizers_of
from .steps import COMMIT_FILE, await_outcome, commit_record, list_root, refuse_step, retention_victims, step_health, step_name
from .restore import LoadResult, Optimizers, _holds_dtensor, extra_state, load
from .storage import Location, resolve

log = logging.getLogger("ckpttool")
T = TypeVar("T")

#: the phases ``Checkpointer(on_phase=...)`` reports: preparing (joining the previous save, the lease,
#: the step's directory, the ranks' agreement), getting the state dict, staging (the async copy into
#: host buffers), the fence (an optimizer step waiting for that copy), writing this rank's part, the
#: commit (rank 0), a whole sync save, wait(), and "done" (start = end: the moment an async save's
#: background thread finished)
PHASES = ("state", "stage", "fence", "prepare", "write", "commit", "sync save", "wait", "done")


class Checkpointer:
    """Save and resume training state under one root directory (a local path or an fsspec URL).

    Every rank of the job creates one and calls the same methods in the same order; in a single
    process without a process group it works as rank 0 of 1 (to inspect or load on a laptop).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep_last: int | None = None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        async_save: bool = False,
        commit_timeout: float = 1800.0,
        lease_stale_after: float = 600.0,
        compress: str | None = None,
        on_commit: Callable[[int, str], None] | None = None,
        on_phase: Callable[[str, float, float], None] | None = None,
        writer_nice: int | None = None,
        incremental: bool = False,
        on_nonfinite: str = "warn",
        health: bool = True,
    ):
        if keep_last is not None and keep_last < 1:
            raise UsageError(f"keep_last must be at least 1, got {keep_last}", hint="use None to keep every step")
        if keep_every is not None and keep_every < 1:
            raise UsageError(f"keep_every must be at least 1, got {keep_every}")
        if on_nonfinite not in ("warn", "refuse"):
            raise UsageError(f"on_nonfinite must be 'warn' or 'refuse', got {on_nonfinite!r}")
        if writer_nice is not None and not (isinstance(writer_nice, int) and 0 <= writer_nice <= 19):
            raise UsageError(f"writer_nice must be a nice value from 0 to 19, got {writer_nice!r}",
                             hint="use None to leave the writer at the training thread's priority")
        self.root: Location = resolve(root, storage_options)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.storage_options = storage_options or {}
        self.async_save = async_save
        check_compress(compress)
        self.compress = compress  # "zstd": every record stored compressed (plain torch reads it back)
        self.commit_timeout = commit_timeout  # how long rank 0 waits for the other ranks' parts of a step
        self._lease = Lease(self.root, stale_after=lease_stale_after)  # taken by rank 0 at the first save
        self._pending: Job | None = None  # the async save being written
        self._pending_error: BaseException | None = None
        self._outcome: tuple[Location, Location] | None = None  # (ranks > 0) the last async step whose commit is not yet seen
        self._group: Any = None  # checkpoint-only process group, made on the first async save
        self._staged: Any = None  # the last async save's copy of the state, reused by the next (DCP fallback)
        self._stager = self._new_stager()  # host buffers of async saves, reused while shapes hold
        self._states = StateCache()  # get_state_dict's answer, kept while the model's and optimizer's structure holds
        self.on_commit = on_commit  # rank 0, once a step is committed: on_commit(step, its URL) (a save's background thread for async saves)
        # on_phase(name, start, end) after each phase of a save (time.perf_counter(), in the thread
        # that ran it): where the time of a save goes, for benchmarks and logs (PHASES)
        self.on_phase = on_phase
        # incremental: each rank writes the parameters that do not train (requires_grad=False) to a
        # file of their own, and a step whose file would come out as the last committed step's gets
        # that file by a hard link (a server-side copy on an object store) instead of a write
        self.incremental = incremental
        self._frozen: frozenset[str] = frozenset()  # the state keys of this save's frozen parameters
        self._trainable: set[str] = set()  # the state keys of this save's trainable parameters
        # health: NaN/Inf counted in every record as it is written, and each record's data digest
        # compared with this rank's previous committed save (a stale copy); in the commit record
        self.health = health
        self.on_nonfinite = on_nonfinite  # "refuse": a step with non-finite values is not committed
        self._last_digests: Any = None  # (step, its final place, this rank's record digests) of its last save
        self._written: Any = None  # what this rank put in its frozen file at its last save (dcp_format.Written)
        # The threads of async saves, started at the first (a thread started per save cost the
        # training thread milliseconds): the copy into host memory, at the training thread's
        # priority since the optimizer's next step may wait for it, and the writer, at nice
        # ``writer_nice`` (Linux: per thread; None: the training thread's). The writer's hashing
        # and writing take CPU from training; niced, it yields the cores to the training threads,
        # but it may hold the GIL while it waits for a core, and its save commits later. On 2
        # ranks here nice 19 did not lower what the saves cost the loop (alternated with nice 0 in
        # one run at 1 GB: +1.35 against +1.09 s a save, each +-0.4 s): not the default.
        self.writer_nice = writer_nice
        self._copier = Worker("ckpttool-stage")
        self._writer = Worker("ckpttool-save", nice=writer_nice)

    # --- queries --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Steps that never committed, or whose commit record is
        damaged, are not listed."""
        self._check_root()
        return list_root(self.root).committed

    def incomplete(self) -> list[str]:
        """Directory names under the root that never committed (a crash mid-save leaves these)."""
        self._check_root()
        return list_root(self.root).incomplete

    def clean(self) -> list[str]:
        """Remove what never committed; returns the removed names. Refused (:class:`LeaseError`)
        while another live job holds the root, whose save in progress would be removed."""
        self.wait()

        def remove() -> list[str]:
            if not self.root.exists():
                raise NotFoundError("training root does not exist", where=self.root.url, hint="check the path")
            self._hold_lease()
            removed = []
            for name in self.incomplete():
                self.root.child(name).remove()
                removed.append(name)
            return removed

        return dist.agreed(remove, rank0_only=True) or []

    def _hold_lease(self) -> None:
        if not self._lease.held:
            self._check_root()
            self.root.makedirs()  # a missing bucket is an error here, never created
            self._lease.acquire()
            atexit.register(self._lease.release)  # after the interpreter joined a pending save
        else:
            self._lease.check()

    def step_path(self, step: int) -> str:
        return self.root.child(step_name(step)).url

    # --- save ----------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: Optimizers = None, extra: dict | None = None,
             blocking: bool | None = None) -> str:
        """Write ``{"model", "optim", "extra"}`` of this step as DCP and commit it; returns its path.

        ``optimizer``: one optimizer or a list of them (as torch's ``get_state_dict`` takes them;
        their states are merged under ``optim``). Every rank writes its own shards and an index of
        them; rank 0 merges the indexes into ``.metadata``, writes the commit record last and
        renames the step into place. No collective runs in the write or the commit, so with
        ``async_save=True`` (or ``blocking=False``) the call returns once this rank's state is
        being copied into reused host buffers and a background thread finishes the save even if
        the process group is destroyed meanwhile; the interpreter does not exit before it has.

        The step holds the values of the call, whatever the caller does next: until the copy is
        done, every optimizer's step waits for it, and an in-place write on this thread to a tensor
        not yet copied copies that tensor first (``snapshot.py``). A write no guard sees (another
        thread, ``.numpy()``) that is found by the tensor's version counter fails the save
        (:class:`SnapshotError`): nothing is committed. The next ``save``, ``wait`` or ``close``
        raises a background save's error on every rank. Raises :class:`OutputExistsError` if the
        step exists, :class:`StorageError` when the storage refuses the write (earlier steps stay
        intact).
        """
        self._not_from_the_writer("save")
        if not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int, got {step!r}")
        optimizers = optimizers_of(optimizer)
        blocking = not self.async_save if blocking is None else blocking
        self._stager.fence()  # the last save's copy ends first (and its write guard leaves this thread)
        final = self.root.child(step_name(step))
        tmp = self._timed("prepare", self._begin_save, step, final)
        state, buffers = self._timed("state", self._training_state, model, optimizers, extra)
        # (read by this save's writer only: the next save() sets it after joining this one)
        frozen = [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad]
        self._frozen = frozenset(frozen) if self.incremental else frozenset()
        self._trainable = {f"model.{n}" for n, _ in model.named_parameters()} - set(frozen)
        staged = None
        if not blocking:
            try:
                # a forward may change module buffers in place: copied at the call, found by the address
                # of what is copied (``buffers``: of each buffer's local tensor; a DTensor's own data_ptr() is 0);
                # the rest is copied in the background, guarded (snapshot.py)
                staged = self._timed("stage", self._stager.stage, state, dist.rank(), _stores, in_order=buffers, background=True)
            except _Unsupported:
                staged = None  # a placement ckpttool's writer does not lay out: DCP's own writer
        own = staged is not None or (blocking and dcp_format.supports(state))  # else DCP's writer, which needs the process group
        if blocking:
            if own:
                self._timed("sync save", self._save_own_sync, state, step, tmp, final)
            else:
                self._write_and_commit_dcp(state, step, tmp, final, group=None)
            return final.url
        if not own:
            if self._group is None and dist.active():
                import torch.distributed as tdist

                # DCP's collectives must never interleave with the training's (FSDP all-gathers on the
                # default group): a group of their own, used only by the background thread.
                self._group = tdist.new_group(backend="gloo")
            staged = self._staged = _stage(state, self._staged)  # copied at the call
        dist.pause_point("after-stage")
        if own and self._stager.copying:
            self._copier.submit(self._stager.copy, name="ckpttool-stage")
        rank, world_size = dist.rank(), dist.world_size()
        self._pending = self._writer.submit(lambda: self._background(staged, step, tmp, final, own, rank, world_size),
                                            name=f"ckpttool-save-{step}")
        return final.url

    @property
    def state_cache(self) -> StateCache:
        """The kept ``get_state_dict`` answer (``.hits``, ``.misses``): read it, do not change it."""
        return self._states

    def _training_state(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
                        extra: dict | None) -> tuple[dict[str, Any], set[int]]:
        """This save's ``{"model", "optim", "extra"}`` and the addresses of the model's buffers:
        torch's ``get_state_dict`` answer, kept from the last save while the structure holds."""
        base, buffers = self._states.state(model, optimizers)
        state = dict(base)
        if extra:
            state["extra"] = extra_state(extra)
        return state, buffers

    def _background(self, staged: dict[str, Any], step: int, tmp: Location, final: Location, own: bool, rank: int,
                    world_size: int) -> None:
        try:
            if own:
                try:
                    self._stager.wait(run=False)  # the copies are in host memory (CUDA: issued on a side stream)
                    self._timed("write", self._write_own, staged, tmp, rank, final, step)
                    if rank == 0:
                        self._timed("commit", self._commit_own, step, tmp, final, world_size)
                except BaseException as exc:
                    if rank == 0:  # the other ranks wait for the commit: tell them why it will not come
                        refuse_step(tmp, exc.message() if isinstance(exc, CkptError) else f"{type(exc).__name__}: {exc}")
                    elif isinstance(exc, SnapshotError):
                        _say_failed(tmp, rank, exc)  # rank 0 stops waiting for this rank's part
                    raise
                if rank != 0:
                    self._outcome = (tmp, final)  # wait() and close() learn from storage whether rank 0 committed it
            else:
                self._write_and_commit_dcp(staged, step, tmp, final, group=self._group)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next save/wait/close
            self._pending_error = exc
            # also said now: a process whose last save fails and that never calls save/wait/close again
            log.error("ckpttool: the background save of step %d failed: %s", step, exc)
        finally:
            now = time.perf_counter()
            self._phase("done", now, now)  # the background save is over (rank 0: committed, or failed)

    def _save_own_sync(self, state: dict[str, Any], step: int, tmp: Location, final: Location) -> None:
        dist.agreed(lambda: self._timed("write", self._write_own, state, tmp, dist.rank(), final, step))
        dist.agreed(lambda: self._timed("commit", self._commit_own, step, tmp, final, dist.world_size()), rank0_only=True)

    def _timed(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, reported to ``on_phase`` as phase ``name`` (when set)."""
        if self.on_phase is None:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._phase(name, start, time.perf_counter())

    def _phase(self, name: str, start: float, end: float) -> None:
        if self.on_phase is not None:
            try:
                self.on_phase(name, start, end)
            except Exception:  # noqa: BLE001 - a caller's callback must not fail a save
                log.exception("on_phase callback failed for phase %s", name)

    def _write_own(self, state: dict[str, Any], tmp: Location, rank: int, final: Location, step: int) -> None:
        previous = self._written
        if previous is not None and not previous.step_dir.child(COMMIT_FILE).exists():
            previous = None  # its step never committed, or retention removed it: nothing to share
        last = self._last_digests
        if last is not None and not last[1].child(COMMIT_FILE).exists():
            last = None  # the stale check compares with the previous committed step only
        check = health.Check(self._trainable, last[2] if last else None, last[0] if last else None) if self.health else None
        self._written = None
        self._last_digests = None
        try:
            written = dcp_format.write_rank(tmp, rank, state, after_write=lambda: dist.pause_point("after-write"),
                                            compress=self.compress, frozen=self._frozen, previous=previous, health=check)
            if written is not None:
                written.step_dir = final  # where its files are once the step is committed
        except CkptError:
            raise
        except Exception as exc:  # a write the storage refused: one line naming the step
            raise _save_error(exc, tmp) from None
        self._written = written
        if check is not None:
            self._last_digests = (step, final, check.tally.digests)

    def _commit_own(self, step: int, tmp: Location, final: Location, world_size: int) -> None:
        """Rank 0: wait for every rank's index in storage, write .metadata, then the commit record
        (last), publish the step and apply retention."""
        indexes = dcp_format.read_rank_indexes(tmp, world_size, self.commit_timeout)
        manifest = dcp_format.commit_metadata(tmp, indexes)
        record = {"manifest": manifest, **dcp_format.step_bytes(indexes)}  # bytes written, and shared with the step before
        per_rank = dcp_format.per_rank_keys(indexes)
        if per_rank:
            record["per_rank"] = per_rank  # keys of extra whose values differ between ranks: each rank's own is kept
        found = health.merge_ranks([index.health for index in indexes])
        if found is not None:
            record["health"] = found
            self._judge_health(step, found)
        tmp.child(COMMIT_FILE).write_bytes(commit_record(step, world_size, record))
        dist.pause_point("before-rename")
        self.root.commit_policy.publish(tmp, final)
        self._committed(step, final)
        self._apply_retention()

    def _judge_health(self, step: int, found: dict[str, Any]) -> None:
        """Rank 0, before the commit: a step with non-finite values is refused with
        ``on_nonfinite="refuse"`` (every rank raises it), else said at once in one line."""
        bad = health.nonfinite_keys(found)
        stale = found.get("unchanged") or []
        if bad:
            said = "; ".join(p for p in health.problems(found) if p.split(":")[0] in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            if self.on_nonfinite == "refuse":
                raise UnhealthyStepError(f"step {step} holds non-finite values ({said}{more}); not committed",
                                         hint="the run diverged before this save; resume from an earlier step "
                                              "(ckpttool inspect ROOT shows which are healthy)")
            log.warning("ckpttool: step %d holds non-finite values: %s%s", step, said, more)
        if stale:
            log.warning("ckpttool: step %d: %d trainable tensor(s) unchanged since step %s while their optimizer state "
                        "moved, first %s (a stale copy of the weights, or gradients that never reach them?)",
                        step, len(stale), found.get("compared_with"), stale[0])

    def _write_and_commit_dcp(self, state: dict[str, Any], step: int, tmp: Location, final: Location, group: Any) -> None:
        """The fallback for placements ckpttool's writer does not lay out: DCP's own writer, whose
        planning and commit are collectives over ``group``."""
        state, per_rank = _with_per_rank(state, group)
        found = _fallback_health(state, group) if self.health else None
        try:
            with _single_process_quiet():
                dcp.save(state, storage_writer=dcp_writer(tmp, self.storage_options, self.compress), process_group=group)
        except _DCP_ERRORS as exc:
            raise _save_error(exc, tmp) from None
        dist.pause_point("after-write")
        manifest = _manifest_of_own_file(tmp, group)
        self._commit_dcp(step, tmp, final, manifest, group, per_rank, found)
        self._apply_retention()

    def _join_pending(self, outcome: bool = False) -> BaseException | None:
        """Wait for this rank's background save; its error, if it failed. With ``outcome`` (wait and
        close), a rank other than 0 also waits until rank 0 committed the step or refused it (its
        reason is then this rank's error): every rank tells the same story, with no collective.
        (``save`` needs not: its agreement raises any rank's error on every rank.)"""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        error, self._pending_error = self._pending_error, None
        pending, self._outcome = self._outcome, None
        if outcome and error is None and pending is not None:
            try:
                await_outcome(*pending, self.commit_timeout)
            except CkptError as exc:
                error = exc
        return error

    @property
    def saving(self) -> bool:
        """Whether this rank's async save is still being written (its background thread runs)."""
        return self._pending is not None and not self._pending.done.is_set()

    @property
    def staging(self) -> Stager:
        """The host buffers of this Checkpointer's async saves (``.buffers``) and whether a
        background copy is in flight (``.copying``): read them, do not change them."""
        return self._stager

    def wait(self) -> None:
        """Block until this rank's pending background save is done (on rank 0: committed); raise
        its error if it failed."""
        self._not_from_the_writer("wait")
        self._stager.fence()  # the copy's rest runs here if the copy thread has not done it (and the write guard goes)
        error = self._timed("wait", self._join_pending, True)
        if error is not None:
            raise error

    def close(self) -> None:
        """Drain the pending save and release what the Checkpointer holds (its process group, the
        root's lease). Also runs at ``with`` exit; a process that never calls it still finishes
        its pending save before the interpreter exits."""
        self._not_from_the_writer("close")
        try:
            self.wait()
        finally:
            self._staged = None
            self._states.clear()
            self._stager = self._new_stager()
            self._copier.close()
            self._writer.close()  # joins a write still running (wait() interrupted): then the lease may go
            self._lease.release()
            if self._group is not None:
                import torch.distributed as tdist

                if dist.active():
                    tdist.destroy_process_group(self._group)
                self._group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _new_stager(self) -> Stager:
        # (a write that waits for the copy, an optimizer step or a guarded edit, is the phase "fence")
        return Stager(lambda: dist.pause_point("stage-copy"), on_fence=lambda start, end: self._phase("fence", start, end))

    def _not_from_the_writer(self, what: str) -> None:
        """``on_commit`` of an async save runs in the writer thread: a ``save``, ``wait`` or
        ``close`` from there would wait for the very save that runs it (forever), or tear the
        Checkpointer down under it."""
        if self._writer.running_here():
            raise UsageError(f"Checkpointer.{what}() was called from the Checkpointer's own background save "
                             "(on_commit runs there)", hint="call it from the training loop; on_commit should only record or notify")

    def _begin_save(self, step: int, final: Location) -> Location:
        """Join the pending save, hold the lease and make the step's temporary directory (rank 0),
        and agree on the outcome in one exchange: the directory's name, or the first rank's error
        raised on every rank (a failed background save fails every rank's next save)."""
        error = self._join_pending()
        name = None
        if error is None and dist.rank() == 0:
            try:
                self._hold_lease()
                name = self._make_step_dir(final)
            except CkptError as exc:
                error = exc
        outcomes = dist.all_gather((None if error is None else (type(error).__name__, str(error)), name))
        failed = next((r for r, (failure, _) in enumerate(outcomes) if failure is not None), None)
        if failed is not None:
            if name is not None:  # made here, and no rank writes into it
                with contextlib.suppress(CkptError):
                    self.root.child(name).remove()
            if error is not None:
                raise error
            kind, text = outcomes[failed][0]
            raise RuntimeError(f"rank {failed} failed: {kind}: {text}")
        return self.root.child(outcomes[0][1])

    def _make_step_dir(self, final: Location) -> str:
        self._check_root()
        self.root.makedirs()
        if final.exists():
            raise OutputExistsError("step already exists", where=final.url, hint="save under a new step number or delete it first")
        # Filesystems rename a finished temp directory into place; object stores have no
        # atomic rename, so there the step is written in place and the commit record,
        # written last, is what makes it count (the root's commit policy decides).
        tmp = self.root.commit_policy.staging(final)
        tmp.makedirs()
        return tmp.name

    def _commit_dcp(self, step: int, tmp: Location, final: Location, manifest: dict[str, Any], group: Any = None,
                    per_rank: list[str] | None = None, found: dict[str, Any] | None = None) -> None:
        dist.barrier("ckpttool.commit", group)

        def commit() -> None:
            full = {**manifest, "files": metadata_row(tmp)}  # the manifest covers .metadata too
            fields: dict[str, Any] = {"manifest": full, **({"per_rank": per_rank} if per_rank else {})}
            if found is not None:
                fields["health"] = found
                self._judge_health(step, found)
            tmp.child(COMMIT_FILE).write_bytes(commit_record(step, dist.world_size(), fields))
            dist.pause_point("before-rename")
            self.root.commit_policy.publish(tmp, final)
            self._committed(step, final)

        dist.agreed(commit, rank0_only=True, group=group)

    def _committed(self, step: int, final: Location) -> None:
        """Tell ``on_commit`` (an error in it is logged: the step is committed whatever it does)."""
        if self.on_commit is not None:
            try:
                self.on_commit(step, final.url)
            except Exception:  # noqa: BLE001 - a caller's callback must not undo a commit
                log.exception("on_commit callback failed for step %d", step)

    def _apply_retention(self) -> None:
        if dist.rank() != 0 or self.keep_last is None:
            return
        for victim in retention_victims(self.steps(), self.keep_last, self.keep_every):
            loc = self.root.child(step_name(victim))
            try:
                # a delete cut short leaves a hidden temporary (filesystems) or an un-committed
                # step (object stores), never something that looks like a step
                self.root.commit_policy.retire(loc, COMMIT_FILE)
            except CkptError as exc:
                log.warning("retention: could not delete %s: %s", loc.url, exc)

    def _check_root(self) -> None:
        if self.root.isfile():
            raise UsageError(
                "checkpoint root is a file, not a directory", where=self.root.url, hint="pass the directory that holds step-<N>"
            )

    # --- load ----------------------------------------------------------------------------------

    def load(self, model: torch.nn.Module, optimizer: Optimizers = None, step: int | None = None, *,
             verify: bool = True, extra: dict[str, Any] | None = None) -> LoadResult | None:
        """Load the newest (or the given) committed step into ``model`` (and ``optimizer``).

        Works on any world size and mesh. Returns ``None`` when ``step`` is None and nothing was
        committed yet; a step whose commit record is damaged is never taken as the newest (a
        warning names it). Raises :class:`NotFoundError` for a missing step,
        :class:`MismatchError` when the checkpoint does not fit the model, and with ``verify`` (the
        default) :class:`ChecksumError` when a record read does not match its checksum.
        """
        self._stager.fence()  # a pending async save's copy reads the tensors this load overwrites
        self._states.clear()  # the load replaces the optimizer's state (the signature would notice; nothing to keep)
        self._check_root()
        listing = list_root(self.root)
        committed = listing.committed
        if step is None:
            newer_damaged = [s for s in listing.damaged if not committed or s > committed[-1]]
            if newer_damaged and dist.rank() == 0:
                log.warning("not loading step(s) %s under %s: commit record damaged (%s)", newer_damaged, self.root.url,
                            listing.damaged[newer_damaged[-1]])
            if not committed:
                return None
            step = committed[-1]
        elif step in listing.damaged:
            raise CorruptCheckpointError(f"step {step} cannot be loaded: {listing.damaged[step]}",
                                         where=self.root.child(step_name(step)).url,
                                         hint=f"committed steps: {committed or 'none'}")
        elif step not in committed:
            raise NotFoundError(
                f"step {step} is not a committed checkpoint",
                where=self.root.url,
                hint=f"committed steps: {committed or 'none'}",
            )
        self._warn_if_unhealthy(step, committed)
        result = load(self.root.child(step_name(step)), model, optimizer, verify=verify, storage_options=self.storage_options,
                      extra=extra)
        return LoadResult(step=step, extra=result.extra, path=result.path, extra_by_rank=result.extra_by_rank)


    def _warn_if_unhealthy(self, step: int, committed: list[int]) -> None:
        """One line (rank 0) when the step to load holds non-finite values, naming the newest
        committed step that does not (from the commit records' health)."""
        if dist.rank() != 0:
            return
        found = step_health(self.root.child(step_name(step)))
        bad = health.nonfinite_keys(found)
        if not bad:
            return
        older = next((s for s in reversed(committed) if s < step and step_health(self.root.child(step_name(s))) is not None
                      and not health.nonfinite_keys(step_health(self.root.child(step_name(s))))), None)
        log.warning("ckpttool: loading step %d, which holds non-finite values (%s%s); %s", step,
                    "; ".join(health.problems(found)[:2]), f" and {len(bad) - 2} more" if len(bad) > 2 else "",
                    f"the newest step without any is step {older}" if older is not None else "no earlier step is known to be without any")


class _Unsupported(Exception):
    """A tensor of the state has a placement ckpttool's writer does not lay out (found while staging)."""


def _stores(value: Any) -> bool:
    """Whether this rank stores its box of a DTensor (``dcp.stores``), raising :class:`_Unsupported`
    for a placement the writer does not lay out, so that an async save falls back to DCP's writer.
    Called by the stager only for a tensor it has not seen: a kept tensor was checked then."""
    if not dcp_format.supports({"t": value}):
        raise _Unsupported
    return dcp_format.stores(value)


# DCP raises CheckpointException, a BaseException, for failures on any rank.
_DCP_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def _stage(state: Any, previous: Any = None) -> Any:
    """A copy of every tensor (DTensors stay DTensors), so the caller may change the originals.

    ``previous`` is the last save's copy, no longer in use once that save committed: tensors of
    the same shape, dtype and layout are copied into it, so async saves keep one copy of the
    rank's state in host memory and do not fault in fresh pages every time.
    """
    if isinstance(state, torch.Tensor):
        if _same_layout(state, previous):
            _local(previous).copy_(_local(state))
            return previous
        return state.detach().clone()
    if isinstance(state, dict):
        prev = previous if isinstance(previous, dict) else {}
        return {k: _stage(v, prev.get(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        prev = previous if isinstance(previous, (list, tuple)) and len(previous) == len(state) else [None] * len(state)
        staged = [_stage(v, p) for v, p in zip(state, prev)]
        return staged if isinstance(state, list) else tuple(staged)
    return frozen(state)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _say_failed(step_dir: Location, rank: int, exc: BaseException) -> None:
    """A rank whose part failed before its write began: its index carries the error, so rank 0
    stops waiting for it and refuses the step at once."""
    with contextlib.suppress(Exception):
        dcp_format.publish_failure(step_dir, rank, exc.message() if isinstance(exc, CkptError) else str(exc))


def _same_layout(t: torch.Tensor, other: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if not isinstance(other, torch.Tensor) or type(other) is not type(t) or other.dtype != t.dtype or other.shape != t.shape:
        return False
    if isinstance(t, DTensor):
        return other.placements == t.placements and other.device_mesh == t.device_mesh and _local(other).shape == _local(t).shape
    return other.device == t.device


def _with_per_rank(state: dict[str, Any], group: Any) -> tuple[dict[str, Any], list[str]]:
    """DCP's writer keeps rank 0's value of every plain value of ``extra``: here (its path is
    collective anyway) each rank's digest of every top-level value of ``extra`` without a DTensor
    is gathered, and each value that differs between ranks is added whole under
    ``per_rank.<rank>.<key>``, as ckpttool's own writer lays them out. DCP's writer traverses every
    value: one kept whole (:class:`Whole`) is handed to it as it is (its non-string keys come back
    as strings, as from plain ``dcp.save``)."""
    extra = state.get("extra")
    if not extra:
        return state, []
    extra = {k: v.value if isinstance(v, Whole) else v for k, v in extra.items()}
    state = {**state, "extra": extra}
    if not dist.active():
        return state, []
    mine = {}
    for top, value in extra.items():
        if not _holds_dtensor(value):
            buf = io.BytesIO()
            torch.save(value, buf)
            mine[top] = (hash_bytes(buf.getvalue()), value)
    # every rank gets every rank's values: DCP's planner has rank 0 alone write objects
    everyone = dist.all_gather(mine, group)
    differing = sorted({top for values in everyone for top in values
                        if any(top not in v or v[top][0] != values[top][0] for v in everyone)})
    if not differing:
        return state, []
    return {**state, PER_RANK: {str(r): {top: values[top][1] for top in differing if top in values}
                                for r, values in enumerate(everyone)}}, differing


def _fallback_health(state: dict[str, Any], group: Any) -> dict[str, Any]:
    """DCP's writer passes no bytes through ckpttool: each rank counts NaN and Inf in the local
    shards it holds (each box once: a replicated one on its first holder; a ``Partial`` sum, which
    is no value yet, not at all), and rank 0 adds them up. No stale check on this path."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from .index import flatten

    flat, _ = flatten(state)
    tally = health.Tally()
    rank = dist.rank()
    for key, value in flat.items():
        if isinstance(value, DTensor):
            coordinate = value.device_mesh.get_coordinate()
            if coordinate is None or any(isinstance(p, Partial) or (isinstance(p, Replicate) and c != 0)
                                         for p, c in zip(value.placements, coordinate)):
                continue
            tally.count(key, value._local_tensor.detach())
        elif isinstance(value, torch.Tensor) and rank == 0:
            tally.count(key, value.detach())
    parts = [{"nonfinite": counts} for counts in dist.all_gather(tally.nonfinite, group)]
    return health.merge(parts, None, set())


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _manifest_of_own_file(step_dir: Location, group: Any) -> dict[str, Any]:
    """Each rank hashes the records of its own data file (read back while the page cache still
    holds them); rank 0 gets them all for the commit record. Documented in docs/format.md."""
    mine = hash_records(step_dir, dist.rank())
    records: dict[str, Any] = {}
    for part in dist.all_gather(mine, group):
        records.update(part["records"])
    return {"algorithm": mine["algorithm"], "records": records}


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns on every call that it assumes one process; that is our intent."""
    with warnings.catch_warnings():
        if not dist.active():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _save_error(exc: BaseException, tmp: Location) -> CkptError:
    """One typed error for a failed save. torch's zip writer reports a refused write as
    "unexpected pos ..." without the errno, so a nearly full disk is also checked for directly."""
    if isinstance(exc, CkptError):
        return exc
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 20:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    errnos = {getattr(e, "errno", None) for e in chain}
    text = " ".join(str(e) for e in chain).lower()
    full = errnos & {errno.ENOSPC, errno.EFBIG, errno.EDQUOT} or any(
        t in text for t in ("no space left", "errno 28", "file too large", "errno 27", "quota"))
    if not full and "unexpected pos" in text and tmp.local_path is not None:
        try:
            st = os.statvfs(tmp.local_path)
            full = st.f_bavail * st.f_frsize < (1 << 20)
        except OSError:
            pass
    if full:
        return StorageError("no space left on device while saving", where=tmp.url, hint="free space; earlier steps are intact")
    if errnos & {errno.EACCES, errno.EPERM, errno.EROFS} or "permission denied" in text or "read-only file system" in text:
        return StorageError("permission denied while saving", where=tmp.url, hint="check the directory's permissions; earlier steps are intact")
    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return StorageError(f"save failed: {last}", where=tmp.url)
