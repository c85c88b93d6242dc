"""Offline commands spread over workers: torch.distributed (gloo) processes that split one output.

A worker is a process of a gloo group. Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment,
any number of nodes) a command joins the group torchrun set up; ``--nproc N`` starts up to N local
workers itself (:func:`launch`; as many as pay for their start, :func:`workers_for`), with a
file-store rendezvous (no port to pick) and the name of the output's staging directory chosen up
front, so that a worker killed mid-run leaves nothing behind.

What is split is the output's files (a reshard's target ranks, a sharded convert's shards) and a
verify's entries: worker ``w`` of ``n`` takes the ``w``-th contiguous run of them (neighbouring files
read neighbouring source bytes), reads only the source bytes they need, and worker 0 writes the file that completes the output (``.metadata``, the
index) last, from every worker's records merged in file order, so the bytes written do not depend
on how many workers wrote them. Any worker's failure fails every worker and leaves no output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

ENV_INIT = "CKPTTOOL_INIT_METHOD"  # set by launch(): the file store the workers meet at
ENV_STAGING = "CKPTTOOL_STAGING"  # set by launch(): the hidden name the output is staged under
ENV_TIMEOUT = "CKPTTOOL_WORKER_TIMEOUT"  # seconds a worker waits for the others (default a day)
ENV_SPLIT = "CKPTTOOL_SPLIT"  # "always": --nproc N starts N workers whatever the work (tests, benchmarks)
# The figures below are measured, with the runs behind them, in docs/benchmarks.md ("Issue 50,
# part 5").
#: what starting the workers costs beyond one process, in seconds: an interpreter each, importing
#: torch, and the gloo group
START_S = 2.5
#: bytes one process moves per second, on local files and on an object store. The object store's
#: is the slow end on purpose: against a faster store it splits where one process would have been
#: quicker, which costs at most the workers' start, where the opposite error costs minutes. (One
#: read's speed, tried as a probe, did not tell a command's speed.)
RATE = {"local": 0.5e9, "object store": 10e6}
#: the cores a worker on local files can keep busy: it reads ahead in one thread while it writes and
#: hashes in another
CORES_PER_WORKER = 2
#: how long the others may take to stop after one worker failed with an error it reported
GRACE_S = 30.0
#: whether this process joined a group of workers (:func:`workers`): the CLI then ends it with os._exit
joined = False


def launched() -> bool:
    """Whether this process is one of several workers (started by torchrun or by :func:`launch`)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


@contextmanager
def workers() -> Iterator[bool]:
    """Join the workers' gloo group for one command (yields whether there are several workers)."""
    if not launched():  # one process: no group (and torch is not imported for one)
        yield False
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield True
        return
    global joined, _terminated
    timeout = timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, 24 * 3600)))
    dist.init_process_group("gloo", init_method=os.environ.get(ENV_INIT, "env://"), timeout=timeout,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    joined = True
    # torchrun stops the other workers with SIGTERM when one fails: unwind (the output's staging
    # directory is removed on the way out) instead of dying where the signal lands
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield True
    except Terminated:
        _terminated = True
        sys.exit(128 + signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # The group is not destroyed: the process ends in leave() and os._exit. Destroying it joins
    # gloo's threads while holding the GIL, and one of them may still be dropping the last
    # reference to a collective's tensor made in Python (all_gather_object's), which needs the
    # GIL: a deadlock, seen on older torch releases.


_terminated = False


def leave() -> None:
    """A worker's last act before ``os._exit``: wait (at most :data:`GRACE_S`) until every worker
    got here, so that none exits before worker 0 has written its report. torchrun takes a
    worker's non-zero exit (a verify that found a difference exits 1 on every worker) for a
    failure and stops the rest with SIGTERM, which could land on worker 0 before it printed.
    A worker stopped by SIGTERM, or one whose peers are gone, does not wait."""
    if not joined or _terminated:
        return
    from . import rendezvous

    rendezvous.await_every_worker(GRACE_S)


class Terminated(BaseException):
    """SIGTERM arrived (torchrun stopping the workers): a BaseException, so that no ``except
    Exception`` swallows it and the command unwinds."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def plan_workers(nproc: int, input_bytes: Callable[[int], int], cores: int, remote: bool) -> tuple[int, str | None]:
    """How many of ``--nproc N``'s workers to start, and why not N (None when N).

    Workers pay where each has the cores it keeps busy (on an object store, where they wait on the
    network, every one does) and where the time they save, the one process's time over the input
    less its share of it, is more than their start costs. ``input_bytes(enough)`` counts the
    input's bytes, and may stop once they reach ``enough``."""
    fit = nproc if remote else min(nproc, cores // CORES_PER_WORKER)
    if fit <= 1:
        return 1, f"this machine has {cores} cores, and a worker on local files keeps {CORES_PER_WORKER} busy"
    speed = RATE["object store" if remote else "local"]
    pays_from = START_S * speed * fit / (fit - 1)
    have = input_bytes(int(pays_from))
    if have < pays_from:
        where = f"at {speed / 1e6:.0f} MB/s {'from an object store' if remote else 'on local files'}"
        return 1, (f"{_gb(have)} of input does not pay for starting {fit} workers (about {START_S:g} s; "
                   f"{where}, splitting pays from {_gb(pays_from)})")
    if fit < nproc:
        return fit, f"this machine has {cores} cores, and a worker on local files keeps {CORES_PER_WORKER} busy"
    return nproc, None


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def workers_for(nproc: int, src: str, dst: str | None, storage_options: dict | None = None) -> tuple[int, str | None]:
    """:func:`plan_workers` for a command reading ``src`` (and writing ``dst``) on this machine;
    ``CKPTTOOL_SPLIT=always`` starts ``nproc`` whatever the work. An input that cannot be sized (it
    is missing, say) runs in one process, with nothing to say: the command's own error follows."""
    from .storage import resolve

    if nproc <= 1 or os.environ.get(ENV_SPLIT) == "always":
        return nproc, None
    try:
        source = resolve(src, storage_options)
        if not source.exists():
            return 1, None
        remote = source.batch_reads or (dst is not None and resolve(dst, storage_options).batch_reads)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return plan_workers(nproc, source.bytes_under, cores, remote)
    except Exception:  # noqa: BLE001 - sizing is advice: the command itself says what is wrong with its input
        return 1, None


def staging_name() -> str | None:
    """The staging name :func:`launch` chose for the output (None under a plain torchrun)."""
    return os.environ.get(ENV_STAGING) or None


def launch(nproc: int, argv: list[str], dst: str | None, storage_options: dict | None = None) -> int:
    """Run ``python -m ckpttool ARGV`` as ``nproc`` workers here and return the command's exit code.

    Worker 0 prints (its report, or the one error every worker agreed on); the others are silent
    unless a worker dies without a word (killed, or crashed before the workers could agree): then
    its last lines of stderr are shown and the exit code is 2. The others are stopped at once when
    one dies, and the output's staging directory, if any, is removed.
    """
    from .storage import resolve, temp_sibling

    staged = None
    if dst is not None:
        loc = resolve(dst, storage_options)
        if loc.local_path is not None:
            staged = temp_sibling(loc)
    with tempfile.TemporaryDirectory(prefix="ckpttool-workers-") as tmp:
        env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), **{ENV_INIT: f"file://{tmp}/store"})
        if staged is not None:
            env[ENV_STAGING] = staged.name
        logs, procs = [], []
        for r in range(nproc):
            log = None if r == 0 else open(os.path.join(tmp, f"worker-{r}.err"), "w+b")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "ckpttool", *argv],
                                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                          stdout=None if r == 0 else subprocess.DEVNULL, stderr=log))
        try:
            codes, first = _wait(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        try:
            if all(c in (0, 1, 2) for c in codes):
                return max(codes)  # the same on every worker, which agreed on the outcome
            dead = first if first is not None else next(r for r, c in enumerate(codes) if c not in (0, 1, 2))
            tail = b""
            if logs[dead] is not None:
                logs[dead].seek(0)
                tail = logs[dead].read()[-2000:]
            how = f"signal {-codes[dead]}" if codes[dead] < 0 else f"exit code {codes[dead]}"
            print(f"ckpttool: error: worker {dead} of {nproc} died ({how}); nothing was written"
                  + (f"\n{tail.decode(errors='replace').rstrip()}" if tail.strip() else ""), file=sys.stderr)
            return 2
        finally:
            for log in logs:
                if log is not None:
                    log.close()
            if staged is not None and staged.exists():
                staged.remove()


def _wait(procs: list[subprocess.Popen]) -> tuple[list[int], int | None]:
    """Wait for every worker; once one has failed, the rest get :data:`GRACE_S` to stop (they do
    at once when the failure was an error all of them agreed on), after one that died by a signal
    none. Returns the exit codes and the first worker that died without reporting (or None)."""
    deadline, first = None, None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes, first  # type: ignore[return-value]
        if first is None:
            first = next((r for r, c in enumerate(codes) if c is not None and c not in (0, 1, 2)), None)
        if deadline is None and (first is not None or any(c not in (None, 0) for c in codes)):
            deadline = time.monotonic() + (0 if first is not None else GRACE_S)
        if deadline is not None and time.monotonic() >= deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [p.wait() for p in procs], first
        time.sleep(0.05)


class SharedProgress:
    """Progress of all the workers, shown by worker 0 (the only one that prints): every worker
    publishes the bytes it has done in the group's key-value store (at most every half second),
    and worker 0 shows their sum against the whole command's bytes, from its own calls and from
    a thread that polls the store while it waits for the others. Without a store to use (a torch
    whose private accessor moved), worker 0 shows its own share."""

    PERIOD_S = 0.5

    def __init__(self, progress: Callable[[int, int, str], None] | None, total: int | None, tag: str):
        import torch.distributed as dist

        from .compat import default_store

        self._progress = progress
        self._total = total or 0
        self._calls_total = total is None  # each call's total is the command's (verify), not a share's
        self._rank, self._workers = dist.get_rank(), dist.get_world_size()
        self._store = default_store()
        self._keys = [f"ckpttool-progress/{tag}/{r}" for r in range(self._workers)]
        self._done = 0
        self._key = ""
        self._sent = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self._rank == 0 and progress is not None and self._store is not None:
            self._thread = threading.Thread(target=self._poll, name="ckpttool-progress", daemon=True)
            self._thread.start()

    def __call__(self, done: int, total: int, key: str) -> None:
        """This worker's own progress (``total``: its share's, or with ``total=None`` given to the
        constructor, the whole command's)."""
        self._done, self._key = done, key
        if self._calls_total:
            self._total = total
        if self._rank != 0:
            now = time.monotonic()
            if self._store is not None and (now - self._sent >= self.PERIOD_S or done >= total or self._calls_total):
                self._store.set(self._keys[self._rank], str(done))
                self._sent = now
        else:
            self._show()

    def _others(self) -> int:
        if self._store is None:
            return 0
        present = [k for k in self._keys[1:] if self._store.check([k])]
        return sum(int(self._store.get(k)) for k in present)

    def _show(self) -> None:
        if self._progress is None:
            return
        with self._lock:
            self._progress(min(self._total, self._done + self._others()), self._total, self._key)

    def _poll(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            try:
                self._show()
            except Exception:  # noqa: BLE001 - the store went away with the group: stop showing
                return

    def close(self, finished: bool) -> None:
        """Stop polling; ``finished`` (every worker done): show the whole command done."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if finished and self._rank == 0 and self._progress is not None:
            self._progress(self._total, self._total, "")
