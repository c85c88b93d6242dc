"""Benchmark: offline ``ckpttool reshard`` against a file copy and against resharding online.

A ~4 GB checkpoint (fp32 params + AdamW state) is saved with ckpttool from 2 gloo CPU ranks (a plain DCP directory plus
the commit record), or ``--src`` names one. Each case runs in fresh processes, the page cache dropped before it:

  raw copy             the DCP files read and written to one file + fsync (``_common.raw_copy``, one Python
                       process): the limit for a tool that reads and writes every byte once
  ckpttool reshard M   ``ckpttool.offline.reshard.reshard(src, dst, world_size=M)`` (what ``ckpttool reshard SRC DST
                       --world-size M`` runs), one process, default budget 1 GiB
  online M             without the tool: M ranks build the FSDP2 model and AdamW, ``dcp.load`` (DCP reshards
                       while reading) and ``set_state_dict``, then ``dcp.save`` to a new directory

Times: the work inside the processes (after imports; online: load + save after the model is built, slowest
rank), and the whole processes (spawn to exit: interpreter, imports, model build). Every output is fsync'ed in
the timed work (ckpttool and DCP fsync their files; an fsync of the tree follows). Peak memory: the process
tree's (the larger of its largest process's peak RSS and the polled peak of its summed anonymous + shmem
pages: shared library pages do not count). The fastest run of each case is reported, every value from it.

    .venv/bin/python bench/reshard.py --size 4 --md docs/bench/reshard.md --plot docs/img/bench-reshard.png

Targets (issue "offline reshard"): <= 1.1x the copy's time; >= 2x faster than online; peak RSS <= budget + 300 MB.
"""

import json
import os
import time
from typing import Any

from _common import GB, MiB, drop_caches, fsync_tree, path_bytes, proc_status, raw_copy, remove, reset_peak_rss, timed
from _dist import dcp_files, finish_rank, fit_layers, init_rank, model_dims  # importing _dist puts this repository first on sys.path
from harness import Chart, Column, Panel, Set, Spec, check, main, peak_check

from ckpttool.choices import parse_size

SAVED_ON = "2"


def single_case(args) -> dict[str, Any]:
    """A one-process case (raw copy, ckpttool reshard): the work after imports, then an fsync of the output."""
    if args._case.startswith("ckpt"):
        for m in ("torch", "ckpttool.formats.dcp"):
            __import__(m)  # imports are not the work
        from ckpttool.offline.reshard import reshard
    rss0, t0 = reset_peak_rss(), time.perf_counter()
    if args._case == "raw_copy":
        out = raw_copy(dcp_files(args._src), args._dst)
    else:
        rep = reshard(args._src, args._dst, world_size=int(args._case.split("_")[-1]), memory_budget=args.budget)
        out = {"bytes": rep.bytes, "tensors": rep.tensors, "bytes_per_rank": rep.bytes_per_rank}
    t1 = time.perf_counter()
    fsync_tree(args._dst)
    t2 = time.perf_counter()
    return {"ok": True, "work_s": t1 - t0, "fsync_s": t2 - t1, "seconds": t2 - t0, "out": out,
            "rss0_kib": rss0, "hwm_growth_kib": (proc_status("VmHWM") or 0) - rss0}


def online_rank(args) -> None:
    """One rank of the online way: build, load (resharding), save again."""
    init_rank(args)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from _dist import make_mesh, shell_model

    tb = time.perf_counter()
    model = shell_model(json.loads(args._cfg), make_mesh(str(args._world)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = dict(zip(("model", "optim"), get_state_dict(model, opt)))  # creates AdamW's state to load into
    build_s = time.perf_counter() - tb
    dist.barrier()
    rss0, t0 = reset_peak_rss(), time.perf_counter()
    dcp.load(state, checkpoint_id=args._src)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    t1 = time.perf_counter()
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=args._dst)
    dist.barrier()
    t2 = time.perf_counter()
    finish_rank(args, {"ok": True, "build_s": build_s, "load_s": t1 - t0, "save_s": t2 - t1, "seconds": t2 - t0,
                       "rss0_kib": rss0, "hwm_kib": proc_status("VmHWM") or 0, "torch": torch.__version__})


def measure(run, name: str, src: str, cfg: dict[str, int]) -> dict[str, Any]:
    """One run of a case in fresh processes, the page cache dropped before it (unless warm)."""
    dst = os.path.join(run.work, "copy.bin" if name == "raw_copy" else "out")
    remove(dst)
    dropped = drop_caches() if run.cold else False
    if name.startswith("online"):
        args = ["--_case", "online", "--_src", src, "--_dst", dst, "--_cfg", json.dumps(cfg)]
        ranks, proc = run.ranks(name, int(name.split("_")[1]), args)
        r = {"ok": ranks is not None, "rc": proc.rc}
        if ranks is not None:
            extra_sync = timed(lambda: fsync_tree(dst))  # DCP fsyncs its files already: this only makes sure
            r.update({k: max(x[k] for x in ranks) for k in ("seconds", "load_s", "save_s", "build_s")},
                     process_wall_s=proc.wall_s + extra_sync, peak_kib=proc.peak_kib, rank_peak_kib=max(x["hwm_kib"] for x in ranks))
            r["seconds"] += extra_sync
    else:
        r, _ = run.child(name, ["--_case", name, "--_src", src, "--_dst", dst, "--budget", run.args.budget])
    if r["ok"]:
        r["out_bytes"] = path_bytes(dst)
    r["cache_dropped"] = dropped
    remove(dst)
    return r


def label(name: str) -> str:
    """A case in words."""
    m = name.split("_")[-1]
    if name == "raw_copy":
        return "raw copy of the DCP files (+fsync)"
    if name.startswith("ckpt"):
        return f"ckpttool reshard 2 -> {m} ranks"
    return f"online: {m} ranks load + dcp.save" + (" (oversubscribed)" if int(m) > 2 else "")


def sets(run):
    """The checkpoint (or --src): the raw copy, the reshard to each of --worlds, the online way to each."""
    small = run.args.small_tensors
    src, info = (run.checkpoint(run.args.size, SAVED_ON, fit_layers({**model_dims(run.args.size), "small": small}, run.args.size),
                                name=f"ckpt-{run.args.size:g}GB-on-{SAVED_ON}-{small}small") if small else run.checkpoint(run.args.size, SAVED_ON))
    worlds, cfg = [int(w) for w in run.args.worlds.split(",") if w], info.get("cfg") or model_dims(run.args.size)
    online = [] if run.args.no_online else [f"online_{w}" for w in worlds]
    yield Set(["raw_copy"] + [f"ckpt_reshard_{w}" for w in worlds] + online, lambda n: measure(run, n, src, cfg),
              lambda n, r: (f"{label(n):<44} work {r['seconds']:7.1f} s  whole {r['process_wall_s']:7.1f} s  "
                            f"peak {r['peak_kib'] / 1024:6.0f} MiB"),
              heading=f"{info['file_bytes'] / GB:.2f} GB checkpoint saved on {SAVED_ON} ranks", info=info)


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows (ratios to the raw copy and to the online way) and the verdict on each target."""
    cases, nbytes, limit_mib = res["cases"], res["checkpoint"]["file_bytes"], (parse_size(run.args.budget) + 300 * 1000**2) / MiB
    copy, rows, checks = cases.get("raw_copy", {}), [], []
    for name, c in cases.items():
        rows.append(row := {"case": name, "label": label(name)})
        if not c.get("ok"):
            row["failed"] = True
            continue
        m = name.split("_")[-1]
        online = cases.get(f"online_{m}", {}) if name.startswith("ckpt") else {}
        row.update(seconds=c["seconds"], wall_s=c["process_wall_s"], gbps=nbytes / c["seconds"] / GB,
                   x_copy=c["seconds"] / copy["seconds"] if copy.get("ok") else None,
                   speedup_online=online["seconds"] / c["seconds"] if online.get("ok") else None,
                   speedup_online_wall=online["process_wall_s"] / c["process_wall_s"] if online.get("ok") else None,
                   peak_mib=c["peak_kib"] / 1024, detail="")
        if name.startswith("online"):
            row["detail"] = (f"build {c['build_s']:.1f} s, load {c['load_s']:.1f} s, save {c['save_s']:.1f} s; "
                             f"per rank peak {c['rank_peak_kib'] / 1024:.0f} MiB")
        if not name.startswith("ckpt"):
            continue
        row["detail"], tag = f"fsync after {c['fsync_s']:.2f} s", f"reshard 2 -> {m} ranks @ {nbytes / GB:.1f} GB"
        if row["x_copy"] is not None:
            checks.append(check("<= 1.1x a copy of the same bytes (+fsync)", tag,
                                f"{c['seconds']:.1f} s vs {copy['seconds']:.1f} s = {row['x_copy']:.2f}x", row["x_copy"] <= 1.1))
        for what, key, x in (("work only", "seconds", "speedup_online"), ("whole processes", "process_wall_s", "speedup_online_wall")):
            if row[x] is not None:
                checks.append(check(f">= 2x faster than online ({what})", tag,
                                    f"{online[key]:.1f} s / {c[key]:.1f} s = {row[x]:.2f}x", row[x] >= 2))
        checks.append(peak_check(tag, row["peak_mib"], limit_mib))
    return rows, checks


SPEC = Spec(
    "reshard", "Benchmark: offline reshard", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--size": dict(type=float, default=4.0, help="checkpoint size in GB (default 4)"),
             "--worlds": dict(default="1,3,4", help="target world sizes (default 1,3,4)"),
             "--small-tensors": dict(type=int, default=0, help="also this many parameters of 4096 fp32 elements in the checkpoint (16 KiB: with their AdamW state, 3 tensors under 64 KiB each; default 0; run_all: 3334 at 2 GB, 10,002 small tensors)"),
             "--src": dict(help="use this existing DCP checkpoint (or ckpttool training root) instead of writing one"),
             "--no-online": dict(action="store_true", help="leave out the online cases (the copy and the reshards only)")},
    columns=[Column("case", "label", None), Column("work s", "seconds", ".1f"), Column("GB/s", "gbps"),
             Column("× copy time", "x_copy"), Column("online / this (work)", "speedup_online"),
             Column("whole processes s", "wall_s", ".1f"), Column("online / this (whole)", "speedup_online_wall"),
             Column("peak MiB (tree, anon+shmem)", "peak_mib", ".0f"), Column("detail", "detail", None)],
    chart=Chart([Panel("seconds", "seconds (grey: raw copy, blue: ckpttool, red: online with plain DCP)", also="wall_s",
                       legend=("work (after imports / model build)", "whole processes")),
                 Panel("peak_mib", "peak RSS of the process tree (MiB)", log=True, limit_label="budget + 300 MB",
                       limit=lambda res: (parse_size(res["options"]["budget"]) + 300 * 1000**2) / MiB)],
                title=lambda res: f"reshard {res['checkpoint']['file_bytes'] / GB:.2f} GB saved on {SAVED_ON} ranks"),
    child=single_case, rank=online_rank, flags=("budget", "keep", "warm"))

main(SPEC, __name__)
