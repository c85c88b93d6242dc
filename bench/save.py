"""Benchmark: saving from a training loop, sync and async, against the disk and plain torch.

For each size (GB of fp32 params + AdamW exp_avg + exp_avg_sq, 12 bytes per parameter) it trains
the bundled Transformer with FSDP2 on 2 gloo CPU ranks (the canonical loop of
ckpttool/trainer/train.py: forward, loss, backward, grad clipping, AdamW step, loss all-reduce) and
measures, each case in a fresh set of processes with the page cache dropped before it:

  raw write             os.write of a 64 MiB buffer + fsync, the state's bytes (1 stream, and
                        2 streams in parallel, one per rank): the disk's limit
  dcp.save              plain torch.distributed.checkpoint.save of get_state_dict
  ckpttool sync         Checkpointer.save (DCP + manifest + commit record + rename)
  dcp.async_save        plain torch, on a gloo process group of its own (dist.new_group)
  ckpttool async        Checkpointer(async_save=True).save
  ckpttool async loop   (ckpt_async_loop) the same, every few steps of a training loop, as a user's
                        loop runs it: what the saves cost the loop, per save, against the same
                        loop without them (below)

In each save case, every rank builds the model and then:

  1. runs 4 warm-up steps (AdamW state exists after the first); VmHWM is reset after the first,
     and the peak of the other 3 is the memory baseline;
  2. resets VmHWM again, then makes --prior-saves (default 1) untimed saves of step 0, 1, ... with
     the same method, each fully waited (ckpttool: save() then wait(); dcp.async_save: the
     future's result()), to a step/directory of its own: the measured save is then a steady-state
     one (the checkpoint process group exists, ckpttool's staging buffer is reused). With
     --prior-saves 0 the measured save is the processes' first (set-up costs included);
  3. reference window A: --steps steps (default 10), each step's duration recorded;
  4. the measured save: "save() blocks" is how long the call takes;
  5. keeps stepping until the background save is done on every rank, and at least --steps steps:
     each rank adds a "still running" flag to the loss all-reduce of every step (a 2-element SUM
     all-reduce [loss, running]), so all ranks stop after the same step k (FSDP's collectives
     need them to agree). Done means: ckpttool async, its writer thread has committed and ended;
     dcp.async_save, the future is done; sync methods, save() has returned, so k = --steps;
  6. waits (wait()/result(): "wait s", ~0 by now), then reference window B: --steps more steps.

  extra loop time = sum of the k overlapping steps - k x the median step of windows A and B.
  The sync methods overlap nothing: their extra loop time is the measurement's noise floor (it
  can be negative). The commit time runs from the save() call to the durable commit (taken where
  it happens, in the writer thread for async). Peak RSS per rank is VmHWM from before the prior
  saves to the end of window B; "added by save" is that peak minus the warm-up steps' peak, so
  ckpttool's staging copy counts even when a prior save made it. ckpttool's blocking and
  background phases of the measured save are timed by wrapping its internals from this script
  (the library is not changed). Raw writes build their 64 MiB buffers before the clock; the 2
  streams start together behind a barrier and are timed from the first start to the last end.

The loop case (ckpt_async_loop) runs, after the same warm-up, --loop-saves (default 20) pairs of
blocks of --loop-block (default 3) steps: a *save block* starts with an async save() (step i, the
Checkpointer keeps the last 2 steps), a *plain block* has no save, so the loop saves every 2 x
--loop-block steps. Its cost per save is (sum of save blocks - sum of plain blocks) / saves: the
loop with saves against the same loop without them, alternated block by block so that the
machine's drift cancels (the median block difference is printed beside it). A save still running
at the end of its block would move part of its cost into the next plain block: "spilled" counts
those. Reported beside it: save() + fence per save (median, and the worst), the background CPU
seconds per save (this process's CPU minus the training thread's, save blocks against plain
ones), the training thread's extra run-queue wait (waiting for a core), and memory: the staging
buffers' bytes against the rank's state, the peak over all the saves (VmHWM) minus training's own
peak over --steps steps without saves taken after the loop (close() frees the staging buffers:
training's peak grows over the steps by itself, +330 MiB a rank in 120 steps at 1 GB here, so
the peak before the loop, also printed, understates it), and the peak of each pair of blocks
(steady over the saves, or growing?). The ratio's denominator is the sync case's save
of the same run, as everywhere here; --loop-sync (default 2) sync saves at the end of the loop
case give the same processes' own (the "same processes" column).

Each case runs --repeat times, rounds interleaved; one representative run is reported (the median
extra loop time with >= 3 runs, else the faster commit) and every value of a row comes from it;
the JSON keeps each key's value in every run (KEY_all) and all the runs.

    .venv/bin/python bench/save.py --sizes 1 --md docs/bench/save.md --plot docs/img/bench-save.png

Targets (issues "async save" and 29): async save() + fence <= 1% of the sync save's time; what
async saves cost a training loop <= 0.25x of a sync save each (the loop case); sync save >= 0.85x
raw write bandwidth; async adds at most one copy of the rank's state (+5%) to host memory, steadily
over the loop's saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, MiB, add_run_args, bar_labels, best_of, cold_cache, drop_caches, f, failed_row, json_path, machine_brief,
    md_header, md_table, measure_child, now, parser, pattern_buffer, plot_file, print_results, proc_status, raw_write,
    remove, reset_peak_rss, run_header, run_rounds, start_run, table, verdict_md, wait_for_convert, write_json,
    write_markdown,
)
from _dist import add_rank_args, finish_rank, init_rank, measure_ranks, model_dims, n_params, rank_results  # noqa: E402

SCRIPT = os.path.abspath(__file__)
WORLD = 2
WARMUP_STEPS = 4  # before anything is measured; AdamW state exists after the first
METHODS = {
    "dcp_save": "plain dcp.save",
    "ckpt_sync": "ckpttool sync save",
    "dcp_async": "plain dcp.async_save (own gloo group)",
    "ckpt_async": "ckpttool async save",
}
SYNC_METHODS = ("dcp_save", "ckpt_sync")  # done when save() returns: their extra loop time is the noise floor
#: the loop case: what async saves every few steps cost a training loop, against the same loop without saves
LOOP = "ckpt_async_loop"
LOOP_LABEL = "ckpttool async save in a loop"


# --- the rank body ----------------------------------------------------------------------------------


#: the timeline's name for the training thread's waits for a background copy (Stager.fence)
FENCE = "fence: optimizer step waits for the copy (Stager.fence)"
#: Checkpointer.on_phase's names -> the labels of this benchmark's timeline (its JSON and the page)
PHASE_LABELS = {"state": "get_state_dict (training_state)", "stage": "stage copy into host buffers (Stager.stage)",
                "fence": FENCE, "prepare": "join the last save, lease, step dir, agreement (prepare)", "write": "write this rank's part (write_rank)",
                "commit": "commit (wait for indexes, .metadata, record, rename)", "sync save": "sync save (all)",
                "wait": "wait()"}


class Timeline:
    """(name, start, end, thread) of wrapped calls, relative to a t0 set by the caller."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, float, float, str]] = []
        self.lock = threading.Lock()

    def wrap(self, name: str, fn):
        depth = threading.local()

        def timed(*a, **k):
            outer = getattr(depth, "n", 0) == 0  # recursive functions (_stage): the outermost call only
            depth.n = getattr(depth, "n", 0) + 1
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                e = time.perf_counter()
                depth.n -= 1
                if outer:
                    with self.lock:
                        self.events.append((name, s - self.t0, e - self.t0, threading.current_thread().name))

        return timed

    def record(self, name: str, start: float, end: float) -> None:
        """One phase that ended, in the calling thread (a Checkpointer's on_phase callback)."""
        with self.lock:
            self.events.append((name, start - self.t0, end - self.t0, threading.current_thread().name))

    def rows(self) -> list[list[Any]]:
        return [[n, round(s, 4), round(e, 4), round(e - s, 4), t] for n, s, e, t in sorted(self.events, key=lambda x: x[1])]


def rank_case(args) -> None:
    """One rank of a save case: the training loop around the measured save (steps 1-6 above)."""
    rank, world = init_rank(args)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpttool import Checkpointer
    from ckpttool.trainer.model import ModelConfig, build_fsdp_model, local_batch
    from _dist import make_mesh, state_nbytes

    method, root, nsteps, nprior = args._case, args._root, args.steps, args.prior_saves
    config = ModelConfig(**json.loads(args._cfg))
    mesh = make_mesh(str(world))
    tb = time.perf_counter()
    model = build_fsdp_model(config, mesh, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    build_s = time.perf_counter() - tb
    criterion = nn.CrossEntropyLoss()
    batch = args.batch_size
    counter = iter(range(1 << 30))  # the training step number (the batch), across all phases

    def train_step(running=None) -> tuple[float, int]:
        """One step of the loop; returns its duration and how many ranks' saves were still running
        at its loss all-reduce (``running()`` is this rank's flag, piggybacked on the all-reduce:
        the ranks agree on when to stop stepping, as FSDP's collectives need)."""
        t = time.perf_counter()
        x, y = local_batch(next(counter), rank, world, batch, config, 0)
        loss = criterion(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        g = torch.stack([loss.detach().float(), torch.tensor(1.0 if running is not None and running() else 0.0)])
        dist.all_reduce(g)  # SUM: [loss of every rank, ranks whose save is still running]
        _loss_sum, still = g.tolist()
        return time.perf_counter() - t, int(round(still))

    train_step()  # warm-up 1 of WARMUP_STEPS: AdamW state exists after the first step
    msd, osd = get_state_dict(model, optimizer)
    rank_bytes = state_nbytes({"model": msd, "optim": osd})
    del msd, osd

    tl = Timeline()
    ck = None
    pg = None
    done_at: list[float] = []
    if method == "dcp_async":
        pg = dist.new_group(backend="gloo")  # set-up, as a job would do once
    if method.startswith("ckpt_"):
        # Where ckpttool's time goes: its phases, as its on_phase seam reports them (main thread:
        # blocking; writer thread: background); "done" is the moment the writer thread finished
        # (rank 0: committed).
        def on_phase(name: str, start: float, end: float) -> None:
            if name == "done":
                done_at.append(end)
            else:
                tl.record(PHASE_LABELS[name], start, end)

        # the loop case keeps 2 steps: its saves would fill the disk otherwise
        ck = Checkpointer(root, async_save=(method in ("ckpt_async", LOOP)), on_phase=on_phase,
                          keep_last=2 if method == LOOP else None,
                          **({"writer_nice": args.writer_nice} if args.writer_nice is not None else {}))

    def dcp_dir(step: int) -> str:
        return os.path.join(root, f"dcp-step-{step}")

    def start_save(step: int):
        """Start a save of ``step`` with this case's method; returns dcp.async_save's future or None."""
        extra = {"step": step, "note": "bench/save.py"}
        if method == "dcp_save":
            msd, osd = get_state_dict(model, optimizer)
            dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=dcp_dir(step))
            del msd, osd
            done_at.append(time.perf_counter())
        elif method == "ckpt_sync":
            ck.save(step, model, optimizer, extra=extra)
            done_at.append(time.perf_counter())
        elif method == "dcp_async":
            msd, osd = get_state_dict(model, optimizer)
            fut = dcp.async_save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=dcp_dir(step), process_group=pg)
            fut.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
            del msd, osd
            return fut
        elif method == "ckpt_async":
            ck.save(step, model, optimizer, extra=extra)
        else:
            raise SystemExit(f"unknown method {method}")
        return None

    # the memory baseline: the peak of training steps before any save (the rest of the warm-up)
    dist.barrier()
    rss_base0 = reset_peak_rss()
    for _ in range(WARMUP_STEPS - 1):
        train_step()
    base_hwm = proc_status("VmHWM") or 0
    if method == LOOP:
        doc = loop_case(args, ck, model, optimizer, train_step, tl)
        ck.close()
        finish_rank(args, {**doc, "ok": True, "method": method, "build_s": build_s, "rank_state_bytes": rank_bytes,
                           "rss_base0_kib": rss_base0, "base_hwm_kib": base_hwm, "torch": torch.__version__})
        return

    # from here on, the peak includes the prior saves: ckpttool's staging copy, made by the first
    # async save and reused by the next, counts as memory added by saving
    dist.barrier()
    rss_save0 = reset_peak_rss()
    prior_s = []
    for step in range(nprior):  # untimed, fully waited: the measured save is a steady-state one
        dist.barrier()
        tp = time.perf_counter()
        fut = start_save(step)
        if fut is not None:
            fut.result()
        if ck is not None:
            ck.wait()
        prior_s.append(time.perf_counter() - tp)

    dist.barrier()
    win_a = [train_step()[0] for _ in range(nsteps)]  # reference window A

    spy = None
    if os.environ.get("CKB_PYSPY") and method in os.environ.get("CKB_PYSPY_CASES", method).split(","):
        # diagnosis only (--pyspy): sample this rank's threads from the save call on
        import subprocess

        spy = subprocess.Popen([os.environ["CKB_PYSPY"], "record", "-p", str(os.getpid()), "--threads", "--idle", "-r", "200",
                                "-f", "raw", "-o", f"{os.environ['CKB_PYSPY_OUT']}/{method}-rank{rank}.txt", "-d", "120"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    dist.barrier()
    done_at.clear()
    tl.events.clear()  # the timeline is the measured save's
    tl.t0 = t0 = time.perf_counter()
    fut = start_save(nprior)  # the measured save
    t1 = time.perf_counter()

    def running() -> bool:
        if method == "ckpt_async":
            return ck.saving
        if method == "dcp_async":
            return not fut.done()
        return False  # sync: the save is done when save() returns

    overlap: list[float] = []  # the steps that overlap the background save (at least nsteps)
    while True:
        d, still = train_step(running)
        overlap.append(d)
        if still == 0 and len(overlap) >= nsteps:
            break
    t2 = time.perf_counter()
    if fut is not None:
        fut.result()
    if ck is not None:
        ck.wait()
    t3 = time.perf_counter()
    win_b = [train_step()[0] for _ in range(nsteps)]  # reference window B: after the commit
    dist.barrier()
    save_hwm = proc_status("VmHWM") or 0
    if spy is not None:
        import signal

        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        spy.wait(timeout=60)
    if ck is not None:
        ck.close()
    if pg is not None:
        dist.destroy_process_group(pg)
    ref = statistics.median(win_a + win_b)
    k = len(overlap)
    commit_s = (max(done_at) if done_at else t3) - t0
    finish_rank(args, {
        "ok": True, "method": method, "build_s": build_s, "rank_state_bytes": rank_bytes, "prior_saves": nprior,
        "prior_save_s": prior_s, "blocking_s": t1 - t0, "ref_step_s": ref, "k_steps": k, "overlap_s": sum(overlap),
        "extra_s": sum(overlap) - k * ref, "wait_s": t3 - t2, "commit_s": commit_s,
        "fence_s": sum(e - st for name, st, e, _ in tl.events if name == FENCE and st >= t1 - t0),
        "win_a_steps": win_a, "overlap_steps": overlap, "win_b_steps": win_b,
        "rss_base0_kib": rss_base0, "base_hwm_kib": base_hwm, "rss_save0_kib": rss_save0, "save_hwm_kib": save_hwm,
        "timeline": tl.rows(), "torch": torch.__version__,
    })


def loop_case(args, ck, model, optimizer, train_step, tl: Timeline) -> dict[str, Any]:
    """The loop case's body on one rank (after the warm-up): what async saves cost a training loop.

    The loop saves every 2k steps (k = --loop-block): a *save block* is a save() and the k steps
    after it, a *plain block* the k steps after those. The cost of a save to the loop is the time
    of the save blocks minus that of the plain blocks, per save: the loop with saves against the
    same loop without them, alternated block by block so that the machine's drift cancels. A
    save still running at the end of its block (``spilled``) would move part of its cost into the
    plain block that follows; each save block is long enough that none should. Memory: the peak
    over all the saves (the first one allocates the staging buffers) minus the training-only peak,
    and the RSS after each plain block (steady, or growing?). CPU: this process's CPU seconds in
    each block, and the training thread's own; their difference, save blocks against plain ones,
    is what the save's background threads took. At the end, --loop-sync sync saves of the same
    processes give the ratio's denominator measured alongside."""
    import torch.distributed as dist

    from _common import proc_status, reset_peak_rss

    k, n = args.loop_block, args.loop_saves
    # the memory baseline: the peak of --steps training steps without a save, right before the
    # loop (the warm-up's 3 steps saw less than training's own peak: the sync case's "added" of
    # +300 MiB with no staging at all was that)
    dist.barrier()
    reset_peak_rss()
    for _ in range(args.steps):
        train_step()
    base_hwm = proc_status("VmHWM") or 0
    save_blocks, plain_blocks, blocks_s, fences, spilled, rss_kib, pair_hwm = [], [], [], [], [], [], []

    def block(save_step: int | None) -> dict[str, float]:
        w, p, t, q = time.perf_counter(), time.process_time(), time.thread_time(), run_delay()
        blocking = None
        if save_step is not None:
            ck.save(save_step, model, optimizer, extra={"step": save_step, "note": "bench/save.py loop"})
            blocking = time.perf_counter() - w
        still = 0
        for _ in range(k):
            _d, still = train_step((lambda: ck.saving) if save_step is not None else None)
        if save_step is not None:
            spilled.append(still)
        return {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - p, "main_cpu_s": time.thread_time() - t,
                "main_runq_s": run_delay() - q, "blocking_s": blocking}

    for i in range(n):
        tl.events.clear()
        reset_peak_rss()  # the peak of each pair of blocks: steady over the saves, or growing?
        save_blocks.append(block(i))
        fences.append(sum(e - s for name, s, e, _ in tl.events if name == FENCE))
        save_blocks[-1]["phases_s"] = {name: e - s for name, s, e, thread in tl.events if thread == "MainThread" and name != FENCE}
        plain_blocks.append(block(None))
        rss_kib.append(proc_status("VmRSS") or 0)
        pair_hwm.append(proc_status("VmHWM") or 0)
    tw = time.perf_counter()
    ck.wait()
    wait_s = time.perf_counter() - tw
    hwm = max(pair_hwm + [proc_status("VmHWM") or 0])
    views = [b for b in ck.staging.buffers.values()]
    staging_bytes = sum({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in views}.values())
    # training's own peak after as many steps as the loop made: its peak grows over the steps
    # without any save (+330 MiB a rank over 120 steps at 1 GB here), so the peak before the loop
    # understates it. close() frees the staging buffers (one mapping: returned at once).
    del views
    ck.close()
    dist.barrier()
    reset_peak_rss()
    for _ in range(args.steps):
        train_step()
    after_hwm = proc_status("VmHWM") or 0
    sync_s = []
    for j in range(args.loop_sync):  # the denominator, in the same processes: a sync save, waited by every rank
        dist.barrier()
        ts = time.perf_counter()
        ck.save(n + j, model, optimizer, extra={"step": n + j}, blocking=True)
        dist.barrier()
        sync_s.append(time.perf_counter() - ts)
    blocks_s = [(s["wall_s"], p["wall_s"]) for s, p in zip(save_blocks, plain_blocks)]
    cost = sum(s - p for s, p in blocks_s) / n
    bg_cpu = sum((s["cpu_s"] - s["main_cpu_s"]) - (p["cpu_s"] - p["main_cpu_s"]) for s, p in zip(save_blocks, plain_blocks)) / n
    return {
        "loop_saves": n, "loop_block": k, "save_blocks": save_blocks, "plain_blocks": plain_blocks,
        "loop_cost_s": cost, "loop_cost_median_s": statistics.median(s - p for s, p in blocks_s),
        "plain_block_s": statistics.median(p for _s, p in blocks_s),
        "blocking_s": statistics.median(s["blocking_s"] for s in save_blocks),
        "fence_s": statistics.median(fences), "stall_all_s": [s["blocking_s"] + fc for s, fc in zip(save_blocks, fences)],
        "bg_cpu_s": bg_cpu, "main_cpu_extra_s": sum(s["main_cpu_s"] - p["main_cpu_s"] for s, p in zip(save_blocks, plain_blocks)) / n,
        "main_runq_extra_s": sum(s["main_runq_s"] - p["main_runq_s"] for s, p in zip(save_blocks, plain_blocks)) / n,
        "spilled": sum(1 for x in spilled if x), "rss_after_kib": rss_kib, "pair_hwm_kib": pair_hwm, "save_hwm_kib": hwm,
        "loop_base_hwm_kib": base_hwm, "loop_after_hwm_kib": after_hwm, "staging_bytes": staging_bytes, "wait_s": wait_s,
        "sync_in_loop_s": sync_s, "timeline": tl.rows(),
    }


def run_delay() -> float:
    """Seconds the calling thread has waited for a CPU (its run queue delay, Linux schedstat); 0 elsewhere."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def raw_case(dst: str, nbytes: int, streams: int) -> dict[str, Any]:
    """Raw write of ``nbytes``: the buffers are built before the clock; 2 streams start together
    (a barrier) and their time is the span from the first start to the last end of the writes."""
    rss0 = reset_peak_rss()
    bufs = [pattern_buffer() for _ in range(streams)]
    if streams == 1:
        out = raw_write(dst, nbytes, buf=bufs[0])
        seconds = out["seconds"]
    else:
        outs: list[dict[str, float] | None] = [None] * streams
        parts = [nbytes // streams + (1 if i < nbytes % streams else 0) for i in range(streams)]
        start = threading.Barrier(streams)

        def write(i: int) -> None:
            outs[i] = raw_write(f"{dst}.{i}", parts[i], buf=bufs[i], start=start)

        ths = [threading.Thread(target=write, args=(i,)) for i in range(streams)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        if any(o is None for o in outs):
            raise SystemExit("a raw write stream failed")
        seconds = max(o["t_end"] for o in outs) - min(o["t_start"] for o in outs)
        out = {"parts": outs}
    for i in range(streams):
        remove(f"{dst}.{i}")
    remove(dst)
    return {"ok": True, "seconds": seconds, "raw": out, "rss0_kib": rss0}


# --- the parent ----------------------------------------------------------------------------------


def summarise(name: str, run) -> dict[str, Any]:
    """One run of a case: a raw write's own result; the slowest rank's times of a save case, the
    highest peak of its ranks, rank 0's phases and step times."""
    if name.startswith("raw"):
        r = dict(run.result)
        r.update(ok=run.rc == 0 and "seconds" in r, peak_kib=run.peak_kib, process_wall_s=run.wall_s)
        if r["ok"]:
            r["commit_s"] = r["seconds"]
        return r
    ranks = rank_results(name, run)
    if ranks is None:
        return {"ok": False, "rc": run.rc}
    mx = lambda k: max(x[k] for x in ranks)  # noqa: E731
    if name == LOOP:
        # over training's own peak after the loop (the same number of steps: see loop_case)
        added = [(x["save_hwm_kib"] - max(x["loop_base_hwm_kib"], x.get("loop_after_hwm_kib", 0))) for x in ranks]
        added_before = [(x["save_hwm_kib"] - x["loop_base_hwm_kib"]) for x in ranks]
        keep = ("loop_saves", "loop_block", "plain_block_s", "spilled", "sync_in_loop_s", "save_blocks", "plain_blocks")
        return {"ok": True, **{key: ranks[0][key] for key in keep},
                # the blocks end at the same all-reduce on every rank: the slowest rank's figures
                "loop_cost_s": mx("loop_cost_s"), "loop_cost_median_s": mx("loop_cost_median_s"), "blocking_s": mx("blocking_s"),
                "fence_s": mx("fence_s"), "stall_max_s": max(max(x["stall_all_s"]) for x in ranks), "bg_cpu_s": mx("bg_cpu_s"),
                "main_cpu_extra_s": mx("main_cpu_extra_s"), "main_runq_extra_s": mx("main_runq_extra_s"), "wait_s": mx("wait_s"), "rank_state_bytes": mx("rank_state_bytes"),
                "added_kib": max(added), "added_per_rank_kib": added, "added_over_first_peak_kib": max(added_before), "rank_peak_kib": max(x["save_hwm_kib"] for x in ranks),
                "rss_after_kib_per_rank": [x["rss_after_kib"] for x in ranks], "pair_hwm_kib_per_rank": [x["pair_hwm_kib"] for x in ranks],
                "loop_base_hwm_kib_per_rank": [x["loop_base_hwm_kib"] for x in ranks], "staging_bytes": mx("staging_bytes"),
                "loop_after_hwm_kib_per_rank": [x.get("loop_after_hwm_kib") for x in ranks],
                "tree_peak_kib": run.peak_kib, "process_wall_s": run.wall_s, "timeline_rank0": ranks[0].get("timeline", []),
                "torch": ranks[0].get("torch")}
    added = [(x["save_hwm_kib"] - x["base_hwm_kib"]) for x in ranks]
    return {
        "ok": True, "prior_saves": ranks[0]["prior_saves"], "prior_save_s": [max(v) for v in zip(*(x["prior_save_s"] for x in ranks))],
        "blocking_s": mx("blocking_s"), "fence_s": mx("fence_s"), "ref_step_s": mx("ref_step_s"),
        "k_steps": mx("k_steps"), "overlap_s": mx("overlap_s"), "extra_s": mx("extra_s"),
        "extra_per_rank_s": [x["extra_s"] for x in ranks], "wait_s": mx("wait_s"), "commit_s": mx("commit_s"),
        "rank_state_bytes": mx("rank_state_bytes"), "rank_peak_kib": max(x["save_hwm_kib"] for x in ranks),
        "rank_base_peak_kib": max(x["base_hwm_kib"] for x in ranks), "added_kib": max(added),
        "added_per_rank_kib": added, "tree_peak_kib": run.peak_kib, "process_wall_s": run.wall_s,
        "build_s": mx("build_s"), "timeline_rank0": ranks[0].get("timeline", []),
        "timeline_rank1": ranks[1].get("timeline", []) if len(ranks) > 1 else [],
        "win_a_steps_rank0": ranks[0]["win_a_steps"], "overlap_steps_rank0": ranks[0]["overlap_steps"],
        "win_b_steps_rank0": ranks[0]["win_b_steps"], "torch": ranks[0].get("torch"),
    }


def pick_run(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """The representative run of a case: with >= 3 runs the one with the median extra loop time
    (the lower median for an even count), else the one with the faster commit (raw cases: always)."""
    if all(r.get("loop_cost_s") is not None for r in ok):  # the loop case: the (lower) median loop cost
        return sorted(ok, key=lambda r: r["loop_cost_s"])[(len(ok) - 1) // 2]
    with_extra = [r for r in ok if r.get("extra_s") is not None]
    if len(with_extra) >= 3:
        return sorted(with_extra, key=lambda r: r["extra_s"])[(len(with_extra) - 1) // 2]
    return min(ok, key=lambda r: r["commit_s"])


def measure(name: str, args, work: str, cfg: dict[str, int], nbytes: int, cold: bool) -> dict[str, Any]:
    """One run of a case in fresh processes, the page cache dropped before it (unless warm)."""
    dropped = drop_caches() if cold else False
    if name.startswith("raw"):
        streams = 2 if name == "raw_write_2" else 1
        run = measure_child(SCRIPT, ["--_raw", os.path.join(work, "raw.bin"), str(nbytes), str(streams)], work, name,
                            timeout_s=args.case_timeout)
    else:
        root = os.path.join(work, name)
        remove(root)
        run = measure_ranks(SCRIPT, WORLD, ["--_case", name, "--_root", root, "--_cfg", json.dumps(cfg),
                                            "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                                            "--prior-saves", str(args.prior_saves), "--loop-saves", str(args.loop_saves),
                                            "--loop-block", str(args.loop_block), "--loop-sync", str(args.loop_sync),
                                            *(["--writer-nice", str(args.writer_nice)] if args.writer_nice is not None else [])],
                            work, name, timeout_s=args.case_timeout)
        remove(root)
    r = summarise(name, run)
    r["cache_dropped"] = dropped
    return r


def derive(size: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of a size's table (ratios to the raw write, the sync save and plain torch) and the
    verdict on each target."""
    cases, nbytes = size["cases"], size["state_bytes"]
    raw1, raw2 = cases.get("raw_write_1", {}), cases.get("raw_write_2", {})
    raw_s = min((x["commit_s"] for x in (raw1, raw2) if x.get("ok")), default=None)  # None: no raw case ran
    sync = cases.get("ckpt_sync", {})
    sync_s = sync.get("commit_s") if sync.get("ok") else None
    plain_of = {"ckpt_sync": "dcp_save", "ckpt_async": "dcp_async"}
    rows = []
    for name, label in [("raw_write_1", "raw write, 1 stream (os.write+fsync)"), ("raw_write_2", "raw write, 2 streams in parallel")] + list(METHODS.items()):
        if name not in cases:
            continue
        c = cases[name]
        if not c.get("ok"):
            rows.append({"case": name, "label": label, "failed": True})
            continue
        plain = cases.get(plain_of.get(name, ""), {})
        row = {"case": name, "label": label, "commit_s": c["commit_s"], "gbps": nbytes / c["commit_s"] / GB,
               "bw_vs_raw": raw_s / c["commit_s"] if raw_s else None,
               "commit_vs_plain": (c["commit_s"] / plain["commit_s"]) if plain.get("ok") else None,
               "peak_mib": (c.get("rank_peak_kib") or c.get("peak_kib") or 0) / 1024,
               "tree_peak_mib": (c.get("tree_peak_kib") or c.get("peak_kib") or 0) / 1024, "runs": c.get("runs"),
               "picked": c.get("picked")}
        if not name.startswith("raw"):
            fence = (c.get("fence_s") or 0.0) if name.startswith("ckpt") else None  # ckpttool's Stager only
            stall = c["blocking_s"] + (fence or 0.0)  # save() plus the fence
            row.update(blocking_s=c["blocking_s"], fence_s=fence, stall_s=stall,
                       stall_pct_sync=100 * stall / sync_s if sync_s else None, ref_step_s=c["ref_step_s"], k_steps=c["k_steps"], overlap_s=c["overlap_s"],
                       extra_s=c["extra_s"], wait_s=c["wait_s"], noise_floor=name in SYNC_METHODS,
                       blocking_pct_sync=100 * c["blocking_s"] / sync_s if sync_s else None,
                       extra_pct_sync=100 * c["extra_s"] / sync_s if sync_s else None,
                       added_mib=c["added_kib"] / 1024, rank_state_mib=c["rank_state_bytes"] / MiB,
                       added_x_state=c["added_kib"] * 1024 / c["rank_state_bytes"],
                       blocking_vs_plain=(c["blocking_s"] / plain["blocking_s"]) if plain.get("ok") else None,
                       extra_s_all=c.get("extra_s_all"))
        rows.append(row)
    checks = []
    tag = f"@ {nbytes / GB:.2f} GB"
    by = {r["case"]: r for r in rows if not r.get("failed")}
    a, s = by.get("ckpt_async"), by.get("ckpt_sync")
    if a and s:
        checks.append({"target": "async save() plus the fence block <= 1% of sync save", "case": f"ckpttool async {tag}",
                       "value": f"{a['blocking_s']:.3f} + {a['fence_s']:.3f} s = {a['stall_pct_sync']:.2f}% of {s['commit_s']:.2f} s",
                       "pass": a["stall_pct_sync"] <= 1})
        checks.append({"target": "extra loop time during the save (reported with its noise floor)", "case": f"ckpttool async {tag}",
                       "value": f"{a['extra_s']:+.2f} s over {a['k_steps']} steps = {a['extra_pct_sync']:.0f}% of {s['commit_s']:.2f} s "
                                f"(noise floor, sync: {s['extra_s']:+.2f} s)",
                       "pass": None})
        checks.append({"target": "async adds <= 1 copy of the rank's state (+5%)", "case": f"ckpttool async {tag}",
                       "value": f"+{a['added_mib']:.0f} MiB = {a['added_x_state']:.2f}x of {a['rank_state_mib']:.0f} MiB",
                       "pass": a["added_x_state"] <= 1.05})
    loop = cases.get(LOOP, {})
    if loop.get("ok"):
        row, loop_checks = derive_loop(loop, sync_s)
        rows.append(row)
        checks.extend(loop_checks)
    elif LOOP in cases:
        rows.append({"case": LOOP, "label": LOOP_LABEL, "failed": True})
    if s and s.get("bw_vs_raw") is not None:
        checks.append({"target": "sync save bandwidth >= 0.85x raw write", "case": f"ckpttool sync {tag}",
                       "value": f"{s['gbps']:.2f} GB/s = {s['bw_vs_raw']:.2f}x", "pass": s["bw_vs_raw"] >= 0.85})
    return rows, checks


def derive_loop(c: dict[str, Any], sync_case_s: float | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The loop case's row and its verdicts. The denominator is the sync case's save of this run
    (as every other ratio here), else the sync saves the loop case made at its end."""
    in_loop = statistics.median(c["sync_in_loop_s"]) if c.get("sync_in_loop_s") else None
    sync_s = sync_case_s or in_loop
    n = c["loop_saves"]
    stall = c["blocking_s"] + c["fence_s"]
    rss = [kib / 1024 for kib in c["rss_after_kib_per_rank"][0]]
    # the peak of each pair of blocks over the baseline, on the rank that added most; the first
    # pair's includes the staging buffers' first allocation
    worst = max(range(len(c["added_per_rank_kib"])), key=lambda r: c["added_per_rank_kib"][r])
    pairs = [(kib - c["loop_base_hwm_kib_per_rank"][worst]) / 1024 for kib in c["pair_hwm_kib_per_rank"][worst]]
    half = max(1, len(pairs[1:]) // 2)
    drift = statistics.mean(pairs[-half:]) - statistics.mean(pairs[1:1 + half]) if len(pairs) > 2 else None
    row = {"case": LOOP, "label": LOOP_LABEL, "loop": True, "saves": n, "block": c["loop_block"], "plain_block_s": c["plain_block_s"],
           "loop_cost_s": c["loop_cost_s"], "loop_cost_median_s": c["loop_cost_median_s"], "sync_s": sync_s, "sync_in_loop_s": in_loop,
           "cost_x_sync": c["loop_cost_s"] / sync_s if sync_s else None,
           "cost_x_sync_in_loop": c["loop_cost_s"] / in_loop if in_loop else None,
           "blocking_s": c["blocking_s"], "fence_s": c["fence_s"], "stall_s": stall, "stall_max_s": c["stall_max_s"],
           "stall_pct_sync": 100 * stall / sync_s if sync_s else None, "bg_cpu_s": c["bg_cpu_s"], "spilled": c["spilled"],
           "added_mib": c["added_kib"] / 1024, "rank_state_mib": c["rank_state_bytes"] / MiB,
           "added_x_state": c["added_kib"] * 1024 / c["rank_state_bytes"], "rss_first_mib": rss[0] if rss else None,
           "added_first_mib": c.get("added_over_first_peak_kib", c["added_kib"]) / 1024,
           "rss_last_mib": rss[-1] if rss else None, "rss_spread_mib": (max(rss) - min(rss)) if rss else None,
           "pair_added_mib": pairs, "pair_drift_mib": drift, "staging_mib": c["staging_bytes"] / MiB,
           "staging_x_state": c["staging_bytes"] / c["rank_state_bytes"],
           "peak_mib": c["rank_peak_kib"] / 1024, "runs": c.get("runs"), "picked": c.get("picked")}
    tag = f"every {2 * c['loop_block']} steps, {n} saves"
    checks = []
    if sync_s:
        checks.append({"target": "async saves cost the loop <= 0.25x of a sync save each", "case": f"{LOOP_LABEL}, {tag}",
                       "value": f"{c['loop_cost_s']:+.2f} s per save = {row['cost_x_sync']:.2f}x of {sync_s:.2f} s "
                                f"(median block {c['loop_cost_median_s']:+.2f} s; background CPU {c['bg_cpu_s']:.2f} s/save)",
                       "pass": row["cost_x_sync"] <= 0.25})
        checks.append({"target": "async save() plus the fence block <= 1% of sync save (median of the loop's saves)",
                       "case": f"{LOOP_LABEL}, {tag}",
                       "value": f"{c['blocking_s']:.3f} + {c['fence_s']:.3f} s = {row['stall_pct_sync']:.2f}% of {sync_s:.2f} s "
                                f"(worst {c['stall_max_s']:.3f} s)",
                       "pass": row["stall_pct_sync"] <= 1})
    drift = "" if row["pair_drift_mib"] is None else f", peak per save {row['pair_drift_mib']:+.0f} MiB from the first to the second half"
    checks.append({"target": "async adds <= 1 copy of the rank's state (+5%), over all the loop's saves", "case": f"{LOOP_LABEL}, {tag}",
                   "value": f"+{row['added_mib']:.0f} MiB = {row['added_x_state']:.2f}x of {row['rank_state_mib']:.0f} MiB over "
                            f"training's own peak after the loop (over its peak before: +{row['added_first_mib']:.0f} MiB); "
                            f"staging buffers {row['staging_x_state']:.3f}x{drift}",
                   "pass": row["added_x_state"] <= 1.05})
    return row, checks


def measured_save(prior_saves: int) -> str:
    """What the measured save was, in words (printed with every table)."""
    if prior_saves <= 0:
        return "the measured save is the first save of the processes (--prior-saves 0: set-up costs included)"
    return (f"the measured save follows {prior_saves} untimed, fully waited prior save{'s' if prior_saves > 1 else ''} of the same "
            "method (steady state: process groups exist, ckpttool's staging buffer is reused)")


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    """A size's results table."""
    head = ["case", "save() blocks s", "fence s", "loop: ref ms/step × steps during save", "extra loop s (sync: noise floor)", "commit s",
            "GB/s", "BW / raw", "commit × plain", "blocks % of sync", "extra % of sync", "peak RSS/rank MiB",
            "added by save MiB (× rank state)"]
    lines = []
    for r in rows:
        if r["case"] == LOOP:
            continue
        if r.get("failed"):
            lines.append(failed_row(head, r["label"]))
            continue
        if r["case"].startswith("raw"):
            lines.append([r["label"], "–", "–", "–", "–", f(r["commit_s"]), f(r["gbps"]), f(r["bw_vs_raw"]), "–", "–", "–", f(r["peak_mib"], ".0f"), "–"])
            continue
        extra = f(r["extra_s"], "+.2f") + (" (noise)" if r.get("noise_floor") else "")
        lines.append([r["label"], f(r["blocking_s"], ".3f"), f(r["fence_s"], ".3f"), f"{1000 * r['ref_step_s']:.0f} × {r['k_steps']}", extra,
                      f(r["commit_s"]), f(r["gbps"]), f(r["bw_vs_raw"]), f(r["commit_vs_plain"]), f(r["blocking_pct_sync"], ".1f"),
                      f(r["extra_pct_sync"], ".0f"), f(r["peak_mib"], ".0f"), f"+{r['added_mib']:.0f} ({r['added_x_state']:.2f}x)"])
    text = table(head, lines, markdown)
    loop = [r for r in rows if r["case"] == LOOP]
    if loop:
        text += "\n\n" + render_loop(loop[0], markdown)
    return text


def render_loop(r: dict[str, Any], markdown: bool) -> str:
    """The loop case's table: what saving every few steps cost the loop, per save."""
    head = ["case", "saves", "save every", "plain block s", "loop cost per save s (median block)", "× sync save",
            "× sync save (same processes)", "background CPU s per save", "save() + fence s (worst)", "% of sync", "spilled",
            "added MiB (× rank state)", "staging buffers × state", "peak per save: drift MiB"]
    if r.get("failed"):
        return table(head, [failed_row(head, r["label"])], markdown)
    line = [r["label"], str(r["saves"]), f"{2 * r['block']} steps", f(r["plain_block_s"]),
            f"{r['loop_cost_s']:+.2f} ({r['loop_cost_median_s']:+.2f})", f(r["cost_x_sync"]), f(r["cost_x_sync_in_loop"]),
            f(r["bg_cpu_s"]), f"{r['stall_s']:.3f} ({r['stall_max_s']:.3f})", f(r["stall_pct_sync"]), str(r["spilled"]),
            f"+{r['added_mib']:.0f} ({r['added_x_state']:.2f}x)", f(r["staging_x_state"], ".3f"), f(r["pair_drift_mib"], "+.0f")]
    return table(head, [line], markdown)


def breakdown(results: dict[str, Any]) -> str:
    """ckpttool's phases of the measured save (rank 0, representative run): where the blocking and the background time go."""
    out = []
    for size in results["sizes"]:
        for name in ("ckpt_sync", "ckpt_async"):
            c = size["cases"].get(name, {})
            if not c.get("ok"):
                continue
            out.append(f"\n{METHODS[name]} @ {size['state_bytes'] / GB:.2f} GB, rank 0 (seconds from the save() call):\n")
            out.append(md_table(["phase", "start", "end", "duration", "thread"], [[str(x) for x in row] for row in c["timeline_rank0"]],
                                left=(0, 4)))
            out.append("")
    return "\n".join(out)


def draw(plt, results: dict[str, Any]):
    """The plot of the largest size: what each save costs the loop (left) and memory per rank (right)."""
    if not results["sizes"]:
        return "no results: no plot"
    size = results["sizes"][-1]
    rows = [r for r in size.get("rows", []) if not r.get("failed")]
    saves = [r for r in rows if not r["case"].startswith("raw") and r["case"] != LOOP]
    if not saves:
        return "no save case succeeded: no plot"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    y = range(len(saves))
    ax1.barh([i - 0.27 for i in y], [r["blocking_s"] for r in saves], height=0.25, label="save() blocks", color="#d62728")
    ax1.barh(list(y), [r["extra_s"] for r in saves], height=0.25, color="#ff7f0e",
             label="extra loop time while the save runs (sync rows: noise floor; may be < 0)")
    ax1.barh([i + 0.27 for i in y], [r["commit_s"] for r in saves], height=0.25, label="time to durable commit", color="#1f77b4")
    raws = [r["commit_s"] for r in rows if r["case"].startswith("raw")]
    if raws:
        ax1.axvline(min(raws), color="grey", ls=":", label=f"raw write + fsync ({min(raws):.2f} s)")
    ax1.axvline(0, color="k", lw=0.6)
    prior = results.get("prior_saves", 0)
    ax1.set_title(f"{size['state_bytes'] / GB:.2f} GB state on {WORLD} ranks: what a save costs the loop "
                  f"({'after %d prior save(s)' % prior if prior else 'first save'})", fontsize=9)
    ax2.barh(list(y), [r["peak_mib"] for r in saves], color="#1f77b4", label="peak RSS per rank")
    ax2.barh(list(y), [r["added_mib"] for r in saves], color="#ff7f0e", label="added by saving (over training steps without)")
    st = saves[0]["rank_state_mib"]
    ax2.axvline(st, color="r", ls="-.", label=f"one copy of the rank's state ({st:.0f} MiB)")
    ax2.set_title("memory per rank", fontsize=9)
    for ax, unit in ((ax1, "seconds"), (ax2, "MiB")):
        bar_labels(ax, [r["label"] for r in saves])
        ax.set_xlabel(unit)
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    return fig, f"ckpttool save vs disk and plain torch {results.get('torch', '')}: {machine_brief(results)}"


def progress(name: str, r: dict[str, Any], nbytes: int) -> str:
    """The line printed after each run of a case."""
    if name == LOOP:
        return (f"{name:<12} loop cost {r['loop_cost_s']:+.2f} s/save (median block {r['loop_cost_median_s']:+.2f} s, "
                f"plain block {r['plain_block_s']:.2f} s) over {r['loop_saves']} saves, background CPU {r['bg_cpu_s']:.2f} s/save, "
                f"blocks {r['blocking_s']:.3f} + fence {r['fence_s']:.3f} s, sync in loop {statistics.median(r['sync_in_loop_s']):.2f} s, "
                f"spilled {r['spilled']}, added +{r['added_kib'] / 1024:.0f} MiB/rank of {r['rank_state_bytes'] / MiB:.0f}")
    extra = "" if name.startswith("raw") else (
        f"  blocks {r['blocking_s']:.3f} s  loop {r['extra_s']:+.2f} s over {r['k_steps']} steps"
        f" (ref {1000 * r['ref_step_s']:.0f} ms/step)  wait {r['wait_s']:.2f} s"
        f"  added +{r['added_kib'] / 1024:.0f} MiB/rank of {r['rank_state_bytes'] / MiB:.0f}")
    return f"{name:<12} commit {r['commit_s']:7.2f} s {nbytes / r['commit_s'] / GB:6.2f} GB/s{extra}"


def markdown(results: dict[str, Any], args) -> str:
    """The results file: the method, each size's table and verdicts, where ckpttool's time goes."""
    out = [md_header("Benchmark: save from the training loop (sync and async)", results),
           f"Method: {results['measured_save']}; {WARMUP_STEPS} warm-up steps; reference windows of {args.steps} steps "
           f"before the save and after its commit; extra loop time = time of the k steps that overlap the save "
           f"(k >= {args.steps}) - k × the median step of the reference windows; one representative run per case "
           f"of {args.repeat}.\n\n"]
    for size in results["sizes"]:
        out.append(f"### {size['state_bytes'] / GB:.2f} GB of state ({size['params'] / 1e6:.1f}M params), {WORLD} ranks\n\n")
        out.append(render(size["rows"], markdown=True) + "\n\n" + verdict_md(size["checks"]) + "\n\n")
    out.append("### Where ckpttool's time goes\n" + breakdown(results) + "\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sizes", default="1", help="state sizes in GB, comma-separated (default 1)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each case, rounds interleaved; one representative run is "
                   "reported: the median extra loop time with >= 3 runs, else the faster commit (default 2)")
    p.add_argument("--steps", type=int, default=10, help="steps of each reference window, and the least number of steps "
                   "counted as overlapping the save (default 10)")
    p.add_argument("--prior-saves", type=int, default=1, help="untimed, fully waited saves of the same method before the "
                   "measured one, so it is a steady-state save (default 1; 0: measure the first save)")
    p.add_argument("--batch-size", type=int, default=2, help="global batch size (default 2; seq_len 32)")
    p.add_argument("--cases", default=f"raw_write_1,raw_write_2,dcp_save,ckpt_sync,dcp_async,ckpt_async,{LOOP}")
    p.add_argument("--loop-saves", type=int, default=20, help=f"{LOOP}: async saves in the loop (default 20)")
    p.add_argument("--loop-block", type=int, default=3, help=f"{LOOP}: steps of a save block and of a plain block; the "
                   "loop saves every 2x this many steps (default 3)")
    p.add_argument("--loop-sizes", default="smallest", help=f"sizes (GB, comma-separated) at which {LOOP} runs, or "
                   "'smallest' (default: the smallest of --sizes; the case takes 2 x --loop-block x --loop-saves steps)")
    p.add_argument("--writer-nice", type=int, default=None, help="ckpttool cases: Checkpointer(writer_nice=N), the "
                   "background writer's nice value (default: the library's, the training thread's priority)")
    p.add_argument("--loop-sync", type=int, default=2, help=f"{LOOP}: sync saves at the end, in the same processes (default 2)")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a running bench/convert.py")
    add_run_args(p, "save", "/tmp/ckpttool-bench-save")
    p.add_argument("--pyspy", metavar="DIR", help="diagnosis: sample every rank with py-spy (raw stacks into DIR); "
                   "slows the ranks down, so its timings are not results")
    p.add_argument("--pyspy-bin", default="py-spy")
    add_rank_args(p, "--_case", "--_root", "--_cfg")
    p.add_argument("--_raw", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prior_saves < 0 or args.steps < 1:
        p.error("--prior-saves must be >= 0 and --steps >= 1")
    if args.loop_saves < 1 or args.loop_block < 1 or args.loop_sync < 0:
        p.error("--loop-saves and --loop-block must be >= 1, --loop-sync >= 0")

    if args._raw:
        write_json(args._result, raw_case(args._raw[0], int(args._raw[1]), int(args._raw[2])))
        return 0
    if args._rank is not None:
        rank_case(args)
        return 0

    if args.pyspy:
        os.makedirs(args.pyspy, exist_ok=True)
        os.environ.update(CKB_PYSPY=args.pyspy_bin, CKB_PYSPY_OUT=os.path.abspath(args.pyspy),
                          CKB_PYSPY_CASES=",".join(c for c in args.cases.split(",") if not c.startswith("raw")))
    out_dir, work, machine = start_run(args.out_dir)
    cold = cold_cache(args.warm)
    results: dict[str, Any] = {
        **run_header(SCRIPT, argv, machine), "cold": cold, "repeat": args.repeat,
        "world": WORLD, "steps": args.steps, "warmup_steps": WARMUP_STEPS, "prior_saves": args.prior_saves,
        "measured_save": measured_save(args.prior_saves), "batch_size": args.batch_size, "sizes": [],
    }
    out_json = json_path(args, out_dir, "save")
    print(measured_save(args.prior_saves), flush=True)
    names = [c for c in args.cases.split(",") if c]
    sizes = [float(s) for s in args.sizes.split(",") if s]
    loop_sizes = [min(sizes)] if args.loop_sizes == "smallest" and sizes else [float(s) for s in args.loop_sizes.split(",") if s]
    for size_gb in sizes:
        cfg = model_dims(size_gb)
        params = n_params(cfg)
        nbytes = 12 * params + 4 * (5 + 16 * cfg["n_layers"])  # + AdamW's 0-d step counters
        print(f"\n== {size_gb:g} GB: {cfg}, {params / 1e6:.1f}M params, {nbytes / GB:.2f} GB of state", flush=True)
        wait_for_convert(size_gb, args.no_wait)
        here = [n for n in names if n != LOOP or size_gb in loop_sizes]
        runs = run_rounds(args.repeat, here, lambda n: measure(n, args, work, cfg, nbytes, cold),
                          lambda n, r: progress(n, r, nbytes))
        cases = {n: best_of(rs, ["commit_s", "blocking_s", "extra_s", "k_steps", "ref_step_s", "overlap_s", "wait_s", "loop_cost_s",
                                 "bg_cpu_s"],
                            ["rank_peak_kib", "added_kib", "tree_peak_kib", "peak_kib"], pick=pick_run) for n, rs in runs.items()}
        size = {"size_gb": size_gb, "cfg": cfg, "params": params, "state_bytes": nbytes, "cases": cases, "all_runs": runs}
        results["sizes"].append(size)
        write_json(out_json, results)  # the runs are safe before anything is derived from them
        size["rows"], size["checks"] = derive(size)
        write_json(out_json, results)
    results["torch"] = next((r.get("torch") for s in results["sizes"] for r in s["cases"].values() if r.get("torch")), None)
    results["finished"] = now()
    write_json(out_json, results)
    for size in results["sizes"]:
        print_results(render(size["rows"], markdown=False), size["checks"],
                      f"{size['state_bytes'] / GB:.2f} GB state ({size['params'] / 1e6:.1f}M params), {WORLD} ranks; "
                      f"{measured_save(results['prior_saves'])}")
    print(breakdown(results))
    print(f"\nresults: {out_json}")
    write_markdown(args.md, markdown(results, args))
    if args.plot:
        print(plot_file(args.plot, draw, results))
    remove(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
