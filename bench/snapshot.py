"""Benchmark: what issue 35's promises cost — the writer's CPU per save with health on and off, and the training thread's
time while the write guard is on its stack.

Health. One process writes one rank's part of a step (``write_rank``, the function an async save's writer thread runs) for
the trainer's model with AdamW state, about --size-gb GB, alternately with the health check (NaN/Inf counted in every record
as it is written, the records' digests kept and compared with the previous save) and without it, --rounds times each (on,
off; then off, on; ...). Each write goes to a fresh directory on the disk and is removed after. Reported: the writing
thread's CPU seconds per save (``getrusage(RUSAGE_THREAD)``; min / median / max) and the wall time, and the ratio of the
medians. The CPU a health check spends is also timed alone (``count_nonfinite`` over every tensor, best of 3), beside xxh3
of the same bytes: the pass the writer makes anyway.

Write guard. From save() until the next optimizer step a TorchDispatchMode sits on the saving thread's stack
(``snapshot.py``): every op of that step's forward and backward passes through it. Measured: the median forward + backward
of the trainer's model (presets --guard-presets, one process, one thread) with no guard, with the guard watching a copy in
flight (every writing op looks up the storages it writes), and with the guard on the stack after the copy is done.

    .venv/bin/python bench/snapshot.py --size-gb 1 --rounds 15 --json docs/bench/snapshot.json --md docs/bench/snapshot.md

Target (issue 35): health adds at most 10% to the writer's CPU per save.
"""

import argparse
import dataclasses
import itertools
import os
import resource
import shutil
import statistics
import tempfile
import time

import torch
import xxhash

from _common import timed
from harness import Chart, Column, Panel, Set, Spec, check, main, md_table  # before ckpttool: it puts this repository on sys.path

from ckpttool.training import snapshot
from ckpttool.training.step_writer import write_rank
from ckpttool.health import Check, count_nonfinite
from ckpttool.index import iter_leaves
from ckpttool.training.state import torch_state
from ckpttool.storage import resolve
from ckpttool.training.trainer.model import PRESETS, build_model, synthetic_batch

PARTS = (("user CPU", "user"), ("system CPU", "system"), ("CPU", "cpu"), ("wall", "wall"))
STATS = (("min", min), ("median", statistics.median), ("max", max))
GUARD = ("none", "watching", "passthrough")  # no guard; watching a copy in flight; on the stack after the copy
LIMIT = 1.10  # the target: health on / off, the writer's CPU per save (medians)


def state_of(size_gb: float) -> tuple[dict, set[str]]:
    """The trainer's model (its 1g preset scaled by depth) with AdamW state, as a save's state dict; its parameters' names."""
    model = build_model(dataclasses.replace(PRESETS["1g"], n_layers=max(1, round(PRESETS["1g"].n_layers * size_gb))), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    return torch_state(model, optimizer), {f"model.{n}" for n, _ in model.named_parameters()}


def write_once(state: dict, trainable: set[str], root: str, health: bool, before: dict | None) -> tuple[dict, dict | None]:
    """One save's write on this thread: its CPU (user, system) and wall seconds, the health check's digests."""
    step = tempfile.mkdtemp(dir=root)
    check_ = Check(trainable, before, 0 if before is not None else None) if health else None
    usage, wall = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
    write_rank(resolve(step), 0, state, health=check_)
    after, wall = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter() - wall
    shutil.rmtree(step)
    user, system = after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime
    return {"ok": True, "user": user, "system": system, "cpu": user + system, "wall": wall}, check_ and check_.tally.digests


class _Never:
    """Copies that stay in flight and never match a write: the guard's whole check, every op."""
    before_write = staticmethod(lambda spans: None)
    pending = staticmethod(lambda: True)


def guard_cost(preset: str, steps: int) -> dict[str, float]:
    """Median seconds of a forward + backward without the guard, with it watching, and after."""
    model = build_model(PRESETS[preset], 0)
    x, y = synthetic_batch(0, 2, PRESETS[preset], 0)
    out = {}
    for mode in (*GUARD, "none"):
        times, never = [], _Never()
        for _ in range(steps):
            if mode != "none":
                assert snapshot.watch(never)
                if mode == "passthrough":
                    snapshot.forget(never)
            times.append(timed(lambda: torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()))
            snapshot.forget(never)
            snapshot.release()
            model.zero_grad()
        out[mode] = statistics.median(times[2:])  # ("none" twice: before and after; the second is kept)
    return out


def sets(run):
    """The health writes, alternated in rounds (one set); then the health check alone and the guard's cost."""
    torch.set_num_threads(1)  # the writer thread of a training process: one core
    args, rounds = run.args, itertools.count(1)
    state, trainable = state_of(args.size_gb)
    tensors = [t for _, t in iter_leaves({"model": state["model"], "optim": state["optim"]}) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"state: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB; writing to {run.work}", flush=True)
    _, digests = write_once(state, trainable, run.work, True, None)  # warm: page cache, allocator, imports

    def alternated(_case: str) -> dict:  # one round: both writes, their order swapped every round
        order = ("on", "off") if next(rounds) % 2 else ("off", "on")
        return {mode: write_once(state, trainable, run.work, mode == "on", digests)[0] for mode in order}

    yield Set(["round"], alternated, lambda m, r: f"health {m:3s}: writer CPU user {r['user']:.3f} s + system {r['system']:.3f} s, "
              f"wall {r['wall']:.3f} s", explode=lambda _case, r: r, time_keys=["cpu", "wall"], peak_keys=[],
              info={"bytes": nbytes, "tensors": len(tensors), "torch": torch.__version__},
              heading=f"{len(tensors)} tensors, {nbytes / 1e9:.2f} GB, {args.repeat} writes each, alternated")
    best = lambda fn: min(timed(fn) for _ in range(3))  # noqa: E731
    run.extra.update(bytes=nbytes, count_nonfinite_s=best(lambda: [count_nonfinite(t) for t in tensors]), xxh3_s=best(lambda: [
        xxhash.xxh3_64(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())).intdigest() for t in tensors]))
    state = tensors = None  # (the guard's models need the memory)
    run.extra["guard"] = {preset: guard_cost(preset, args.guard_steps) for preset in args.guard_presets.split(",") if preset}


def derive(res: dict, run) -> tuple[list[dict], list[dict]]:
    """min / median / max of each mode's runs, and the verdict on the ratio of the CPU medians."""
    rows = []
    for mode in ("off", "on"):
        ok = [r for r in res["all_runs"][mode] if r.get("ok")]
        row = {"case": f"health {mode}", "label": f"health {mode}"}
        row.update({f"{key}_{stat}": fn([r[key] for r in ok]) for _, key in PARTS for stat, fn in STATS})
        rows.append({**row, "stacked": row["user_median"] + row["system_median"]})
    ratio = rows[1]["cpu_median"] / rows[0]["cpu_median"]
    return rows, [check("health adds at most 10% to the writer's CPU per save", f"write_rank of {res['checkpoint']['bytes'] / 1e9:.2f} GB, "
                        f"{len(ok)} writes each", f"{ratio:.3f}x (CPU medians, on / off)", ratio <= LIMIT)]


def epilogue(results: dict) -> str:
    """The CPU ratios and the health check alone, in a sentence; the guard's cost, as a table."""
    off, on = results["sets"][0]["rows"]
    ratio, nbytes, count_s, hash_s = on["cpu_median"] / off["cpu_median"], results["bytes"], results["count_nonfinite_s"], results["xxh3_s"]
    guard = [[p, *(f"{g[m] * 1e3:.2f}" for m in GUARD), *(f"{g[m] / g['none']:.3f}x" for m in GUARD[1:])]
             for p, g in results["guard"].items()]
    return (f"health on / off, writer CPU per save (medians): **{ratio:.3f}x** (target <= {LIMIT:.2f}x: "
            f"{'pass' if ratio <= LIMIT else 'fail'}); user CPU alone {on['user_median'] / off['user_median']:.3f}x. The count alone "
            f"over the {nbytes / 1e9:.2f} GB: {count_s:.3f} s ({nbytes / count_s / 1e9:.1f} GB/s, one core); xxh3 of the same bytes, "
            f"which the writer computes anyway: {hash_s:.3f} s ({nbytes / hash_s / 1e9:.1f} GB/s).\n\n## The write guard: a forward + "
            f"backward with it on the stack (median of {results['sets'][0]['options']['guard_steps'] - 2} steps)\n\n"
            + md_table(["preset", "fwd+bwd ms, no guard", "guard watching a copy", "guard after the copy", "watching", "after"], guard)
            + "\n")


SPEC = Spec(
    "snapshot", "Benchmark: what the snapshot promise costs (issue 35)", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--size-gb": dict(type=float, default=1.0), "--guard-steps": dict(type=int, default=12),
             "--rounds": dict(dest="repeat", metavar="N", type=int, default=5, help="writes with health and without it, alternated "
                              "(default 5 each)"),
             "--guard-presets": dict(default="tiny,small,1g", help="trainer presets the guard's cost is measured on"),
             # no cache to drop: a write is measured after a warm-up write
             "--warm": dict(action="store_true", default=True, help=argparse.SUPPRESS)},
    columns=[Column("writer", "label", None), *(Column(f"{part} s {k}", f"{key}_{k}", ".3f") for part, key in PARTS for k, _ in STATS)],
    chart=Chart([Panel("stacked", "writer CPU s per save (medians)", also="system_median", legend=("user + system CPU", "system CPU"),
                       limit=lambda res: LIMIT * res["rows"][0]["stacked"], limit_label="target: off + 10%")],
                title=lambda res: "issue 35: the writer's CPU per save, health off and on (medians)",
                color=lambda r: "#888888" if r["case"] == "health off" else "#1f77b4"),
    epilogue=epilogue, repeat=5)

main(SPEC, __name__)
