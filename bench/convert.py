"""Benchmark: ``ckpttool convert`` against the disk, plain torch, and the checkpoint's size.

For each size (GB of tensor data: fp32 params + AdamW exp_avg + exp_avg_sq, ~12 bytes per parameter) a DCP
checkpoint ``{"model", "optim", "extra"}`` is written with plain ``dcp.save`` from 2 gloo CPU ranks of an FSDP2
model; then each case runs in a fresh child (peak RSS is the case's own), the page cache dropped before it:

  raw write       os.write of a 64 MiB buffer + fsync, as many bytes as the checkpoint's tensors
  raw read        the DCP files read start to end (cold cache)
  raw copy        the DCP files read and written to one file + fsync (what an ideal converter does)
  torch ...       dcp_to_torch_save; full DCP load + safetensors.save_file; torch_save_to_dcp
  ckpttool ...    DCP -> .pt, -> safetensors, -> safetensors with 1 GB shards, and .pt -> DCP

``--repeat`` runs per case, rounds interleaved: the fastest run's time, the highest peak RSS of all runs. Times:
the work after imports plus an fsync of the output (writers that do not fsync are not flattered by the page
cache). "Δ over import": the peak over a bare ``import torch, ckpttool``, measured the same way.

    .venv/bin/python bench/convert.py --sizes 1,4,12 --plot docs/img/bench-convert.png
"""

import json
import os
import re
import sys
import time
from typing import Any

from _common import (GB, MiB, code_version, drop_caches, fsync_tree, pattern_buffer, proc_status, raw_copy, raw_read, raw_write,
                     remove, reset_peak_rss)
from _dist import dcp_files, fit_layers  # importing _dist puts this repository first on sys.path: its ckpttool is the one measured
from harness import Chart, Column, Panel, Set, Spec, check, main, peak_check

from ckpttool.choices import parse_size

PT = "full.pt"  # ckpt_dcp_to_pt's output: the .pt the ``*_to_dcp`` cases read (removed after each round)

#: name: label, output in the work folder, ckpttool.convert's arguments. Plain torch (torch_*): only up to --plain-max-gb.
CASES: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "raw_write": ("raw write (os.write+fsync)", "raw.bin", {}),
    "raw_read": ("raw read of the DCP files", None, {}),
    "raw_copy": ("raw copy of the DCP files (+fsync)", "copy.bin", {}),
    "torch_dcp_to_torch_save": ("torch dcp_to_torch_save", "plain.pt", {}),
    "torch_load_save_file": ("torch full load + safetensors save_file", "plain.safetensors", {}),
    "ckpt_dcp_to_pt": ("ckpttool DCP -> .pt", PT, dict(to="torch")),
    "ckpt_dcp_to_st": ("ckpttool DCP -> safetensors", "out.safetensors", dict(to="safetensors")),
    "ckpt_dcp_to_st_sharded": ("ckpttool DCP -> safetensors 1GB shards", "sharded", dict(to="safetensors", max_shard_size="1GB")),
    "ckpt_dcp_to_st_serial": ("ckpttool DCP -> safetensors, no read-ahead", "serial.safetensors", dict(to="safetensors", read_ahead=False)),
    "torch_save_to_dcp": ("torch torch_save_to_dcp (.pt -> DCP)", "plain-dcp", {}),
    "ckpt_pt_to_dcp": ("ckpttool .pt -> DCP", "back-dcp", dict(to="dcp")),
}
#: The plain-torch counterpart of each ckpttool case (same input, same output format).
PLAIN_OF = {"ckpt_dcp_to_pt": "torch_dcp_to_torch_save", "ckpt_dcp_to_st": "torch_load_save_file",
            "ckpt_dcp_to_st_sharded": "torch_load_save_file", "ckpt_pt_to_dcp": "torch_save_to_dcp"}
#: Cases for the checkpoints with tensors larger than the budget: the memory bound is the point there.
LARGE_CASES = ("raw_write", "ckpt_dcp_to_pt", "ckpt_dcp_to_st", "ckpt_pt_to_dcp")


def model_config(size_gb: float, large: bool = False) -> dict[str, int]:
    """dim 2048, as many blocks as fit ``size_gb``; vocabulary 8192: the largest tensors (embedding, output, the MLP's
    8192 x 2048) are 64 MiB at every size, only their number grows. ``large``: vocabulary 196608, embedding and output
    1.5 GiB each, over the default budget, as in real LLMs (Gemma-2B's embedding: 2 GiB in fp32). Below 0.5 GB narrower."""
    return fit_layers(dict(vocab_size=196608 if large else 8192, dim=2048, n_layers=1, n_heads=16, seq_len=1024) if size_gb >= 0.5
                      else dict(vocab_size=16384 if large else 2048, dim=512, n_layers=1, n_heads=8, seq_len=256), size_gb)


def run_case(args) -> dict[str, Any]:
    """One case in its child: the work after imports, then an fsync of its output (torch.save and save_file do not fsync)."""
    name, src, dst = args._case, args._src, args._dst
    versions: dict[str, str] = {}
    if not name.startswith("raw"):
        import torch

        for m in ("torch.distributed.checkpoint", "ckpttool.offline.convert", "ckpttool.formats.dcp", "ckpttool.formats.safetensors",
                  "ckpttool.formats.torch_save"):
            __import__(m)  # imports are not the work
        torch.set_num_threads(1)
        versions = {"torch": torch.__version__, "ckpttool": sys.modules["ckpttool"].__version__}
    buf = pattern_buffer() if name == "raw_write" else None  # built before the clock
    rss0, t0 = reset_peak_rss(), time.perf_counter()
    out: dict[str, Any] = {}
    if name == "raw_write":
        out = raw_write(dst, int(args._bytes), buf=buf)
    elif name.startswith("raw"):
        out = raw_read(dcp_files(src)) if name == "raw_read" else raw_copy(dcp_files(src), dst)
    elif name in ("torch_dcp_to_torch_save", "torch_save_to_dcp"):
        from torch.distributed.checkpoint import format_utils

        getattr(format_utils, "dcp_to_torch_save" if name == "torch_dcp_to_torch_save" else name)(src, dst)
    elif name == "torch_load_save_file":
        from safetensors.torch import save_file
        from torch.distributed.checkpoint import FileSystemReader, _nested_dict, state_dict_loader

        flat, _ = _nested_dict.flatten_state_dict(state_dict_loader._load_state_dict_from_keys(storage_reader=FileSystemReader(src)))
        save_file({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}, dst, metadata={"format": "pt"})
    elif name.startswith("ckpt_"):
        from ckpttool import convert

        convert(src, dst, memory_budget=args.budget, **CASES[name][2])
    t1 = time.perf_counter()
    if name == "raw_write":
        t0 = t1 - out["seconds"]  # the write's own timing (open, writes, fsync)
    out_bytes = fsync_tree(dst) if dst and os.path.exists(dst) else 0
    t2 = time.perf_counter()
    return {"ok": True, "work_s": t1 - t0, "fsync_s": t2 - t1, "seconds": t2 - t0, "out_bytes": out_bytes,
            "rss_after_imports_kib": rss0, "hwm_growth_kib": (proc_status("VmHWM") or 0) - rss0, "raw": out, **versions}


def measure(run, name: str, src: str, nbytes: int) -> dict[str, Any]:
    """One run of a case in a fresh child, the page cache dropped before it (unless warm)."""
    dst = os.path.join(run.work, CASES[name][1]) if CASES.get(name, ("", None))[1] else ""  # the baseline writes nothing
    remove(dst)
    dropped = drop_caches() if run.cold else False
    r, proc = run.child(name, ["--_case", name, "--_src", os.path.join(run.work, PT) if name.endswith("_to_dcp") else src,
                               "--_dst", dst, "--_bytes", str(nbytes), "--budget", run.args.budget])
    r.update(cache_dropped=dropped, user_s=proc.user_s, sys_s=proc.sys_s, maxrss_kib=proc.maxrss_kib, tree_peak_kib=proc.tree_peak_kib)
    if name != "ckpt_dcp_to_pt":
        remove(dst)
    return r


def sets(run):
    """The baseline (a bare import, as many runs as a case), then a set per size point on a checkpoint from _dist's generator
    (plain dcp.save on 2 ranks; --keep: kept, and reused), removed once measured; the code measured at the start and the end."""
    args, repo = run.args, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run.extra["code"] = code_version(repo)
    print(f"code: {json.dumps(run.extra['code'])}", flush=True)
    base = [measure(run, "baseline", "", 0) for _ in range(args.repeat)]
    run.extra["baseline"] = {"peak_kib": (base_kib := max(r["peak_kib"] for r in base)), "runs": base}
    print(f"baseline import torch, ckpttool: peak RSS {base_kib / 1024:.0f} MiB", flush=True)
    points = [(float(s), False) for s in args.sizes.split(",") if s.strip()]
    points += [(float(s), True) for s in (args.large_tensor_sizes or "").split(",") if s.strip()]
    run.flat_rows = []  # the regular checkpoints' ckpttool rows: is peak RSS flat with size?
    for i, (size, large) in enumerate(points):
        cfg, small = model_config(size, large), args.small_tensors
        if small:
            cfg = fit_layers({**cfg, "small": small}, size)
        src, info = run.checkpoint(size, "2", cfg, "dcp", f"dcp-{size:g}GB" + ("-large" if large else "") + (f"-{small}small" if small else ""))
        # from the config: an fp32 param, exp_avg and exp_avg_sq and a 4-byte step per parameter tensor; the largest tensor is an
        # embedding, the output or an MLP weight
        cfg = info["cfg"]
        info.update(size_gb=size, large=large, tensor_bytes=12 * info["params"] + 4 * info["tensors"] // 3,
                    largest_tensor_bytes=4 * cfg["dim"] * max(cfg["vocab_size"], cfg["seq_len"], 4 * cfg["dim"]))
        print(f"   {info['params'] / 1e6:.0f}M params, {info['tensors']} tensors, {info['tensor_bytes'] / GB:.2f} GB tensor data, "
              f"{info['file_bytes'] / GB:.2f} GB on disk, largest tensor {info['largest_tensor_bytes'] / MiB:.0f} MiB; "
              f"dcp.save took {info['save_s']:.1f} s", flush=True)
        names = [n for n in CASES if not (n.startswith("torch_") and size > args.plain_max_gb) and not (large and n not in LARGE_CASES)
                 and not (args.cases and not re.search(args.cases, n))]
        if any(n.endswith("_to_dcp") for n in names) and "ckpt_dcp_to_pt" not in names:
            names.insert(0, "ckpt_dcp_to_pt")  # it writes the .pt they read
        yield Set(names, lambda n: measure(run, n, src, info["tensor_bytes"]),
                  lambda n, r: (f"{CASES[n][0]:<44} {r['seconds']:8.1f} s  {info['tensor_bytes'] / r['seconds'] / GB:6.2f} GB/s  "
                                f"peak {r['peak_kib'] / 1024:7.0f} MiB  (fsync {r['fsync_s']:.1f} s, "
                                f"CPU user {r['user_s']:.1f} s + sys {r['sys_s']:.1f} s)"),
                  heading=f"{size:g} GB" + (f", large tensors ({info['largest_tensor_bytes'] / MiB:.0f} MiB)" if large else "")
                  + f"; page cache {'dropped before each case' if run.cold else 'warm'}; import torch, ckpttool {base_kib / 1024:.0f} MiB",
                  tag=f"{size:g}GB" + ("-large" if large else ""), info={**info, "last": i == len(points) - 1},
                  after_round=lambda: remove(os.path.join(run.work, PT)))
        for path in run.made:  # this checkpoint, once measured (none with --keep)
            remove(path)
    run.extra["code_at_end"] = code_version(repo)
    if run.extra["code_at_end"] != run.extra["code"]:
        print(f"warning: ckpttool/ changed during the run: {run.extra['code']} -> {run.extra['code_at_end']}", file=sys.stderr)


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per case: GB/s, ratios to raw write and plain torch, RSS; the ckpttool cases' verdicts (the last set: peak RSS flat with size)."""
    info, cases, budget = res["checkpoint"], res["cases"], parse_size(run.args.budget)
    nbytes, limit_mib = info["tensor_bytes"], (budget + 300 * 1000**2) / MiB
    tensor_gb, largest_mib = nbytes / GB, info["largest_tensor_bytes"] / MiB
    raw, d2t, copy = (cases.get(n, {}).get("seconds") for n in ("raw_write", "torch_dcp_to_torch_save", "raw_copy"))
    rows, checks = [], []
    for name, c in cases.items():
        rows.append(r := {"size_gb": info["size_gb"], "large": info["large"], "case": name, "label": CASES[name][0],
                          "size": f"{info['size_gb']:g}", "largest": ""})
        if c.get("failed"):
            r["failed"] = True
            continue
        t, peak = c["seconds"], max(c["peak_kib_all"])  # the fastest run's time, the highest peak of all runs
        plain = cases.get(PLAIN_OF.get(name, ""), {}).get("seconds")
        r.update(tensor_gb=tensor_gb, largest_tensor_mib=largest_mib, seconds=t, size=f"{tensor_gb:.2f} GB",
                 largest=f"{largest_mib:.0f} MiB", gbps=(c["raw"]["bytes"] if name in ("raw_read", "raw_copy") else nbytes) / t / GB,
                 x_raw_write_time=t / raw if raw else None, bw_vs_raw_write=raw / t if raw else None,
                 speedup_vs_dcp_to_torch_save=d2t / t if (d2t and name == "ckpt_dcp_to_pt") else None,  # same input and output format
                 speedup_vs_plain=plain / t if (plain and name.startswith("ckpt_")) else None, peak_mib=peak / 1024,
                 growth_mib=(peak - run.extra["baseline"]["peak_kib"]) / 1024, hwm_growth_mib=c.get("hwm_growth_kib", 0) / 1024)
        if not name.startswith("ckpt_"):
            continue
        if not r["large"]:  # same tensor shapes at every size: only their number grows
            run.flat_rows.append(r)
        tag = f"{r['label']} @ {tensor_gb:.1f} GB" + (f" (largest tensor {largest_mib:.0f} MiB)" if r["large"] else "")
        if copy:
            checks.append(check("<= 1.1x a copy of the same bytes (+fsync)", tag, f"{t:.1f} s vs {copy:.1f} s = {t / copy:.2f}x",
                                t / copy <= 1.1))
        if (x := r["speedup_vs_dcp_to_torch_save"]) is not None:
            checks.append(check(">= 4x faster than dcp_to_torch_save", tag, f"{x:.2f}x", x >= 4))
        checks.append(peak_check(tag, r["peak_mib"], limit_mib))
    tol = budget / MiB / 10
    for name in dict.fromkeys(r["case"] for r in run.flat_rows) if info["last"] else ():
        rs = sorted((r for r in run.flat_rows if r["case"] == name), key=lambda r: r["tensor_gb"])
        peaks = [r["peak_mib"] for r in rs]
        if len(rs) >= 2:
            checks.append(check(f"peak RSS flat with size (spread <= {tol:.0f} MiB)", CASES[name][0], " / ".join(f"{p:.0f}" for p in peaks)
                                + " MiB at " + " / ".join(f"{r['tensor_gb']:.1f}" for r in rs) + " GB", max(peaks) - min(peaks) <= tol))
    return rows, checks


SPEC = Spec(
    "convert", "Benchmark: ckpttool convert", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--sizes": dict(default="1,4,12", help="checkpoint sizes in GB of tensor data, comma-separated (default 1,4,12)"),
             "--large-tensor-sizes": dict(default="12", help="also these sizes with 1.5 GiB tensors (embedding, output, their AdamW "
                                          "state), over the budget: ckpttool cases and raw write only (default 12; '' for none)"),
             "--small-tensors": dict(type=int, default=0, help="also this many parameters of 4096 fp32 elements in the checkpoint (16 KiB: with their AdamW state, 3 tensors under 64 KiB each; default 0; run_all: 3334 at 2 GB, 10,002 small tensors)"),
             "--plain-max-gb": dict(type=float, default=4, help="plain-torch cases (they load it all) only up to this size (default 4)"),
             "--cases": dict(help="regex: run only the matching cases (raw_write, ckpt_dcp_to_st, ...)")},
    columns=[Column("size", "size", None), Column("largest tensor", "largest", None), Column("case", "label", None),
             Column("time s", "seconds", ".1f"), Column("GB/s", "gbps"), Column("× raw-write time", "x_raw_write_time"),
             Column("BW / raw write", "bw_vs_raw_write"), Column("× vs dcp_to_torch_save", "speedup_vs_dcp_to_torch_save"),
             Column("× vs plain same format", "speedup_vs_plain"), Column("peak RSS MiB", "peak_mib", ".0f"),
             Column("Δ over import MiB", "growth_mib", "+.0f")],
    chart=Chart([Panel("gbps", "GB/s = tensor bytes / (time + fsync); raw read and copy: file bytes", note=lambda r: f"{r['gbps']:.2f}"),
                 Panel("peak_mib", "peak RSS of the process tree (MiB), highest of the runs", log=True, limit_label="budget + 300 MB",
                       limit=lambda res: (parse_size(res["options"]["budget"]) + 300 * 1000**2) / MiB)],
                title=lambda res: f"ckpttool convert vs disk and plain torch, {res['heading']}"),
    child=run_case, hidden=("--_bytes",), flags=("keep", "budget", "warm"), repeat=2, case_timeout=3600, verdict_widths=(42, 52))

main(SPEC, __name__)
