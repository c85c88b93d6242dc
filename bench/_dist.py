"""The multi-rank side of the benchmarks. Parent side (standard library only): :func:`measure_ranks` runs a case as a
launcher process that spawns W ranks (gloo, file rendezvous); ``run_child`` measures the launcher's whole tree (all
ranks together), each rank reports its timings and ``VmHWM`` (harness's ``Run.checkpoint`` so runs the generator). Rank
side (torch imported lazily): group set-up, an FSDP2 model on a mesh with random training state, the generator's rank.

As a script, the launcher: ``python bench/_dist.py --launch SCRIPT WORLD RESULT LOGPREFIX -- ARGS...``
starts ``python -u SCRIPT --_rank R --_world WORLD --_rdzv FILE --_result RESULT.R ARGS...`` for each
rank R, kills the others as soon as one fails, and writes ``{"rcs": [...], "ranks": [...]}`` to RESULT.
"""

import math
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import GB, ChildRun, child_argv, proc_status, read_json, read_text, remove, run_child, write_json  # noqa: E402


def measure_ranks(script: str, world: int, args: list[str], work: str, name: str, timeout_s: float | None = None) -> ChildRun:
    """Run one multi-rank case: a fresh launcher and its ``world`` ranks (``peak_kib``: all of them
    together; ``result``: the launcher's); on failure, the ranks' log tails join ``log_tail``."""
    result, prefix = os.path.join(work, f"{name}.result.json"), os.path.join(work, f"{name}.rank")
    run = run_child(child_argv(os.path.abspath(__file__), "--launch", script, str(world), result, prefix, "--", *args), result,
                    os.path.join(work, f"{name}.log"), timeout_s=timeout_s)
    if run.rc != 0:
        logs = [(r, f"{prefix}{r}.log") for r in range(world)]
        run.log_tail += "\n" + "".join(f"--- rank {r} ---\n" + read_text(log)[-3000:] for r, log in logs if os.path.exists(log))
    return run


def launch(script: str, world: int, result: str, log_prefix: str, args: list[str]) -> int:
    """The launcher's body (runs in its own process): spawn the ranks, wait, merge their results."""
    rdzv, procs = f"{result}.rdzv-{os.getpid()}-{time.time_ns()}", []
    for r in range(world):
        remove(f"{result}.{r}")
        with open(f"{log_prefix}{r}.log", "w") as log:  # the rank writes to its own copy of the descriptor
            argv = child_argv(script, "--_rank", str(r), "--_world", str(world), "--_rdzv", rdzv, "--_result", f"{result}.{r}", *args)
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    rcs: list[int | None] = [None] * world
    while None in rcs:
        time.sleep(0.02)
        rcs = [p.poll() for p in procs]
        if any(rc not in (None, 0) for rc in rcs):  # one failed: the others would wait forever
            for p in procs:
                p.kill()  # nothing, for one that has exited
            rcs = [p.wait() for p in procs]
    remove(rdzv)
    ranks = [read_json(f"{result}.{r}", {}) for r in range(world)]
    for r in range(world):
        remove(f"{result}.{r}")
    write_json(result, {"rcs": rcs, "ranks": ranks})
    return 0 if all(rc == 0 for rc in rcs) else 1


def dcp_dir_of(path: str) -> str:
    """The DCP directory: ``path`` itself, or the newest ``step-<N>`` of a ckpttool training root."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    return os.path.join(path, max((n for n in os.listdir(path) if n.startswith("step-")), key=lambda n: int(n.split("-")[1])))


def dcp_files(path: str) -> list[str]:
    """The DCP files of a checkpoint directory (``.metadata`` and the ``.distcp`` files)."""
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n == ".metadata" or n.endswith(".distcp"))


def mesh_label(mesh: str) -> str:
    """A layout in words: ``1 rank``, ``3 ranks``, ``HSDP 2x2``."""
    return f"HSDP {mesh}" if "x" in mesh else f"{mesh} rank" + ("s" if mesh != "1" else "")


def mesh_world(spec: str) -> int:
    """The number of ranks of a layout (``"4"``, ``"2x2"``)."""
    return math.prod(int(x) for x in spec.split("x"))


#: elements of each of the ``small`` extra parameters of a config: 16 KiB in fp32, so the parameter, its exp_avg and its
#: exp_avg_sq are each a tensor under 64 KiB (a checkpoint of mixed tensor sizes: norms, biases, LoRA, MoE router weights)
SMALL_NUMEL = 4096


def n_params(cfg: dict[str, int]) -> int:
    """Parameters of the bundled Transformer with config ``cfg`` (12 bytes each with AdamW state), its ``small`` included."""
    d, v, s = cfg["dim"], cfg["vocab_size"], cfg["seq_len"]
    per_layer = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    return 2 * v * d + s * d + 2 * d + cfg["n_layers"] * per_layer + cfg.get("small", 0) * SMALL_NUMEL


def fit_layers(cfg: dict[str, int], size_gb: float, up: bool = False) -> dict[str, int]:
    """``cfg`` with as many blocks (at least one) as bring its fp32 params + AdamW exp_avg + exp_avg_sq (12 bytes/param)
    closest to ``size_gb`` GB (``up``: the fewest that reach it)."""
    fixed = n_params({**cfg, "n_layers": 0})
    per_layer = n_params({**cfg, "n_layers": 1}) - fixed
    cfg["n_layers"] = max(1, (math.ceil if up else round)((size_gb * GB / 12 - fixed) / per_layer))
    return cfg


def model_dims(size_gb: float, seq_len: int = 32) -> dict[str, int]:
    """A Transformer config of about ``size_gb`` GB (:func:`fit_layers`): dim 384 under 0.5 GB, 768 up to
    ~2 GB (the ``1g`` preset: CPU training steps stay short), 2048 above (as bench/convert.py); a short
    ``seq_len`` keeps a step cheap (the sequence hardly changes the state's size)."""
    dim, heads, vocab = (384, 6, 4096) if size_gb < 0.5 else (768, 12, 8192) if size_gb <= 2 else (2048, 16, 8192)
    return fit_layers(dict(vocab_size=vocab, dim=dim, n_layers=1, n_heads=heads, seq_len=seq_len), size_gb)


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
    shape = tuple(int(x) for x in spec.split("x"))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)


def state_nbytes(state: Any) -> int:
    """Bytes of this rank's tensors (DTensors: the local shard) in a nested state dict."""
    import torch
    from torch.distributed.tensor import DTensor
    if isinstance(state, DTensor):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        state = list(state.values())
    return sum(state_nbytes(v) for v in state) if isinstance(state, (list, tuple)) else 0


def shell_model(cfg: dict[str, int], mesh):
    """An FSDP2 model on ``mesh``, storage uninitialised (meta -> fully_shard -> to_empty): what a job loads into; with
    ``cfg["small"]``, that many more parameters of SMALL_NUMEL elements (``small.<i>``, sharded with the root)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from ckpttool.training.trainer.model import ModelConfig, Transformer
    small = cfg.get("small", 0)
    with torch.device("meta"):
        model = Transformer(ModelConfig(**{k: v for k, v in cfg.items() if k != "small"}))
        if small:
            model.small = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(SMALL_NUMEL)) for _ in range(small))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def gen_rank(dst: str, cfg: dict[str, int], mesh_spec: str, how: str, step: int = 1) -> dict[str, Any]:
    """One rank of the checkpoint writer: an FSDP2 model on ``mesh_spec``, its params and AdamW state
    (exp_avg, exp_avg_sq, step=1: what one step leaves) set to random values (the replicas of a shard
    alike, as after training), saved with ckpttool (``how="ckpttool"``: ``dst`` is a training root,
    the step ``dst/step-<step>``) or plain ``dcp.save`` (``how="dcp"``: ``dst`` is the DCP directory)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = shell_model(cfg, mesh := make_mesh(mesh_spec))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + (mesh.get_local_rank(mesh.ndim - 1) if mesh.ndim > 1 else dist.get_rank()))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.05, 0.05, generator=gen)
            avg, sq = torch.empty_like(p), torch.empty_like(p)
            avg.to_local().uniform_(-1e-3, 1e-3, generator=gen)
            sq.to_local().uniform_(0, 1e-6, generator=gen)
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": avg, "exp_avg_sq": sq}
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
    return {"ok": True, "save_s": time.perf_counter() - t0, "rank_state_bytes": nbytes, "state_bytes": sum(total),
            "params": sum(p.numel() for p in model.parameters()), "tensors": 3 * len(list(model.parameters())), "torch": torch.__version__}


if __name__ == "__main__":  # the launcher (see above); anything else prints this module's help
    if len(sys.argv) >= 6 and sys.argv[1] == "--launch":
        rest = sys.argv[6:]
        sys.exit(launch(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], rest[1:] if rest[:1] == ["--"] else rest))
    print(__doc__)
    sys.exit(2)
