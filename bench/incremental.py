"""Benchmark: incremental checkpoints of a model with a frozen base (issue 30).

The bundled Transformer, about ``--size`` GB of state (fp32), on 2 gloo CPU ranks, 95% of its parameters frozen (AdamW
holds state only for the other 5%), saves steps 1..``--saves`` with ``Checkpointer(incremental=True)``, a training step
before each (the trainable 5% and their AdamW state change); a plain Checkpointer saves the same states in another
root, so each incremental save is compared with a full save of the same state. Saves are sync, timed barrier to
barrier (slowest rank); the bytes written and shared are the incremental step's commit record's.

    .venv/bin/python bench/incremental.py --size 1 --md docs/bench/incremental.md

Targets: every save after the first writes <= 1.1x the changed bytes (the trainable parameters and the optimizer's
state: what a save must write) and takes <= 0.2x a full save.
"""

import json
import os
import time

from _common import MiB, remove
from _dist import finish_rank, init_rank, make_mesh, model_dims, state_nbytes
from harness import Column, Set, Spec, check, f, main

FROZEN = 0.95


def rank_case(args) -> None:
    """One rank: per step a training step, then the incremental and the full save, each barrier to barrier."""
    init_rank(args)
    import torch
    import torch.distributed as dist

    from ckpttool import Checkpointer
    from ckpttool.steps import read_commit_record
    from ckpttool.storage import resolve
    from ckpttool.training.trainer.model import ModelConfig, build_fsdp_model, local_batch

    cfg = ModelConfig(**json.loads(args._cfg))
    model = build_fsdp_model(cfg, make_mesh("2"), seed=0)
    params = list(model.parameters())
    total, training = sum(p.numel() for p in params), 0
    # trainable from the last parameter back (a fine-tune trains the top layers), passing over any that would overshoot
    # 5% by more than a tenth (the output head alone is 7%): the fraction lands near 95%, not where a parameter ends
    for p in reversed(params):
        p.requires_grad_(training < (1 - FROZEN) * total and training + p.numel() <= 1.1 * (1 - FROZEN) * total)
        training += p.numel() * p.requires_grad
    trainable = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    inc = Checkpointer(os.path.join(args._src, "incremental"), incremental=True, keep_last=2)
    full = Checkpointer(os.path.join(args._src, "full"), keep_last=1)
    rows = []
    for step in range(1, int(args._saves) + 1):
        x, y = local_batch(step, dist.get_rank(), dist.get_world_size(), 4, cfg, 0)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        rows.append({"step": step, "bytes_changed": state_nbytes([trainable, list(optimizer.state.values())])})
        for key, ck in (("inc_s", inc), ("full_s", full)):
            dist.barrier()
            t0 = time.perf_counter()
            path = ck.save(step, model, optimizer)
            dist.barrier()
            rows[-1][key] = time.perf_counter() - t0
            if ck is inc:
                record = read_commit_record(resolve(path)) or {}
                rows[-1].update(bytes_written=record.get("bytes_written"), bytes_shared=record.get("bytes_shared"))
    for ck in (inc, full):
        ck.close()
    finish_rank(args, {"ok": True, "rows": rows, "frozen_fraction": 1 - training / total, "torch": torch.__version__})


def sets(run):
    """One case: the saves on 2 ranks (in a fresh root); per step the slowest rank's times and all ranks' changed bytes."""
    # model_dims counts 12 bytes a parameter (fp32 + AdamW); with 95% frozen it is 4, plus 8 for the AdamW state of the 5% that train
    cfg, root = model_dims(run.args.size * 12 / (4 + 8 * (1 - FROZEN))), os.path.join(run.work, "roots")

    def measure(_) -> dict:
        remove(root)
        ranks, proc = run.ranks("incremental", 2, ["--_src", root, "--_cfg", json.dumps(cfg), "--_saves", str(run.args.saves)])
        if ranks is None:
            return {"ok": False, "rc": proc.rc}
        steps = [{**rs[0], "inc_s": max(r["inc_s"] for r in rs), "full_s": max(r["full_s"] for r in rs),
                  "bytes_changed": sum(r["bytes_changed"] for r in rs)} for rs in zip(*(r["rows"] for r in ranks))]
        return {"ok": True, "steps": steps, "frozen_fraction": ranks[0]["frozen_fraction"], "torch": ranks[0]["torch"],
                "process_wall_s": proc.wall_s, "peak_kib": proc.peak_kib}

    yield Set(["incremental"], measure, lambda _, r: f"{len(r['steps'])} saves in {r['process_wall_s']:.1f} s", info={"cfg": cfg},
              time_keys=["process_wall_s"])


def derive(res: dict, run) -> tuple[list[dict], list[dict]]:
    c = res["cases"]["incremental"]
    if not c.get("ok"):
        return [], [check("the benchmark ran", "2 ranks", "failed", False)]
    res["torch"], res["frozen_fraction"] = c["torch"], c["frozen_fraction"]
    rows = [{**s, "x_full": s["inc_s"] / s["full_s"],
             "x_written": s["bytes_written"] / s["bytes_changed"] if s["bytes_written"] is not None else None} for s in c["steps"]]
    return rows, [v for r in rows if r["step"] >= 2 for v in (
        check("an incremental save writes <= 1.1x the changed bytes", f"save {r['step']}", f"{(r['bytes_written'] or 0) / MiB:.1f} MiB for "
              f"{r['bytes_changed'] / MiB:.1f} MiB = {f(r['x_written'])}x", r["x_written"] is not None and r["x_written"] <= 1.1),
        check("an incremental save takes <= 0.2x a full save", f"save {r['step']}",
              f"{r['inc_s']:.2f} s vs {r['full_s']:.2f} s = {r['x_full']:.2f}x", r["x_full"] <= 0.2))]


SPEC = Spec(
    "incremental", "Incremental checkpoints", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--size": dict(type=float, default=1.0, help="state size in GB (default 1)"),
             "--saves": dict(type=int, default=5, help="saves (steps 1..N; default 5)")},
    columns=[Column("step", "step", None), Column("incremental s", "inc_s"), Column("full s", "full_s"), Column("× full", "x_full")]
    + [Column(f"{k} MiB", lambda r, k=k: (r[f"bytes_{k}"] or 0) / MiB, ".1f") for k in ("written", "shared", "changed")]
    + [Column("written / changed", "x_written")],
    epilogue=lambda results: "\n".join(f"{s['frozen_fraction'] * 100:.1f}% of the parameters frozen, 2 ranks, sync saves; each row's "
                                       "times are the slowest rank's." for s in results["sets"] if "frozen_fraction" in s),
    rank=rank_case, hidden=("--_saves",), repeat=1)

main(SPEC, __name__)
