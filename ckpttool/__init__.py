"""ckpttool: inspect, convert, reshard and verify PyTorch distributed checkpoints, and save/resume them.

    from ckpttool import Checkpointer
"""

from .checkpointer import Checkpointer, LoadResult, load
from .errors import CkptError
from .pipeline import convert

__all__ = ["Checkpointer", "CkptError", "LoadResult", "convert", "load"]
__version__ = "0.1.0"
