#!/usr/bin/env python3
"""Benchmark: incremental checkpoints of a model with a frozen base (issue 30).

A Transformer of about ``--size`` GB of state (the bundled model, fp32) on 2 gloo CPU ranks, with
95% of its parameters frozen (``requires_grad=False``; the trainable 5% are taken from the last
parameters back, passing over the output head, which alone is more; AdamW holds state only for them), saves steps 1..``--saves`` with ``Checkpointer(incremental=True)``,
one training step between saves (the trainable 5% and their AdamW state change). The same states
are also saved by a plain (full) Checkpointer in another root, so each incremental save is compared
with a full save of the same state in the same run. Each save is sync, timed barrier to barrier on
every rank (the slowest rank counts); bytes written and shared are the step's commit record's.

    .venv/bin/python bench/incremental.py --size 1 --md docs/bench/incremental.md

Targets: every save after the first writes <= 1.1x the changed bytes (the bytes of the trainable
parameters and the optimizer's state: what a save must write) and takes <= 0.2x a full save.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, MiB, add_run_args, f, json_path, md_header, now, parser, print_results, remove, run_header, start_run, table,
    verdict_md, write_json, write_markdown,
)
from _dist import add_rank_args, finish_rank, init_rank, measure_ranks, model_dims, rank_results  # noqa: E402

SCRIPT = os.path.abspath(__file__)
FROZEN = 0.95


def rank_case(args) -> None:
    init_rank(args)
    import torch
    import torch.distributed as dist

    from ckpttool import Checkpointer
    from ckpttool.steps import read_commit_record
    from ckpttool.storage import resolve
    from ckpttool.trainer.model import ModelConfig, build_fsdp_model, local_batch
    from _dist import make_mesh

    cfg = ModelConfig(**json.loads(args._cfg))
    model = build_fsdp_model(cfg, make_mesh("2"), seed=0)
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    # 5% of the parameters train, the rest is frozen: parameters are made trainable from the last
    # one back (the top of the model, as a fine-tune trains its last layers), passing over any
    # that would overshoot 5% by more than a tenth (the output head alone is 7% here), so the
    # fraction lands near 95% rather than wherever a whole parameter ends
    need, training = (1 - FROZEN) * total, 0
    for _, p in params:
        p.requires_grad_(False)
    for _, p in reversed(params):
        if training >= need:
            break
        if training + p.numel() <= 1.1 * need:
            p.requires_grad_(True)
            training += p.numel()
    trainable = [p for _, p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    inc = Checkpointer(os.path.join(args._root, "incremental"), incremental=True, keep_last=2)
    full = Checkpointer(os.path.join(args._root, "full"), keep_last=1)
    rows = []
    for step in range(1, args._saves + 1):
        x, y = local_batch(step, dist.get_rank(), dist.get_world_size(), 4, cfg, 0)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        changed = sum(p.to_local().numel() * p.element_size() for p in trainable)
        changed += sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
                       for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        times = {}
        for name, ck in (("incremental", inc), ("full", full)):
            dist.barrier()
            t0 = time.perf_counter()
            path = ck.save(step, model, optimizer)
            dist.barrier()
            times[name] = time.perf_counter() - t0
            if name == "incremental":
                record = read_commit_record(resolve(path)) or {}
        rows.append({"step": step, "inc_s": times["incremental"], "full_s": times["full"], "changed_bytes": changed,
                     "bytes_written": record.get("bytes_written"), "bytes_shared": record.get("bytes_shared")})
    inc.close()
    full.close()
    finish_rank(args, {"ok": True, "rows": rows, "frozen_fraction": 1 - sum(p.numel() for p in trainable) / total,
                       "torch": torch.__version__})


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=1.0, help="state size in GB (default 1)")
    p.add_argument("--saves", type=int, default=5, help="saves (steps 1..N; default 5)")
    add_run_args(p, "incremental", "/tmp/ckpttool-bench-incremental")
    add_rank_args(p, "--_root", "--_cfg", "--_saves")
    args = p.parse_args(argv)
    if args._rank is not None:
        args._saves = int(args._saves)
        rank_case(args)
        return 0
    out_dir, work, machine = start_run(args.out_dir)
    # model_dims sizes a model at 12 bytes a parameter (fp32 + AdamW); with 95% frozen a parameter
    # costs 4 bytes, plus 8 for the AdamW state of the 5% that train
    cfg = model_dims(args.size * 12 / (4 + 8 * (1 - FROZEN)))
    root = os.path.join(out_dir, "roots")
    remove(root)
    try:
        run = measure_ranks(SCRIPT, 2, ["--_root", root, "--_cfg", json.dumps(cfg), "--_saves", str(args.saves)], work, "incremental",
                            timeout_s=args.case_timeout)
        ranks = rank_results("incremental", run)
    finally:
        remove(root)
    results: dict[str, Any] = {**run_header(SCRIPT, argv, machine), "cfg": cfg, "ok": ranks is not None, "finished": now()}
    checks: list[dict[str, Any]] = []
    lines: list[list[str]] = []
    if ranks is not None:
        results["torch"] = ranks[0].get("torch")
        results["frozen_fraction"] = ranks[0]["frozen_fraction"]
        steps = []
        for i, row in enumerate(ranks[0]["rows"]):
            mx = lambda k: max(r["rows"][i][k] for r in ranks)  # noqa: E731
            changed = sum(r["rows"][i]["changed_bytes"] for r in ranks)
            s = {"step": row["step"], "inc_s": mx("inc_s"), "full_s": mx("full_s"), "changed_bytes": changed,
                 "bytes_written": row["bytes_written"], "bytes_shared": row["bytes_shared"]}
            steps.append(s)
            written_x = s["bytes_written"] / changed if s["bytes_written"] is not None else None
            lines.append([str(s["step"]), f(s["inc_s"]), f(s["full_s"]), f(s["inc_s"] / s["full_s"]),
                          f((s["bytes_written"] or 0) / MiB, ".1f"), f((s["bytes_shared"] or 0) / MiB, ".1f"),
                          f(changed / MiB, ".1f"), f(written_x)])
            if s["step"] >= 2:
                checks.append({"target": "an incremental save writes <= 1.1x the changed bytes", "case": f"save {s['step']}",
                               "value": f"{(s['bytes_written'] or 0) / MiB:.1f} MiB for {changed / MiB:.1f} MiB = {f(written_x)}x",
                               "pass": written_x is not None and written_x <= 1.1})
                checks.append({"target": "an incremental save takes <= 0.2x a full save", "case": f"save {s['step']}",
                               "value": f"{s['inc_s']:.2f} s vs {s['full_s']:.2f} s = {s['inc_s'] / s['full_s']:.2f}x",
                               "pass": s["inc_s"] / s["full_s"] <= 0.2})
        results["steps"] = steps
    else:
        checks.append({"target": "the benchmark ran", "case": "2 ranks", "value": "failed", "pass": False})
    head = ["step", "incremental s", "full s", "× full", "written MiB", "shared MiB", "changed MiB", "written / changed"]
    print_results(table(head, lines, False), checks)
    write_json(json_path(args, out_dir, "incremental"), {**results, "checks": checks})
    frac = results.get("frozen_fraction")
    write_markdown(args.md, md_header("Incremental checkpoints", results)
                   + f"\n{frac * 100 if frac is not None else float('nan'):.1f}% of the parameters frozen, 2 ranks, "
                     f"sync saves; each row's times are the slowest rank's.\n\n"
                   + table(head, lines, True) + "\n\n" + verdict_md(checks) + "\n")
    remove(work)
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
