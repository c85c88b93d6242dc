"""Commit policies: how an output written as several files appears at its final path whole, or
not at all (a rename of a hidden temporary on filesystems; on object stores, which have no atomic
rename, in-place writes with the file that completes the output written last)."""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from typing import Any, Protocol

log = logging.getLogger("ckpttool")


class Place(Protocol):
    """What a commit policy uses of a location (storage.location.Location)."""

    url: str
    name: str

    def child(self, *parts: str) -> Any: ...
    def sibling(self, name: str) -> Any: ...
    def exists(self) -> bool: ...
    def remove(self) -> None: ...
    def rename_to(self, other: Any) -> None: ...


class CommitPolicy(ABC):
    """How an output written as several files becomes visible whole, or not at all."""

    @abstractmethod
    def staging(self, final: Place) -> Place:
        """Where to write the output before it is committed (no I/O)."""

    def prepare(self, staged: Place, final: Place) -> None:
        """Called before the first byte is written, once replacing ``final`` was allowed (--force)."""

    @abstractmethod
    def publish(self, staged: Place, final: Place) -> None:
        """Make the written output appear at ``final``."""

    def retire(self, final: Place, marker: str) -> None:
        """Delete a committed output so that a delete cut short never leaves something that looks
        like it: here, remove its commit ``marker`` first (it is then incomplete), then the rest."""
        final.child(marker).remove()
        final.remove()

    def discard(self, staged: Place) -> None:
        """Remove a failed output. A removal that fails is logged with the path, not hidden."""
        try:
            staged.remove()
        except Exception as exc:  # noqa: BLE001 - already failing; the original error matters more
            log.warning("could not remove the partial output %s (%s); remove it by hand", staged.url, exc)


class RenameCommit(CommitPolicy):
    """Filesystems: write under a hidden sibling name, then rename it into place in one step."""

    def staging(self, final: Place) -> Place:
        return temp_sibling(final)

    def publish(self, staged: Place, final: Place) -> None:
        if final.exists():
            final.remove()  # only reached when replacing was allowed; checked before writing began
        staged.rename_to(final)

    def retire(self, final: Place, marker: str) -> None:
        """Rename out of sight in one step (to a hidden temporary name that ``clean`` removes),
        then delete: a delete cut short leaves no visible, half-deleted step."""
        hidden = self.staging(final)
        final.rename_to(hidden)
        hidden.remove()


class InPlaceCommit(CommitPolicy):
    """Object stores: write at the final name, the file that makes the output complete last
    (``.metadata``, an index, a commit record, or a single object, which does not exist until its
    upload completes; a failed upload is aborted, never completed)."""

    def staging(self, final: Place) -> Place:
        return final

    def prepare(self, staged: Place, final: Place) -> None:
        if final.exists():
            final.remove()  # replacing an old output: its files must not mix with the new ones

    def publish(self, staged: Place, final: Place) -> None:
        return None


def temp_sibling(loc: Place, tag: str = "tmp") -> Place:
    """A fresh hidden name beside ``loc`` to write into before committing to ``loc``."""
    return loc.sibling(f".{loc.name}.{tag}-{uuid.uuid4().hex[:8]}")
