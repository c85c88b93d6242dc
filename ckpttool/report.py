"""What a check found: a :class:`Report` of :class:`Problem` lines (file, key, what, what to do).

Formats fill one in during ``verify`` (each checks its own files); the CLI renders it as text or
JSON. Pure data: nothing here reads files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Problem:
    what: str
    file: str | None = None
    key: str | None = None
    hint: str | None = None
    unreadable: bool = False  # a value ckpttool refuses to read (not a difference found): exit 2

    def line(self) -> str:
        where = ", ".join(p for p in (self.file, f"key {self.key!r}" if self.key else None) if p)
        text = f"{where}: {self.what}" if where else self.what
        return f"{text} ({self.hint})" if self.hint else text


@dataclass
class Report:
    path: str
    kind: str  # "integrity" or "equality"
    problems: list[Problem] = field(default_factory=list)
    tensors_checked: int = 0
    bytes_checked: int = 0
    objects_checked: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        """0 when nothing is wrong, 2 when a value could not be read at all (refused by the
        allow-list), else 1 (a difference or damage found)."""
        if not self.problems:
            return 0
        return 2 if any(p.unreadable for p in self.problems) else 1

    def add(self, what: str, file: str | None = None, key: str | None = None, hint: str | None = None,
            unreadable: bool = False) -> None:
        self.problems.append(Problem(what, file, key, hint, unreadable))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def checked_tensor(self, nbytes: int) -> None:
        self.tensors_checked += 1
        self.bytes_checked += nbytes

    def merge(self, other: Report) -> None:
        """Add a sub-report (one step of a training root) to this one."""
        self.problems += other.problems
        for n in other.notes:
            self.note(n)
        self.tensors_checked += other.tensors_checked
        self.bytes_checked += other.bytes_checked
        self.objects_checked += other.objects_checked

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        return doc
