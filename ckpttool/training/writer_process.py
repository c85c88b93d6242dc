"""An async save's write in a process of its own (``Checkpointer(writer="process")``).

The background thread of an async save shares the training process's GIL and cores with the
training thread: hashing every byte and writing it costs training more than its CPU time (the
training thread waits for the GIL and the scheduler). Here the staged state stays where the
stager put it: the CPU buffers are views of one block of shared memory (a ``memfd``: anonymous,
gone with the last process that maps it, whatever kills them), which the writer process maps
once (again when the stager allocates a new block); per save it is sent the state's structure,
with each staged tensor as (offset, dtype, shape) in that block, and runs
:func:`step_writer.write_rank` on it: the block digests, the writes and the rank's index. The
training process's background thread waits for its answer (relaying its progress to the rank's
beat). Rank 0's then waits, watching the beats, for every rank's index to be in storage and sends
the commit (:func:`step_writer.commit_step`: the indexes read and merged into ``.metadata``); it
writes the commit record from the answer and publishes the step as before.

The writer process is started as ``python -c`` (not multiprocessing's spawn, which runs the
training script's ``__main__`` again), over a socket pair; messages are plain pickles (a
tensor outside the block goes by value: torch's sharing reductions, once registered by a
DataLoader, would need multiprocessing's own processes). A writer process that dies is a failed
save, named (:class:`WriterProcessError`), never a wait: the socket ends, and the next save starts
a new process. It exits when the training process goes (its socket ends) and at
``Checkpointer.close()``. It follows the training process's ``CKPTTOOL_*`` variables as they are
at each save (the fault points tests set). Linux (``memfd_create``); CPU tensors: a CUDA tensor's
pinned buffer is its own, not in the block, and is sent by value.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Callable

import torch

from ..errors import CkptError, StorageError, UsageError
from .step_writer import HostShard, Written

log = logging.getLogger("ckpttool")


class WriterProcessError(StorageError):
    """The writer process of this rank ended before it answered: the save failed."""


@dataclass(frozen=True)
class _InBlock:
    """A staged tensor as the writer process finds it: ``nbytes`` at ``offset`` of the shared block."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    box: Any
    global_shape: tuple[int, ...]
    store: bool
    plain: bool


def available() -> None:
    """Refuse ``writer="process"`` where it cannot run (no ``memfd_create``: not Linux)."""
    if not hasattr(os, "memfd_create"):
        raise UsageError("writer='process' needs Linux (memfd_create)", hint="use the default writer='thread'")


class SharedBlock:
    """``nbytes`` of shared memory (a memfd, zero-filled by the kernel: never uninitialised) and a
    uint8 tensor over them; ``fd`` is handed to the writer process."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.fd = os.memfd_create("ckpttool-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes) if nbytes else None
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def __del__(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)


def _map(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if type(value) is tuple:
        return tuple(_map(v, fn) for v in value)
    return fn(value)


def _encode(staged: dict[str, Any], block: SharedBlock | None) -> dict[str, Any]:
    """The staged state with each HostShard whose copy is a view of ``block`` as an :class:`_InBlock`."""
    base = block.tensor.untyped_storage().data_ptr() if block is not None and block.nbytes else None

    def one(value: Any) -> Any:
        if isinstance(value, HostShard) and value.local.device.type == "cpu" and value.local.is_contiguous() \
                and value.local.untyped_storage().data_ptr() == base:
            local = value.local
            return _InBlock(local.storage_offset() * local.element_size(), local.numel() * local.element_size(), local.dtype,
                            tuple(local.shape), value.box, value.shape, value.store, value.plain)
        return value

    return _map(staged, one)


def _decode(encoded: dict[str, Any], block: torch.Tensor | None) -> dict[str, Any]:
    def one(value: Any) -> Any:
        if isinstance(value, _InBlock):
            local = block[value.offset:value.offset + value.nbytes].view(value.dtype).view(value.shape)
            return HostShard(local, value.box, value.global_shape, value.store, value.plain)
        return value

    return _map(encoded, one)


class WriterProcess:
    """One rank's writer process, started at its first write."""

    def __init__(self, nice: int | None = None):
        self._nice = nice
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._block: SharedBlock | None = None  # the block the process has mapped
        self._settings: dict[str, str] = {}  # the CKPTTOOL_* variables of its environment
        self._lock = threading.Lock()

    def write(self, block: SharedBlock | None, step_dir: Any, rank: int, staged: dict[str, Any], step: int,
              progress: Callable[[int], None] | None, health: Any, **kwargs: Any) -> Written | None:
        """:func:`step_writer.write_rank` of the staged state, in the writer process; ``health``'s
        tally comes back filled as the write filled it there."""
        def send() -> None:
            if block is not self._block and block is not None:
                self._send(("block", block.nbytes))
                send_handle(self._conn, block.fd, self._proc.pid)
                self._block = block
            self._send(("write", (step_dir, rank, _encode(staged, block), health, progress is not None, kwargs)))

        written, tally = self._ask(send, progress, f"the writer process of rank {rank} ended while writing step {step}", step_dir)
        if health is not None:
            health.tally = tally
        return written

    def commit(self, step_dir: Any, world_size: int, timeout: float, step: int) -> dict[str, Any]:
        """Rank 0: :func:`step_writer.commit_step` in the writer process (every rank's index is in
        storage by now); returns the commit record's fields."""
        return self._ask(lambda: self._send(("commit", (step_dir, world_size, timeout, step))), None,
                         f"the writer process of rank 0 ended while committing step {step}", step_dir)

    def _ask(self, send: Callable[[], None], progress: Callable[[int], None] | None, ended: str, step_dir: Any) -> Any:
        """Send one piece of work, relay its progress, return its answer; its own error raised."""
        with self._lock:
            self._running()
            try:
                settings = {k: v for k in list(os.environ) if k.startswith("CKPTTOOL_") and (v := os.environ.get(k)) is not None}
                if settings != self._settings:  # (a test's fault points, set after the process started)
                    self._send(("settings", settings))
                    self._settings = settings
                send()
                while True:
                    kind, payload = pickle.loads(self._conn.recv_bytes())
                    if kind == "progress":
                        if progress is not None:
                            progress(payload)
                    elif kind == "done":
                        return payload
                    else:
                        failure = payload  # the work's own error (a full disk): raised below, the process lives on
                        break
            except (EOFError, OSError) as exc:
                code = self._stop()
                raise WriterProcessError(f"{ended} ({_ended(code, exc)})", where=str(getattr(step_dir, "url", step_dir)),
                                         hint="the step is not committed; the next save starts a new writer process") from None
            except BaseException:
                self._stop()  # (out of step with it, or still working: the next save starts another)
                raise
        raise failure

    def start(self) -> None:
        """Start the writer process now, unless it runs (it imports torch: about a second, which the
        first save's copy overlaps). One that cannot start is left for the write to try again and
        fail by name, in the background: ``save()`` has marked its step pending by now."""
        with self._lock:
            try:
                self._running()
            except WriterProcessError as exc:
                log.debug("ckpttool: %s", exc)

    def _running(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._start()

    def _send(self, message: Any) -> None:
        # (pickles between this process and the writer process it started, over their private socket
        # pair: no checkpoint's bytes are unpickled here; those go through safe_pickle only)
        self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (where ckpttool is imported from)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p))
        code = f"from ckpttool.training.writer_process import serve; serve({theirs.fileno()}, {self._nice!r}, {os.getpid()})"
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
                                          stdin=subprocess.DEVNULL)
        except OSError as exc:  # (no memory or processes left to fork, the interpreter gone)
            ours.close()
            raise WriterProcessError(f"the writer process could not be started ({exc.strerror or exc})",
                                     where=sys.executable,
                                     hint="the step is not committed; the next save tries again (or use writer='thread')") from None
        finally:
            theirs.close()
        self._conn, self._block = Connection(ours.detach()), None
        self._settings = {k: v for k, v in env.items() if k.startswith("CKPTTOOL_")}  # (what it started with)
        self._send(("path", sys.path))  # (the modules of the state's values import there as here: the script's folder)

    def _stop(self) -> int | None:
        proc, self._proc = self._proc, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._block = None
        if proc is None:
            return None
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._send(("stop", None))
                except OSError:
                    pass
            self._stop()


def _ended(code: int | None, exc: BaseException) -> str:
    if code is not None and code < 0:
        return f"killed by signal {-code}"
    if code is not None:
        return f"exit code {code}"
    return type(exc).__name__


def _settle(nice: int | None, parent: int) -> bool:
    """The writer process's own settings; False where the training process is gone already."""
    from . import background

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's Ctrl-C is the training process's to handle)
    with contextlib.suppress(Exception):  # never outlive the training process (Linux: PR_SET_PDEATHSIG)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:
        return False  # (it went before the line above)
    if nice is not None:
        os.nice(nice)
    background.one_intraop_thread()
    return True


def _failed(exc: BaseException, step_dir: Any) -> tuple[str, Any]:
    """The answer for work that raised ``exc``: ("error", the error as the training process raises it)."""
    from ..storage import save_error

    error = exc if isinstance(exc, CkptError) else save_error(exc, step_dir) if isinstance(exc, Exception) else None
    return "error", error or CkptError(f"the work stopped: {type(exc).__name__}: {exc}", where=step_dir.url)


def _commit(payload: Any) -> tuple[str, Any]:
    """Rank 0's commit of a step: ("done", the commit record's fields) or ("error", the error)."""
    from . import step_writer

    step_dir, world_size, timeout, step = payload
    try:
        return "done", step_writer.commit_step(step_dir, world_size, timeout, step)
    except Exception as exc:  # noqa: BLE001 - handed to the training process, which raises it
        # (as it is, as the commit in the training process raises it: an error that is no CkptError,
        # a bug in the merge, is never a failed save that tolerate_failures lets pass)
        return "error", exc
    except BaseException as exc:  # noqa: BLE001
        return _failed(exc, step_dir)


def _write(payload: Any, block: torch.Tensor | None, progress: Any) -> tuple[str, Any]:
    """One rank's write of a save, as the answer the training process gets: ("done", (what was
    written, the health tally)) or ("error", the error)."""
    from .. import rendezvous
    from . import step_writer

    step_dir, rank, encoded, health, beats, kwargs = payload
    try:
        written = step_writer.write_rank(step_dir, rank, _decode(encoded, block), health=health,
                                         pause=functools.partial(rendezvous.pause_point, who=rank),
                                         progress=progress if beats else None, **kwargs)
        return "done", (written, health.tally if health is not None else None)
    except BaseException as exc:  # noqa: BLE001 - handed to the training process, which raises it
        return _failed(exc, step_dir)


def serve(fd: int, nice: int | None, parent: int) -> None:
    """The writer process: map the block, write what it is sent, answer; until the socket ends."""
    if not _settle(nice, parent):
        return
    conn = Connection(fd)
    block = None
    said = [0.0]

    def send(message: Any) -> None:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def progress(nbytes: int) -> None:  # (bytes written so far, for the rank's beat: a few a second at most)
        if time.monotonic() - said[0] >= 0.2:
            said[0] = time.monotonic()
            send(("progress", nbytes))

    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the training process is gone
        try:
            kind, payload = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001 - a value of the state whose class does not import here
            send(("error", CkptError(f"the writer process cannot read this save's state ({type(exc).__name__}: {exc})",
                                     hint="a value of a class defined in the training script itself? Checkpointer(writer='thread') "
                                          "saves it")))
            continue
        if kind == "stop":
            return
        if kind == "path":
            sys.path[:] = payload
            continue
        if kind == "settings":  # the training process's CKPTTOOL_* variables as they are now
            for name in [k for k in os.environ if k.startswith("CKPTTOOL_") and k not in payload]:
                del os.environ[name]
            os.environ.update(payload)
            continue
        if kind == "block":
            handle = recv_handle(conn)
            try:
                block = torch.frombuffer(mmap.mmap(handle, payload), dtype=torch.uint8) if payload else None
            finally:
                os.close(handle)
            continue
        answer = _commit(payload) if kind == "commit" else _write(payload, block, progress)
        try:
            try:
                send(answer)
            except (pickle.PicklingError, TypeError, AttributeError):  # an error that does not pickle: said as text
                send(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))
        except OSError:
            return  # the training process is gone (its write, done, is in storage for rank 0 to judge)
