"""The one checker of a DCP step's records against its manifest (the commit record's digest of
every record, of its 64 KiB blocks, and of ``.metadata``) and against torch's CRC-32 of their
tensor data. It yields :class:`Finding` values; its two callers decide what a finding is: a read
(``checks.py``: loads, convert, reshard) raises it as a :class:`ChecksumError`, ``verify``
(``integrity.py``) reports it and goes on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...checksums import ALGORITHM, HASH_BLOCK, hash_bytes
from ...errors import ChecksumError, CkptError
from ...steps import COMMIT_FILE, MAX_MANIFEST_BYTES, parse_manifest_file
from ...storage import Location
from .metadata import METADATA_FILE

_CHANGED = "the bytes changed after the save committed; restore the file or use another step"
#: the bytes of ranks' manifest files whose parsed rows a reader keeps (the most recently used):
#: a verify of every record of a 16,384-rank step reads them all, one after another
ROWS_KEPT = 2 * MAX_MANIFEST_BYTES


@dataclass(frozen=True)
class Finding:
    """One thing wrong, said once for both callers: ``message(key)`` names the key in the text
    (an error), ``message()`` leaves it to the report's own column."""

    text: str  # with {subject}
    keyed: str  # the subject when the key is named ({key}: its repr)
    plain: str  # the subject in a report
    where: str
    hint: str

    def message(self, key: str | None = None, on: str = "") -> str:
        subject = self.keyed.format(key=repr(key)) if key is not None else self.plain
        return self.text.format(subject=subject) + on

    def error(self, key: str | None, on: str = "") -> ChecksumError:
        return ChecksumError(self.message(key, on), where=self.where, hint=self.hint)


def _record(offset: int, text: str, where: str, hint: str = _CHANGED) -> Finding:
    return Finding("{subject} " + text, f"record of {{key}} at byte {offset}", f"record at byte {offset}", where, hint)


class Manifest:
    """A step's manifest, parsed: per record (file, offset) its length, digest and block digests
    (or None), the block size, and ``.metadata``'s size and digest. The rows of a file that a
    rank's manifest file holds (ckpttool's own writer) are read from it, and checked against the
    commit record's size and digest of it, the first time a record of that file is looked up; the
    rows of the manifest files read last are kept, up to :data:`ROWS_KEPT` bytes of their files."""

    def __init__(self, manifest: dict[str, Any], step_dir: Location | None = None):
        self.algorithm = manifest.get("algorithm")
        self.block = manifest.get("block") or HASH_BLOCK
        self._inline: dict[str, dict[int, tuple[int, str, Any]]] = {
            name: _by_offset(rows) for name, rows in manifest.get("records", {}).items()}
        self._split: dict[str, tuple[str, int, str, list[str]]] = {
            file: (name, length, digest, files)
            for name, (length, digest, files) in manifest.get("manifests", {}).items() for file in files}
        # a rank's manifest file read: (its bytes, its rows by data file, its ``sharded`` entry)
        self._loaded: OrderedDict[str, tuple[int, dict[str, dict[int, tuple[int, str, Any]]], Any]] = OrderedDict()
        self._damaged: dict[str, Finding] = {}
        self._step_dir = step_dir
        self.metadata = manifest.get("files", {}).get(METADATA_FILE)

    def rows_of(self, name: str) -> tuple[dict[int, tuple[int, str, Any]], Finding | None]:
        """The rows of data file ``name`` by record offset (none for a file the manifest does not
        know), or what is wrong with the manifest file that holds them."""
        rows = self._inline.get(name)
        if rows is not None:
            return rows, None
        loaded, finding = self._rank_file(name)
        return (loaded[1][name], None) if loaded is not None else ({}, finding)

    def rows_or_none_of(self, name: str) -> dict[int, tuple[int, str, Any]]:
        """:meth:`rows_of` for a reader that checks records without reporting: no rows where the
        manifest file that holds them cannot be read (each record's own check then says why)."""
        rows, finding = self.rows_of(name)
        return rows if finding is None else {}

    def sharded_of(self, name: str, owner: str) -> tuple[Any, Finding | None]:
        """The ``sharded`` entry of the rank's manifest file that holds data file ``name``'s rows
        (``load_index.py``; None where it has none, or where that file is not ``owner``, the
        rank's own), or what is wrong with that file."""
        if (self._split.get(name) or ("",))[0] != owner:
            return None, None
        loaded, finding = self._rank_file(name)
        return (loaded[2], None) if loaded is not None else (None, finding)

    def _rank_file(self, name: str) -> tuple[Any, Finding | None]:
        """The manifest file holding data file ``name``'s rows, read and checked once (kept while
        it is among the last read): ``(bytes, rows by file, sharded)``, or None and what is wrong
        (None and None for a file no manifest file holds)."""
        if name in self._damaged:
            return None, self._damaged[name]
        split = self._split.get(name)
        if split is None or self._step_dir is None:
            return None, None
        mname = split[0]
        if mname in self._loaded:
            self._loaded.move_to_end(mname)
            return self._loaded[mname], None
        parsed, problem, where = self._read(*split)
        if parsed is None:
            for file in split[3]:  # (each data file's records name their own file)
                self._damaged[file] = Finding(
                    "{subject} cannot be checked: " + _literal(f"the manifest file {mname} {problem}"),
                    f"record of {{key}} in {_literal(file)}", f"records of {file}", where,
                    "the step's manifest changed or was lost after the save committed; use another step")
            return None, self._damaged[name]
        records, sharded = parsed
        self._loaded[mname] = (split[1], {file: _by_offset(file_rows) for file, file_rows in records.items()}, sharded)
        while sum(size for size, *_ in self._loaded.values()) > ROWS_KEPT and len(self._loaded) > 1:
            self._loaded.popitem(last=False)
        return self._loaded[mname], None

    def _read(self, mname: str, length: int, digest: str, files: list[str]) -> tuple[Any, str | None, str]:
        """A rank's manifest file, checked: (its rows by data file, None, url) or (None, what is wrong, url)."""
        url = self._step_dir.url
        try:
            loc = self._step_dir.inside(mname, self._step_dir.child(COMMIT_FILE).url)  # (no symlink out of the step)
            url = loc.url
            if not loc.exists():
                return None, "is missing", url
            size = loc.size()
            if size != length or size > MAX_MANIFEST_BYTES:
                return None, f"holds {size} bytes, the commit record says {length}", url
            raw = loc.read_bytes(0, length + 1)
            if len(raw) != length or hash_bytes(raw) != digest:
                return None, "does not match the commit record's checksum of it", url
            parsed = parse_manifest_file(raw, self.block, files)
            if parsed is None:
                return None, "is not a manifest ckpttool writes", url
            return parsed, None, url
        except (CkptError, OSError) as exc:
            return None, f"cannot be read ({exc})", url

    @classmethod
    def of(cls, manifest: dict[str, Any] | None, step_dir: Location | None = None) -> tuple[Manifest | None, str | None]:
        """The manifest to check against (None when there is none, or it was hashed with another
        algorithm than this install's), and a note saying which."""
        if not manifest:
            return None, None
        if manifest.get("algorithm", ALGORITHM) != ALGORITHM:
            return None, f"manifest uses {manifest.get('algorithm')}, this install hashes with {ALGORITHM}: not checked"
        return cls(manifest, step_dir), f"checked against the manifest ({ALGORITHM}) of the commit record"

    def check_metadata(self, size: int, digest: str, url: str) -> Finding | None:
        if self.metadata is not None and list(self.metadata) != [size, digest]:
            return Finding("{subject} does not match the manifest written at commit", ".metadata", ".metadata", url,
                           "it changed after the save committed; the step cannot be trusted: load an earlier one")
        return None

    def row(self, info: Any, url: str) -> tuple[tuple[int, str, Any] | None, Finding | None]:
        """The manifest's row of the record at ``info`` (relative_path, offset, length), or what is
        wrong: a record the manifest does not know."""
        rows, finding = self.rows_of(info.relative_path)
        if finding is not None:
            return None, finding
        row = rows.get(info.offset)
        if row is None or row[0] != info.length:
            return None, _record(info.offset, "is not in the manifest written at commit", url,
                                 "the .metadata changed after the save")
        return row, None

    def check_digest(self, info: Any, digest: str, url: str) -> Finding | None:
        """The record's digest as read against the manifest's."""
        row, finding = self.row(info, url)
        if finding is None and digest != row[1]:
            finding = _record(info.offset, "does not match the manifest's checksum", url)
        return finding


def _literal(text: str) -> str:
    """``text`` as it reads once it went through ``str.format`` (a file name may hold braces)."""
    return text.replace("{", "{{").replace("}", "}}")


def _by_offset(rows: list[list[Any]]) -> dict[int, tuple[int, str, Any]]:
    return {off: (length, digest, extra[0] if extra else None) for off, length, digest, *extra in rows}


def check_crc(offsets: Any, crc: int, stored: int, url: str) -> Finding | None:
    """A chunk's tensor data (its CRC-32 as read) against the CRC-32 torch stored with it."""
    if crc == stored:
        return None
    hint = "the bytes changed after they were written (bit rot, a bad copy); restore the file or use another step"
    if stored == 0:  # (torch's set_crc32_options(False), and ckpttool's training save, write none)
        hint = ("the record may carry no CRC-32 (ckpttool's save writes none: the commit record's manifest proves its bytes); "
                f"check the step with its {COMMIT_FILE}, or " + hint)
    return Finding("{subject} does not match its CRC-32 " + f"(stored {stored:08x}, computed {crc:08x})",
                   f"tensor data of {{key}} (chunk at {list(offsets)})", f"tensor data of the chunk at {list(offsets)}", url, hint)
