"""Helpers for the multi-rank benchmarks (bench/save.py, load.py, reshard.py, verify.py, and the
checkpoint writer of convert.py): launching a case's ranks, a rank's set-up, the model
configurations and a fast checkpoint generator.

Two halves:

* the parent side (standard library only, like ``_common.py``): :func:`measure_ranks` runs one
  case as a fresh *launcher* process that spawns W rank processes (gloo, file rendezvous) and waits
  for them; ``_common.run_child`` measures the launcher's whole process tree (peak RSS of the sum of
  all ranks) and each rank reports its own timings and ``VmHWM``; the checkpoints a benchmark
  reads are written (or, with ``--keep``, reused) by :func:`checkpoint`;
* the rank side (imports torch lazily): process-group set-up, the model built on a mesh with
  random training state, and the checkpoint generator's rank.

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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, ChildRun, child_argv, proc_status, remove, report_failure, run_child, write_json,
)

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


def rank_results(name: str, run: ChildRun) -> list[dict[str, Any]] | None:
    """Each rank's result of a multi-rank case; None (after printing why) when any rank failed."""
    ranks = run.result.get("ranks", []) if run.result else []
    if run.rc != 0 or not ranks or not all(r.get("ok") for r in ranks):
        report_failure(name, run)
        return None
    return ranks


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


# --- the checkpoints a benchmark reads -----------------------------------------------------------


def checkpoint(script: str, out_dir: str, size_gb: float, mesh: str, keep: bool, work: str) -> tuple[str, dict[str, Any]]:
    """A ckpttool training root of ``size_gb`` GB saved on ``mesh`` in ``out_dir``, and its facts
    (kept next to it, ``ROOT.json``): with ``keep`` an earlier run's is reused, else it is written
    now through ``script``'s ``--_gen`` ranks (:func:`generate`)."""
    root = os.path.join(out_dir, f"ckpt-{size_gb:g}GB-on-{mesh}")
    info_path = root + ".json"
    if keep and os.path.exists(info_path) and os.path.isdir(root):
        with open(info_path) as fh:
            info = json.load(fh)
        print(f"reusing {root}", flush=True)
    else:
        print(f"saving {size_gb:g} GB with ckpttool on {mesh_label(mesh)} ...", flush=True)
        info = generate(script, root, model_dims(size_gb), mesh, "ckpttool", work, f"gen-{mesh}")
        write_json(info_path, info)
    return root, info


def existing_checkpoint(src: str) -> tuple[str, dict[str, Any]]:
    """``--src``: the DCP directory of an existing checkpoint (or training root), and the facts a
    benchmark wrote next to it (``SRC.json``) if there are any."""
    info_path = os.path.abspath(src).rstrip("/") + ".json"
    info = {}
    if os.path.exists(info_path):
        with open(info_path) as fh:
            info = json.load(fh)
    return dcp_dir_of(os.path.abspath(src)), info


def remove_checkpoint(root: str) -> None:
    """Remove a generated checkpoint and its facts."""
    remove(root)
    remove(root + ".json")


def run_writer(script: str, dst: str, world: int, args: list[str], work: str, name: str,
               timeout_s: float | None = None) -> ChildRun:
    """Write the checkpoint ``dst`` anew with ``world`` ranks of ``script ARGS``: the set-up of a
    benchmark, not a case; if it fails the benchmark cannot run, and stops here."""
    remove(dst)
    run = measure_ranks(script, world, args, work, name, timeout_s=timeout_s)
    if run.rc != 0:
        raise SystemExit(f"writing the checkpoint {dst} failed (exit {run.rc}):\n{run.log_tail}")
    return run


def generate(script: str, dst: str, cfg: dict[str, int], mesh_spec: str, how: str, work: str, name: str) -> dict[str, Any]:
    """Write a checkpoint with ``mesh_spec`` ranks through ``script``'s ``--_gen`` rank mode."""
    run = run_writer(script, dst, mesh_world(mesh_spec), ["--_gen", dst, json.dumps(cfg), mesh_spec, how], work, name)
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


def dcp_bytes(path: str) -> int:
    """Bytes of the DCP files of a checkpoint directory: what a raw read or copy of it moves."""
    return sum(os.path.getsize(p) for p in dcp_files(path))


def mesh_label(mesh: str) -> str:
    """A layout in words: ``1 rank``, ``3 ranks``, ``HSDP 2x2``."""
    return f"HSDP {mesh}" if "x" in mesh else f"{mesh} rank" + ("s" if mesh != "1" else "")


def mesh_world(spec: str) -> int:
    """The number of ranks of a layout (``"4"``, ``"2x2"``)."""
    if "x" in spec:
        r, s = (int(x) for x in spec.split("x"))
        return r * s
    return int(spec)


def n_params(cfg: dict[str, int]) -> int:
    """Parameters of the bundled Transformer with config ``cfg`` (a checkpoint of its fp32 params
    and AdamW state holds 12 bytes for each)."""
    d, v, s = cfg["dim"], cfg["vocab_size"], cfg["seq_len"]
    per_layer = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    return 2 * v * d + s * d + 2 * d + cfg["n_layers"] * per_layer


def fit_layers(cfg: dict[str, int], size_gb: float) -> dict[str, int]:
    """``cfg`` with as many blocks (at least one) as bring its fp32 params + AdamW exp_avg +
    exp_avg_sq (12 bytes/param) closest to ``size_gb`` GB."""
    fixed = n_params({**cfg, "n_layers": 0})
    per_layer = n_params({**cfg, "n_layers": 1}) - fixed
    cfg["n_layers"] = max(1, round((size_gb * GB / 12 - fixed) / per_layer))
    return cfg


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
    return fit_layers(cfg, size_gb)


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
    """Hand this rank's result (with its rank and peak RSS) to the launcher and leave the group."""
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


def random_training_state(cfg: dict[str, int], mesh_spec: str):
    """An FSDP2 model on ``mesh_spec`` and its AdamW optimizer, holding random training state
    (:func:`fill_state`); the replicas of a shard (HSDP) hold the same values, as after training."""
    import torch
    import torch.distributed as dist

    mesh = make_mesh(mesh_spec)
    model = shell_model(cfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shard_rank = mesh.get_local_rank(mesh.ndim - 1) if mesh.ndim > 1 else dist.get_rank()
    fill_state(model, opt, 1000 + shard_rank)
    return model, opt


def gen_rank(dst: str, cfg: dict[str, int], mesh_spec: str, how: str, step: int = 1) -> dict[str, Any]:
    """One rank of a checkpoint writer: random state on ``mesh_spec``, saved with ckpttool's
    Checkpointer (``how="ckpttool"``: ``dst`` is a training root, the step is ``dst/step-<step>``)
    or plain ``dcp.save`` (``how="dcp"``: ``dst`` is the checkpoint directory)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = random_training_state(cfg, mesh_spec)
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


def main() -> int:
    """The launcher's command line (see above); anything else prints this module's help."""
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
