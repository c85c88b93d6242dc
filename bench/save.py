"""Benchmark: saving from a training loop, sync and async, against the disk and plain torch.

Each size (GB of fp32 params + AdamW exp_avg + exp_avg_sq, 12 bytes a parameter) trains the bundled Transformer with FSDP2 on 2
gloo CPU ranks (ckpttool/trainer/train.py's loop: forward, loss, backward, grad clipping, AdamW step, loss all-reduce); each case
runs in fresh processes, the page cache dropped before it:

  raw write             os.write of a 64 MiB buffer + fsync, the state's bytes, 1 stream and 2 in parallel (one per rank):
                        the disk's limit
  dcp.save              plain torch.distributed.checkpoint.save of get_state_dict
  ckpttool sync         Checkpointer.save (DCP + manifest + commit record + rename)
  dcp.async_save        plain torch, on a gloo process group of its own (dist.new_group)
  ckpttool async        Checkpointer(async_save=True).save
  ckpttool async loop   (ckpt_async_loop) the same every few steps of a training loop: what the saves cost it

In a save case every rank builds the model, then: 1. 4 warm-up steps (AdamW state exists after the first; the peak of the last 3
is the memory baseline); 2. resets VmHWM and makes --prior-saves (default 1) untimed, fully waited saves of the same method: the
measured save is a steady-state one (process groups exist, ckpttool's staging buffer is reused; 0: the processes' first, set-up
included); 3. reference window A: --steps steps (default 10); 4. the measured save ("save() blocks": the call); 5. steps until
the save is done on every rank, at least --steps (a "still running" flag rides on each step's loss all-reduce: all ranks stop
after the same step k, as FSDP's collectives need; done: ckpttool async, its writer thread committed and ended; dcp.async_save,
its future done; sync methods, save() returned, k = --steps); 6. waits ("wait s", ~0 by now); reference window B: --steps steps.

extra loop time = the k overlapping steps - k x the median step of windows A and B; the sync methods overlap nothing: theirs is
the noise floor (it can be negative). The commit time runs from the save() call to the durable commit (taken where it happens:
the writer thread for async). Peak RSS per rank: VmHWM from before the prior saves to the end of window B; "added by save" is
that minus the warm-up's peak, so ckpttool's staging copy counts even when a prior save made it. ckpttool's phases: its on_phase
callback. Raw writes build their buffers before the clock; 2 streams start together behind a barrier, timed from the first
start to the last end.

The loop case runs, after the warm-up, --loop-saves (default 20) pairs of blocks of --loop-block (default 3) steps: a save block
starts with an async save() (keep_last=2) and ends with its wait() (issue 50's measure; before it, a save could run on
into the next plain block), a plain block has none. Cost per save = (save blocks - plain blocks) / saves: the
loop against itself without saves, alternated so the machine's drift cancels (the median block difference beside it).
"spilled": saves still running after their block's steps (the wait() then takes the rest). The CPU a save takes: the
process CPU seconds (every thread, and with --writer process the writer process's) of a save block minus its plain block, the
median pair, the slower rank; its floor: the
seconds that rank takes to copy its state into ready buffers and hash every byte once (floor_cpu), in the same processes. Also: save() + fence
per save (median, worst), the background CPU per save (process CPU minus the training thread's, save blocks against plain), the
training thread's extra run-queue wait, the staging buffers against the rank's state, the peak over all saves minus training's
own peak over --steps steps after the loop (training's peak grows by itself, +330 MiB a rank in 120 steps at 1 GB: the peak
before the loop, also printed, understates it), and each pair's peak (steady, or growing?). Ratios divide by the sync case's
save; --loop-sync (default 2) sync saves at the end give the same processes' own.

Each case runs --repeat times (default 2), rounds interleaved; one representative run is reported (>= 3 runs: the median extra
loop time or loop cost, else the faster commit), every value of a row from it.

    .venv/bin/python bench/save.py --sizes 1 --md docs/bench/save.md --plot docs/img/bench-save.png

Targets (issues "async save" and 29): async save() + fence <= 1% of the sync save's time; what async saves cost a training loop
<= 0.25x of a sync save each (the loop case); sync save >= 0.85x raw write bandwidth; async adds at most one copy of the rank's
state (+5%) to host memory, steadily over the loop's saves.
"""

import contextlib
import json
import os
import statistics
import threading
import time
from typing import Any

from _common import GB, MiB, drop_caches, pattern_buffer, proc_status, raw_write, remove, reset_peak_rss, timed
from _dist import finish_rank, init_rank, make_mesh, model_dims, n_params, state_nbytes  # (puts the repository on sys.path)
from harness import Chart, Column, Panel, Set, Spec, check, main, md_table, render

WORLD = 2
WARMUP_STEPS = 4  # before anything is measured; AdamW state exists after the first
RAW = {"raw_write_1": "raw write, 1 stream (os.write+fsync)", "raw_write_2": "raw write, 2 streams in parallel"}
METHODS = {"dcp_save": "plain dcp.save", "ckpt_sync": "ckpttool sync save",
           "dcp_async": "plain dcp.async_save (own gloo group)", "ckpt_async": "ckpttool async save"}
SYNC_METHODS = ("dcp_save", "ckpt_sync")  # done when save() returns: their extra loop time is the noise floor
LOOP, LOOP_LABEL = "ckpt_async_loop", "ckpttool async save in a loop"
FENCE = "fence: optimizer step waits for the copy (Stager.fence)"
#: Checkpointer.on_phase's names -> this benchmark's timeline labels (its JSON and the page)
PHASE_LABELS = {"state": "get_state_dict (training_state)", "stage": "stage copy into host buffers (Stager.stage)", "fence": FENCE,
                "prepare": "join the last save, lease, step dir, agreement (prepare)", "write": "write this rank's part (write_rank)",
                "commit": "commit (wait for indexes, .metadata, record, rename)", "sync save": "sync save (all)", "wait": "wait()"}
RANK_OPTS = ("steps", "batch_size", "prior_saves", "loop_saves", "loop_block", "loop_sync", "writer_nice", "writer")
#: a save case's figures taken from the slowest rank (the highest); the rest are rank 0's (each rank's: "ranks")
SLOWEST = ("blocking_s", "fence_s", "ref_step_s", "k_steps", "overlap_s", "extra_s", "wait_s", "commit_s", "rank_state_bytes",
           "build_s", "loop_cost_s", "loop_cost_median_s", "bg_cpu_s", "main_cpu_extra_s", "main_runq_extra_s", "staging_bytes",
           "save_cpu_s", "floor_cpu_s")


def rank_case(args) -> None:
    """One rank of a save case: the training loop around the measured save (steps 1-6 above)."""
    rank, world = init_rank(args)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpttool import Checkpointer
    from ckpttool.training.trainer.model import ModelConfig, build_fsdp_model, local_batch

    method, root, nsteps, config = args._case, args._dst, args.steps, ModelConfig(**json.loads(args._cfg))
    tb = time.perf_counter()
    model = build_fsdp_model(config, make_mesh(str(world)), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    build_s, criterion, counter = time.perf_counter() - tb, torch.nn.CrossEntropyLoss(), iter(range(1 << 30))

    def train_step(running=None) -> tuple[float, int]:
        """One step; its duration and how many ranks' saves were still running at its loss all-reduce (``running()``, this
        rank's flag, rides on it: the ranks agree on when to stop stepping)."""
        t = time.perf_counter()
        x, y = local_batch(next(counter), rank, world, args.batch_size, config, 0)
        loss = criterion(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        g = torch.stack([loss.detach().float(), torch.tensor(1.0 if running is not None and running() else 0.0)])
        dist.all_reduce(g)  # SUM: [loss of every rank, ranks whose save is still running]
        return time.perf_counter() - t, int(round(g.tolist()[1]))

    train_step()  # warm-up 1 of WARMUP_STEPS: AdamW state exists after the first step
    rank_bytes = state_nbytes(get_state_dict(model, optimizer))
    events: list[tuple[str, float, float, str]] = []  # ckpttool's phases (main thread: blocking; writer thread: background)
    done_at: list[float] = []  # when the save was done (ckpttool's "done": its writer thread ended; rank 0: committed)

    def on_phase(name: str, start: float, end: float) -> None:
        if name == "done":
            done_at.append(end)
        else:
            events.append((PHASE_LABELS[name], start, end, threading.current_thread().name))

    ck = pg = fut = None
    if method == "dcp_async":
        pg = dist.new_group(backend="gloo")  # set-up, as a job would do once
    if method.startswith("ckpt_"):  # the loop case keeps 2 steps: its saves would fill the disk otherwise
        ck = Checkpointer(root, async_save=method in ("ckpt_async", LOOP), on_phase=on_phase,
                          keep_last=2 if method == LOOP else None, writer_nice=args.writer_nice, writer=args.writer)
    wait = ck.wait if ck is not None else lambda: fut is not None and fut.result()

    def start_save(step: int) -> None:
        """Start a save of ``step`` with this case's method (dcp.async_save's future: ``fut``)."""
        nonlocal fut
        extra = {"step": step, "note": "bench/save.py"}
        if ck is not None:
            ck.save(step, model, optimizer, extra=extra)
        else:
            msd, osd = get_state_dict(model, optimizer)
            state, dst = {"model": msd, "optim": osd, "extra": extra}, os.path.join(root, f"dcp-step-{step}")
            if method == "dcp_async":
                fut = dcp.async_save(state, checkpoint_id=dst, process_group=pg)
                fut.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
            else:
                dcp.save(state, checkpoint_id=dst)
        if method in SYNC_METHODS:
            done_at.append(time.perf_counter())

    dist.barrier()  # the memory baseline: the peak of training steps before any save (the rest of the warm-up)
    rss_base0 = reset_peak_rss()
    for _ in range(WARMUP_STEPS - 1):
        train_step()
    doc = {"ok": True, "method": method, "build_s": build_s, "rank_state_bytes": rank_bytes, "rss_base0_kib": rss_base0,
           "base_hwm_kib": proc_status("VmHWM") or 0, "torch": torch.__version__}
    if method == LOOP:
        return finish_rank(args, {**doc, **loop_case(args, ck, model, optimizer, train_step, events)})
    # from here on, the peak includes the prior saves: ckpttool's staging copy, made by one and reused, counts as added by saving
    dist.barrier()
    doc.update(rss_save0_kib=reset_peak_rss(), prior_saves=args.prior_saves, prior_save_s=[])
    for step in range(args.prior_saves):  # untimed, fully waited: the measured save is a steady-state one
        dist.barrier()
        tp = time.perf_counter()
        start_save(step)
        wait()
        doc["prior_save_s"].append(time.perf_counter() - tp)
    dist.barrier()
    win_a = [train_step()[0] for _ in range(nsteps)]  # reference window A
    dist.barrier()
    done_at.clear()
    events.clear()  # the timeline is the measured save's
    t0 = time.perf_counter()
    start_save(args.prior_saves)  # the measured save
    t1 = time.perf_counter()
    overlap, still = [], 1  # the steps that overlap the background save (at least nsteps); ranks whose save still runs
    while still or len(overlap) < nsteps:
        d, still = train_step(lambda: ck.saving if method == "ckpt_async" else method == "dcp_async" and not fut.done())
        overlap.append(d)
    t2 = time.perf_counter()
    wait()
    t3 = time.perf_counter()
    win_b = [train_step()[0] for _ in range(nsteps)]  # reference window B: after the commit
    dist.barrier()
    doc["save_hwm_kib"] = proc_status("VmHWM") or 0
    if ck is not None:
        ck.close()
    if pg is not None:
        dist.destroy_process_group(pg)
    ref, k, over = statistics.median(win_a + win_b), len(overlap), sum(overlap)
    finish_rank(args, {**doc, "blocking_s": t1 - t0, "ref_step_s": ref, "k_steps": k, "overlap_s": over, "extra_s": over - k * ref,
                       "wait_s": t3 - t2, "commit_s": (max(done_at) if done_at else t3) - t0, "win_a_steps": win_a,
                       "overlap_steps": overlap, "win_b_steps": win_b, "timeline": timeline(events, t0),
                       "fence_s": sum(e - s for name, s, e, _ in events if name == FENCE and s >= t1)})


def timeline(events: list[tuple[str, float, float, str]], t0: float) -> list[list[Any]]:
    """(phase, start, end, duration, thread) rows, in seconds from ``t0``."""
    return [[n, round(s - t0, 4), round(e - t0, 4), round(e - s, 4), t] for n, s, e, t in sorted(events, key=lambda x: x[1])]


def loop_case(args, ck, model, optimizer, train_step, events: list) -> dict[str, Any]:
    """The loop case on one rank, after the warm-up (see the module's docstring). CPU: this process's and the training
    thread's CPU seconds in each block; their difference, save blocks against plain, is the save's background threads'."""
    import torch.distributed as dist

    def peak_of_steps() -> int:  # training's own peak over --steps steps without a save
        dist.barrier()
        reset_peak_rss()
        for _ in range(args.steps):
            train_step()
        return proc_status("VmHWM") or 0

    # also before the loop (the warm-up's 3 steps saw less: the sync case's "added" of +300 MiB without staging was that)
    k, n, base_hwm = args.loop_block, args.loop_saves, peak_of_steps()
    save_blocks, plain_blocks, fences, spilled, rss_kib, pair_hwm = [], [], [], [], [], []

    def block(save_step: int | None) -> dict[str, Any]:
        w, p, t, q = time.perf_counter(), time.process_time() + children_cpu(), time.thread_time(), run_delay()
        blocking = None
        if save_step is not None:
            ck.save(save_step, model, optimizer, extra={"step": save_step, "note": "bench/save.py loop"})
            blocking = time.perf_counter() - w
        for _ in range(k):
            _d, still = train_step((lambda: ck.saving) if save_step is not None else None)
        if save_step is not None:
            spilled.append(still)
            ck.wait()  # (issue 50's measure: steps that start with an async save and end with its wait())
        return {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() + children_cpu() - p, "main_cpu_s": time.thread_time() - t,
                "main_runq_s": run_delay() - q, "blocking_s": blocking}

    for i in range(n):
        events.clear()
        reset_peak_rss()  # the peak of each pair of blocks: steady over the saves, or growing?
        save_blocks.append(block(i))
        fences.append(sum(e - s for name, s, e, _ in events if name == FENCE))
        save_blocks[-1]["phases_s"] = {name: e - s for name, s, e, thread in events if thread == "MainThread" and name != FENCE}
        plain_blocks.append(block(None))
        rss_kib.append(proc_status("VmRSS") or 0)
        pair_hwm.append(proc_status("VmHWM") or 0)
    wait_s, hwm = timed(ck.wait), max(pair_hwm + [proc_status("VmHWM") or 0])
    staging_bytes = sum({s.data_ptr(): s.nbytes() for s in (b.untyped_storage() for b in ck.staging.buffers.values())}.values())
    floor = floor_cpu(list(ck.staging.buffers.values()))
    ck.close()  # frees the staging buffers (one mapping: at once) before training's own peak after the loop
    after_hwm, sync_s = peak_of_steps(), []
    for j in range(args.loop_sync):  # the denominator, in the same processes: a sync save, waited by every rank
        dist.barrier()
        ts = time.perf_counter()
        ck.save(n + j, model, optimizer, extra={"step": n + j}, blocking=True)
        dist.barrier()
        sync_s.append(time.perf_counter() - ts)
    ck.close()
    pairs, med = list(zip(save_blocks, plain_blocks)), statistics.median
    per_save = lambda fn: sum(fn(s) - fn(p) for s, p in pairs) / n  # noqa: E731
    return {"loop_saves": n, "loop_block": k, "save_blocks": save_blocks, "plain_blocks": plain_blocks,
            "loop_cost_s": per_save(lambda b: b["wall_s"]), "loop_cost_median_s": med(s["wall_s"] - p["wall_s"] for s, p in pairs),
            "plain_block_s": med(p["wall_s"] for p in plain_blocks), "blocking_s": med(s["blocking_s"] for s in save_blocks),
            "fence_s": med(fences), "stall_all_s": [s["blocking_s"] + fc for s, fc in zip(save_blocks, fences)],
            "bg_cpu_s": per_save(lambda b: b["cpu_s"] - b["main_cpu_s"]), "main_cpu_extra_s": per_save(lambda b: b["main_cpu_s"]),
            "save_cpu_s": med(s["cpu_s"] - p["cpu_s"] for s, p in pairs), "floor_cpu_s": floor,
            "main_runq_extra_s": per_save(lambda b: b["main_runq_s"]), "spilled": sum(1 for x in spilled if x), "rss_after_kib": rss_kib,
            "pair_hwm_kib": pair_hwm, "save_hwm_kib": hwm, "loop_base_hwm_kib": base_hwm, "loop_after_hwm_kib": after_hwm,
            "staging_bytes": staging_bytes, "wait_s": wait_s, "sync_in_loop_s": sync_s,
            "timeline": timeline(events, min((e[1] for e in events), default=0.0))}  # the last save's, from its first phase


def floor_cpu(buffers: list, rounds: int = 3) -> float:
    """The floor of what a save's CPU can be (issue 50): the process CPU seconds to copy the rank's state into ready
    buffers and hash every byte once (xxh3 in 64 KiB blocks, as the manifest), on one thread as ckpttool's background
    threads run (background.Worker); the median of ``rounds`` after one untimed round (the ready buffers' pages faulted
    in). The source is the staging buffers: the rank's state, the same bytes at the same size."""
    import torch
    from ckpttool.buffers import tensor_buffer
    from ckpttool.checksums import BlockHasher
    from ckpttool.training.background import Worker

    ready = [torch.empty_like(b) for b in buffers]

    def once() -> None:
        for dst, src in zip(ready, buffers):
            dst.copy_(src)
            hasher = BlockHasher()
            hasher.update(tensor_buffer(dst.reshape(-1).view(torch.uint8)))
            hasher.finish()

    worker, times = Worker("bench-floor"), []
    worker.submit(once).wait()
    for _ in range(rounds):
        start = time.process_time()
        worker.submit(once).wait()
        times.append(time.process_time() - start)
    worker.close()
    return statistics.median(times)


def children_cpu() -> float:
    """CPU seconds of this process's running children so far (a writer process, ``--writer process``: a rank's CPU is
    its own and its writer's), from /proc (10 ms ticks); 0 without children."""
    total = 0
    with contextlib.suppress(OSError):
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                    if int(fields[1]) == os.getpid():
                        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def run_delay() -> float:
    """Seconds the calling thread has waited for a CPU (its run queue delay, Linux schedstat); 0 elsewhere."""
    with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as fh:
        return int(fh.read().split()[1]) / 1e9
    return 0.0


def raw_case(args) -> dict[str, Any]:
    """A raw write of the state's bytes into the directory ``--_dst``, in 1 or 2 streams."""
    from concurrent.futures import ThreadPoolExecutor

    nbytes, streams = int(args._bytes), 2 if args._case == "raw_write_2" else 1
    rss0, bufs, start = reset_peak_rss(), [pattern_buffer() for _ in range(streams)], threading.Barrier(streams)
    os.makedirs(args._dst, exist_ok=True)
    with ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(lambda i: raw_write(os.path.join(args._dst, str(i)), nbytes // streams + (i < nbytes % streams),
                                                 buf=bufs[i], start=start), range(streams)))
    seconds = max(o["t_end"] for o in outs) - min(o["t_start"] for o in outs)
    return {"ok": True, "seconds": seconds, "commit_s": seconds, "raw": outs[0] if streams == 1 else {"parts": outs}, "rss0_kib": rss0}


def measure(run, name: str, info: dict[str, Any]) -> dict[str, Any]:
    """One run of a case in fresh processes, the page cache dropped before it (unless warm). A save case: the slowest rank's
    times (the blocks end at the same all-reduce on every rank), the highest peak."""
    dropped = drop_caches() if run.cold else False
    dst = os.path.join(run.work, name)
    remove(dst)
    argv = ["--_case", name, "--_dst", dst, "--_cfg", json.dumps(info["cfg"]), "--_bytes", str(info["state_bytes"])]
    if name in RAW:
        r, _ = run.child(name, argv)
    else:
        opts = {f"--{k.replace('_', '-')}": getattr(run.args, k) for k in RANK_OPTS}
        ranks, proc = run.ranks(name, WORLD, argv + [x for k, v in opts.items() if v is not None for x in (k, str(v))])
        r = {"ok": False, "rc": proc.rc}
        if ranks is not None:  # added: over the warm-up's peak; the loop case's over training's own peak after the loop
            loop = name == LOOP
            added = [x["save_hwm_kib"] - (max(x["loop_base_hwm_kib"], x["loop_after_hwm_kib"]) if loop else x["base_hwm_kib"])
                     for x in ranks]
            r = {**ranks[0], **{k: max(x[k] for x in ranks) for k in SLOWEST if k in ranks[0]}, "ranks": ranks, "added_kib": max(added),
                 "added_per_rank_kib": added, "rank_peak_kib": max(x["save_hwm_kib"] for x in ranks), "tree_peak_kib": proc.peak_kib,
                 "process_wall_s": proc.wall_s}
            if loop:
                r.update(stall_max_s=max(max(x["stall_all_s"]) for x in ranks),
                         added_over_first_peak_kib=max(x["save_hwm_kib"] - x["loop_base_hwm_kib"] for x in ranks))
            info["torch"] = r["torch"]  # the harness takes a set's torch version from its info
    remove(dst)
    return {**r, "cache_dropped": dropped}


def pick_run(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """The representative run: with >= 3 runs the one with the (lower) median extra loop time, the loop case's the (lower)
    median loop cost, else the one with the faster commit (raw cases: always)."""
    if all(r.get("loop_cost_s") is not None for r in ok):
        return sorted(ok, key=lambda r: r["loop_cost_s"])[(len(ok) - 1) // 2]
    with_extra = [r for r in ok if r.get("extra_s") is not None]
    if len(with_extra) >= 3:
        return sorted(with_extra, key=lambda r: r["extra_s"])[(len(with_extra) - 1) // 2]
    return min(ok, key=lambda r: r["commit_s"])


def progress(name: str, r: dict[str, Any]) -> str:
    """The line printed after each run of a case."""
    keys = ("commit_s", "blocking_s", "fence_s", "extra_s", "k_steps", "wait_s", "loop_cost_s", "loop_cost_median_s", "plain_block_s",
            "bg_cpu_s", "spilled")
    added = f"  added +{r['added_kib'] / 1024:.0f} MiB/rank of {r['rank_state_bytes'] / MiB:.0f}" if "added_kib" in r else ""
    return f"{name:<16} " + "  ".join(f"{k} {round(r[k], 3)}" for k in keys if r.get(k) is not None) + added


def sets(run):
    """One set per size: the raw writes, the save cases and (at --loop-sizes) the loop case."""
    a, every = run.args, [*RAW, *METHODS, LOOP]
    names = [c for c in a.cases.split(",") if c]
    if set(names) - set(every) or a.prior_saves < 0 or a.steps < 1 or a.loop_saves < 1 or a.loop_block < 1 or a.loop_sync < 0:
        raise SystemExit(f"cases are {','.join(every)}; --prior-saves and --loop-sync must be >= 0, --steps, --loop-saves and "
                         "--loop-block >= 1")
    sizes = [float(s) for s in a.sizes.split(",") if s]
    loop_sizes = [min(sizes)] if a.loop_sizes == "smallest" and sizes else [float(s) for s in a.loop_sizes.split(",") if s]
    measured = ("the measured save is the first save of the processes (--prior-saves 0: set-up costs included)" if a.prior_saves <= 0
                else f"the measured save follows {a.prior_saves} untimed, fully waited prior save{'s' if a.prior_saves > 1 else ''} of "
                "the same method (steady state: process groups exist, ckpttool's staging buffer is reused)")
    run.extra.update(world=WORLD, steps=a.steps, warmup_steps=WARMUP_STEPS, prior_saves=a.prior_saves, measured_save=measured,
                     batch_size=a.batch_size)
    print(measured, flush=True)
    for size_gb in sizes:
        cfg = model_dims(size_gb)
        # the state's bytes: 12 per parameter plus AdamW's 0-d step counters
        info = {"size_gb": size_gb, "cfg": cfg, "params": n_params(cfg), "state_bytes": 12 * n_params(cfg) + 4 * (5 + 16 * cfg["n_layers"])}
        yield Set([n for n in names if n != LOOP or size_gb in loop_sizes], lambda n, info=info: measure(run, n, info), progress,
                  pick=pick_run, info=info, tag=f"{size_gb:g}gb",
                  heading=f"{info['state_bytes'] / GB:.2f} GB of state ({info['params'] / 1e6:.1f}M params), {WORLD} ranks",
                  time_keys=["commit_s", "blocking_s", "extra_s", "k_steps", "ref_step_s", "overlap_s", "wait_s", "loop_cost_s",
                             "bg_cpu_s"], peak_keys=["rank_peak_kib", "added_kib", "tree_peak_kib", "peak_kib"])


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows (ratios to the raw write, the sync save, plain torch) and verdicts; the loop case's row: ``res["loop"]``."""
    cases, nbytes = res["cases"], res["checkpoint"]["state_bytes"]
    ok = {n: c for n, c in cases.items() if c.get("ok")}
    raw_s = min((ok[n]["commit_s"] for n in RAW if n in ok), default=None)  # None: no raw case ran
    sync_s = ok.get("ckpt_sync", {}).get("commit_s")
    pct = lambda x: 100 * x / sync_s if sync_s else None  # noqa: E731
    rows = []
    for name, label in [(n, lb) for n, lb in {**RAW, **METHODS}.items() if n in cases]:
        c, plain = ok.get(name), ok.get({"ckpt_sync": "dcp_save", "ckpt_async": "dcp_async"}.get(name, ""))
        rows.append({"case": name, "label": label, "failed": True} if c is None else {
            "case": name, "label": label, "commit_s": c["commit_s"], "gbps": nbytes / c["commit_s"] / GB,
            "bw_vs_raw": raw_s / c["commit_s"] if raw_s else None, "commit_vs_plain": c["commit_s"] / plain["commit_s"] if plain else None,
            "peak_mib": (c.get("rank_peak_kib") or c.get("peak_kib") or 0) / 1024})
        if c is not None and name in METHODS:
            fence = c["fence_s"] if name.startswith("ckpt") else None  # ckpttool's Stager only
            stall = c["blocking_s"] + (fence or 0.0)  # save() plus the fence
            rows[-1].update({k: c[k] for k in ("blocking_s", "ref_step_s", "k_steps", "overlap_s", "extra_s", "wait_s")}, fence_s=fence,
                            stall_s=stall, stall_pct_sync=pct(stall), blocking_pct_sync=pct(c["blocking_s"]),
                            extra_pct_sync=pct(c["extra_s"]), noise_floor=name in SYNC_METHODS, added_mib=c["added_kib"] / 1024,
                            rank_state_mib=c["rank_state_bytes"] / MiB, added_x_state=c["added_kib"] * 1024 / c["rank_state_bytes"],
                            blocking_vs_plain=c["blocking_s"] / plain["blocking_s"] if plain else None)
    checks, at = [], f"@ {nbytes / GB:.2f} GB"
    by = {r["case"]: r for r in rows if not r.get("failed")}
    a, s = by.get("ckpt_async"), by.get("ckpt_sync")
    if a and s:
        checks += [check("async save() plus the fence block <= 1% of sync save", f"ckpttool async {at}",
                         f"{a['blocking_s']:.3f} + {a['fence_s']:.3f} s = {a['stall_pct_sync']:.2f}% of {s['commit_s']:.2f} s",
                         a["stall_pct_sync"] <= 1),
                   check("extra loop time during the save (reported with its noise floor)", f"ckpttool async {at}",
                         f"{a['extra_s']:+.2f} s over {a['k_steps']} steps = {a['extra_pct_sync']:.0f}% of {s['commit_s']:.2f} s "
                         f"(noise floor, sync: {s['extra_s']:+.2f} s)", None),
                   check("async adds <= 1 copy of the rank's state (+5%)", f"ckpttool async {at}",
                         f"+{a['added_mib']:.0f} MiB = {a['added_x_state']:.2f}x of {a['rank_state_mib']:.0f} MiB",
                         a["added_x_state"] <= 1.05)]
    if LOOP in cases:
        failed = ({"case": LOOP, "label": LOOP_LABEL, "failed": True}, [])
        res["loop"], loop_checks = derive_loop(ok[LOOP], sync_s) if LOOP in ok else failed
        checks += loop_checks
    if s and s["bw_vs_raw"] is not None:
        checks.append(check("sync save bandwidth >= 0.85x raw write", f"ckpttool sync {at}",
                            f"{s['gbps']:.2f} GB/s = {s['bw_vs_raw']:.2f}x", s["bw_vs_raw"] >= 0.85))
    return rows, checks


def derive_loop(c: dict[str, Any], sync_case_s: float | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The loop case's row and verdicts; the denominator: this run's sync case (as every ratio here), else the loop's sync saves."""
    in_loop = statistics.median(c["sync_in_loop_s"]) if c.get("sync_in_loop_s") else None
    sync_s, n, stall = sync_case_s or in_loop, c["loop_saves"], c["blocking_s"] + c["fence_s"]
    rss = [kib / 1024 for kib in c["rss_after_kib"]]
    # the peak of each pair of blocks over the baseline, on the rank that added most (the first pair's includes the staging
    # buffers' first allocation): steady, or growing from the first half to the second?
    worst = c["ranks"][max(range(len(c["ranks"])), key=lambda i: c["added_per_rank_kib"][i])]
    pairs = [(kib - worst["loop_base_hwm_kib"]) / 1024 for kib in worst["pair_hwm_kib"]]
    half = max(1, len(pairs[1:]) // 2)
    drift = statistics.mean(pairs[-half:]) - statistics.mean(pairs[1:1 + half]) if len(pairs) > 2 else None
    row = {"case": LOOP, "label": LOOP_LABEL, "saves": n, "block": c["loop_block"], "sync_s": sync_s, "sync_in_loop_s": in_loop,
           **{k: c[k] for k in ("plain_block_s", "loop_cost_s", "loop_cost_median_s", "blocking_s", "fence_s", "stall_max_s", "bg_cpu_s",
                                "spilled", "save_cpu_s", "floor_cpu_s")},
           "cpu_x_floor": c["save_cpu_s"] / c["floor_cpu_s"] if c.get("floor_cpu_s") else None,
           "cost_x_sync": c["loop_cost_s"] / sync_s if sync_s else None,
           "cost_x_sync_in_loop": c["loop_cost_s"] / in_loop if in_loop else None, "stall_s": stall,
           "stall_pct_sync": 100 * stall / sync_s if sync_s else None, "added_mib": c["added_kib"] / 1024,
           "rank_state_mib": c["rank_state_bytes"] / MiB, "added_x_state": c["added_kib"] * 1024 / c["rank_state_bytes"],
           "added_first_mib": c["added_over_first_peak_kib"] / 1024, "rss_first_mib": rss[0] if rss else None,
           "rss_last_mib": rss[-1] if rss else None, "rss_spread_mib": (max(rss) - min(rss)) if rss else None, "pair_added_mib": pairs,
           "pair_drift_mib": drift, "staging_mib": c["staging_bytes"] / MiB, "staging_x_state": c["staging_bytes"] / c["rank_state_bytes"],
           "peak_mib": c["rank_peak_kib"] / 1024}
    case, checks = f"{LOOP_LABEL}, every {2 * c['loop_block']} steps, {n} saves", []
    if sync_s:
        checks += [check("async saves cost the loop <= 0.25x of a sync save each", case,
                         f"{c['loop_cost_s']:+.2f} s per save = {row['cost_x_sync']:.2f}x of {sync_s:.2f} s (median block "
                         f"{c['loop_cost_median_s']:+.2f} s; background CPU {c['bg_cpu_s']:.2f} s/save)", row["cost_x_sync"] <= 0.25),
                   check("async save() plus the fence block <= 1% of sync save (median of the loop's saves)", case,
                         f"{c['blocking_s']:.3f} + {c['fence_s']:.3f} s = {row['stall_pct_sync']:.2f}% of {sync_s:.2f} s "
                         f"(worst {c['stall_max_s']:.3f} s)", row["stall_pct_sync"] <= 1)]
    if row["cpu_x_floor"] is not None:
        checks.append(check("the CPU a save takes from training <= 1.3x the floor (copy into ready buffers + hash every byte once)",
                            case, f"{c['save_cpu_s']:.3f} s per save (median pair, slower rank, every thread) = "
                                  f"{row['cpu_x_floor']:.2f}x of {c['floor_cpu_s']:.3f} s", row["cpu_x_floor"] <= 1.3))
    more = "" if drift is None else f", peak per save {drift:+.0f} MiB from the first to the second half"
    return row, checks + [check("async adds <= 1 copy of the rank's state (+5%), over all the loop's saves", case,
                                f"+{row['added_mib']:.0f} MiB = {row['added_x_state']:.2f}x of {row['rank_state_mib']:.0f} MiB over "
                                f"training's own peak after the loop (over its peak before: +{row['added_first_mib']:.0f} MiB); "
                                f"staging buffers {row['staging_x_state']:.3f}x{more}", row["added_x_state"] <= 1.05)]


def epilogue(results: dict[str, Any]) -> str:
    """The method, each size's loop case table, and where ckpttool's time goes: the measured save's phases (rank 0, its run)."""
    steps, sets_ = results.get("steps"), results["sets"]
    out = [f"Method: {results.get('measured_save')}; {WARMUP_STEPS} warm-up steps; reference windows of {steps} steps before the save "
           f"and after its commit; extra loop time = time of the k steps that overlap the save (k >= {steps}) - k × the median step of "
           f"the reference windows; one representative run per case of {results.get('repeat')}."]
    out += [f"### {r['heading']}: {LOOP_LABEL}\n\n" + render(LOOP_COLUMNS, [r["loop"]], markdown=True) for r in sets_ if r.get("loop")]
    out += ["### Where ckpttool's time goes"] + [
        f"{METHODS[name]} @ {r['checkpoint']['state_bytes'] / GB:.2f} GB, rank 0 (seconds from the save() call):\n\n"
        + md_table(["phase", "start", "end", "duration", "thread"], [[str(x) for x in row] for row in r["cases"][name]["timeline"]],
                   left=(0, 4)) for r in sets_ for name in ("ckpt_sync", "ckpt_async") if r["cases"].get(name, {}).get("ok")]
    return "\n\n".join(out) + "\n"


def added(r: dict[str, Any]) -> str | None:
    return f"+{r['added_mib']:.0f} ({r['added_x_state']:.2f}x)" if "added_mib" in r else None


LOOP_COLUMNS = [
    Column("case", "label", None), Column("saves", "saves", "d"), Column("save every", lambda r: f"{2 * r['block']} steps", ""),
    Column("plain block s", "plain_block_s"),
    Column("loop cost per save s (median block)", lambda r: f"{r['loop_cost_s']:+.2f} ({r['loop_cost_median_s']:+.2f})", ""),
    Column("× sync save", "cost_x_sync"), Column("× sync save (same processes)", "cost_x_sync_in_loop"),
    Column("background CPU s per save", "bg_cpu_s"), Column("CPU s per save (× floor)", lambda r: (
        f"{r['save_cpu_s']:.3f} ({r['cpu_x_floor']:.2f}x of {r['floor_cpu_s']:.3f})" if r.get("cpu_x_floor") else None), ""),
    Column("save() + fence s (worst)", lambda r: f"{r['stall_s']:.3f} ({r['stall_max_s']:.3f})", ""), Column("% of sync", "stall_pct_sync"),
    Column("spilled", "spilled", "d"), Column("added MiB (× rank state)", added, ""),
    Column("staging buffers × state", "staging_x_state", ".3f"), Column("peak per save: drift MiB", "pair_drift_mib", "+.0f")]

SPEC = Spec(
    "save", "Benchmark: save from the training loop (sync and async)", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--sizes": dict(default="1", help="state sizes in GB, comma-separated (default 1)"),
             "--steps": dict(type=int, default=10, help="steps of a reference window, the least overlapping the save (default 10)"),
             "--prior-saves": dict(type=int, default=1, help="untimed, waited saves before the measured one (default 1; 0: none)"),
             "--batch-size": dict(type=int, default=2, help="global batch size (default 2; seq_len 32)"),
             "--cases": dict(default=",".join([*RAW, *METHODS, LOOP]), help="the cases, comma-separated (default: all)"),
             "--loop-saves": dict(type=int, default=20, help=f"{LOOP}: async saves in the loop (default 20)"),
             "--loop-block": dict(type=int, default=3, help=f"{LOOP}: steps of a save block and of a plain block (default 3)"),
             "--loop-sizes": dict(default="smallest", help=f"sizes (GB, comma-separated) at which {LOOP} runs, or 'smallest' (default)"),
             "--writer-nice": dict(type=int, help="ckpttool cases: Checkpointer(writer_nice=N) (default: the training thread's)"),
             "--writer": dict(default="thread", choices=["thread", "process"],
                              help="ckpttool cases: Checkpointer(writer=...) (default thread; process: the CPU of a save counts the writer process's)"),
             "--loop-sync": dict(type=int, default=2, help=f"{LOOP}: sync saves at the end, in the same processes (default 2)")},
    columns=[Column("case", "label", None), Column("save() blocks s", "blocking_s", ".3f"), Column("fence s", "fence_s", ".3f"),
             Column("loop: ref ms/step × steps during save",
                    lambda r: f"{1000 * r['ref_step_s']:.0f} × {r['k_steps']}" if "k_steps" in r else None, ""),
             Column("extra loop s (sync: noise floor)",
                    lambda r: f"{r['extra_s']:+.2f}{' (noise)' * r['noise_floor']}" if "extra_s" in r else None, ""),
             Column("commit s", "commit_s"), Column("GB/s", "gbps"), Column("BW / raw", "bw_vs_raw"),
             Column("commit × plain", "commit_vs_plain"), Column("blocks % of sync", "blocking_pct_sync", ".1f"),
             Column("extra % of sync", "extra_pct_sync", ".0f"), Column("peak RSS/rank MiB", "peak_mib", ".0f"),
             Column("added by save MiB (× rank state)", added, "")],
    chart=Chart([Panel("blocking_s", "seconds (the sync rows' extra loop time is the noise floor; may be < 0)", also="extra_s",
                       legend=("save() blocks", "extra loop time while the save runs")),
                 Panel("commit_s", "seconds to durable commit", limit_label="raw write + fsync (the faster)",
                       limit=lambda res: min((r["commit_s"] for r in res["rows"] if r["case"] in RAW and "commit_s" in r), default=None)),
                 Panel("peak_mib", "MiB per rank", also="added_mib",
                       legend=("peak RSS per rank", "added by saving (over training steps without)"),
                       limit=lambda res: next((r["rank_state_mib"] for r in res["rows"] if r.get("rank_state_mib")), None),
                       limit_label="one copy of the rank's state")],
                title=lambda res: (f"save {res['checkpoint']['state_bytes'] / GB:.2f} GB state on {WORLD} ranks: what a save costs the "
                                   f"loop ({f'after {n} prior save(s)' if (n := res['options']['prior_saves']) else 'first save'})")),
    child=raw_case, rank=rank_case, hidden=("--_bytes",), flags=("warm",), epilogue=epilogue)

main(SPEC, __name__)
