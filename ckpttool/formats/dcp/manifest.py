"""The one checker of a DCP step's records against its manifest (the commit record's digest of
every record, of its 64 KiB blocks, and of ``.metadata``) and against torch's CRC-32 of their
tensor data. It yields :class:`Finding` values; its two callers decide what a finding is: a read
(``checks.py``: loads, convert, reshard) raises it as a :class:`ChecksumError`, ``verify``
(``integrity.py``) reports it and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...checksums import ALGORITHM, HASH_BLOCK
from ...errors import ChecksumError
from .metadata import METADATA_FILE

_CHANGED = "the bytes changed after the save committed; restore the file or use another step"


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
    (or None), the block size, and ``.metadata``'s size and digest."""

    def __init__(self, manifest: dict[str, Any]):
        self.algorithm = manifest.get("algorithm")
        self.block = manifest.get("block") or HASH_BLOCK
        self.rows: dict[tuple[str, int], tuple[int, str, Any]] = {
            (name, off): (length, digest, extra[0] if extra else None)
            for name, rows in manifest.get("records", {}).items() for off, length, digest, *extra in rows}
        self.metadata = manifest.get("files", {}).get(METADATA_FILE)

    @classmethod
    def of(cls, manifest: dict[str, Any] | None) -> tuple[Manifest | None, str | None]:
        """The manifest to check against (None when there is none, or it was hashed with another
        algorithm than this install's), and a note saying which."""
        if not manifest:
            return None, None
        if manifest.get("algorithm", ALGORITHM) != ALGORITHM:
            return None, f"manifest uses {manifest.get('algorithm')}, this install hashes with {ALGORITHM}: not checked"
        return cls(manifest), f"checked against the manifest ({ALGORITHM}) of the commit record"

    def check_metadata(self, size: int, digest: str, url: str) -> Finding | None:
        if self.metadata is not None and list(self.metadata) != [size, digest]:
            return Finding("{subject} does not match the manifest written at commit", ".metadata", ".metadata", url,
                           "it changed after the save committed; the step cannot be trusted: load an earlier one")
        return None

    def row(self, info: Any, url: str) -> tuple[tuple[int, str, Any] | None, Finding | None]:
        """The manifest's row of the record at ``info`` (relative_path, offset, length), or what is
        wrong: a record the manifest does not know."""
        row = self.rows.get((info.relative_path, info.offset))
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


def check_crc(offsets: Any, crc: int, stored: int, url: str) -> Finding | None:
    """A chunk's tensor data (its CRC-32 as read) against the CRC-32 torch stored with it."""
    if crc == stored:
        return None
    return Finding("{subject} does not match its CRC-32 " + f"(stored {stored:08x}, computed {crc:08x})",
                   f"tensor data of {{key}} (chunk at {list(offsets)})", f"tensor data of the chunk at {list(offsets)}", url,
                   "the bytes changed after they were written (bit rot, a bad copy); restore the file or use another step")
