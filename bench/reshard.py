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

from _common import (  # noqa: E402
    GB, MiB, add_run_args, bar_labels, best_of, cold_cache, drop_caches, f, failed_row, fsync_tree, json_path,
    machine_brief, md_header, measure_child, now, parse_size, parser, path_bytes, plot_file, print_results, proc_status,
    raw_copy, remove, report_failure, reset_peak_rss, run_header, run_rounds, start_run, table, verdict_md,
    wait_for_convert, write_json, write_markdown,
)
from _dist import (  # noqa: E402
    add_rank_args, checkpoint, dcp_bytes, dcp_dir_of, dcp_files, existing_checkpoint, finish_rank, gen_mode, init_rank,
    measure_ranks, model_dims, rank_results, remove_checkpoint,
)

SCRIPT = os.path.abspath(__file__)
SAVED_ON = "2"


# --- cases inside a child ------------------------------------------------------------------------


def single_case(name: str, src: str, dst: str, world: int, budget: str) -> dict[str, Any]:
    """A one-process case (raw copy, ckpttool reshard): the work after imports, then an fsync of the output."""
    if name.startswith("ckpt"):
        import torch  # noqa: F401 - imports are not the work

        import ckpttool.formats.dcp  # noqa: F401
        import ckpttool.commands  # noqa: F401
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    if name == "raw_copy":
        out = raw_copy(dcp_files(src), dst)
    else:
        from ckpttool.commands import reshard

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
    """One run of a case in fresh processes, the page cache dropped before it (unless warm)."""
    dst = os.path.join(work, "out" if not name == "raw_copy" else "copy.bin")
    remove(dst)
    dropped = drop_caches() if not args.warm else False
    if name.startswith("online"):
        world = int(name.split("_")[1])
        run = measure_ranks(SCRIPT, world, ["--_case", "online", "--_src", src, "--_dst", dst, "--_cfg", json.dumps(cfg)],
                            work, name, timeout_s=args.case_timeout)
        ranks = rank_results(name, run)
        r = {"ok": ranks is not None, "rc": run.rc}
        if ranks is not None:
            t0 = time.perf_counter()
            fsync_tree(dst)  # DCP fsyncs its files already: this only makes sure
            extra_sync = time.perf_counter() - t0
            r.update(seconds=max(x["seconds"] for x in ranks) + extra_sync, load_s=max(x["load_s"] for x in ranks),
                     save_s=max(x["save_s"] for x in ranks), build_s=max(x["build_s"] for x in ranks),
                     process_wall_s=run.wall_s + extra_sync, peak_kib=run.peak_kib, out_bytes=path_bytes(dst),
                     rank_peak_kib=max(x["hwm_kib"] for x in ranks))
    else:
        world = int(name.split("_")[-1]) if name.startswith("ckpt") else 0
        run = measure_child(SCRIPT, ["--_single", name, "--_src", src, "--_dst", dst, "--_m", str(world), "--budget", args.budget],
                            work, name, timeout_s=args.case_timeout)
        ok = run.rc == 0 and run.result.get("ok")
        r = {"ok": bool(ok), "rc": run.rc}
        if ok:
            r.update(run.result)
            r.update(process_wall_s=run.wall_s, peak_kib=run.peak_kib, out_bytes=path_bytes(dst))
        else:
            report_failure(name, run)
    r["cache_dropped"] = dropped
    remove(dst)
    return r


def derive(results: dict[str, Any], budget: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of a checkpoint's table (ratios to the raw copy and to the online way) and the
    verdict on each target."""
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
                checks.append({"target": "<= 1.1x a copy of the same bytes (+fsync)", "case": tag,
                               "value": f"{c['seconds']:.1f} s vs {copy['seconds']:.1f} s = {row['x_copy']:.2f}x", "pass": row["x_copy"] <= 1.1})
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
    """A case in words."""
    if name in LABELS:
        return LABELS[name]
    m = name.split("_")[-1]
    if name.startswith("ckpt"):
        return f"ckpttool reshard 2 -> {m} ranks"
    return f"online: {m} ranks load + dcp.save" + (" (oversubscribed)" if int(m) > 2 else "")


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    """A checkpoint's results table."""
    head = ["case", "work s", "GB/s", "× copy time", "online / this (work)", "whole processes s", "online / this (whole)",
            "peak MiB (tree, anon+shmem)", "detail"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append(failed_row(head, label(r["case"])))
            continue
        lines.append([label(r["case"]), f(r["seconds"], ".1f"), f(r["gbps"]), f(r["x_copy"]), f(r["speedup_online"]),
                      f(r["wall_s"], ".1f"), f(r["speedup_online_wall"]), f(r["peak_mib"], ".0f"), r["detail"]])
    return table(head, lines, markdown, left=(0, 8))


def draw(plt, results: dict[str, Any], rows: list[dict[str, Any]], budget: int):
    """Time of each case, work and whole processes (left), and its peak memory against the budget (right)."""
    ok = [r for r in rows if not r.get("failed")]
    colors = [("#888888" if r["case"] == "raw_copy" else "#1f77b4" if r["case"].startswith("ckpt") else "#d62728") for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    y = list(range(len(ok)))
    ax1.barh([i - 0.2 for i in y], [r["seconds"] for r in ok], height=0.4, color=colors, label="work (after imports / model build)")
    ax1.barh([i + 0.2 for i in y], [r["wall_s"] for r in ok], height=0.4, color=colors, alpha=0.4, label="whole processes")
    ax1.set_xlabel("seconds (grey: raw copy, blue: ckpttool, red: online with plain DCP)")
    ax1.grid(axis="x", alpha=0.3)
    ax2.barh(y, [r["peak_mib"] for r in ok], color=colors)
    lim = (budget + 300 * 1000**2) / MiB
    ax2.axvline(lim, color="r", ls="-.", label=f"budget + 300 MB ({lim:.0f} MiB)")
    ax2.set_xscale("log")
    ax2.set_xlabel("peak RSS of the process tree (MiB)")
    ax2.grid(axis="x", alpha=0.3, which="both")
    for ax in (ax1, ax2):
        bar_labels(ax, [label(r["case"]) for r in ok])
        ax.legend(fontsize=8)
    return fig, (f"reshard {results['checkpoint']['file_bytes'] / GB:.2f} GB saved on {SAVED_ON} ranks: {machine_brief(results)}, "
                 f"torch {results.get('torch')}")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=4.0, help="checkpoint size in GB (default 4)")
    p.add_argument("--worlds", default="1,3,4", help="target world sizes (default 1,3,4)")
    p.add_argument("--online-worlds", default=None, help="world sizes of the online way (default: --worlds)")
    p.add_argument("--online-size", type=float, default=None,
                   help="run the online way (and a ckpttool reshard to compare with) on a checkpoint of this size instead")
    p.add_argument("--budget", default="1GiB", help="ckpttool reshard's --memory-budget (default 1GiB)")
    p.add_argument("--src", help="use this existing DCP checkpoint (or ckpttool training root) instead of writing one")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the generated checkpoint")
    p.add_argument("--repeat", type=int, default=2, help="runs of each case, rounds interleaved; the fastest is reported (default 2)")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a running bench/convert.py")
    add_run_args(p, "reshard", "/tmp/ckpttool-bench-reshard")
    add_rank_args(p, "--_case", "--_single", "--_src", "--_dst", "--_m", "--_cfg", gen=True)
    args = p.parse_args(argv)

    if gen_mode(args):
        return 0
    if args._rank is not None:
        online_rank(args)
        return 0
    if args._single:
        write_json(args._result, single_case(args._single, args._src, args._dst, int(args._m), args.budget))
        return 0

    budget = parse_size(args.budget)
    out_dir, work, machine = start_run(args.out_dir)
    args.warm = not cold_cache(args.warm)
    wait_for_convert(dcp_bytes(dcp_dir_of(os.path.abspath(args.src))) / GB if args.src else args.size, args.no_wait)
    made: list[str] = []  # the checkpoints this run wrote and removes at the end (unless --keep)

    def generated(size: float) -> tuple[str, dict[str, Any]]:
        root, info = checkpoint(SCRIPT, out_dir, size, SAVED_ON, args.keep, work)
        if not args.keep:
            made.append(root)
        return dcp_dir_of(root), info

    if args.src:
        src, info = existing_checkpoint(args.src)
        cfg = info.get("cfg") or model_dims(args.size)
    else:
        src, info = generated(args.size)
        cfg = info["cfg"]
    info["file_bytes"] = dcp_bytes(src)
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
        src2, info2 = generated(args.online_size)
        info2["file_bytes"] = dcp_bytes(src2)
        plans.append((src2, info2, info2["cfg"], ["raw_copy"] + [f"ckpt_reshard_{w}" for w in online_worlds]
                      + [f"online_{w}" for w in online_worlds]))

    out_json = json_path(args, out_dir, "reshard")
    results_all = {**run_header(SCRIPT, argv, machine), "cold": not args.warm, "budget": args.budget,
                   "repeat": args.repeat, "sets": []}
    for src_dir, inf, c, names in plans:
        print(f"\n== {inf['file_bytes'] / GB:.2f} GB ({src_dir})", flush=True)
        runs = run_rounds(args.repeat, names, lambda n: measure(n, args, work, src_dir, c),
                          lambda n, r: f"{label(n):<44} work {r['seconds']:7.1f} s  whole {r['process_wall_s']:7.1f} s"
                                       f"  peak {r['peak_kib'] / 1024:6.0f} MiB")
        res = {"checkpoint": inf, "machine": machine, "torch": inf.get("torch"),
               "cases": {n: best_of(rs, ["seconds", "process_wall_s"], ["peak_kib"]) for n, rs in runs.items()}, "all_runs": runs}
        res["rows"], res["checks"] = derive(res, budget)
        results_all["sets"].append(res)
        write_json(out_json, results_all)
    results_all["finished"] = now()
    write_json(out_json, results_all)
    md = []
    for res in results_all["sets"]:
        head = f"{res['checkpoint']['file_bytes'] / GB:.2f} GB checkpoint saved on {SAVED_ON} ranks"
        print_results(render(res["rows"], markdown=False), res["checks"], head)
        md.append(f"### {head}\n\n" + render(res["rows"], markdown=True) + "\n\n" + verdict_md(res["checks"]) + "\n")
    print(f"\nresults: {out_json}")
    results_all["torch"] = results_all["sets"][0].get("torch")
    write_markdown(args.md, md_header("Benchmark: offline reshard", results_all) + "\n".join(md))
    if args.plot:
        res = results_all["sets"][0]
        print(plot_file(args.plot, draw, res, res["rows"], budget))
        if len(results_all["sets"]) > 1:
            base, ext = os.path.splitext(args.plot)
            res = results_all["sets"][1]
            print(plot_file(f"{base}-online{ext}", draw, res, res["rows"], budget))
    for root in made:
        remove_checkpoint(root)
    remove(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
