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

from .bulk import no_gc
from .checksums import ALGORITHM, DIGEST_CHARS, PARTS, block_count, new_hasher
from .errors import CkptError, CorruptCheckpointError, StepTooLargeError
from .storage import Location

COMMIT_FILE = ".ckpttool-commit.json"
COMMIT_FORMAT = "ckpttool-commit"
COMMIT_VERSION = 2  # 2: the record carries a checksum of its own content (1 had none)
MAX_COMMIT_BYTES = 256 << 20  # what a reader parses; the writer refuses to commit a larger record
# A rank's manifest file (its records' rows, block digests included: 16 hex digits per 64 KiB, so
# 256 MiB covers about 1 TB of one rank's data); the writer fails the rank's save beyond it.
MAX_MANIFEST_BYTES = 256 << 20
_MANIFEST_RE = re.compile(r"__[0-9]+\.manifest")  # (fullmatch: one plain name, ASCII digits)

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
    with no_gc():  # (sorting a dict's keys makes tuples: at 16,384 ranks, collections of everything rank 0 holds)
        record["checksum"] = {"algorithm": ALGORITHM, "digest": _digest(record)}
        raw = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    if len(raw) > MAX_COMMIT_BYTES:  # (read_commit_record refuses it: never commit what cannot be loaded)
        raise StepTooLargeError(f"the commit record of step {step} would hold {len(raw)} bytes, more than the "
                                f"{MAX_COMMIT_BYTES >> 20} MiB ckpttool reads", where=step_name(step),
                                hint="the step is not committed")
    return raw


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


def manifest_file_name(rank: int) -> str:
    """The file of one rank's manifest rows in a step written by ckpttool's own writer (DCP's
    readers pass over it: ``.metadata`` does not name it)."""
    return f"__{rank}.manifest"


def manifest_file_bytes(records: dict[str, list[list[Any]]], where: str, sharded: list[Any] | None = None) -> bytes:
    """A rank's manifest file: the rows of the records of its data files, by file, and with
    ``sharded`` where its DTensor records are (``formats/dcp/load_index.py``)
    (:class:`StepTooLargeError` beyond the size its readers take)."""
    raw = json.dumps({"records": records, **({"sharded": sharded} if sharded is not None else {})}, separators=(",", ":")).encode()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise StepTooLargeError(f"this rank's manifest would hold {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES >> 20} "
                                "MiB ckpttool reads", where=where, hint="the step is not committed; save fewer or larger records a rank")
    return raw


def parse_manifest_file(raw: bytes, block: int | None, files: list[str]) -> tuple[dict[str, list[list[Any]]], Any] | None:
    """The rows of ``files`` in a rank's manifest file (its size and digest already checked
    against the commit record), and its ``sharded`` entry (unchecked here; None where it has
    none); None when it is not what the writer writes."""
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    records = parsed.get("records") if isinstance(parsed, dict) else None
    if not isinstance(records, dict) or set(records) != set(files) or not _rows_ok(records, block):
        return None
    return records, parsed.get("sharded")


def _rows_ok(records: Any, block: int | None) -> bool:
    """Manifest rows by file: ``[offset, length, digest]``, a tensor record's with a fourth
    element ``{"data": [start, bytes], "rest": digest, "blocks": digests}`` (and ``"digest":
    "parts"`` where the record's digest is of those: ``checksums.RecordHasher``) whose data lies
    inside the record and whose block digests are as many as ``block`` bytes of data make."""

    def counts(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    def blocks_ok(row: list[Any]) -> bool:
        extra = row[3]
        if block is None or not isinstance(extra, dict) or set(extra) - {"digest"} != {"data", "rest", "blocks"}:
            return False
        if "digest" in extra and extra["digest"] != PARTS:  # (the record's digest is of its parts: checksums.py)
            return False
        data, rest, digests = extra["data"], extra["rest"], extra["blocks"]
        return (isinstance(data, list) and len(data) == 2 and all(map(counts, data)) and data[0] + data[1] <= row[1]
                and isinstance(rest, str) and isinstance(digests, str)
                and len(digests) == DIGEST_CHARS * block_count(data[1], block))

    def row_ok(row: Any) -> bool:
        return (isinstance(row, list) and len(row) in (3, 4) and all(map(counts, row[:2])) and isinstance(row[2], str)
                and (len(row) == 3 or blocks_ok(row)))

    return isinstance(records, dict) and all(isinstance(rows, list) and all(map(row_ok, rows)) for rows in records.values())


def _manifest_ok(manifest: Any) -> bool:
    """The manifest's shape: its rows (:func:`_rows_ok`) in ``records``, whole files' ``[bytes,
    digest]`` in ``files``, and in ``manifests`` the ranks' manifest files (:func:`manifest_file_name`)
    as ``[bytes, digest, [the data files whose rows it holds]]``, no data file in two places."""
    if not isinstance(manifest, dict):
        return False
    block = manifest.get("block")
    if block is not None and not (isinstance(block, int) and not isinstance(block, bool) and block > 0):
        return False
    records, files, split = manifest.get("records", {}), manifest.get("files", {}), manifest.get("manifests", {})
    if not (_rows_ok(records, block) and isinstance(files, dict)
            and all(isinstance(v, list) and len(v) == 2 and _rows_ok({"": [[0, *v]]}, block) for v in files.values())
            and isinstance(split, dict)):
        return False
    seen = set(records)
    for name, entry in split.items():  # (one a rank: 16,384 at 16,384 ranks, checked by every loading rank)
        if not (type(entry) is list and len(entry) == 3 and type(entry[0]) is int and 0 <= entry[0] <= MAX_MANIFEST_BYTES
                and type(entry[1]) is str and type(entry[2]) is list and _MANIFEST_RE.fullmatch(name)):
            return False
        for file in entry[2]:
            if type(file) is not str or file in seen:
                return False
            seen.add(file)
    return True


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
