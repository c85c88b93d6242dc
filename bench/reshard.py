"""Benchmark: offline ``ckpttool reshard`` against a file copy and against resharding online.

A ~4 GB checkpoint (fp32 params + AdamW state) is saved with ckpttool from 2 gloo CPU ranks (a
plain DCP directory plus the commit record). Then, each case in a fresh process with the page
cache dropped before it:

  raw copy             the checkpoint's DCP files read and written to one file + fsync, from a Python
                       process (``_common.raw_copy``): the limit for a tool that reads and writes
                       every byte once
  ckpttool reshard M   ``ckpttool.pipeline.reshard(src, dst, world_size=M)`` (what ``ckpttool
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

import argparse
import json
import os
import re
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB,
    MiB,
    child_argv,
    drop_caches,
    fsync_tree,
    machine_facts,
    path_bytes,
    proc_status,
    raw_copy,
    remove,
    reset_peak_rss,
    run_child,
    write_json,
)
from _dist import (  # noqa: E402
    add_rank_args,
    can_drop_caches,
    best_of,
    dcp_dir_of,
    dcp_files,
    f,
    finish_rank,
    gen_rank,
    generate,
    init_rank,
    md_table,
    measure_ranks,
    model_dims,
    text_table,
    verdict_lines,
    md_header,
    verdict_md,
    wait_for_convert,
)

SCRIPT = os.path.abspath(__file__)
SAVED_ON = "2"


def parse_size(text: str) -> int:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", text, re.IGNORECASE)
    if not m:
        raise SystemExit(f"cannot read size {text!r}")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


# --- cases inside a child ------------------------------------------------------------------------


def single_case(name: str, src: str, dst: str, world: int, budget: str) -> dict[str, Any]:
    if name.startswith("ckpt"):
        import torch  # noqa: F401 - imports are not the work

        import ckpttool.formats.dcp  # noqa: F401
        import ckpttool.pipeline  # noqa: F401
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    if name == "raw_copy":
        out = raw_copy(dcp_files(src), dst)
    else:
        from ckpttool.pipeline import reshard

        rep = reshard(src, dst, world_size=world, memory_budget=budget)
        out = {"bytes": rep.bytes, "tensors": rep.tensors, "bytes_per_rank": rep.bytes_per_rank}
    t1 = time.perf_counter()
    fsync_tree(dst)
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

    cfg = json.loads(args._cfg)
    tb = time.perf_counter()
    mesh = make_mesh(str(args._world))
    model = shell_model(cfg, mesh)
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


# --- the parent ----------------------------------------------------------------------------------


def measure(name: str, args, work: str, src: str, cfg: dict[str, int]) -> dict[str, Any]:
    dst = os.path.join(work, "out" if not name == "raw_copy" else "copy.bin")
    remove(dst)
    dropped = drop_caches() if not args.warm else False
    if name.startswith("online"):
        world = int(name.split("_")[1])
        run = measure_ranks(SCRIPT, world, ["--_case", "online", "--_src", src, "--_dst", dst, "--_cfg", json.dumps(cfg)],
                            work, name, timeout_s=args.case_timeout)
        ranks = run.result.get("ranks", []) if run.result else []
        ok = run.rc == 0 and ranks and all(r.get("ok") for r in ranks)
        r = {"ok": bool(ok), "rc": run.rc}
        if ok:
            t0 = time.perf_counter()
            fsync_tree(dst)  # DCP fsyncs its files already: this only makes sure
            extra_sync = time.perf_counter() - t0
            r.update(seconds=max(x["seconds"] for x in ranks) + extra_sync, load_s=max(x["load_s"] for x in ranks),
                     save_s=max(x["save_s"] for x in ranks), build_s=max(x["build_s"] for x in ranks),
                     process_wall_s=run.wall_s + extra_sync, peak_kib=run.peak_kib, out_bytes=path_bytes(dst),
                     rank_peak_kib=max(x["hwm_kib"] for x in ranks))
    else:
        world = int(name.split("_")[-1]) if name.startswith("ckpt") else 0
        result = os.path.join(work, "result.json")
        run = run_child(child_argv(SCRIPT, "--_single", name, "--_src", src, "--_dst", dst, "--_m", str(world),
                                   "--budget", args.budget, "--_result", result),
                        result, os.path.join(work, f"{name}.log"), timeout_s=args.case_timeout)
        ok = run.rc == 0 and run.result.get("ok")
        r = {"ok": bool(ok), "rc": run.rc}
        if ok:
            r.update(run.result)
            r.update(process_wall_s=run.wall_s, peak_kib=run.peak_kib, out_bytes=path_bytes(dst))
    if not r["ok"]:
        print(f"  !! {name} failed (exit {run.rc}):\n{run.log_tail[-6000:]}", file=sys.stderr)
    r["cache_dropped"] = dropped
    remove(dst)
    return r


def derive(results: dict[str, Any], budget: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cases, nbytes = results["cases"], results["checkpoint"]["file_bytes"]
    copy = cases.get("raw_copy", {})
    rows, checks = [], []
    limit_mib = (budget + 300 * 1000**2) / MiB
    for name, c in cases.items():
        if not c.get("ok"):
            rows.append({"case": name, "failed": True})
            continue
        m = name.split("_")[-1]
        online = cases.get(f"online_{m}", {}) if name.startswith("ckpt") else {}
        row = {"case": name, "seconds": c["seconds"], "wall_s": c["process_wall_s"], "gbps": nbytes / c["seconds"] / GB,
               "x_copy": c["seconds"] / copy["seconds"] if copy.get("ok") else None,
               "speedup_online": online["seconds"] / c["seconds"] if online.get("ok") else None,
               "speedup_online_wall": online["process_wall_s"] / c["process_wall_s"] if online.get("ok") else None,
               "peak_mib": c["peak_kib"] / 1024, "detail": ""}
        if name.startswith("online"):
            row["detail"] = f"build {c['build_s']:.1f} s, load {c['load_s']:.1f} s, save {c['save_s']:.1f} s; per rank peak {c['rank_peak_kib'] / 1024:.0f} MiB"
        elif name.startswith("ckpt"):
            row["detail"] = f"fsync after {c['fsync_s']:.2f} s"
        rows.append(row)
        if name.startswith("ckpt"):
            tag = f"reshard 2 -> {m} ranks @ {nbytes / GB:.1f} GB"
            if row["x_copy"] is not None:
                checks.append({"target": "<= 1.25x the raw copy's time", "case": tag,
                               "value": f"{c['seconds']:.1f} s vs {copy['seconds']:.1f} s = {row['x_copy']:.2f}x", "pass": row["x_copy"] <= 1.25})
            if row["speedup_online"] is not None:
                checks.append({"target": ">= 2x faster than online (work only)", "case": tag,
                               "value": f"{online['seconds']:.1f} s / {c['seconds']:.1f} s = {row['speedup_online']:.2f}x",
                               "pass": row["speedup_online"] >= 2})
                checks.append({"target": ">= 2x faster than online (whole processes)", "case": tag,
                               "value": f"{online['process_wall_s']:.1f} s / {c['process_wall_s']:.1f} s = {row['speedup_online_wall']:.2f}x",
                               "pass": row["speedup_online_wall"] >= 2})
            checks.append({"target": f"peak RSS <= budget + 300 MB ({limit_mib:.0f} MiB)", "case": tag,
                           "value": f"{row['peak_mib']:.0f} MiB", "pass": row["peak_mib"] <= limit_mib})
    return rows, checks


LABELS = {"raw_copy": "raw copy of the DCP files (+fsync)"}


def label(name: str) -> str:
    if name in LABELS:
        return LABELS[name]
    m = name.split("_")[-1]
    if name.startswith("ckpt"):
        return f"ckpttool reshard 2 -> {m} ranks"
    return f"online: {m} ranks load + dcp.save" + (" (oversubscribed)" if int(m) > 2 else "")


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ["case", "work s", "GB/s", "× copy time", "online / this (work)", "whole processes s", "online / this (whole)",
            "peak MiB (tree, anon+shmem)", "detail"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append([label(r["case"]), "failed"] + [""] * (len(head) - 2))
            continue
        lines.append([label(r["case"]), f(r["seconds"], ".1f"), f(r["gbps"]), f(r["x_copy"]), f(r["speedup_online"]),
                      f(r["wall_s"], ".1f"), f(r["speedup_online_wall"]), f(r["peak_mib"], ".0f"), r["detail"]])
    return (md_table if markdown else text_table)(head, lines, left=(0, 8))


def plot(results: dict[str, Any], rows: list[dict[str, Any]], path: str, budget: int) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    ok = [r for r in rows if not r.get("failed")]
    colors = [("#888888" if r["case"] == "raw_copy" else "#1f77b4" if r["case"].startswith("ckpt") else "#d62728") for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    y = list(range(len(ok)))
    ax1.barh([i - 0.2 for i in y], [r["seconds"] for r in ok], height=0.4, color=colors, label="work (after imports / model build)")
    ax1.barh([i + 0.2 for i in y], [r["wall_s"] for r in ok], height=0.4, color=colors, alpha=0.4, label="whole processes")
    ax1.set_yticks(y)
    ax1.set_yticklabels([label(r["case"]) for r in ok], fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds (grey: raw copy, blue: ckpttool, red: online with plain DCP)")
    ax1.legend(fontsize=8)
    ax1.grid(axis="x", alpha=0.3)
    ax2.barh(y, [r["peak_mib"] for r in ok], color=colors)
    lim = (budget + 300 * 1000**2) / MiB
    ax2.axvline(lim, color="r", ls="-.", label=f"budget + 300 MB ({lim:.0f} MiB)")
    ax2.set_yticks(y)
    ax2.set_yticklabels([label(r["case"]) for r in ok], fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xscale("log")
    ax2.set_xlabel("peak RSS of the process tree (MiB)")
    ax2.legend(fontsize=8)
    ax2.grid(axis="x", alpha=0.3, which="both")
    m = results["machine"]
    fig.suptitle(f"reshard {results['checkpoint']['file_bytes'] / GB:.2f} GB saved on {SAVED_ON} ranks: {m.get('cpus')} cores, "
                 f"{m.get('mem_total_gib')} GiB RAM, {m.get('disk_fs')} on {m.get('disk_device')}, torch {results.get('torch')}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=4.0, help="checkpoint size in GB (default 4)")
    p.add_argument("--worlds", default="1,3,4", help="target world sizes (default 1,3,4)")
    p.add_argument("--online-worlds", default=None, help="world sizes of the online way (default: --worlds)")
    p.add_argument("--online-size", type=float, default=None,
                   help="run the online way (and a ckpttool reshard to compare with) on a checkpoint of this size instead")
    p.add_argument("--budget", default="1GiB")
    p.add_argument("--out-dir", default="/tmp/ckpttool-bench-reshard")
    p.add_argument("--src", help="use this existing DCP checkpoint (or ckpttool training root) instead of writing one")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the generated checkpoint")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--case-timeout", type=float, default=1800)
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--plot")
    add_rank_args(p)
    p.add_argument("--_case", help=argparse.SUPPRESS)
    p.add_argument("--_single", help=argparse.SUPPRESS)
    p.add_argument("--_src", help=argparse.SUPPRESS)
    p.add_argument("--_dst", help=argparse.SUPPRESS)
    p.add_argument("--_m", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_cfg", help=argparse.SUPPRESS)
    p.add_argument("--_gen", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._gen:
        init_rank(args)
        dst, cfg, mesh, how = args._gen
        finish_rank(args, gen_rank(args, dst, json.loads(cfg), mesh, how))
        return 0
    if args._rank is not None:
        online_rank(args)
        return 0
    if args._single:
        write_json(args._result, single_case(args._single, args._src, args._dst, args._m, args.budget))
        return 0

    budget = parse_size(args.budget)
    out_dir = os.path.abspath(args.out_dir)
    work = os.path.join(out_dir, "work")
    os.makedirs(work, exist_ok=True)
    if not args.warm and not can_drop_caches():
        print("cannot drop the page cache (needs root): running warm", file=sys.stderr)
        args.warm = True
    machine = machine_facts(out_dir)
    print(f"machine: {json.dumps(machine)}", flush=True)
    src_gb = sum(os.path.getsize(x) for x in dcp_files(dcp_dir_of(os.path.abspath(args.src)))) / GB if args.src else args.size
    if src_gb > 0.5 and not args.no_wait:
        wait_for_convert()

    def checkpoint(size: float) -> tuple[str, dict[str, Any], bool]:
        cfg = model_dims(size)
        root = os.path.join(out_dir, f"ckpt-{size:g}GB-on-{SAVED_ON}")
        info_path = root + ".json"
        if args.keep and os.path.exists(info_path) and os.path.isdir(root):
            with open(info_path) as fh:
                info = json.load(fh)
            print(f"reusing {root}", flush=True)
        else:
            print(f"saving {size:g} GB with ckpttool on {SAVED_ON} ranks ...", flush=True)
            info = generate(SCRIPT, root, cfg, SAVED_ON, "ckpttool", work, "gen")
            info["file_bytes"] = sum(os.path.getsize(p) for p in dcp_files(dcp_dir_of(root)))
            write_json(info_path, info)
        return dcp_dir_of(root), info, not args.keep

    made: list[str] = []
    if args.src:
        src = dcp_dir_of(os.path.abspath(args.src))
        info_path = os.path.abspath(args.src).rstrip("/") + ".json"
        info = json.load(open(info_path)) if os.path.exists(info_path) else {}
        info["file_bytes"] = sum(os.path.getsize(p) for p in dcp_files(src))
        cfg = info.get("cfg") or model_dims(args.size)
    else:
        src, info, temp = checkpoint(args.size)
        cfg = info["cfg"]
        if temp:
            made.append(os.path.dirname(src))
    print(f"   {src}: {info['file_bytes'] / GB:.2f} GB of DCP files", flush=True)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    online_worlds = [int(w) for w in (args.online_worlds or args.worlds).split(",") if w]
    plans: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = []
    names = ["raw_copy"] + [f"ckpt_reshard_{w}" for w in worlds]
    if args.online_size is None:
        names += [f"online_{w}" for w in online_worlds]
        plans.append((src, info, cfg, names))
    else:
        plans.append((src, info, cfg, names))
        src2, info2, temp2 = checkpoint(args.online_size)
        if temp2:
            made.append(os.path.dirname(src2))
        plans.append((src2, info2, info2["cfg"], ["raw_copy"] + [f"ckpt_reshard_{w}" for w in online_worlds]
                      + [f"online_{w}" for w in online_worlds]))

    json_path = args.json or os.path.join(out_dir, "reshard-results.json")
    results_all = {"command": " ".join([os.path.relpath(sys.executable), os.path.relpath(SCRIPT), *(argv if argv is not None else sys.argv[1:])]),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine, "cold": not args.warm, "budget": args.budget,
                   "repeat": args.repeat, "sets": []}
    for src_dir, inf, c, names in plans:
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        print(f"\n== {inf['file_bytes'] / GB:.2f} GB ({src_dir})", flush=True)
        for rnd in range(args.repeat):
            for name in names:
                r = measure(name, args, work, src_dir, c)
                runs[name].append(r)
                if r.get("ok"):
                    print(f"   [{rnd + 1}/{args.repeat}] {label(name):<44} work {r['seconds']:7.1f} s  whole {r['process_wall_s']:7.1f} s"
                          f"  peak {r['peak_kib'] / 1024:6.0f} MiB", flush=True)
        res = {"checkpoint": inf, "machine": machine, "torch": inf.get("torch"),
               "cases": {n: best_of(rs, ["seconds", "process_wall_s"], ["peak_kib"]) for n, rs in runs.items()}, "all_runs": runs}
        res["rows"], res["checks"] = derive(res, budget)
        results_all["sets"].append(res)
        write_json(json_path, results_all)
    results_all["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(json_path, results_all)
    md = []
    for res in results_all["sets"]:
        head = f"{res['checkpoint']['file_bytes'] / GB:.2f} GB checkpoint saved on {SAVED_ON} ranks"
        print(f"\n{head}:\n" + render(res["rows"], markdown=False) + "\n")
        print("\n".join(verdict_lines(res["checks"])))
        md.append(f"### {head}\n\n" + render(res["rows"], markdown=True) + "\n\n" + verdict_md(res["checks"]) + "\n")
    print(f"\nresults: {json_path}")
    if args.md:
        results_all["torch"] = results_all["sets"][0].get("torch")
        with open(args.md, "w") as fh:
            fh.write(md_header("Benchmark: offline reshard", results_all))
            fh.write("\n".join(md))
        print(f"markdown: {args.md}")
    if args.plot:
        res = results_all["sets"][0]
        print(plot(res, res["rows"], args.plot, budget))
        if len(results_all["sets"]) > 1:
            base, ext = os.path.splitext(args.plot)
            res = results_all["sets"][1]
            print(plot(res, res["rows"], f"{base}-online{ext}", budget))
    for d in made:
        remove(d)
        remove(d + ".json")
    remove(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
