"""Benchmark: loading a checkpoint into FSDP2 / HSDP models on the same and on other world sizes.

A ~1 GB state (fp32 params + AdamW state) is saved with ckpttool from 2 gloo CPU ranks, and at each
target layout (1, 3, 4 ranks, HSDP 2x2) too, so that a resharding load is compared with one that
needs none on the same ranks. A case is a fresh set of ranks (``build_fsdp_model`` on the target
mesh, AdamW state made before any clock) timing, barrier to barrier (slowest rank):

  dcp.load        plain torch: ``get_state_dict``, ``dcp.load``, ``set_state_dict`` (no checks)
  load, no checks ``Checkpointer.load(model, optimizer, verify=False)``
  load            ``Checkpointer.load(model, optimizer)``: every record's CRC-32 and the manifest checked
  verify_loaded   ``ckpttool.verify_loaded(model, optimizer, path)`` right after it

cold (the page cache dropped before the ranks start, and by rank 0 before each later step), then
warm in the same processes. Peak RSS per rank (VmHWM, reset before each step) and of the process
tree (anonymous + shmem pages); bytes read: rchar (/proc/self/io) around the checked load, all
ranks, and its read system calls (syscr: the files' and gloo's sockets'). Of ``--repeat`` runs, the one with the smallest load time is reported.

    .venv/bin/python bench/load.py --size 1 --md docs/bench/load.md --plot docs/img/bench-load.png

Targets: resharding load <= 1.1x the load saved on that layout, verify_loaded <= 1x the load (issue
"resharding loads"); a load's checks <= 10% over plain ``dcp.load`` (issue "trust"). 3 and 4 ranks
oversubscribe 2 cores: both sides of a comparison run on the same ranks.
"""

import json
import os
import time
from typing import Any

from _common import GB, MiB, cache_states, drop_caches, proc_io, proc_status, raw_read, reset_peak_rss
from _dist import dcp_files, finish_rank, init_rank, make_mesh, mesh_label, mesh_world, model_dims, state_nbytes
from harness import Chart, Column, Panel, Set, Spec, check, main

SAVED_ON = "2"


def rank_case(args) -> None:
    """One rank: per cache state the four steps, each with its own peak RSS and bytes read."""
    init_rank(args)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckpttool import Checkpointer, verify_loaded
    from ckpttool.training.trainer.model import ModelConfig, build_fsdp_model

    mesh, t = make_mesh(args._mesh), time.perf_counter()
    model = build_fsdp_model(ModelConfig(**json.loads(args._cfg)), mesh, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    rank_bytes = state_nbytes(get_state_dict(model, optimizer))  # creates the AdamW state: not part of the load
    build_s = time.perf_counter() - t
    ck = Checkpointer(os.path.dirname(args._src))

    def plain_dcp_load() -> None:
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        dcp.load(state, checkpoint_id=args._src)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    phases: dict[str, Any] = {}
    for phase in args._phases.split(","):  # cold (dropped by the parent) first, then warm: the same steps again
        ph = phases[phase] = {}

        def step(key: str, fn, recool: bool = phase == "cold"):
            ph[key + "_cache_dropped"] = recool and dist.get_rank() == 0 and drop_caches()
            dist.barrier()
            rss0, io0, t0 = reset_peak_rss(), proc_io(), time.perf_counter()
            out = fn()
            dist.barrier()
            t1, io1, hwm = time.perf_counter(), proc_io(), proc_status("VmHWM") or 0
            ph[key + "_s"], ph[key + "_read_bytes"], ph[key + "_read_calls"] = t1 - t0, io1["rchar"] - io0["rchar"], io1["syscr"] - io0["syscr"]
            ph[key + "_hwm_kib"], ph[key + "_added_kib"] = hwm, hwm - rss0
            return out

        step("dcp", plain_dcp_load, recool=False)
        step("nocheck", lambda: ck.load(model, optimizer, verify=False))
        res = step("load", lambda: ck.load(model, optimizer))
        report = step("verify", lambda: verify_loaded(model, optimizer, res.path))
        ph.update(ok=bool(report.ok), mismatches=len(report.mismatches), tensors_checked=report.tensors_checked, step=res.step)
    finish_rank(args, {"ok": all(p["ok"] for p in phases.values()), "phases": phases, "build_s": build_s,
                       "rank_state_bytes": rank_bytes, "torch": torch.__version__})


def measure(run, case: str, steps: dict[str, str], cfg: dict[str, int], caches: list[str]) -> dict[str, dict[str, Any]]:
    """One set of ranks (``case``: MESH|SRC) loading SRC's checkpoint on MESH in every cache state, cold (or else warm) first."""
    mesh, src = case.split("|")
    dropped = caches[0] == "cold" and drop_caches()
    if caches[0] != "cold":
        raw_read(dcp_files(steps[src]))
    args = ["--_src", steps[src], "--_mesh", mesh, "--_cfg", json.dumps(cfg), "--_phases", ",".join(caches)]
    ranks, proc = run.ranks(f"{mesh}_from_{src}", mesh_world(mesh), args)
    if ranks is None:
        return {c: {"ok": False, "rc": proc.rc} for c in caches}
    out = {}
    for cache in caches:
        ph = [r["phases"][cache] for r in ranks]
        c = out[cache] = {k: max(x[k] for x in ph) for k in ph[0]}  # the slowest rank, the largest peak
        c.update(ok=True, cache_dropped=dropped and cache == "cold", build_s=max(r["build_s"] for r in ranks),
                 rank_state_bytes=max(r["rank_state_bytes"] for r in ranks), rank_peak_kib=max(c["load_hwm_kib"], c["verify_hwm_kib"]),
                 tree_peak_kib=proc.peak_kib, process_wall_s=proc.wall_s,
                 # what the ranks' read calls returned in the checked load (page cache or disk) against what they hold
                 read_bytes=sum(x["load_read_bytes"] for x in ph), needed_bytes=sum(r["rank_state_bytes"] for r in ranks),
                 read_calls=sum(x["load_read_calls"] for x in ph))  # (read system calls: files, and the sockets of gloo)
    return out


def sets(run):
    """The checkpoints on the source's and (unless --no-matched) each target layout; a set of ranks per (layout, checkpoint)."""
    args, targets = run.args, [m for m in run.args.meshes.split(",") if m]
    made = {m: run.checkpoint(args.size, m) for m in [SAVED_ON] + ([] if args.no_matched else targets)}
    steps, cfg = {m: v[0] for m, v in made.items()}, model_dims(args.size)
    caches = sorted(cache_states(args.caches), key=lambda c: c != "cold")
    plan = [f"{SAVED_ON}|{SAVED_ON}"] + [f"{m}|{SAVED_ON}" for m in targets] + ([] if args.no_matched else [f"{m}|{m}" for m in targets])
    yield Set(plan, lambda case: measure(run, case, steps, cfg, caches),
              lambda k, r: (f"{k:<14} load {r['load_s']:6.2f} s (dcp.load {r['dcp_s']:6.2f}, unchecked {r['nocheck_s']:6.2f})  "
                            f"verify_loaded {r['verify_s']:6.2f} s  peak/rank {r['rank_peak_kib'] / 1024:5.0f} MiB"),
              info=made[SAVED_ON][1], time_keys=["load_s", "verify_s", "build_s", "dcp_s", "nocheck_s"],
              peak_keys=["rank_peak_kib", "load_added_kib", "verify_added_kib", "tree_peak_kib"],
              explode=lambda case, out: {f"{case}|{c}": r for c, r in out.items()})


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows, cold first (ratios to the load on the same layout and on the source's ranks), and the verdicts."""
    nbytes, cases, rows, checks = res["checkpoint"]["state_bytes"], res["cases"], [], []
    for key in sorted(cases, key=lambda k: k.split("|")[2] != "cold"):
        c, (mesh, src, cache) = cases[key], key.split("|")
        row = {"mesh": mesh, "src": src, "cache": cache, "label": f"{mesh_label(mesh)} from {mesh_label(src)}", "failed": not c.get("ok")}
        rows.append(row)
        if row["failed"]:
            continue
        matched, same = cases.get(f"{mesh}|{mesh}|{cache}", {}), cases.get(f"{SAVED_ON}|{SAVED_ON}|{cache}", {})
        row.update(c, gbps=nbytes / c["load_s"] / GB, verify_x_load=c["verify_s"] / c["load_s"], x_dcp=c["load_s"] / c["dcp_s"],
                   x_nocheck=c["load_s"] / c["nocheck_s"], read_x_needed=c["read_bytes"] / c["needed_bytes"],
                   x_matched=c["load_s"] / matched["load_s"] if matched.get("ok") and src != mesh else None,
                   x_same2=c["load_s"] / same["load_s"] if same.get("ok") else None)
        tag = f"{row['label']}, {cache}"
        if row["x_matched"] is not None:
            checks.append(check("resharding load <= 1.1x the same-size load", tag,
                                f"{c['load_s']:.2f} s vs {matched['load_s']:.2f} s = {row['x_matched']:.2f}x", row["x_matched"] <= 1.1))
        checks += [check("bytes a load reads <= 1.1x the bytes its ranks need", tag, f"{c['read_bytes'] / MiB:.0f} MiB for "
                         f"{c['needed_bytes'] / MiB:.0f} MiB = {row['read_x_needed']:.2f}x", row["read_x_needed"] <= 1.1),
                   check("load with its checks <= 1.1x plain dcp.load", tag, f"{c['load_s']:.2f} s vs {c['dcp_s']:.2f} s = "
                         f"{row['x_dcp']:.2f}x (unchecked {c['nocheck_s']:.2f} s)", row["x_dcp"] <= 1.1),
                   check("verify_loaded <= 1x the load time", tag,
                         f"{c['verify_s']:.2f} s vs {c['load_s']:.2f} s = {row['verify_x_load']:.2f}x", row["verify_x_load"] <= 1.0)]
    return rows, checks


SPEC = Spec(
    "load", "Benchmark: loading on the same and on other layouts", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--size": dict(type=float, default=1.0, help="state size in GB (default 1)"),
             "--meshes": dict(default="1,3,4,2x2", help="target layouts besides the source's 2 ranks (default 1,3,4,2x2)"),
             "--no-matched": dict(action="store_true", help="skip the checkpoints saved natively on each target layout"),
             "--caches": dict(default="cold,warm", help="cache states to load in, in the same processes (default cold,warm)")},
    columns=[Column(*c) for c in [
        ("load on", lambda r: mesh_label(r["mesh"]), None), ("saved on", lambda r: mesh_label(r["src"]), None), ("cache", "cache", None),
        ("load s", "load_s"), ("GB/s", "gbps"), ("dcp.load s", "dcp_s"), ("× dcp.load", "x_dcp"), ("unchecked s", "nocheck_s"),
        ("× unchecked", "x_nocheck"), ("× same layout", "x_matched"), (f"× load on {SAVED_ON}", "x_same2"), ("verify_loaded s", "verify_s"),
        ("verify / load", "verify_x_load"), ("read / needed", "read_x_needed"), ("read calls", "read_calls", ".0f"),
        ("peak RSS/rank MiB", lambda r: r["rank_peak_kib"] / 1024, ".0f"),
        ("added by load MiB/rank (rank state)", lambda r: f"+{r['load_added_kib'] / 1024:.0f} ({r['rank_state_bytes'] / MiB:.0f})", "s"),
        ("added by verify MiB", lambda r: r["verify_added_kib"] / 1024, "+.0f"),
        ("tree peak anon+shmem MiB", lambda r: r["tree_peak_kib"] / 1024, ".0f")]],
    chart=Chart([Panel("load_s", "seconds, slowest rank (blue: same layout, orange: resharding)", also="verify_s",
                       legend=("load", "verify_loaded"))], split="cache", color=lambda r: "#1f77b4" if r["src"] == r["mesh"] else "#ff7f0e",
                title=lambda res: f"ckpttool load of {res['checkpoint']['state_bytes'] / GB:.2f} GB saved on {SAVED_ON} ranks (3-4 ranks "
                                  "oversubscribe the cores)"),
    rank=rank_case, hidden=("--_phases",), flags=("keep",))

main(SPEC, __name__)
