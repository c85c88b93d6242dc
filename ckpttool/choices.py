"""Names the command line offers before it imports torch (formats come from the registry)."""

from __future__ import annotations

#: ``--dtype`` casts floating-point tensors to one of these
CAST_DTYPES = ("float32", "bfloat16", "float16")
