"""Benchmark: ``ckpttool convert`` against the disk, plain torch, and the checkpoint's size.

For each size (GB of tensor data: fp32 params + AdamW exp_avg + exp_avg_sq, about 12 bytes per
parameter) it writes a DCP checkpoint ``{"model", "optim", "extra"}`` with plain
``torch.distributed.checkpoint.save`` from 2 gloo CPU ranks of an FSDP2 model, then runs every case
in a fresh child process (so peak RSS is the case's own), dropping the page cache before each one:

  raw write       os.write of a 64 MiB buffer + fsync, as many bytes as the checkpoint's tensors
  raw read        the DCP files read start to end (cold cache)
  raw copy        the DCP files read and written to one file + fsync (what an ideal converter does)
  torch ...       dcp_to_torch_save; full DCP load + safetensors.save_file; torch_save_to_dcp
  ckpttool ...    DCP -> .pt, -> safetensors, -> safetensors with 1 GB shards, and .pt -> DCP

Each case runs ``--repeat`` times (rounds interleaved; the fastest run is kept, the highest peak RSS
is reported). Times are the work inside the child (after imports) plus an fsync of the output,
so writers that do not fsync themselves are not flattered by the page cache.

    .venv/bin/python bench/convert.py --sizes 1,4,12 --plot docs/img/bench-convert.png

Outputs: a table on stdout, a JSON of every run (``--json``), optionally a Markdown table
(``--md``) and a PNG plot (``--plot``, needs matplotlib). See bench/README.md.
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
    GB, MiB, ChildRun, add_run_args, bar_labels, code_version, cold_cache, drop_caches, failed_row, fsync_tree, f,
    json_path, machine_brief, measure_child, now, parse_size, parser, path_bytes, pattern_buffer, plot_file, print_results,
    proc_status, raw_copy, raw_read, raw_write, remove, report_failure, reset_peak_rss, run_header, run_rounds, start_run,
    table, verdict_md, write_json, write_markdown,
)
from _dist import add_rank_args, finish_rank, fit_layers, init_rank, random_training_state, run_writer  # noqa: E402

SCRIPT = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(SCRIPT))
WORLD = 2

# --- the checkpoint ------------------------------------------------------------------------------


def model_config(size_gb: float, large: bool = False) -> dict[str, int]:
    """A Transformer whose fp32 params + AdamW state come close to ``size_gb`` GB.

    dim 2048 and as many blocks as fit. Default vocabulary 8192, so the largest tensors (embedding,
    output, and the MLP's 8192 x 2048) are 64 MiB at every size: only the number of tensors grows.
    ``large``: vocabulary 196608, so the embedding and output weights and their AdamW state are
    1.5 GiB each, bigger than the default memory budget (as in real LLMs: Gemma-2B's embedding is
    2 GiB in fp32). Below 0.5 GB a narrower model, for quick runs.
    """
    if size_gb >= 0.5:
        cfg = dict(vocab_size=196608 if large else 8192, dim=2048, n_layers=1, n_heads=16, seq_len=1024)
    else:
        cfg = dict(vocab_size=16384 if large else 2048, dim=512, n_layers=1, n_heads=8, seq_len=256)
    return fit_layers(cfg, size_gb)


def gen_rank(dst: str, size_gb: float, large: bool) -> dict[str, Any]:
    """One rank of the writer: an FSDP2 model with random parameters and AdamW state
    (``_dist.random_training_state``: what one optimizer step leaves), saved with plain ``dcp.save``;
    returns the checkpoint's facts."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    cfg = model_config(size_gb, large)
    model, opt = random_training_state(cfg, str(WORLD))
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "extra": {"step": 1, "data_seed": 7, "note": "bench/convert.py"}}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=dst)
    dist.barrier()
    seconds = time.perf_counter() - t0
    params = list(model.parameters())
    return {"size_gb": size_gb, "large": large, "config": cfg, "params": sum(p.numel() for p in params),
            "tensor_bytes": sum(3 * p.numel() * p.element_size() + 4 for p in params),
            "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params),
            "tensors": 3 * len(params), "dcp_save_s": seconds, "world_size": WORLD}


def generate(dst: str, size_gb: float, large: bool, work: str, info_path: str, timeout_s: float | None = None) -> dict[str, Any]:
    """Write the DCP checkpoint with WORLD rank processes (``_dist.run_writer``); its facts go to ``info_path`` too."""
    run = run_writer(SCRIPT, dst, WORLD, ["--_gen", dst, str(size_gb), str(int(large))], work, "gen", timeout_s=timeout_s)
    info = run.result["ranks"][0]["info"]
    info["gen_wall_s"] = run.wall_s
    info["file_bytes"] = path_bytes(dst)
    write_json(info_path, info)
    return info


# --- the cases (run in a child process each) -----------------------------------------------------

CASES: dict[str, dict[str, Any]] = {
    # name: label, kind (raw / torch / ckpttool), plain (only up to --plain-max-gb), output suffix
    "raw_write": dict(label="raw write (os.write+fsync)", kind="raw", out="raw.bin"),
    "raw_read": dict(label="raw read of the DCP files", kind="raw", out=None),
    "raw_copy": dict(label="raw copy of the DCP files (+fsync)", kind="raw", out="copy.bin"),
    "torch_dcp_to_torch_save": dict(label="torch dcp_to_torch_save", kind="torch", plain=True, out="plain.pt"),
    "torch_load_save_file": dict(label="torch full load + safetensors save_file", kind="torch", plain=True,
                                 out="plain.safetensors"),
    "ckpt_dcp_to_pt": dict(label="ckpttool DCP -> .pt", kind="ckpttool", out="full.pt"),
    "ckpt_dcp_to_st": dict(label="ckpttool DCP -> safetensors", kind="ckpttool", out="out.safetensors"),
    "ckpt_dcp_to_st_sharded": dict(label="ckpttool DCP -> safetensors 1GB shards", kind="ckpttool", out="sharded"),
    "ckpt_dcp_to_st_serial": dict(label="ckpttool DCP -> safetensors, no read-ahead", kind="ckpttool", out="serial.safetensors"),
    "torch_save_to_dcp": dict(label="torch torch_save_to_dcp (.pt -> DCP)", kind="torch", plain=True, out="plain-dcp",
                              needs_pt=True),
    "ckpt_pt_to_dcp": dict(label="ckpttool .pt -> DCP", kind="ckpttool", out="back-dcp", needs_pt=True),
}
#: The plain-torch counterpart of each ckpttool case (same input, same output format).
PLAIN_OF = {"ckpt_dcp_to_pt": "torch_dcp_to_torch_save", "ckpt_dcp_to_st": "torch_load_save_file",
            "ckpt_dcp_to_st_sharded": "torch_load_save_file", "ckpt_pt_to_dcp": "torch_save_to_dcp"}


def _dcp_files(src: str) -> list[str]:
    return sorted(os.path.join(src, n) for n in os.listdir(src))


def run_case(name: str, src: str, dst: str, pt: str, nbytes: int, budget: str) -> dict[str, Any]:
    """The body of one case, inside its child; returns timings and in-process memory facts."""
    kind = CASES.get(name, {"kind": "torch"})["kind"]
    versions: dict[str, str] = {}
    if kind != "raw":
        import torch  # noqa: F401 - imports are not the work
        import torch.distributed.checkpoint  # noqa: F401

        import ckpttool
        import ckpttool.formats.dcp  # noqa: F401
        import ckpttool.formats.safetensors  # noqa: F401
        import ckpttool.formats.torch_save  # noqa: F401
        import ckpttool.commands  # noqa: F401

        torch.set_num_threads(1)
        versions = {"torch": torch.__version__, "ckpttool": ckpttool.__version__}
    buf = pattern_buffer() if name == "raw_write" else None  # built before the clock
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    if name == "baseline":
        pass
    elif name == "raw_write":
        out = raw_write(dst, nbytes, buf=buf)
    elif name == "raw_read":
        out = raw_read(_dcp_files(src))
    elif name == "raw_copy":
        out = raw_copy(_dcp_files(src), dst)
    elif name == "torch_dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(src, dst)
    elif name == "torch_load_save_file":
        import torch
        from safetensors.torch import save_file
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        sd: dict[str, Any] = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        flat, _ = flatten_state_dict(sd)
        save_file({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}, dst, metadata={"format": "pt"})
    elif name == "torch_save_to_dcp":
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

        torch_save_to_dcp(pt, dst)
    elif name.startswith("ckpt_"):
        from ckpttool import convert

        if name == "ckpt_dcp_to_pt":
            convert(src, dst, to="torch", memory_budget=budget)
        elif name == "ckpt_dcp_to_st":
            convert(src, dst, to="safetensors", memory_budget=budget)
        elif name == "ckpt_dcp_to_st_serial":  # the same without reading the next slab during the write
            convert(src, dst, to="safetensors", memory_budget=budget, read_ahead=False)
        elif name == "ckpt_dcp_to_st_sharded":
            convert(src, dst, to="safetensors", max_shard_size="1GB", memory_budget=budget)
        elif name == "ckpt_pt_to_dcp":
            convert(pt, dst, to="dcp", memory_budget=budget)
    else:
        raise SystemExit(f"unknown case {name}")
    t1 = time.perf_counter()
    if name == "raw_write":
        t0 = t1 - out["seconds"]  # the write's own timing (open, writes, fsync)
    # Writers that do not fsync (torch.save, save_file) would otherwise finish in the page cache.
    out_bytes = fsync_tree(dst) if dst and os.path.exists(dst) else 0
    t2 = time.perf_counter()
    hwm = proc_status("VmHWM") or 0
    return {"work_s": t1 - t0, "fsync_s": t2 - t1, "seconds": t2 - t0, "out_bytes": out_bytes,
            "rss_after_imports_kib": rss0, "hwm_growth_kib": hwm - rss0, "raw": out, **versions}


# --- the parent: run everything, summarise, render -----------------------------------------------


def measure(name: str, args: argparse.Namespace, work: str, src: str, pt: str, nbytes: int, cold: bool) -> dict[str, Any]:
    """One run of a case in a fresh child, the page cache dropped before it (unless warm)."""
    out = CASES[name]["out"] if name in CASES else None
    dst = os.path.join(work, out) if out else ""
    if dst:
        remove(dst)
    dropped = drop_caches() if cold else False
    run = measure_child(SCRIPT, ["--_case", name, "--_src", src, "--_dst", dst, "--_pt", pt, "--_bytes", str(nbytes),
                                 "--budget", args.budget], work, name, timeout_s=args.case_timeout)
    run.result["cache_dropped"] = dropped
    if dst and name != "ckpt_dcp_to_pt":  # that one's output is the .pt source of the reverse cases
        remove(dst)
    if run.rc != 0:
        report_failure(name, run)
    return summarise_run(name, run)


def summarise_run(name: str, run: ChildRun) -> dict[str, Any]:
    """One run of a case: the child's exit status, times and memory, and what it reported."""
    return {"case": name, "rc": run.rc, "process_wall_s": run.wall_s, "maxrss_kib": run.maxrss_kib,
            "tree_peak_kib": run.tree_peak_kib, "peak_kib": run.peak_kib, "user_s": run.user_s, "sys_s": run.sys_s,
            **run.result}


#: Cases for the checkpoints with tensors larger than the budget: the memory bound is the point there.
LARGE_CASES = ("raw_write", "ckpt_dcp_to_pt", "ckpt_dcp_to_st", "ckpt_pt_to_dcp")


def cases_for(size_gb: float, large: bool, args: argparse.Namespace) -> list[str]:
    """The cases to run on a checkpoint, in order (the .pt the reverse cases read is made first)."""
    names = []
    for name, spec in CASES.items():
        if spec.get("plain") and size_gb > args.plain_max_gb:
            continue
        if large and name not in LARGE_CASES:
            continue
        if args.cases and not re.search(args.cases, name):
            continue
        names.append(name)
    if any(CASES[n].get("needs_pt") for n in names) and "ckpt_dcp_to_pt" not in names:
        names.insert(0, "ckpt_dcp_to_pt")  # it makes the .pt they read
    return names


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A case's result: its fastest run, with the highest peak RSS of all its runs."""
    ok = [r for r in runs if r["rc"] == 0 and "seconds" in r]
    if not ok:
        return {"case": runs[0]["case"], "failed": True, "runs": runs}
    fastest = min(ok, key=lambda r: r["seconds"])
    return {**fastest, "peak_kib": max(r["peak_kib"] for r in ok), "times_s": [r["seconds"] for r in ok],
            "peaks_kib": [r["peak_kib"] for r in ok], "runs": len(ok)}


def derive(results: dict[str, Any], budget_bytes: int) -> list[dict[str, Any]]:
    """Rows of the table: per size and case, time, GB/s, ratios to raw write and plain torch, RSS."""
    base_kib = results["baseline"]["peak_kib"]
    rows = []
    for size in results["sizes"]:
        info, cases = size["checkpoint"], size["cases"]
        raw = cases.get("raw_write", {}).get("seconds")
        d2t = cases.get("torch_dcp_to_torch_save", {}).get("seconds")
        for name, r in cases.items():
            if r.get("failed"):
                rows.append({"size_gb": size["size_gb"], "large": size.get("large", False), "case": name,
                             "label": CASES[name]["label"], "failed": True})
                continue
            nbytes = r["raw"]["bytes"] if name in ("raw_read", "raw_copy") else info["tensor_bytes"]
            t = r["seconds"]
            plain = cases.get(PLAIN_OF.get(name, ""), {}).get("seconds")
            row = {
                "size_gb": size["size_gb"], "large": size.get("large", False), "tensor_gb": info["tensor_bytes"] / GB,
                "largest_tensor_mib": info["largest_tensor_bytes"] / MiB, "case": name,
                "label": CASES[name]["label"], "kind": CASES[name]["kind"], "seconds": t, "gbps": nbytes / t / GB,
                "x_raw_write_time": t / raw if raw else None, "bw_vs_raw_write": raw / t if raw else None,
                "speedup_vs_dcp_to_torch_save": d2t / t if (d2t and name == "ckpt_dcp_to_pt") else None,  # same input and output format
                "speedup_vs_plain": plain / t if (plain and name.startswith("ckpt_")) else None,
                "peak_mib": r["peak_kib"] / 1024, "growth_mib": (r["peak_kib"] - base_kib) / 1024,
                "hwm_growth_mib": r.get("hwm_growth_kib", 0) / 1024, "times_s": r["times_s"],
                "user_s": r.get("user_s"), "sys_s": r.get("sys_s"),
            }
            rows.append(row)
    return rows


def verdicts(rows: list[dict[str, Any]], budget_bytes: int) -> list[dict[str, Any]]:
    """Pass/fail of each target for each ckpttool case."""
    limit_mib = (budget_bytes + 300 * 1000**2) / MiB
    out = []
    ck = [r for r in rows if r.get("kind") == "ckpttool"]
    copies = {(r["size_gb"], r["large"]): r for r in rows if r.get("case") == "raw_copy" and not r.get("failed")}
    for r in ck:
        tag = f"{r['label']} @ {r['tensor_gb']:.1f} GB" + (f" (largest tensor {r['largest_tensor_mib']:.0f} MiB)" if r["large"] else "")
        copy = copies.get((r["size_gb"], r["large"]))
        if copy is not None:
            x = r["seconds"] / copy["seconds"]
            out.append({"target": "<= 1.1x a copy of the same bytes (+fsync)", "case": tag,
                        "value": f"{r['seconds']:.1f} s vs {copy['seconds']:.1f} s = {x:.2f}x", "pass": x <= 1.1})
        if r["speedup_vs_dcp_to_torch_save"] is not None:
            out.append({"target": ">= 4x faster than dcp_to_torch_save", "case": tag,
                        "value": f"{r['speedup_vs_dcp_to_torch_save']:.2f}x", "pass": r["speedup_vs_dcp_to_torch_save"] >= 4})
        out.append({"target": f"peak RSS <= budget + 300 MB ({limit_mib:.0f} MiB)", "case": tag,
                    "value": f"{r['peak_mib']:.0f} MiB", "pass": r["peak_mib"] <= limit_mib})
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in ck:
        if not r["large"]:  # same tensor shapes at every size: only their number grows
            by_case.setdefault(r["case"], []).append(r)
    for name, rs in by_case.items():
        if len(rs) < 2:
            continue
        rs = sorted(rs, key=lambda r: r["tensor_gb"])
        spread = max(r["peak_mib"] for r in rs) - min(r["peak_mib"] for r in rs)
        tol = budget_bytes / MiB / 10
        out.append({"target": f"peak RSS flat with size (spread <= {tol:.0f} MiB)", "case": CASES[name]["label"],
                    "value": " / ".join(f"{r['peak_mib']:.0f}" for r in rs) + " MiB at "
                    + " / ".join(f"{r['tensor_gb']:.1f}" for r in rs) + " GB", "pass": spread <= tol})
    return out


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    """The results table: every case of every checkpoint."""
    head = ["size", "largest tensor", "case", "time s", "GB/s", "× raw-write time", "BW / raw write", "× vs dcp_to_torch_save",
            "× vs plain same format", "peak RSS MiB", "Δ over import MiB"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append(failed_row(head, f"{r['size_gb']:g}", "", r["label"]))
            continue
        lines.append([f"{r['tensor_gb']:.2f} GB", f"{r['largest_tensor_mib']:.0f} MiB", r["label"], f"{r['seconds']:.1f}", f"{r['gbps']:.2f}",
                      f(r["x_raw_write_time"]), f(r["bw_vs_raw_write"]), f(r["speedup_vs_dcp_to_torch_save"]), f(r["speedup_vs_plain"]),
                      f"{r['peak_mib']:.0f}", f"{r['growth_mib']:+.0f}"])
    if not lines:
        return "(no cases ran)"
    return table(head, lines, markdown, left=(2,))


def draw(plt, rows: list[dict[str, Any]], results: dict[str, Any], budget_bytes: int):
    """Throughput per case and checkpoint (left), peak RSS against checkpoint size (right)."""
    from matplotlib.patches import Patch

    ok = [r for r in rows if not r.get("failed")]
    points = sorted({(r["large"], r["tensor_gb"], r["largest_tensor_mib"]) for r in ok})
    names = [n for n in CASES if any(r["case"] == n for r in ok)]
    colors = {"raw": "#888888", "torch": "#d62728", "ckpttool": "#1f77b4"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 8), gridspec_kw={"width_ratios": [1.6, 1]})
    width = 0.84 / len(points)
    handles = []
    for j, (large, gb, biggest) in enumerate(points):
        shade = 0.3 + 0.7 * (j + 1) / len(points)
        hatch = "///" if large else None
        label = f"{gb:.1f} GB" + (f" ({biggest / 1024:.1f} GiB tensors)" if large else "")
        handles.append(Patch(facecolor="#555555", alpha=shade, hatch=hatch, label=label))
        for i, name in enumerate(names):
            r = next((r for r in ok if r["case"] == name and r["tensor_gb"] == gb and r["large"] == large), None)
            if r is None:
                continue
            y = i + (j - (len(points) - 1) / 2) * width
            ax1.barh(y, r["gbps"], height=width, color=colors[r["kind"]], alpha=shade, hatch=hatch, edgecolor="white", lw=0)
            ax1.text(r["gbps"], y, f" {r['gbps']:.2f}", va="center", fontsize=6.5)
    bar_labels(ax1, [CASES[n]["label"] for n in names])
    ax1.set_xlabel("GB/s = tensor bytes / (time + fsync); raw read and copy: file bytes")
    ax1.set_title("Throughput, best of runs (grey: raw disk, red: plain torch, blue: ckpttool)", fontsize=9)
    ax1.legend(handles=handles, title="checkpoint", fontsize=8, loc="lower right")
    ax1.grid(axis="x", alpha=0.3)
    markers = iter("osD^v<>ph*")
    for name in names:
        kind = CASES[name]["kind"]
        if kind == "raw" and name != "raw_write":
            continue
        m = next(markers)
        reg = sorted((r["tensor_gb"], r["peak_mib"]) for r in ok if r["case"] == name and not r["large"])
        big = [(r["tensor_gb"], r["peak_mib"]) for r in ok if r["case"] == name and r["large"]]
        style = {"raw": ":", "torch": "--", "ckpttool": "-"}[kind]
        line = ax2.plot([p[0] for p in reg], [p[1] for p in reg], style, marker=m, label=CASES[name]["label"])[0]
        if big:
            ax2.scatter([p[0] for p in big], [p[1] for p in big], marker=m, s=70, facecolors="none",
                        edgecolors=line.get_color(), linewidths=1.5)
    base = results["baseline"]["peak_kib"] / 1024
    ax2.axhline(base, color="k", lw=0.8, ls=":", label=f"import torch, ckpttool ({base:.0f} MiB)")
    limit = (budget_bytes + 300 * 1000**2) / MiB
    ax2.axhline(limit, color="r", lw=0.8, ls="-.", label=f"budget + 300 MB ({limit:.0f} MiB)")
    ax2.set_xlabel("checkpoint tensor data (GB)\nhollow markers: largest tensor 1.5 GiB, over the budget")
    ax2.set_ylabel("peak RSS of the process tree (MiB)")
    ax2.set_yscale("log")
    ax2.set_title("Peak RSS per case (fresh process each)", fontsize=9)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    ax2.grid(alpha=0.3, which="both")
    return fig, (f"ckpttool convert vs disk and plain torch {results.get('torch', '')}: {machine_brief(results)}; "
                 f"page cache {'dropped before each case' if results['cold'] else 'warm'}")


def progress(name: str, r: dict[str, Any], nbytes: int) -> str:
    """The line printed after each run of a case."""
    return (f"{CASES[name]['label']:<44} {r['seconds']:8.1f} s  {nbytes / r['seconds'] / GB:6.2f} GB/s  peak {r['peak_kib'] / 1024:7.0f} MiB"
            f"  (fsync {r['fsync_s']:.1f} s, CPU user {r['user_s']:.1f} s + sys {r['sys_s']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sizes", default="1,4,12", help="checkpoint sizes in GB of tensor data, comma-separated (default 1,4,12)")
    p.add_argument("--keep", action="store_true", help="keep the generated DCP checkpoints (and reuse them on the next run)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each case; the fastest is kept (default 2)")
    p.add_argument("--budget", default="1GiB", help="ckpttool --memory-budget (default 1GiB)")
    p.add_argument("--large-tensor-sizes", default="12", help="also these sizes with 1.5 GiB tensors (embedding, output "
                   "and their AdamW state), bigger than the budget; ckpttool cases and raw write only (default 12; '' for none)")
    p.add_argument("--plain-max-gb", type=float, default=4, help="run the plain-torch cases (which load everything) "
                   "only up to this size (default 4)")
    p.add_argument("--cases", help="regex: run only the matching cases (raw_write, ckpt_dcp_to_st, ...)")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")
    add_run_args(p, "convert", "/tmp/ckpttool-bench", case_timeout=3600)
    p.add_argument("--from-json", metavar="JSON", help="run nothing: render the table, --md and --plot from a saved --json")
    add_rank_args(p, "--_case", "--_src", "--_dst", "--_pt", "--_bytes")  # child modes: a case, a rank of the writer
    p.add_argument("--_gen", nargs=3, metavar=("DST", "SIZE", "LARGE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._gen:
        init_rank(args)
        dst, size, large = args._gen
        finish_rank(args, {"ok": True, "info": gen_rank(dst, float(size), large == "1")})
        return 0
    if args._case:
        write_json(args._result, run_case(args._case, args._src, args._dst, args._pt, int(args._bytes), args.budget))
        return 0

    budget_bytes = parse_size(args.budget)
    if args.from_json:
        with open(args.from_json) as fh:
            results = json.load(fh)
        report(results, parse_size(results.get("budget", args.budget)), args, None)
        return 0
    points = [(float(s), False) for s in args.sizes.split(",") if s.strip()]
    points += [(float(s), True) for s in (args.large_tensor_sizes or "").split(",") if s.strip()]
    out_dir, work, machine = start_run(args.out_dir)
    out_json = json_path(args, out_dir, "convert")
    cold = cold_cache(args.warm)
    results: dict[str, Any] = {
        **run_header(SCRIPT, argv, machine), "cold": cold, "repeat": args.repeat,
        "budget": args.budget, "sizes": [], "code": code_version(REPO),
    }
    print(f"code: {json.dumps(results['code'])}", flush=True)

    # baseline: a bare `import torch, ckpttool` (and the format modules), measured like every case
    base_runs = [measure("baseline", args, work, "", "", 0, cold) for _ in range(args.repeat)]
    results["baseline"] = {"peak_kib": max(r["peak_kib"] for r in base_runs), "runs": base_runs}
    print(f"baseline import torch, ckpttool: peak RSS {results['baseline']['peak_kib'] / 1024:.0f} MiB", flush=True)
    results["torch"] = base_runs[0].get("torch")

    for size, large in points:
        tag = f"{size:g} GB" + (", tensors > budget" if large else "")
        src = os.path.join(out_dir, f"dcp-{size:g}GB" + ("-large" if large else ""))
        info_path = src + ".json"
        if args.keep and os.path.exists(os.path.join(src, ".metadata")) and os.path.exists(info_path):
            with open(info_path) as fh:
                info = json.load(fh)
            print(f"\n== {tag}: reusing {src}", flush=True)
        else:
            print(f"\n== {tag}: writing the DCP checkpoint with {WORLD} ranks ...", flush=True)
            info = generate(src, size, large, work, info_path, timeout_s=args.case_timeout)
        print(f"   {info['params'] / 1e6:.0f}M params, {info['tensors']} tensors, {info['tensor_bytes'] / GB:.2f} GB tensor data,"
              f" {info['file_bytes'] / GB:.2f} GB on disk, largest tensor {info['largest_tensor_bytes'] / MiB:.0f} MiB;"
              f" dcp.save took {info['dcp_save_s']:.1f} s", flush=True)
        pt = os.path.join(work, CASES["ckpt_dcp_to_pt"]["out"])
        runs = run_rounds(args.repeat, cases_for(size, large, args), lambda n: measure(n, args, work, src, pt, info["tensor_bytes"], cold),
                          lambda n, r: progress(n, r, info["tensor_bytes"]), ok=lambda r: r["rc"] == 0, after_round=lambda: remove(pt))
        results["sizes"].append({"size_gb": size, "large": large, "checkpoint": info, "cases": {n: best(rs) for n, rs in runs.items()}})
        if not args.keep:
            remove(src)
            remove(info_path)
        write_json(out_json, results)

    results["finished"] = now()
    results["code_at_end"] = code_version(REPO)
    if results["code_at_end"] != results["code"]:
        print(f"warning: ckpttool/ changed during the run: {results['code']} -> {results['code_at_end']}", file=sys.stderr)
    report(results, budget_bytes, args, out_json)
    remove(work)
    return 0


def report(results: dict[str, Any], budget_bytes: int, args: argparse.Namespace, out_json: str | None) -> None:
    """Derive the rows and verdicts, print the table, write --json, --md and --plot."""
    rows = derive(results, budget_bytes)
    checks = verdicts(rows, budget_bytes)
    results["rows"], results["verdicts"] = rows, checks
    if out_json:
        write_json(out_json, results)
    print_results(render(rows, markdown=False), checks, widths=(42, 52))
    if out_json:
        print(f"\nresults: {out_json}")
    write_markdown(args.md, render(rows, markdown=True) + "\n\n" + verdict_md(checks) + "\n")
    if args.plot:
        print(plot_file(args.plot, draw, rows, results, budget_bytes))


if __name__ == "__main__":
    sys.exit(main())
