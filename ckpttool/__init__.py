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
    "Checkpointer": "training.checkpointer",
    "LoadResult": "training.load",
    "load": "training.load",
    "convert": "offline.convert",
    "CkptError": "errors",
    "verify_loaded": "training.loaded",
}

if TYPE_CHECKING:
    from .errors import CkptError
    from .offline.convert import convert
    from .training.checkpointer import Checkpointer
    from .training.load import LoadResult, load
    from .training.loaded import verify_loaded


__getattr__ = lazy_names(__name__, _WHERE, globals())
