"""ckpttool: inspect, convert, reshard and verify PyTorch distributed checkpoints, and save/resume them.

    from ckpttool import Checkpointer

Names are imported on first use, so ``ckpttool --help`` does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names

__all__ = ["Checkpointer", "CkptError", "LoadResult", "convert", "load", "verify_loaded"]
__version__ = "0.1.0"

_WHERE = {
    "Checkpointer": "checkpointer",
    "LoadResult": "restore",
    "load": "restore",
    "convert": "commands",
    "CkptError": "errors",
    "verify_loaded": "loaded",
}

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .restore import LoadResult, load
    from .errors import CkptError
    from .commands import convert
    from .loaded import verify_loaded


__getattr__ = lazy_names(__name__, _WHERE, globals())
