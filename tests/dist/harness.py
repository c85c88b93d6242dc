"""Run a function on W real gloo ranks (CPU processes) and collect what each returns.

Processes are forked from a forkserver that has torch imported already (fast to start); ranks meet
on 127.0.0.1 through a file rendezvous in a temp dir the parent made; a hung rank fails its test
after ``timeout`` seconds instead of hanging the suite, and a failed rank's traceback is in the error.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

_CTX = mp.get_context("forkserver")
# (transformers: the pretrained-load tests' ranks build its models; an import error here is ignored)
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint", "ckpttool", "transformers"])


class RankFailed(AssertionError):
    pass


def _child(fn: Callable, rank: int, world_size: int, rdzv: str, args: tuple, kwargs: dict, out: Any, env: dict | None = None) -> None:
    os.environ.update(env or {})
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS="1")
    import faulthandler

    import torch
    import torch.distributed as dist

    # a rank killed by a signal (SIGSEGV in a library) leaves every thread's Python stack here, for the error
    fault = open(f"{rdzv}.fault{rank}", "w")
    faulthandler.enable(fault, all_threads=True)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors in a queue would travel as shared-memory handles
        out.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180, env: dict | None = None, **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` on ranks 0..W-1 of a gloo group; returns each rank's result by rank.
    ``env`` is set in each rank before ``fn`` runs."""
    with tempfile.TemporaryDirectory(prefix="ckpttool-rdzv-") as tmp:
        procs, out = spawn_ranks(fn, world_size, tmp, *args, env=env, **kwargs)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(results) - set(errors))
                    raise RankFailed(f"ranks {missing} of {world_size} gave no result within {timeout:.0f} s (hung?)"
                                     + "".join(f"\n--- rank {r} failed:\n{tb}" for r, tb in errors.items()))
                try:
                    rank, status, payload = out.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results and r not in errors]
                    if dead:
                        # give the queue a moment: a rank may have reported just before exiting
                        time.sleep(0.5)
                        if out.empty():
                            raise RankFailed(f"rank(s) {dead} died with exit codes {[procs[r].exitcode for r in dead]}"
                                             + "".join(f"\n--- rank {r} failed:\n{tb}" for r, tb in errors.items())
                                             + "".join(_fault(tmp, r) for r in dead))
                    continue
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors[rank] = payload
                if errors and status == "error":
                    # other ranks may now wait forever in a collective: give them a short grace period
                    deadline = min(deadline, time.monotonic() + 20)
            if errors:
                raise RankFailed("".join(f"\n--- rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
            return [results[r] for r in range(world_size)]
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)


def _fault(rdzv_dir: str, rank: int) -> str:
    """What faulthandler wrote for a rank that died of a signal (its threads' stacks), if anything."""
    try:
        with open(os.path.join(rdzv_dir, f"rdzv.fault{rank}")) as fh:
            text = fh.read().strip()
    except OSError:
        return ""
    return f"\n--- rank {rank} died here:\n{text}" if text else ""


def spawn_ranks(fn: Callable, world_size: int, rdzv_dir: str, *args: Any, env: dict | None = None, **kwargs: Any):
    """Start W ranks running ``fn`` and return (processes, queue) without waiting: for tests that
    kill ranks (kill -9) at a chosen moment."""
    out = _CTX.Queue()
    procs = [
        _CTX.Process(target=_child, args=(fn, r, world_size, os.path.join(rdzv_dir, "rdzv"), args, kwargs, out, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs, out


def wait_then_kill(procs: list, ready: Callable[[], bool], timeout: float = 120, what: str = "ranks never got ready",
                   out: Any = None) -> None:
    """Poll until ``ready()`` while every rank is still alive, then kill -9 all of them and reap
    them. A rank that ended first fails the test with what it reported on ``out``."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what
        if not all(p.exitcode is None for p in procs):
            reports = []
            while out is not None:
                try:
                    rank, kind, payload = out.get(timeout=2)
                except queue.Empty:
                    break
                reports.append(f"rank {rank} {kind}: {payload if kind == 'error' else ''}")
            raise AssertionError(f"a rank ended early: exit codes {[p.exitcode for p in procs]}\n" + "\n".join(reports))
        time.sleep(0.05)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(10)
