"""Benchmark: what issue 35's promises cost — the writer's CPU per save with health on and off, and
the training thread's time while the write guard is on its stack.

Health. One process writes one rank's part of a step (``write_rank``, the function an async save's writer
thread runs) for the trainer's model with AdamW state, about --size-gb GB, alternately with the
health check (NaN/Inf counted in every record as it is written, the records' digests kept and
compared with the previous save) and without it, --rounds times each. Each write goes to a fresh
directory on the disk and is removed after. Reported: the writing thread's CPU seconds per save
(``time.thread_time``; min / median / max) and the wall time, and the ratio of the medians. The
CPU a health check spends is also timed alone (``count_nonfinite`` over every tensor), beside
xxh3 of the same bytes: the pass the writer makes anyway.

Write guard. From save() until the next optimizer step a TorchDispatchMode sits on the saving
thread's stack (``snapshot.py``): every op of that step's forward and backward passes through it.
Measured: the median forward + backward of the trainer's model (presets --guard-presets, one
process, one thread) with no guard, with the guard watching a copy in flight (every writing op
looks up the storages it writes), and with the guard on the stack after the copy is done.

    .venv/bin/python bench/snapshot.py --size-gb 1 --rounds 15 --json docs/bench/snapshot.json --md docs/bench/snapshot.md

Target (issue 35): health adds at most 10% to the writer's CPU per save.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import xxhash  # noqa: E402

from _common import machine_facts, md_table, now, plot_file, write_json, write_markdown  # noqa: E402


def state_of(size_gb: float) -> tuple[dict, set[str]]:
    """The trainer's model (its 1g preset scaled by depth) with AdamW state, as a save's state dict."""
    import dataclasses

    from ckpttool.state_cache import torch_state
    from ckpttool.trainer.model import PRESETS, build_model

    config = dataclasses.replace(PRESETS["1g"], n_layers=max(1, round(PRESETS["1g"].n_layers * size_gb)))
    model = build_model(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    state = torch_state(model, optimizer)
    trainable = {f"model.{n}" for n, _ in model.named_parameters()}
    return state, trainable


def write_once(state: dict, trainable: set[str], root: str, health: bool, before: dict | None) -> tuple[float, float, dict | None]:
    from ckpttool.formats.dcp.save import write_rank
    from ckpttool.health import Check
    from ckpttool.storage import resolve

    step = tempfile.mkdtemp(dir=root)
    check = Check(trainable, before, 0 if before is not None else None) if health else None
    usage, wall = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
    write_rank(resolve(step), 0, state, health=check)
    after, wall = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter() - wall
    shutil.rmtree(step)
    return (after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime), wall, check.tally.digests if check is not None else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5, help="writes with health and without it, alternated (default 5 each)")
    p.add_argument("--out-dir", "--dir", dest="dir", default=None,
                   help="where to write (default: a temporary directory under the repository)")
    p.add_argument("--plot", help="a PNG of the writer's CPU per save, health on and off")
    p.add_argument("--guard-presets", default="tiny,small,1g", help="trainer presets the guard's cost is measured on")
    p.add_argument("--guard-steps", type=int, default=12)
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the writer thread of a training process: one core
    started = now()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckpttool-bench-health-", dir=args.dir or os.path.dirname(os.path.abspath(__file__)))
    try:
        state, trainable = state_of(args.size_gb)
        tensors = [t for part in ("model", "optim") for t in _tensors(state[part])]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        print(f"state: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB; writing to {root}", flush=True)
        _, _, digests = write_once(state, trainable, root, True, None)  # warm: page cache, allocator, imports
        runs: dict[str, list[tuple[float, float, float]]] = {"on": [], "off": []}
        for i in range(args.rounds):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                (user, system), wall, found = write_once(state, trainable, root, mode == "on", digests)
                runs[mode].append((user, system, wall))
                print(f"  round {i + 1} health {mode:3s}: writer CPU user {user:.3f} s + system {system:.3f} s, wall {wall:.3f} s",
                      flush=True)
        from ckpttool.health import count_nonfinite

        count_s = min(_timed(lambda: [count_nonfinite(t) for t in tensors]) for _ in range(3))
        hash_s = min(_timed(lambda: [xxhash.xxh3_64(_bytes(t)).intdigest() for t in tensors]) for _ in range(3))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ntensors = len(tensors)
    del state, tensors  # (the guard's models need the memory)
    guard = {preset: guard_cost(preset, args.guard_steps) for preset in args.guard_presets.split(",") if preset}
    stats = {mode: {"user": _stats([u for u, _, _ in r]), "system": _stats([s for _, s, _ in r]),
                    "cpu": _stats([u + s for u, s, _ in r]), "wall": _stats([w for _, _, w in r])} for mode, r in runs.items()}
    ratio = stats["on"]["cpu"]["median"] / stats["off"]["cpu"]["median"]
    user_ratio = stats["on"]["user"]["median"] / stats["off"]["user"]["median"]
    result = {"started": started, "ended": now(), "argv": sys.argv[1:], "machine": machine_facts(root_dir()),
              "torch": torch.__version__, "bytes": nbytes, "tensors": ntensors, "rounds": args.rounds, "runs": runs,
              "stats": stats, "cpu_ratio": ratio, "user_ratio": user_ratio, "count_nonfinite_s": count_s, "xxh3_s": hash_s,
              "guard": guard, "target": {"health adds at most 10% to the writer's CPU per save": ratio <= 1.10}}
    rows = [[f"health {mode}", *(f"{stats[mode][part][k]:.3f}" for part in ("user", "system", "cpu", "wall")
                                 for k in ("min", "median", "max"))] for mode in ("off", "on")]
    text = md_table(["writer", *(f"{part} s {k}" for part in ("user CPU", "system CPU", "CPU", "wall") for k in ("min", "median", "max"))],
                    rows)
    verdict = "pass" if ratio <= 1.10 else "fail"
    summary = (f"health on / off, writer CPU per save (medians): **{ratio:.3f}x** (target <= 1.10x: {verdict}); "
               f"user CPU alone {user_ratio:.3f}x. "
               f"The count alone over the {nbytes / 1e9:.2f} GB: {count_s:.3f} s ({nbytes / count_s / 1e9:.1f} GB/s, one core); "
               f"xxh3 of the same bytes, which the writer computes anyway: {hash_s:.3f} s ({nbytes / hash_s / 1e9:.1f} GB/s).")
    guard_rows = [[preset, *(f"{g[mode] * 1e3:.2f}" for mode in ("none", "watching", "passthrough")),
                   f"{g['watching'] / g['none']:.3f}x", f"{g['passthrough'] / g['none']:.3f}x"] for preset, g in guard.items()]
    guard_text = md_table(["preset", "fwd+bwd ms, no guard", "guard watching a copy", "guard after the copy", "watching", "after"],
                          guard_rows)
    print(text)
    print(summary)
    print(guard_text)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        print(f"plot: {plot_file(args.plot, draw, result)}")
    if args.md:
        cmd = "`.venv/bin/python bench/snapshot.py " + " ".join(sys.argv[1:]) + "`"
        write_markdown(args.md, f"# Benchmark: what the snapshot promise costs (issue 35)\n\nCommand: {cmd}\n\n"
                                f"Run {started} – {result['ended']}, torch {torch.__version__}, {ntensors} tensors, "
                                f"{nbytes / 1e9:.2f} GB, {args.rounds} writes each, alternated.\n\n{text}\n\n{summary}\n\n"
                                f"## The write guard: a forward + backward with it on the stack (median of "
                                f"{args.guard_steps - 2} steps)\n\n{guard_text}\n")
    return 0


def draw(plt, result: dict) -> object:
    """The writer's CPU per save (user and system, medians) with health off and on."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    modes = ["off", "on"]
    user = [result["stats"][m]["user"]["median"] for m in modes]
    system = [result["stats"][m]["system"]["median"] for m in modes]
    ax.bar([f"health {m}" for m in modes], user, label="user CPU")
    ax.bar([f"health {m}" for m in modes], system, bottom=user, label="system CPU")
    ax.axhline(1.10 * (user[0] + system[0]), color="red", linestyle="--", label="target: off + 10%")
    ax.set_ylabel(f"writer CPU s per save ({result['bytes'] / 1e9:.2f} GB)")
    ax.legend(loc="lower right")
    return fig, "issue 35: the writer's CPU per save, health off and on (medians)"


class _Never:
    """Copies that stay in flight and never match a write: the guard's whole check, every op."""

    def before_write(self, storages):
        pass

    def pending(self) -> bool:
        return True


def guard_cost(preset: str, steps: int) -> dict[str, float]:
    """Median seconds of a forward + backward without the guard, with it watching, and after."""
    from ckpttool import snapshot
    from ckpttool.trainer.model import PRESETS, build_model, synthetic_batch

    config = PRESETS[preset]
    model = build_model(config, 0)
    x, y = synthetic_batch(0, 2, config, 0)
    out = {}
    for mode in ("none", "watching", "passthrough", "none"):
        times = []
        never = _Never()
        for _ in range(steps):
            if mode != "none":
                assert snapshot.watch(never)
                if mode == "passthrough":
                    snapshot.forget(never)
            start = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            times.append(time.perf_counter() - start)
            snapshot.forget(never)
            snapshot.release()
            model.zero_grad()
        out[mode] = statistics.median(times[2:])  # ("none" twice: before and after; the second is kept)
    return out


def root_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


if __name__ == "__main__":
    sys.exit(main())
