"""The background threads of async saves: started once per Checkpointer, not once per save.

Starting a thread waits until the new thread runs, on the training thread: milliseconds when
training keeps the cores busy, a large part of what an async ``save()`` costs that thread. A :class:`Worker` is one long-lived thread that runs the jobs handed to it in order.
It is not a daemon, and it leaves once the main thread has finished and no job is left, so the
interpreter never exits before a pending save is written, as with a thread per save.

A worker may run at a lower CPU priority (``nice``, Linux: per thread), so that what it does
takes the cores only when the training threads do not want them.

A worker runs torch's CPU operators on its own thread alone (:func:`one_intraop_thread`). With
torch's OpenMP backend, every thread that runs a parallel operator gets a team of OpenMP threads,
and those spin for a while after each operator before they sleep, on the cores training wants:
the writer calls one (a NaN count) every few MiB between waits on the disk, so its team spun through
the waits (what it cost: docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ckpttool")

#: how often an idle worker checks whether the main thread has finished (the most an exiting
#: interpreter waits for it)
IDLE_CHECK_S = 0.1


class Job:
    """One piece of work handed to a :class:`Worker`; ``done`` once it ran (or raised)."""

    def __init__(self, fn: Callable[[], Any], name: str | None):
        self.fn = fn
        self.name = name
        self.done = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


class Worker:
    """A long-lived thread running :class:`Job` s one after another (a job's errors are its own
    to record: one that raises is logged and the worker goes on)."""

    def __init__(self, name: str, nice: int | None = None):
        self.name = name
        self.nice = nice
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def running_here(self) -> bool:
        """Whether the calling thread is this worker's (a job's code calling back into its owner)."""
        return self._thread is not None and self._thread is threading.current_thread()

    def submit(self, fn: Callable[[], Any], name: str | None = None) -> Job:
        """Run ``fn`` in the worker thread after the jobs before it; ``name`` names the thread
        while it runs (logs, profilers)."""
        job = Job(fn, name)
        with self._lock:
            self._jobs.put(job)
            if self._thread is None or not self._thread.is_alive():  # first use, after close(), or in a forked child
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=False)
                self._thread.start()
        return job

    def close(self) -> None:
        """Let the thread finish the jobs handed to it, then end; returns once it has."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                self._jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        lower_priority(self.nice)
        one_intraop_thread()
        me = threading.current_thread()
        main = threading.main_thread()
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                if not main.is_alive():  # the interpreter is exiting and nothing is left to do
                    with self._lock:
                        if self._jobs.empty():
                            if self._thread is me:
                                self._thread = None
                            return
                continue
            if job is None:
                return
            if job.name:
                me.name = job.name
            try:
                job.fn()
            except BaseException:  # noqa: BLE001 - a job records its own errors; this is a bug in one
                log.exception("ckpttool background job %s failed", job.name or self.name)
            finally:
                me.name = self.name
                job.done.set()
                job = None  # an idle worker keeps nothing alive (the job holds the staged state)


def lower_priority(nice: int | None) -> None:
    """Lower the calling thread's CPU priority to ``nice`` (Linux, where nice is per thread).
    Elsewhere, or refused, nothing changes."""
    if nice is None or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:  # a sandbox may refuse it: the thread runs at the same priority
        log.debug("could not lower the priority of %s: %s", threading.current_thread().name, exc)


def one_intraop_thread() -> bool:
    """Make torch's CPU operators called from the calling thread run on it alone, leaving every
    other thread's as it was; returns whether they now do. With torch's OpenMP backend the number
    of threads of a parallel region is a per-thread setting (OpenMP's ``nthreads-var``, which
    ``torch.get_num_threads`` reads), set here through the OpenMP runtime torch uses: not
    ``torch.set_num_threads``, which would also change it for threads started later. torch sets a
    thread's count up the first time the thread asks for it (to what ``torch.set_num_threads`` last
    set, if anything did), so it is asked first. Elsewhere (another backend, no runtime found)
    nothing changes, and the debug log says so."""
    if "torch" not in sys.modules:  # (its OpenMP runtime is loaded with it)
        return False
    import torch

    if torch.get_num_threads() == 1:
        return True
    for setter in _omp_setters():
        try:
            setter(1)
        except Exception:  # noqa: BLE001 - an odd runtime: try the next
            continue
        if torch.get_num_threads() == 1:
            return True
    log.debug("ckpttool: %s runs torch's operators on %d threads (no OpenMP runtime of torch's found)",
              threading.current_thread().name, torch.get_num_threads())
    return False


@functools.lru_cache(maxsize=1)
def _omp_setters() -> tuple[Any, ...]:
    """``omp_set_num_threads`` of each OpenMP runtime loaded in this process (libgomp, LLVM's
    libomp, Intel's libiomp5), found among the mapped files (Linux): torch's is the one whose call
    changes ``torch.get_num_threads``. Empty where there is none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return ()
    setters = []
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp")):
            try:
                setters.append(ctypes.CDLL(path).omp_set_num_threads)
            except (OSError, AttributeError):
                continue
    return tuple(setters)
