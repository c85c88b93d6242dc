"""Rules of a training root: ``step-<N>`` naming, the commit record, which steps count, retention.

A step counts once its directory ``ROOT/step-<N>`` holds the commit record ``.ckpttool-commit.json``.
Writers put a step together under a hidden temporary name, write the commit record last and then
rename the directory into place, so on a filesystem a reader sees the whole step or nothing; on an
object store (no atomic rename) the commit record, written last, is what makes the step count.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .storage import Location

COMMIT_FILE = ".ckpttool-commit.json"
COMMIT_FORMAT = "ckpttool-commit"
COMMIT_VERSION = 1

_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.step-(\d+)\.tmp-[0-9a-f]+$")


def step_name(step: int) -> str:
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RootListing:
    """What a training root holds: committed steps, and directories that never committed."""

    committed: list[int]
    incomplete: list[str]  # directory names


def list_root(root: Location) -> RootListing:
    committed: list[int] = []
    incomplete: list[str] = []
    for name in root.listdir():
        step = parse_step(name)
        if step is not None:
            if root.child(name, COMMIT_FILE).exists():
                committed.append(step)
            else:
                incomplete.append(name)
        elif _TMP_RE.match(name):
            incomplete.append(name)
    committed.sort()
    return RootListing(committed, sorted(incomplete))


def is_training_root(loc: Location) -> bool:
    """A directory whose entries include ``step-<N>`` directories (committed or not)."""
    names = loc.listdir()
    return any(parse_step(n) is not None or _TMP_RE.match(n) for n in names)


def commit_record(step: int, world_size: int, extra: dict | None = None) -> bytes:
    import time

    import torch

    record = {
        "format": COMMIT_FORMAT,
        "version": COMMIT_VERSION,
        "step": step,
        "world_size": world_size,
        "torch": torch.__version__,
        "committed_at": time.time(),
    }
    record.update(extra or {})
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def read_commit_record(step_dir: Location) -> dict | None:
    loc = step_dir.child(COMMIT_FILE)
    if not loc.exists():
        return None
    try:
        return json.loads(loc.read_bytes())
    except ValueError:
        return None


def retention_victims(committed: list[int], keep_last: int | None, keep_every: int | None = None) -> list[int]:
    """Steps to delete: all but the newest ``keep_last``, sparing multiples of ``keep_every``."""
    if keep_last is None:
        return []
    keep = set(sorted(committed)[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    return [s for s in sorted(committed) if s not in keep]
