"""Names the command line offers before it imports torch (formats come from the registry)."""

from __future__ import annotations

import re

from .errors import UsageError

#: ``--dtype`` casts floating-point tensors to one of these
CAST_DTYPES = ("float32", "bfloat16", "float16")

#: ``--memory-budget``'s default: the most tensor data an offline command holds in memory at once
DEFAULT_BUDGET = 1 << 30

#: ``--compress`` stores each DCP record compressed, as torch's ``_extensions=[ZStandard()]`` does
COMPRESSIONS = ("zstd",)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str | int, what: str = "size") -> int:
    """``"1GiB"``, ``"500MB"``, ``"2G"``, ``"4096"`` -> bytes (K/M/G/T are powers of 1024 with or
    without i); ``what`` names the option in the error."""
    if isinstance(text, int):
        if text < 1:
            raise UsageError(f"{what} must be positive, got {text}")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"cannot read {what} {text!r}", hint="write e.g. 512MiB, 2GB or a number of bytes")
    number, unit, _ = m.groups()
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit.lower()]
    value = int(float(number) * scale)
    if value < 1:
        raise UsageError(f"{what} must be positive, got {text!r}")
    return value


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ... ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
