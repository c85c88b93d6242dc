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
from typing import Any

from .checksums import ALGORITHM, DIGEST_CHARS, block_count, new_hasher
from .errors import CkptError, CorruptCheckpointError
from .storage import Location

COMMIT_FILE = ".ckpttool-commit.json"
COMMIT_FORMAT = "ckpttool-commit"
COMMIT_VERSION = 2  # 2: the record carries a checksum of its own content (1 had none)
MAX_COMMIT_BYTES = 256 << 20  # a manifest row per record: far below this for any real step

_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.step-(\d+)\.tmp-[0-9a-f]+$")


def step_name(step: int) -> str:
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RootListing:
    """What a training root holds: committed steps, steps whose commit record is damaged (never
    loaded), and directories that never committed. Symlinks in the root are not ours: they are
    neither listed, loaded, retained nor removed."""

    committed: list[int]
    incomplete: list[str]  # directory names
    damaged: dict[int, str]  # step -> what is wrong with its commit record


def list_root(root: Location, check: bool = True) -> RootListing:
    """What ``root`` holds. With ``check``, every commit record is read and validated (a damaged
    one moves its step to ``damaged``); without, a step counts once its record exists (cheap on
    an object store). Retention, after every save, checks: a damaged step must not count toward
    ``keep_last`` and so cost a good one its place (reading the kept steps' records is then part of
    every save's cost, which grows with the manifest: docs/benchmarks.md)."""
    committed: list[int] = []
    incomplete: list[str] = []
    damaged: dict[int, str] = {}
    for name in root.listdir():
        step = parse_step(name)
        if (step is None and not _TMP_RE.match(name)) or root.child(name).islink():
            continue
        if step is None or not root.child(name, COMMIT_FILE).exists():
            incomplete.append(name)
            continue
        try:
            if check:
                read_commit_record(root.child(name))
            committed.append(step)
        except CkptError as exc:
            damaged[step] = exc.what
    committed.sort()
    return RootListing(committed, sorted(incomplete), dict(sorted(damaged.items())))


def is_training_root(loc: Location) -> bool:
    """A directory whose entries include ``step-<N>`` directories (committed or not)."""
    names = loc.listdir()
    return any(parse_step(n) is not None or _TMP_RE.match(n) for n in names)


def _digest(record: dict[str, Any]) -> str:
    h = new_hasher()
    h.update(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def commit_record(step: int, world_size: int, extra: dict | None = None) -> bytes:
    """The commit record's bytes; its ``checksum`` covers everything else in it, so a damaged
    record is noticed instead of silently turning the manifest check off."""
    import time

    import torch

    record: dict[str, Any] = {
        "format": COMMIT_FORMAT,
        "version": COMMIT_VERSION,
        "step": step,
        "world_size": world_size,
        "torch": torch.__version__,
        "committed_at": time.time(),
    }
    record.update(extra or {})
    record["checksum"] = {"algorithm": ALGORITHM, "digest": _digest(record)}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def read_commit_record(step_dir: Location) -> dict | None:
    """The step's commit record (None when it has none); :class:`CorruptCheckpointError` when it
    is damaged: unreadable, not the JSON ckpttool writes, or not matching its own checksum."""
    loc = step_dir.child(COMMIT_FILE)
    if not loc.exists():
        return None
    def damaged(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"commit record is damaged: {what}", where=loc.url,
                                      hint="the step cannot be trusted; load an earlier one (inspect lists them)")
    if loc.size() > MAX_COMMIT_BYTES:
        raise damaged(f"larger than {MAX_COMMIT_BYTES >> 20} MiB")
    try:
        record = json.loads(loc.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise damaged(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or isinstance(record.get("step"), bool):
        raise damaged("it names no step")
    checksum = record.pop("checksum", None)
    if record.get("version", 1) >= 2 or checksum is not None:
        if not (isinstance(checksum, dict) and checksum.get("algorithm") == ALGORITHM):
            raise damaged("its checksum is missing")
        if checksum.get("digest") != _digest(record):
            raise damaged("its content does not match its checksum")
    manifest = record.get("manifest")
    if manifest is not None and not _manifest_ok(manifest):
        raise damaged("its manifest is malformed")
    if parse_step(step_dir.name) not in (None, record["step"]):
        raise damaged(f"it is for step {record['step']}, in {step_dir.name}")
    return record


def _manifest_ok(manifest: Any) -> bool:
    """The manifest's shape: rows ``[offset, length, digest]``, a tensor record's with a fourth
    element ``{"data": [start, bytes], "rest": digest, "blocks": digests}`` whose data lies inside
    the record and whose block digests are as many as ``block`` bytes of data make."""
    if not isinstance(manifest, dict):
        return False
    block = manifest.get("block")
    if block is not None and not (isinstance(block, int) and block > 0):
        return False

    def counts(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    def blocks_ok(row: list[Any]) -> bool:
        extra = row[3]
        if block is None or not isinstance(extra, dict) or set(extra) != {"data", "rest", "blocks"}:
            return False
        data, rest, digests = extra["data"], extra["rest"], extra["blocks"]
        return (isinstance(data, list) and len(data) == 2 and all(map(counts, data)) and data[0] + data[1] <= row[1]
                and isinstance(rest, str) and isinstance(digests, str)
                and len(digests) == DIGEST_CHARS * block_count(data[1], block))

    def row_ok(row: Any) -> bool:
        return (isinstance(row, list) and len(row) in (3, 4) and all(map(counts, row[:2])) and isinstance(row[2], str)
                and (len(row) == 3 or blocks_ok(row)))

    records = manifest.get("records", {})
    files = manifest.get("files", {})
    return (isinstance(records, dict) and all(isinstance(rows, list) and all(map(row_ok, rows)) for rows in records.values())
            and isinstance(files, dict) and all(isinstance(v, list) and len(v) == 2 and row_ok([0, *v]) for v in files.values()))


def step_health(step_dir: Location) -> dict[str, Any] | None:
    """The ``health`` of a committed step's record (None when it has none, or the record is damaged)."""
    try:
        record = read_commit_record(step_dir)
    except CkptError:
        return None
    found = (record or {}).get("health")
    return found if isinstance(found, dict) else None


def retention_victims(committed: list[int], keep_last: int | None, keep_every: int | None = None) -> list[int]:
    """Steps to delete: all but the newest ``keep_last``, sparing multiples of ``keep_every``."""
    if keep_last is None:
        return []
    keep = set(sorted(committed)[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    return [s for s in sorted(committed) if s not in keep]
