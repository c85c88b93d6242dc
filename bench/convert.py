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
    GB,
    MiB,
    ChildRun,
    child_argv,
    code_version,
    drop_caches,
    fsync_tree,
    machine_facts,
    path_bytes,
    pattern_buffer,
    raw_copy,
    raw_read,
    raw_write,
    remove,
    reset_peak_rss,
    proc_status,
    run_child,
    write_json,
)

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
    d, v, s = cfg["dim"], cfg["vocab_size"], cfg["seq_len"]
    per_layer = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    fixed = 2 * v * d + s * d + 2 * d
    cfg["n_layers"] = max(1, round((size_gb * GB / 12 - fixed) / per_layer))
    return cfg


def gen_rank(rank: int, rdzv: str, dst: str, size_gb: float, large: bool, info_path: str) -> None:
    """One rank of the writer: FSDP2 model on meta -> to_empty -> fill; AdamW state set directly
    (exp_avg, exp_avg_sq filled, step=1: what one optimizer step leaves); plain ``dcp.save``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpttool.trainer.model import ModelConfig, Transformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    cfg = ModelConfig(**model_config(size_gb, large))
    with torch.device("meta"):
        model = Transformer(cfg)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tensor_bytes = 0
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.05, 0.05, generator=gen)
            avg, sq = torch.empty_like(p), torch.empty_like(p)
            avg.to_local().uniform_(-1e-3, 1e-3, generator=gen)
            sq.to_local().uniform_(0, 1e-6, generator=gen)
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": avg, "exp_avg_sq": sq}
            tensor_bytes += 3 * p.numel() * p.element_size() + 4
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "extra": {"step": 1, "data_seed": 7, "note": "bench/convert.py"}}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=dst)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        info = {"size_gb": size_gb, "large": large, "config": model_config(size_gb, large), "params": params,
                "tensor_bytes": tensor_bytes, "largest_tensor_bytes": largest,
                "tensors": 3 * len(list(model.parameters())), "dcp_save_s": seconds, "world_size": WORLD}
        write_json(info_path, info)
    dist.destroy_process_group()


def generate(dst: str, size_gb: float, large: bool, work: str, info_path: str, timeout_s: float | None = None) -> dict[str, Any]:
    """Write the DCP checkpoint with 2 rank processes; their tree's peak RSS is recorded too.

    The ranks are polled: when one fails (the other would wait for it forever) or ``timeout_s``
    runs out, every rank still running is killed."""
    import subprocess

    remove(dst)
    rdzv = os.path.join(work, f"rdzv-{os.getpid()}-{time.time_ns()}")
    logs = [open(os.path.join(work, f"gen-rank{r}.log"), "w") for r in range(WORLD)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(child_argv(SCRIPT, "--_gen", str(r), rdzv, dst, str(size_gb), str(int(large)), info_path),
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(WORLD)]
    rcs: list[int | None] = [None] * WORLD
    why = ""
    try:
        while any(rc is None for rc in rcs):
            rcs = [p.poll() for p in procs]
            if any(rc not in (None, 0) for rc in rcs):
                why = "a rank failed"
                break
            if timeout_s and time.perf_counter() - t0 > timeout_s:
                why = f"timed out after {timeout_s:g} s"
                break
            time.sleep(0.05)
    finally:
        for i, p in enumerate(procs):  # whatever is still running: a failed peer or the time ran out
            if p.poll() is None:
                p.kill()
            rcs[i] = p.wait()
    wall = time.perf_counter() - t0
    for f in logs:
        f.close()
    remove(rdzv)
    if any(rcs):
        tails = "".join(open(f.name).read()[-3000:] for f in logs)
        raise SystemExit(f"writing the checkpoint failed ({why or 'a rank failed'}; exit codes {rcs}):\n{tails}")
    with open(info_path) as f:
        info = json.load(f)
    info["gen_wall_s"] = wall
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
    "torch_save_to_dcp": dict(label="torch torch_save_to_dcp (.pt -> DCP)", kind="torch", plain=True, out="plain-dcp",
                              needs_pt=True),
    "ckpt_pt_to_dcp": dict(label="ckpttool .pt -> DCP", kind="ckpttool", out="back-dcp", needs_pt=True),
}
#: The plain-torch counterpart of each ckpttool case (same input, same output format).
PLAIN_OF = {"ckpt_dcp_to_pt": "torch_dcp_to_torch_save", "ckpt_dcp_to_st": "torch_load_save_file",
            "ckpt_dcp_to_st_sharded": "torch_load_save_file", "ckpt_pt_to_dcp": "torch_save_to_dcp"}


def parse_size(text: str) -> int:
    """``1GiB``, ``512MB``, ``2G``: K/M/G/T are powers of 1024, as ckpttool's --memory-budget reads them."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", text, re.IGNORECASE)
    if not m:
        raise SystemExit(f"cannot read size {text!r}")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


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
        import ckpttool.pipeline  # noqa: F401

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


def measure(name: str, args: argparse.Namespace, work: str, src: str, pt: str, nbytes: int, cold: bool) -> ChildRun:
    out = CASES[name]["out"] if name in CASES else None
    dst = os.path.join(work, out) if out else ""
    if dst:
        remove(dst)
    dropped = drop_caches() if cold else False
    run = run_child(child_argv(SCRIPT, "--_case", name, "--_result", os.path.join(work, "result.json"),
                                "--_src", src, "--_dst", dst, "--_pt", pt, "--_bytes", str(nbytes),
                                "--budget", args.budget),
                    os.path.join(work, "result.json"), os.path.join(work, f"{name}.log"), timeout_s=args.case_timeout)
    run.result["cache_dropped"] = dropped
    if dst and name != "ckpt_dcp_to_pt":  # that one's output is the .pt source of the reverse cases
        remove(dst)
    if run.rc != 0:
        print(f"  !! {name} failed (exit {run.rc}):\n{run.log_tail}", file=sys.stderr)
    return run


def summarise_run(name: str, run: ChildRun) -> dict[str, Any]:
    return {"case": name, "rc": run.rc, "process_wall_s": run.wall_s, "maxrss_kib": run.maxrss_kib,
            "tree_peak_kib": run.tree_peak_kib, "peak_kib": run.peak_kib, "user_s": run.user_s, "sys_s": run.sys_s,
            **run.result}


#: Cases for the checkpoints with tensors larger than the budget: the memory bound is the point there.
LARGE_CASES = ("raw_write", "ckpt_dcp_to_pt", "ckpt_dcp_to_st", "ckpt_pt_to_dcp")


def cases_for(size_gb: float, large: bool, args: argparse.Namespace) -> list[str]:
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
    for r in ck:
        tag = f"{r['label']} @ {r['tensor_gb']:.1f} GB" + (f" (largest tensor {r['largest_tensor_mib']:.0f} MiB)" if r["large"] else "")
        if r["bw_vs_raw_write"] is not None:
            out.append({"target": "bandwidth >= 0.8x raw write", "case": tag, "value": f"{r['bw_vs_raw_write']:.2f}x",
                        "pass": r["bw_vs_raw_write"] >= 0.8})
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
                    "value": " / ".join(f"{r['peak_mib']:.0f}" for r in rs) + f" MiB at "
                    + " / ".join(f"{r['tensor_gb']:.1f}" for r in rs) + " GB", "pass": spread <= tol})
    return out


def _f(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ["size", "largest tensor", "case", "time s", "GB/s", "× raw-write time", "BW / raw write", "× vs dcp_to_torch_save",
            "× vs plain same format", "peak RSS MiB", "Δ over import MiB"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append([f"{r['size_gb']:g}", "", r["label"], "failed"] + [""] * (len(head) - 4))
            continue
        lines.append([f"{r['tensor_gb']:.2f} GB", f"{r['largest_tensor_mib']:.0f} MiB", r["label"], f"{r['seconds']:.1f}", f"{r['gbps']:.2f}",
                      _f(r["x_raw_write_time"], ".2f"), _f(r["bw_vs_raw_write"], ".2f"),
                      _f(r["speedup_vs_dcp_to_torch_save"], ".2f"), _f(r["speedup_vs_plain"], ".2f"),
                      f"{r['peak_mib']:.0f}", f"{r['growth_mib']:+.0f}"])
    if not lines:
        return "(no cases ran)"
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 2 else "---:" for i in range(len(head))) + "|"]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def plot(rows: list[dict[str, Any]], results: dict[str, Any], path: str, budget_bytes: int) -> str:
    """Throughput per case and checkpoint (left), peak RSS against checkpoint size (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
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
    ax1.set_yticks(range(len(names)))
    ax1.set_yticklabels([CASES[n]["label"] for n in names], fontsize=8)
    ax1.invert_yaxis()
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
    m = results["machine"]
    fig.suptitle(f"ckpttool convert vs disk and plain torch {results.get('torch', '')}: {m.get('cpus')} cores, "
                 f"{m.get('mem_total_gib')} GiB RAM, {m.get('disk_fs')} on {m.get('disk_device')}; "
                 f"page cache {'dropped before each case' if results['cold'] else 'warm'}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,4,12", help="checkpoint sizes in GB of tensor data, comma-separated (default 1,4,12)")
    p.add_argument("--out-dir", default="/tmp/ckpttool-bench", help="where checkpoints and outputs go (same disk as the raw write)")
    p.add_argument("--keep", action="store_true", help="keep the generated DCP checkpoints (and reuse them on the next run)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each case; the fastest is kept (default 2)")
    p.add_argument("--budget", default="1GiB", help="ckpttool --memory-budget (default 1GiB)")
    p.add_argument("--large-tensor-sizes", default="12", help="also these sizes with 1.5 GiB tensors (embedding, output "
                   "and their AdamW state), bigger than the budget; ckpttool cases and raw write only (default 12; '' for none)")
    p.add_argument("--plain-max-gb", type=float, default=4, help="run the plain-torch cases (which load everything) "
                   "only up to this size (default 4)")
    p.add_argument("--cases", help="regex: run only the matching cases (raw_write, ckpt_dcp_to_st, ...)")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")
    p.add_argument("--case-timeout", type=float, default=3600)
    p.add_argument("--json", help="write every run and the summary here (default OUT_DIR/convert-results.json)")
    p.add_argument("--md", help="write the Markdown table and verdicts here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--from-json", metavar="JSON", help="run nothing: render the table, --md and --plot from a saved --json")
    # child modes
    p.add_argument("--_gen", nargs=6, metavar=("RANK", "RDZV", "DST", "SIZE", "LARGE", "INFO"), help=argparse.SUPPRESS)
    p.add_argument("--_case", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    p.add_argument("--_src", default="", help=argparse.SUPPRESS)
    p.add_argument("--_dst", default="", help=argparse.SUPPRESS)
    p.add_argument("--_pt", default="", help=argparse.SUPPRESS)
    p.add_argument("--_bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._gen:
        rank, rdzv, dst, size, large, info = args._gen
        gen_rank(int(rank), rdzv, dst, float(size), large == "1", info)
        return 0
    if args._case:
        res = run_case(args._case, args._src, args._dst, args._pt, args._bytes, args.budget)
        write_json(args._result, res)
        return 0

    budget_bytes = parse_size(args.budget)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        report(results, parse_size(results.get("budget", args.budget)), args, None)
        return 0
    points = [(float(s), False) for s in args.sizes.split(",") if s.strip()]
    points += [(float(s), True) for s in (args.large_tensor_sizes or "").split(",") if s.strip()]
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    json_path = args.json or os.path.join(out_dir, "convert-results.json")
    cold = not args.warm
    if cold and not drop_caches():
        print("cannot drop the page cache (needs root): running with a warm cache", file=sys.stderr)
        cold = False
    machine = machine_facts(out_dir)
    results: dict[str, Any] = {
        "command": " ".join([os.path.relpath(sys.executable), os.path.relpath(SCRIPT), *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine, "cold": cold, "repeat": args.repeat,
        "budget": args.budget, "sizes": [], "code": code_version(REPO),
    }
    print(f"machine: {json.dumps(machine)}\ncode: {json.dumps(results['code'])}", flush=True)
    work = os.path.join(out_dir, "work")
    os.makedirs(work, exist_ok=True)

    # baseline: a bare `import torch, ckpttool` (and the format modules), measured like every case
    base_runs = [summarise_run("baseline", measure("baseline", args, work, "", "", 0, cold)) for _ in range(args.repeat)]
    results["baseline"] = {"peak_kib": max(r["peak_kib"] for r in base_runs), "runs": base_runs}
    print(f"baseline import torch, ckpttool: peak RSS {results['baseline']['peak_kib'] / 1024:.0f} MiB", flush=True)
    results["torch"] = base_runs[0].get("torch")

    for size, large in points:
        tag = f"{size:g} GB" + (", tensors > budget" if large else "")
        src = os.path.join(out_dir, f"dcp-{size:g}GB" + ("-large" if large else ""))
        info_path = src + ".json"
        if args.keep and os.path.exists(os.path.join(src, ".metadata")) and os.path.exists(info_path):
            with open(info_path) as f:
                info = json.load(f)
            print(f"\n== {tag}: reusing {src}", flush=True)
        else:
            print(f"\n== {tag}: writing the DCP checkpoint with {WORLD} ranks ...", flush=True)
            info = generate(src, size, large, work, info_path, timeout_s=args.case_timeout)
        print(f"   {info['params'] / 1e6:.0f}M params, {info['tensors']} tensors, {info['tensor_bytes'] / GB:.2f} GB tensor data,"
              f" {info['file_bytes'] / GB:.2f} GB on disk, largest tensor {info['largest_tensor_bytes'] / MiB:.0f} MiB;"
              f" dcp.save took {info['dcp_save_s']:.1f} s", flush=True)
        names = cases_for(size, large, args)
        pt = os.path.join(work, CASES["ckpt_dcp_to_pt"]["out"])
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for rnd in range(args.repeat):
            for name in names:
                run = measure(name, args, work, src, pt, info["tensor_bytes"], cold)
                runs[name].append(summarise_run(name, run))
                r = runs[name][-1]
                if r["rc"] == 0:
                    print(f"   [{rnd + 1}/{args.repeat}] {CASES[name]['label']:<44} {r['seconds']:8.1f} s"
                          f"  {info['tensor_bytes'] / r['seconds'] / GB:6.2f} GB/s  peak {r['peak_kib'] / 1024:7.0f} MiB"
                          f"  (fsync {r['fsync_s']:.1f} s, CPU user {r['user_s']:.1f} s + sys {r['sys_s']:.1f} s)", flush=True)
            remove(pt)
        results["sizes"].append({"size_gb": size, "large": large, "checkpoint": info, "cases": {n: best(rs) for n, rs in runs.items()}})
        if not args.keep:
            remove(src)
            remove(info_path)
        write_json(json_path, results)

    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["code_at_end"] = code_version(REPO)
    if results["code_at_end"] != results["code"]:
        print(f"warning: ckpttool/ changed during the run: {results['code']} -> {results['code_at_end']}", file=sys.stderr)
    report(results, budget_bytes, args, json_path)
    remove(work)
    return 0


def report(results: dict[str, Any], budget_bytes: int, args: argparse.Namespace, json_path: str | None) -> None:
    """Derive the rows and verdicts, print the table, write --json, --md and --plot."""
    rows = derive(results, budget_bytes)
    checks = verdicts(rows, budget_bytes)
    results["rows"], results["verdicts"] = rows, checks
    if json_path:
        write_json(json_path, results)
    print("\n" + table(rows, markdown=False))
    print()
    for c in checks:
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['target']:<42} {c['case']:<52} {c['value']}")
    if json_path:
        print(f"\nresults: {json_path}")
    if args.md:
        with open(args.md, "w") as f:
            f.write(table(rows, markdown=True) + "\n\n")
            f.write("| target | case | measured | |\n|---|---|---|---|\n")
            f.writelines(f"| {c['target']} | {c['case']} | {c['value']} | {'pass' if c['pass'] else '**FAIL**'} |\n" for c in checks)
        print(f"markdown: {args.md}")
    if args.plot:
        print(plot(rows, results, args.plot, budget_bytes))


if __name__ == "__main__":
    sys.exit(main())
