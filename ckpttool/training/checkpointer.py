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

import os
from typing import Any, Callable

import torch

from .. import liveness, rendezvous
from ..errors import NotFoundError, UsageError
from ..formats.dcp import check_compress
from . import writer_process
from .lease import Lease
from .load import LoadResult, load_committed
from .state import Optimizers
from .saving import Options, Saves, check_root
from .staging import Stager
from .state import StateCache, optimizers_of
from ..steps import list_root, step_name
from ..storage import Location, resolve

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

    ``keep_last=K`` deletes older committed steps after each commit (``keep_every=N`` also keeps
    every Nth); ``async_save``: ``save`` returns while a background thread writes; ``compress="zstd"``
    stores every record compressed (plain torch reads it back); ``commit_timeout``: how long rank 0
    waits for the other ranks' parts of a step; ``on_commit(step, url)``: rank 0, once a step is
    committed (an async save's background thread); ``on_phase(name, start, end)`` after each of
    :data:`PHASES`; ``writer_nice``: the writer thread's nice value (Linux); ``incremental``: the
    parameters that do not train go to a file of their own, hard-linked from the last committed
    step when unchanged; ``health``: NaN/Inf and stale tensors counted into the commit record,
    ``on_nonfinite="refuse"`` to refuse a step holding non-finite values.

    Ranks that die or trail (``liveness.py``): every rank beats in the job's store from its first
    save; a rank whose beat stands still for ``dead_after`` seconds while others wait for it is
    named on every live rank (:class:`RankDeadError`), ranks that trail the rest by
    ``straggler_after`` seconds are logged by rank 0. ``tolerate_failures=K``: a failed save is
    logged on every rank and training goes on, up to K failed saves in a row (:meth:`save`).

    ``writer="process"``: an async save's write (hashing, the data file, the rank's index) runs in a
    process of this rank's own, reading the staged copy from shared memory; the background thread
    only waits for it (and rank 0 commits). A writer process that dies fails that save, named; the
    next save starts another. CPU tensors; the default ``"thread"`` writes in the background thread.
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
        dead_after: float = liveness.DEAD_AFTER,
        straggler_after: float = liveness.STRAGGLER_AFTER,
        tolerate_failures: int = 0,
        writer: str = "thread",
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
        for name, value in (("dead_after", dead_after), ("straggler_after", straggler_after)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise UsageError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(tolerate_failures, int) or tolerate_failures < 0:
            raise UsageError(f"tolerate_failures must be a non-negative int, got {tolerate_failures!r}",
                             hint="0 raises the first failed save, as by default")
        if writer not in ("thread", "process"):
            raise UsageError(f"writer must be 'thread' or 'process', got {writer!r}")
        if writer == "process":
            writer_process.available()
        check_compress(compress)
        self.root: Location = resolve(root, storage_options)
        self.storage_options = storage_options or {}
        self.async_save = async_save
        options = Options(keep_last=keep_last, keep_every=keep_every, storage_options=self.storage_options,
                          commit_timeout=commit_timeout, compress=compress, on_commit=on_commit, on_phase=on_phase,
                          writer_nice=writer_nice, incremental=incremental, on_nonfinite=on_nonfinite, health=health,
                          dead_after=dead_after, straggler_after=straggler_after, tolerate_failures=tolerate_failures,
                          writer=writer)
        # the root's lease: taken by rank 0 at the first save
        self._saves = Saves(self.root, options, Lease(self.root, stale_after=lease_stale_after))

    # --- queries --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Steps that never committed, or whose commit record is
        damaged, are not listed."""
        check_root(self.root)
        return list_root(self.root).committed

    def incomplete(self) -> list[str]:
        """Directory names under the root that never committed (a crash mid-save leaves these)."""
        check_root(self.root)
        return list_root(self.root).incomplete

    def clean(self) -> list[str]:
        """Remove what never committed; returns the removed names. Refused (:class:`LeaseError`)
        while another live job holds the root, whose save in progress would be removed."""
        self.wait()

        def remove() -> list[str]:
            if not self.root.exists():
                raise NotFoundError("training root does not exist", where=self.root.url, hint="check the path")
            self._saves.hold_lease()
            removed = []
            for name in self.incomplete():
                self.root.child(name).remove()
                removed.append(name)
            return removed

        return rendezvous.agreed("removing the root's uncommitted steps", remove, rank0_only=True) or []

    def step_path(self, step: int) -> str:
        return self.root.child(step_name(step)).url

    @property
    def saving(self) -> bool:
        """Whether this rank's async save is still being written (its background thread runs)."""
        return self._saves.writing()

    @property
    def staging(self) -> Stager:
        """The host buffers of this Checkpointer's async saves (``.buffers``) and whether a
        background copy is in flight (``.copying``): read them, do not change them."""
        return self._saves.stager

    @property
    def state_cache(self) -> StateCache:
        """The kept ``get_state_dict`` answer (``.hits``, ``.misses``): read it, do not change it."""
        return self._saves.states

    @property
    def on_commit(self) -> Callable[[int, str], None] | None:
        """Called on rank 0 as ``on_commit(step, url)`` once a step is committed; may be set at any time."""
        return self._saves.o.on_commit

    @on_commit.setter
    def on_commit(self, fn: Callable[[int, str], None] | None) -> None:
        self._saves.o.on_commit = fn

    # --- save ----------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: Optimizers = None, extra: dict | None = None,
             blocking: bool | None = None) -> str | None:
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
        intact), :class:`RankDeadError` naming a rank that stopped answering.

        With ``tolerate_failures=K``, a failed save (any rank's storage or writer error, a refused
        snapshot; never a dead rank) is logged on every rank instead, naming the failing rank, and
        training goes on: a sync save returns None, an async save's failure is judged by the next
        ``save``, ``wait`` or ``close``; the (K+1)th failed save in a row raises on every rank.
        """
        self._saves.not_from_the_writer("save")
        if not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int, got {step!r}")
        blocking = not self.async_save if blocking is None else blocking
        return self._saves.save(step, model, optimizers_of(optimizer), extra, blocking)

    def wait(self) -> None:
        """Block until this rank's pending background save is done (on rank 0: committed); raise
        its error if it failed (with ``tolerate_failures``, as :meth:`save` says)."""
        self._saves.not_from_the_writer("wait")
        self._saves.stager.fence()  # the copy's rest runs here if the copy thread has not done it (and the write guard goes)
        self._saves.wait()

    def close(self) -> None:
        """Drain the pending save and release what the Checkpointer holds (its process group, the
        root's lease). Also runs at ``with`` exit; a process that never calls it still finishes
        its pending save before the interpreter exits."""
        self._saves.not_from_the_writer("close")
        try:
            self.wait()
        finally:
            self._saves.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
        self._saves.stager.fence()  # a pending async save's copy reads the tensors this load overwrites
        self._saves.states.clear()  # the load replaces the optimizer's state (the signature would notice; nothing to keep)
        check_root(self.root)
        return load_committed(self.root, model, optimizer, step, verify=verify, storage_options=self.storage_options,
                              extra=extra)
