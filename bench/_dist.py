"""Helpers for the multi-rank benchmarks (bench/save.py, load.py, reshard.py, verify.py).

Two halves:

* the parent side (standard library only, like ``_common.py``): :func:`measure_ranks` runs one
  case as a fresh *launcher* process that spawns W rank processes (gloo, file rendezvous) and waits
  for them; ``_common.run_child`` measures the launcher's whole process tree (peak RSS of the sum of
  all ranks) and each rank reports its own timings and ``VmHWM``;
* the rank side (imports torch lazily): process-group set-up, the model configurations, a fast
  checkpoint generator and the formatting helpers the benchmark scripts share.

Run as a script, this file is the launcher:
``python bench/_dist.py --launch SCRIPT WORLD RESULT LOGPREFIX -- ARGS...`` starts ``WORLD``
processes ``python -u SCRIPT --_rank R --_world WORLD --_rdzv FILE --_result RESULT.R ARGS...``,
kills the others as soon as one fails, and writes ``{"rcs": [...], "ranks": [result of each]}`` to
``RESULT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import GB, MiB, ChildRun, child_argv, proc_status, remove, run_child, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DIST = os.path.abspath(__file__)


# --- parent side ---------------------------------------------------------------------------------


def measure_ranks(script: str, world: int, args: list[str], work: str, name: str,
                  timeout_s: float | None = None) -> ChildRun:
    """Run one multi-rank case: a fresh launcher process and its ``world`` ranks.

    Returns the launcher's :class:`ChildRun`: ``peak_kib`` is the peak of the whole tree (all
    ranks together), ``result`` is ``{"rcs": [...], "ranks": [...]}`` with each rank's own result.
    """
    result = os.path.join(work, f"{name}.result.json")
    log = os.path.join(work, f"{name}.log")
    argv = child_argv(DIST, "--launch", script, str(world), result, os.path.join(work, f"{name}.rank"), "--", *args)
    run = run_child(argv, result, log, timeout_s=timeout_s)
    if run.rc != 0:
        tails = ""
        for r in range(world):
            p = os.path.join(work, f"{name}.rank{r}.log")
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    tails += f"--- rank {r} ---\n" + f.read()[-3000:]
        run.log_tail += "\n" + tails
    return run


def launch(script: str, world: int, result: str, log_prefix: str, args: list[str]) -> int:
    """The launcher's body (runs in its own process): spawn the ranks, wait, merge their results."""
    rdzv = f"{result}.rdzv-{os.getpid()}-{time.time_ns()}"
    remove(rdzv)
    procs, logs = [], []
    for r in range(world):
        res = f"{result}.{r}"
        remove(res)
        logs.append(open(f"{log_prefix}{r}.log", "w"))
        argv = child_argv(script, "--_rank", str(r), "--_world", str(world), "--_rdzv", rdzv, "--_result", res, *args)
        procs.append(subprocess.Popen(argv, stdout=logs[-1], stderr=subprocess.STDOUT))
    rcs: list[int | None] = [None] * world
    while any(rc is None for rc in rcs):
        for i, p in enumerate(procs):
            if rcs[i] is None:
                rcs[i] = p.poll()
        if any(rc not in (None, 0) for rc in rcs):  # one failed: the others would wait forever
            for i, p in enumerate(procs):
                if rcs[i] is None:
                    p.kill()
                    rcs[i] = p.wait()
            break
        time.sleep(0.02)
    for f in logs:
        f.close()
    remove(rdzv)
    ranks = []
    for r in range(world):
        res = f"{result}.{r}"
        if os.path.exists(res):
            with open(res) as f:
                ranks.append(json.load(f))
            remove(res)
        else:
            ranks.append({})
    write_json(result, {"rcs": rcs, "ranks": ranks})
    return 0 if all(rc == 0 for rc in rcs) else 1


def wait_for_convert(poll_s: float = 60, quiet: bool = False) -> None:
    """Block while a ``bench/convert.py`` run (a colleague's benchmark) is going on."""
    me = os.getpid()
    while True:
        out = subprocess.run(["pgrep", "-f", "bench/convert.py"], capture_output=True, text=True).stdout.split()
        others = [p for p in out if int(p) != me]
        if not others:
            return
        if not quiet:
            print(f"   waiting: bench/convert.py is running (pids {' '.join(others)}); polling every {poll_s:.0f} s", flush=True)
        time.sleep(poll_s)


def can_drop_caches() -> bool:
    """Whether ``_common.drop_caches`` would work here (root), without dropping anything."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def add_rank_args(p) -> None:
    """The hidden arguments every rank process receives from the launcher."""
    import argparse

    p.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_rdzv", default="", help=argparse.SUPPRESS)
    p.add_argument("--_result", default="", help=argparse.SUPPRESS)


def best_of(runs: list[dict[str, Any]], time_keys: list[str], peak_keys: list[str],
            pick: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One representative run of a case; every reported value comes from that run.

    ``pick`` chooses it among the successful runs (default: the smallest ``time_keys[0]``, the
    fastest run); values of different runs are never mixed into one row. For the spread, every
    key in ``time_keys`` and ``peak_keys`` also gets ``KEY_all``: its value in each successful run,
    in run order. ``picked`` is the index of the chosen run among them, ``runs`` their number.
    """
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return {"failed": True, "runs": runs}
    if pick is not None:
        rep = pick(ok)
    else:
        key = time_keys[0]
        timed = [r for r in ok if r.get(key) is not None]
        rep = min(timed, key=lambda r: r[key]) if timed else ok[0]
    out = dict(rep)
    for k in [*time_keys, *peak_keys]:
        if any(r.get(k) is not None for r in ok):
            out[k + "_all"] = [r.get(k) for r in ok]
    out["picked"] = next(i for i, r in enumerate(ok) if r is rep)
    out["runs"] = len(ok)
    return out


def pick_smallest(key: str) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """A ``best_of`` pick: the run with the smallest ``key``."""
    return lambda ok: min(ok, key=lambda r: r[key] if r.get(key) is not None else float("inf"))


def md_table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i in left else "---:" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def text_table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def md_header(title: str, results: dict[str, Any]) -> str:
    """The top of a results file: what ran, where, when."""
    m = results.get("machine", {})
    facts = (f"{m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('mem_total_gib')} GiB RAM, swap {m.get('swap_gib')} GiB, "
             f"{m.get('disk_fs')} on {m.get('disk_device')} (rotational: {m.get('disk_rotational')}), kernel {m.get('kernel')}, "
             f"Python {m.get('python')}, torch {results.get('torch')}")
    return (f"# {title}\n\n"
            f"Command (from the repository root): `{results.get('command')}`\n\n"
            f"Run {results.get('started')} – {results.get('finished')} on: {facts}.\n\n")


def verdict_lines(checks: list[dict[str, Any]]) -> list[str]:
    return [f"{'PASS' if c['pass'] else 'FAIL'}  {c['target']:<48} {c['case']:<40} {c['value']}" for c in checks]


def verdict_md(checks: list[dict[str, Any]]) -> str:
    rows = [[c["target"], c["case"], c["value"], "pass" if c["pass"] else "**FAIL**"] for c in checks]
    return md_table(["target", "case", "measured", ""], rows, left=(0, 1, 2, 3))


# --- rank side -----------------------------------------------------------------------------------


def init_rank(args) -> tuple[int, int]:
    """Join the gloo group of this case (one compute thread per rank: 2 cores, >= 2 ranks)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args._rdzv}", rank=args._rank, world_size=args._world)
    return args._rank, args._world


def finish_rank(args, doc: dict[str, Any]) -> None:
    import torch.distributed as dist

    doc.setdefault("rank", args._rank)
    doc.setdefault("vmhwm_kib", proc_status("VmHWM"))
    write_json(args._result, doc)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def make_mesh(spec: str):
    """``"4"``: a 1-D mesh of 4 ranks (FSDP2); ``"2x2"``: (replicate=2, shard=2), HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if "x" in spec:
        r, s = (int(x) for x in spec.split("x"))
        return init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (int(spec),))


def mesh_world(spec: str) -> int:
    if "x" in spec:
        r, s = (int(x) for x in spec.split("x"))
        return r * s
    return int(spec)


def model_dims(size_gb: float, seq_len: int = 32) -> dict[str, int]:
    """A Transformer config whose fp32 params + AdamW exp_avg + exp_avg_sq (12 bytes/param) come
    close to ``size_gb`` GB. dim 768 (12 heads, vocab 8192) up to ~2 GB, as the ``1g`` preset, so
    training steps on CPU stay short; dim 2048 above (as bench/convert.py); a short ``seq_len``
    keeps a training step cheap (the sequence does not change the state's size much)."""
    if size_gb <= 2:
        cfg = dict(vocab_size=8192, dim=768, n_layers=1, n_heads=12, seq_len=seq_len)
    else:
        cfg = dict(vocab_size=8192, dim=2048, n_layers=1, n_heads=16, seq_len=seq_len)
    if size_gb < 0.5:
        cfg.update(dim=384, n_heads=6, vocab_size=4096)
    d, v, s = cfg["dim"], cfg["vocab_size"], cfg["seq_len"]
    per_layer = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    fixed = 2 * v * d + s * d + 2 * d
    cfg["n_layers"] = max(1, round((size_gb * GB / 12 - fixed) / per_layer))
    return cfg


def state_nbytes(state: Any) -> int:
    """Bytes of this rank's tensors (DTensors: the local shard) in a nested state dict."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        t = state.to_local()
        return t.numel() * t.element_size()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


def fill_state(model, optimizer, seed: int) -> None:
    """Random parameters and AdamW state (exp_avg, exp_avg_sq, step=1: what one step leaves),
    set directly: much faster than building with init_weights and training a step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.05, 0.05, generator=gen)
            avg, sq = torch.empty_like(p), torch.empty_like(p)
            avg.to_local().uniform_(-1e-3, 1e-3, generator=gen)
            sq.to_local().uniform_(0, 1e-6, generator=gen)
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": avg, "exp_avg_sq": sq}


def shell_model(cfg: dict[str, int], mesh):
    """An FSDP2 model on ``mesh`` with uninitialised storage (meta -> fully_shard -> to_empty):
    what a job builds before it loads a checkpoint into it."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from ckpttool.trainer.model import ModelConfig, Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(**cfg))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def gen_rank(args, dst: str, cfg: dict[str, int], mesh_spec: str, how: str, step: int = 1) -> dict[str, Any]:
    """One rank of a checkpoint writer: random state on ``mesh_spec``, saved with ckpttool's
    Checkpointer (``how="ckpttool"``: ``dst`` is a training root, the step is ``dst/step-<step>``)
    or plain ``dcp.save`` (``how="dcp"``: ``dst`` is the checkpoint directory)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = make_mesh(mesh_spec)
    model = shell_model(cfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # replicas of a shard (HSDP) hold the same values, as they would after training
    shard_rank = mesh.get_local_rank(mesh.ndim - 1) if mesh.ndim > 1 else dist.get_rank()
    fill_state(model, opt, 1000 + shard_rank)
    msd, osd = get_state_dict(model, opt)
    nbytes = state_nbytes({"model": msd, "optim": osd})
    dist.barrier()
    t0 = time.perf_counter()
    if how == "ckpttool":
        from ckpttool import Checkpointer

        ck = Checkpointer(dst)
        ck.save(step, model, opt, extra={"step": step, "note": "bench"})
        ck.close()
    else:
        dcp.save({"model": msd, "optim": osd, "extra": {"step": step, "note": "bench"}}, checkpoint_id=dst)
    dist.barrier()
    total = [None] * dist.get_world_size()
    dist.all_gather_object(total, nbytes)
    params = sum(p.numel() for p in model.parameters())
    return {"ok": True, "save_s": time.perf_counter() - t0, "rank_state_bytes": nbytes, "state_bytes": sum(total),
            "params": params, "tensors": 3 * len(list(model.parameters())), "torch": torch.__version__}


def generate(script: str, dst: str, cfg: dict[str, int], mesh_spec: str, how: str, work: str, name: str) -> dict[str, Any]:
    """Write a checkpoint with ``mesh_spec`` ranks through ``script``'s ``--_gen`` rank mode."""
    remove(dst)
    world = mesh_world(mesh_spec)
    run = measure_ranks(script, world, ["--_gen", dst, json.dumps(cfg), mesh_spec, how], work, name)
    if run.rc != 0:
        raise SystemExit(f"writing the checkpoint {dst} failed (exit {run.rc}):\n{run.log_tail}")
    info = dict(run.result["ranks"][0])
    info.update(cfg=cfg, mesh=mesh_spec, how=how, gen_wall_s=run.wall_s, path=dst)
    return info


def dcp_dir_of(path: str) -> str:
    """The DCP directory: ``path`` itself, or the newest ``step-<N>`` of a ckpttool training root."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    steps = sorted((n for n in os.listdir(path) if n.startswith("step-")), key=lambda n: int(n.split("-")[1]))
    return os.path.join(path, steps[-1])


def dcp_files(path: str) -> list[str]:
    """The DCP files of a checkpoint directory (``.metadata`` and the ``.distcp`` files)."""
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n == ".metadata" or n.endswith(".distcp"))


def main() -> int:
    argv = sys.argv[1:]
    if len(argv) >= 5 and argv[0] == "--launch":
        script, world, result, log_prefix = argv[1], int(argv[2]), argv[3], argv[4]
        rest = argv[5:]
        if rest and rest[0] == "--":
            rest = rest[1:]
        return launch(script, world, result, log_prefix, rest)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
