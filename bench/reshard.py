"""Benchmark: offline ``ckpttool reshard`` against a file copy and against resharding online.

A ~4 GB checkpoint (fp32 params + AdamW state) is saved with ckpttool from 2 gloo CPU ranks (a
plain DCP directory plus the commit record). Then, each case in a fresh process with the page
cache dropped before it:

  raw copy             the checkpoint's DCP files read and written to one file + fsync, from a Python
                       process (``_common.raw_copy``): the limit for a tool that reads and writes
                       every byte once
  ckpttool reshard M   ``ckpttool.commands.reshard(src, dst, world_size=M)`` (what ``ckpttool
                       reshard SRC DST --world-size M`` runs), one process, default budget 1 GiB
  online M             what one does without the tool: start M ranks, build the FSDP2 model and AdamW
                       on them, ``dcp.load`` (DCP reshards while reading) and ``set_state_dict``,
                       then ``dcp.save`` to a new directory

Times: the work inside the processes (after imports; online: load + save after the model is
built, slowest rank) and each case's whole process time (spawn to exit: interpreter, imports,
model build). Every output is fsync'ed inside the timed work (ckpttool and DCP fsync their files;
an fsync of the tree follows). Peak memory: the whole process tree (the larger of the largest
single process's peak RSS and the polled peak of the tree's summed anonymous + shmem pages, so shared library pages do not count).
One run per case is reported, the fastest, with every value from that run.

    .venv/bin/python bench/reshard.py --size 4 --md docs/bench/reshard.md --plot docs/img/bench-reshard.png

Targets (issue "offline reshard"): <= 1.25x the copy's time; >= 2x faster than the online way;
peak RSS <= budget (1 GiB) + 300 MB.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import GB, MiB, drop_caches, fsync_tree, path_bytes, proc_status, raw_copy, remove, reset_peak_rss  # noqa: E402
from _dist import dcp_files, finish_rank, init_rank, model_dims  # noqa: E402
from harness import Chart, Column, Panel, Set, Spec, check, main  # noqa: E402

from ckpttool.choices import parse_size  # noqa: E402

SAVED_ON = "2"


def single_case(args) -> dict[str, Any]:
    """A one-process case (raw copy, ckpttool reshard): the work after imports, then an fsync of the output."""
    if args._case.startswith("ckpt"):
        import torch  # noqa: F401 - imports are not the work

        import ckpttool.commands  # noqa: F401
        import ckpttool.formats.dcp  # noqa: F401
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    if args._case == "raw_copy":
        out = raw_copy(dcp_files(args._src), args._dst)
    else:
        from ckpttool.commands import reshard

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
    msd, osd = get_state_dict(model, opt)  # creates AdamW's state to load into
    build_s = time.perf_counter() - tb
    dist.barrier()
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=args._src)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    t1 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=args._dst)
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
        ranks, proc = run.ranks(name, int(name.split("_")[1]), ["--_case", "online", "--_src", src, "--_dst", dst, "--_cfg", json.dumps(cfg)])
        r = {"ok": ranks is not None, "rc": proc.rc}
        if ranks is not None:
            t0 = time.perf_counter()
            fsync_tree(dst)  # DCP fsyncs its files already: this only makes sure
            extra_sync = time.perf_counter() - t0
            r.update(seconds=max(x["seconds"] for x in ranks) + extra_sync, load_s=max(x["load_s"] for x in ranks),
                     save_s=max(x["save_s"] for x in ranks), build_s=max(x["build_s"] for x in ranks),
                     process_wall_s=proc.wall_s + extra_sync, peak_kib=proc.peak_kib, rank_peak_kib=max(x["hwm_kib"] for x in ranks))
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
    """The checkpoint (or --src) with the copy, the reshards and the online way; with --online-size,
    the online way on a second checkpoint of that size."""
    args = run.args
    worlds = [int(w) for w in args.worlds.split(",") if w]
    online = [int(w) for w in (args.online_worlds or args.worlds).split(",") if w]
    plans = [(args.size, worlds, online if args.online_size is None else [])]
    if args.online_size is not None:
        plans.append((args.online_size, online, online))
    for i, (size, ckpt_worlds, online_worlds) in enumerate(plans):
        src, info = run.checkpoint(size, SAVED_ON, use_src=i == 0)
        cfg = info.get("cfg") or model_dims(size)
        names = ["raw_copy"] + [f"ckpt_reshard_{w}" for w in ckpt_worlds] + [f"online_{w}" for w in online_worlds]
        yield Set(names, lambda n, src=src, cfg=cfg: measure(run, n, src, cfg),
                  lambda n, r: f"{label(n):<44} work {r['seconds']:7.1f} s  whole {r['process_wall_s']:7.1f} s  peak {r['peak_kib'] / 1024:6.0f} MiB",
                  heading=f"{info['file_bytes'] / GB:.2f} GB checkpoint saved on {SAVED_ON} ranks", tag="" if i == 0 else "online", info=info)


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows (ratios to the raw copy and to the online way) and the verdict on each target."""
    cases, nbytes = res["cases"], res["checkpoint"]["file_bytes"]
    copy = cases.get("raw_copy", {})
    rows, checks = [], []
    limit_mib = (parse_size(run.args.budget) + 300 * 1000**2) / MiB
    for name, c in cases.items():
        if not c.get("ok"):
            rows.append({"case": name, "label": label(name), "failed": True})
            continue
        m = name.split("_")[-1]
        online = cases.get(f"online_{m}", {}) if name.startswith("ckpt") else {}
        row = {"case": name, "label": label(name), "seconds": c["seconds"], "wall_s": c["process_wall_s"], "gbps": nbytes / c["seconds"] / GB,
               "x_copy": c["seconds"] / copy["seconds"] if copy.get("ok") else None,
               "speedup_online": online["seconds"] / c["seconds"] if online.get("ok") else None,
               "speedup_online_wall": online["process_wall_s"] / c["process_wall_s"] if online.get("ok") else None,
               "peak_mib": c["peak_kib"] / 1024, "detail": ""}
        if name.startswith("online"):
            row["detail"] = f"build {c['build_s']:.1f} s, load {c['load_s']:.1f} s, save {c['save_s']:.1f} s; per rank peak {c['rank_peak_kib'] / 1024:.0f} MiB"
        elif name.startswith("ckpt"):
            row["detail"] = f"fsync after {c['fsync_s']:.2f} s"
        rows.append(row)
        if not name.startswith("ckpt"):
            continue
        tag = f"reshard 2 -> {m} ranks @ {nbytes / GB:.1f} GB"
        if row["x_copy"] is not None:
            checks.append(check("<= 1.1x a copy of the same bytes (+fsync)", tag,
                                f"{c['seconds']:.1f} s vs {copy['seconds']:.1f} s = {row['x_copy']:.2f}x", row["x_copy"] <= 1.1))
        if row["speedup_online"] is not None:
            checks.append(check(">= 2x faster than online (work only)", tag,
                                f"{online['seconds']:.1f} s / {c['seconds']:.1f} s = {row['speedup_online']:.2f}x", row["speedup_online"] >= 2))
            checks.append(check(">= 2x faster than online (whole processes)", tag,
                                f"{online['process_wall_s']:.1f} s / {c['process_wall_s']:.1f} s = {row['speedup_online_wall']:.2f}x",
                                row["speedup_online_wall"] >= 2))
        checks.append(check(f"peak RSS <= budget + 300 MB ({limit_mib:.0f} MiB)", tag, f"{row['peak_mib']:.0f} MiB", row["peak_mib"] <= limit_mib))
    return rows, checks


def options(p) -> None:
    p.add_argument("--size", type=float, default=4.0, help="checkpoint size in GB (default 4)")
    p.add_argument("--worlds", default="1,3,4", help="target world sizes (default 1,3,4)")
    p.add_argument("--online-worlds", default=None, help="world sizes of the online way (default: --worlds)")
    p.add_argument("--online-size", type=float, default=None,
                   help="run the online way (and a ckpttool reshard to compare with) on a checkpoint of this size instead")
    p.add_argument("--budget", default="1GiB", help="ckpttool reshard's --memory-budget (default 1GiB)")
    p.add_argument("--src", help="use this existing DCP checkpoint (or ckpttool training root) instead of writing one")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the generated checkpoint")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")


SPEC = Spec(
    "reshard", "Benchmark: offline reshard", __doc__, os.path.abspath(__file__), options, sets, derive,
    columns=[Column("case", "label", None), Column("work s", "seconds", ".1f"), Column("GB/s", "gbps"),
             Column("× copy time", "x_copy"), Column("online / this (work)", "speedup_online"),
             Column("whole processes s", "wall_s", ".1f"), Column("online / this (whole)", "speedup_online_wall"),
             Column("peak MiB (tree, anon+shmem)", "peak_mib", ".0f"), Column("detail", "detail", None)],
    chart=Chart([Panel("seconds", "seconds (grey: raw copy, blue: ckpttool, red: online with plain DCP)", also="wall_s",
                       legend=("work (after imports / model build)", "whole processes")),
                 Panel("peak_mib", "peak RSS of the process tree (MiB)", log=True, limit_label="budget + 300 MB",
                       limit=lambda res: (parse_size(res["options"]["budget"]) + 300 * 1000**2) / MiB)],
                title=lambda res: f"reshard {res['checkpoint']['file_bytes'] / GB:.2f} GB saved on {SAVED_ON} ranks"),
    child=single_case, rank=online_rank)

if __name__ == "__main__":
    sys.exit(main(SPEC))
