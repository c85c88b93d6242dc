"""Work that builds millions of small objects at once (a large step's ``.metadata``, merged or
parsed): Python's cyclic garbage collector is held off while it runs.

Each object such work makes is kept until the work ends, and none is part of a reference cycle,
yet every 700 allocations the collector walks the young objects and, ever more often, all the
old ones: it took 29% of rank 0's commit of a 4,096-rank step. Reference counting still frees
everything as usual; the collector resumes as soon as the last such block ends, on any thread.

The collector's switch is the process's: while a block runs (a commit on rank 0's writer thread)
cyclic garbage of the training thread waits for its end, and a ``gc.disable()`` the training
code makes while a block runs is undone when it ends (one made before it is kept).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0  # blocks inside no_gc, on every thread
_was_enabled = False  # the collector's state before the first of them


@contextmanager
def no_gc() -> Iterator[None]:
    """Hold the cyclic collector off inside (nested and concurrent blocks alike: it comes back,
    if it was on, when the last one ends)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
