"""Typed errors that carry a hint; the CLI maps each to one message and an exit code.

Every error says *what* is wrong, *where* (a path, a key) and *what to do*. Library code raises
these instead of ``assert`` or bare ``RuntimeError`` so that callers can tell user errors from bugs.
"""

from __future__ import annotations

#: Exit codes shared by every command (documented in README.md, 'Command line').
EXIT_OK = 0
EXIT_DIFFERENCE = 1
EXIT_BAD_INPUT = 2


class CkptError(Exception):
    """Base class: a user-facing problem with a location and a hint."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, what: str, *, where: str | None = None, hint: str | None = None):
        self.what = what
        self.where = where
        self.hint = hint
        super().__init__(self.message())

    def message(self) -> str:
        text = self.what
        if self.where:
            text = f"{self.where}: {text}"
        if self.hint:
            text = f"{text} ({self.hint})"
        return text


class NotFoundError(CkptError):
    """A path, step or key that the caller named does not exist."""


class NotACheckpointError(CkptError):
    """The path exists but is not a checkpoint in any format we know."""


class FormatError(CkptError):
    """An unknown format name, or a format that cannot do what was asked."""


class CorruptCheckpointError(CkptError):
    """The checkpoint's files contradict themselves or their metadata."""


class ChecksumError(CorruptCheckpointError):
    """Bytes read do not match the checksum stored for them (torch's CRC-32, ckpttool's manifest)."""


class UnsafePickleError(CkptError):
    """A pickle asked for a global that is not on the allow-list; nothing from it ran."""


class MismatchError(CkptError):
    """Checkpoint and target disagree on keys, shapes or dtypes."""


class OutputExistsError(CkptError):
    """The output already exists and ``force`` was not given."""


class UsageError(CkptError):
    """Bad arguments (a negative world size, an unknown dtype, ...)."""


class StorageError(CkptError):
    """A filesystem or object-store operation failed (permission, disk full, backend missing)."""


class UnsafePathError(CkptError):
    """A checkpoint names a path outside itself (``..``, absolute, a symlink out); nothing was read there."""


class LeaseError(CkptError):
    """Another live job holds the training root (or took it over from this one)."""


class RendezvousError(CkptError):
    """Ranks could not agree: a collective of the agreement failed (a rank died, or its connection
    broke)."""


class RankFailedError(RendezvousError):
    """Another rank failed at a step every rank takes together: raised on every rank but the failing
    ones (which raise their own error), naming the failing ranks, what they were doing, and the
    first one's error (``ranks``, ``doing``, ``error_type``)."""

    def __init__(self, ranks: list[int], doing: str, error_type: str, text: str, where: str | None = None):
        self.ranks = list(ranks)
        self.doing = doing
        self.error_type = error_type
        self.text = text
        more = "" if len(ranks) == 1 else f"; rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))} failed too"
        super().__init__(f"rank {ranks[0]} failed: {error_type}: {text} (while {doing}{more})", where=where)

    def __reduce__(self) -> tuple:  # (an error a thread or a process hands on is pickled)
        return type(self), (self.ranks, self.doing, self.error_type, self.text, self.where)


class RankDeadError(RendezvousError):
    """A rank stopped answering: its beat in the job's store has not moved for ``dead_after``
    seconds (its process was killed or is stopped), or the store itself, which rank 0 hosts, cannot
    be reached. Raised on every live rank, naming the dead ranks (``ranks``), the phase each was
    last seen in (``phases``) and what the raising rank was waiting for (``doing``)."""

    def __init__(self, ranks: list[int], phases: dict[int, str], doing: str, where: str | None = None):
        self.ranks = list(ranks)
        self.phases = {int(r): p for r, p in phases.items()}
        self.doing = doing
        seen = "; ".join(f"rank {r}: last seen {self.phases.get(r, 'nowhere')}" for r in self.ranks)
        which = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {', '.join(map(str, self.ranks))}"
        super().__init__(f"{which} stopped answering ({seen}) while {doing}", where=where,
                         hint="its process died or is stopped; the step is not committed: restart the job, "
                              "it resumes from the newest committed step")

    def __reduce__(self) -> tuple:
        return type(self), (self.ranks, self.phases, self.doing, self.where)


class WorkerError(CkptError):
    """Another worker of a command run by several (``--nproc``, torchrun) failed; this is its error."""

    def __init__(self, text: str, exit_code: int = EXIT_BAD_INPUT):
        self.exit_code = exit_code
        super().__init__(text)


class SnapshotError(CkptError):
    """An async save's copy may not hold the values of the call (a tensor was written before its
    copy was done); the step was not committed."""


class UnhealthyStepError(CkptError):
    """A step holds non-finite values and its Checkpointer was told to refuse such steps; not committed."""


class StepTooLargeError(CkptError):
    """A step's commit record, ``.metadata`` or a rank's manifest file would pass the size ckpttool's
    own readers refuse: the writer refuses it first, so no committed step is one that cannot be loaded."""


class StepNotCommittedError(CkptError):
    """Another rank's part of a step failed (or rank 0 could not commit it): the step was not
    committed. ``error_type``: the type of the error that caused it, where rank 0 said."""

    def __init__(self, what: str, *, error_type: str | None = None, where: str | None = None, hint: str | None = None):
        self.error_type = error_type
        super().__init__(what, where=where, hint=hint)

    def __reduce__(self) -> tuple:
        return _rebuild_not_committed, (self.what, self.error_type, self.where, self.hint)


def _rebuild_not_committed(what: str, error_type: str | None, where: str | None, hint: str | None) -> StepNotCommittedError:
    return StepNotCommittedError(what, error_type=error_type, where=where, hint=hint)
