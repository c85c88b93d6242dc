"""Benchmark: ``ckpttool verify`` of a checkpoint against reading and CRC-32-ing all of its bytes.

A ~4 GB checkpoint (fp32 params + AdamW state) is saved with ckpttool's Checkpointer from 2 gloo
CPU ranks (DCP files plus the commit record with its xxh3 manifest), or ``--src`` names one. Then,
each case in a fresh process, with the page cache dropped before it (cold) or the checkpoint's
files read just before it (warm):

  raw read            the files read start to end (os.readv, 64 MiB buffer): the disk's limit
  read + CRC-32       the same, plus ``zlib.crc32`` of every byte: the reference pass
  ckpttool verify     ``ckpttool.verify.verify_path(step)`` (what ``ckpttool verify STEP`` runs: files,
                      byte ranges, tiling, record decoding, the CRC-32 of every record, the manifest)
  ckpttool verify CLI ``ckpttool verify STEP -q`` as a whole process (imports included)

Times are the work inside the child (after imports) except for the CLI row. Peak RSS: the process
tree (the larger of its largest process's peak RSS and the polled peak of its summed anonymous + shmem pages). One
run per case is reported, the fastest, with every value from that run.

    .venv/bin/python bench/verify.py --size 4 --md docs/bench/verify.md --plot docs/img/bench-verify.png

Targets (issue "verify"): <= 1.5x the read + CRC-32 pass (same cache state); peak RSS <= budget
(1 GiB default) + 300 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB,
    MiB,
    RAW_BUFFER,
    child_argv,
    drop_caches,
    machine_facts,
    proc_status,
    raw_read,
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
    model_dims,
    text_table,
    verdict_lines,
    md_header,
    verdict_md,
    wait_for_convert,
)

SCRIPT = os.path.abspath(__file__)
BUDGET = 1 << 30  # verify's default --memory-budget (1GiB)
CLI = os.path.join(os.path.dirname(sys.executable), "ckpttool")
CASES = {
    "raw_read": "raw read of the files",
    "crc_read": "read + zlib.crc32 of every byte",
    "ckpt_verify": "ckpttool verify (library call)",
    "ckpt_verify_cli": "ckpttool verify -q (whole process)",
}


def crc_read(paths: list[str], buf_size: int = RAW_BUFFER) -> dict[str, Any]:
    buf = bytearray(buf_size)
    view = memoryview(buf)
    total = 0
    crcs = {}
    t0 = time.perf_counter()
    for p in paths:
        crc = 0
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [buf])
                if not n:
                    break
                crc = zlib.crc32(view[:n], crc)
                total += n
        finally:
            os.close(fd)
        crcs[os.path.basename(p)] = f"{crc:08x}"
    return {"seconds": time.perf_counter() - t0, "bytes": total, "crc32": crcs}


def single_case(name: str, step_dir: str) -> dict[str, Any]:
    if name == "ckpt_verify":
        import torch  # noqa: F401 - imports are not the work

        import ckpttool.formats.dcp  # noqa: F401
        import ckpttool.verify  # noqa: F401
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    ok = True
    if name == "raw_read":
        out = raw_read(dcp_files(step_dir))
    elif name == "crc_read":
        out = crc_read(dcp_files(step_dir))
    elif name == "ckpt_verify":
        from ckpttool.verify import verify_path

        rep = verify_path(step_dir)
        ok = rep.ok
        out = {"tensors": rep.tensors_checked, "bytes": rep.bytes_checked, "objects": rep.objects_checked,
               "problems": [p.line() for p in rep.problems][:5], "notes": rep.notes}
    seconds = time.perf_counter() - t0
    return {"ok": ok, "seconds": seconds, "out": out, "rss0_kib": rss0, "hwm_growth_kib": (proc_status("VmHWM") or 0) - rss0}


def measure(name: str, step_dir: str, cold: bool, args, work: str) -> dict[str, Any]:
    if cold:
        dropped = drop_caches()
    else:
        raw_read(dcp_files(step_dir))
        dropped = False
    log = os.path.join(work, f"{name}.log")
    result = os.path.join(work, "result.json")
    if name == "ckpt_verify_cli":
        run = run_child([CLI, "-q", "verify", step_dir], result, log, timeout_s=args.case_timeout)
        r = {"ok": run.rc == 0, "seconds": run.wall_s}
    else:
        run = run_child(child_argv(SCRIPT, "--_single", name, "--_src", step_dir, "--_result", result), result, log,
                        timeout_s=args.case_timeout)
        r = dict(run.result)
        r["ok"] = run.rc == 0 and bool(run.result.get("ok"))
    if not r["ok"]:
        print(f"  !! {name} failed (exit {run.rc}):\n{run.log_tail[-4000:]}", file=sys.stderr)
    r.update(peak_kib=run.peak_kib, process_wall_s=run.wall_s, cache_dropped=dropped, rc=run.rc)
    return r


def derive(results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nbytes = results["checkpoint"]["file_bytes"]
    rows, checks = [], []
    lim = (BUDGET + 300 * 1000**2) / MiB
    for cache, cases in results["cases"].items():
        crc = cases.get("crc_read", {})
        raw = cases.get("raw_read", {})
        for name, c in cases.items():
            if not c.get("ok"):
                rows.append({"case": name, "cache": cache, "failed": True})
                continue
            row = {"case": name, "cache": cache, "seconds": c["seconds"], "gbps": nbytes / c["seconds"] / GB,
                   "x_crc": c["seconds"] / crc["seconds"] if crc.get("ok") else None,
                   "x_raw": c["seconds"] / raw["seconds"] if raw.get("ok") else None, "peak_mib": c["peak_kib"] / 1024}
            rows.append(row)
            if name == "ckpt_verify":
                tag = f"{nbytes / GB:.1f} GB, {cache} cache"
                if row["x_crc"] is not None:
                    checks.append({"target": "<= 1.5x the read + CRC-32 pass", "case": tag,
                                   "value": f"{c['seconds']:.2f} s vs {crc['seconds']:.2f} s = {row['x_crc']:.2f}x", "pass": row["x_crc"] <= 1.5})
                checks.append({"target": f"peak RSS <= budget + 300 MB ({lim:.0f} MiB)", "case": tag,
                               "value": f"{row['peak_mib']:.0f} MiB", "pass": row["peak_mib"] <= lim})
    return rows, checks


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ["case", "cache", "time s", "GB/s", "× read+CRC-32", "× raw read", "peak RSS MiB"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append([CASES[r["case"]], r["cache"], "failed", "", "", "", ""])
            continue
        lines.append([CASES[r["case"]], r["cache"], f(r["seconds"]), f(r["gbps"]), f(r["x_crc"]), f(r["x_raw"]), f(r["peak_mib"], ".0f")])
    return (md_table if markdown else text_table)(head, lines, left=(0, 1))


def plot(results: dict[str, Any], rows: list[dict[str, Any]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    ok = [r for r in rows if not r.get("failed")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"raw_read": "#888888", "crc_read": "#555555", "ckpt_verify": "#1f77b4", "ckpt_verify_cli": "#aec7e8"}
    for ax, cache in zip((ax1, ax2), ("cold", "warm")):
        rs = [r for r in ok if r["cache"] == cache]
        y = list(range(len(rs)))
        ax.barh(y, [r["seconds"] for r in rs], color=[colors[r["case"]] for r in rs])
        for i, r in enumerate(rs):
            ax.text(r["seconds"], i, f" {r['seconds']:.1f} s, {r['peak_mib']:.0f} MiB", va="center", fontsize=7)
        crc = next((r for r in rs if r["case"] == "crc_read"), None)
        if crc:
            ax.axvline(1.5 * crc["seconds"], color="r", ls="-.", label="target: 1.5x read + CRC-32")
            ax.legend(fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels([CASES[r["case"]] for r in rs], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(f"page cache {cache}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    m = results["machine"]
    fig.suptitle(f"ckpttool verify of {results['checkpoint']['file_bytes'] / GB:.2f} GB: {m.get('cpus')} cores, {m.get('mem_total_gib')} GiB RAM, "
                 f"{m.get('disk_fs')} on {m.get('disk_device')}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=4.0, help="checkpoint size in GB (default 4)")
    p.add_argument("--src", help="an existing ckpttool step directory or training root to verify instead of writing one")
    p.add_argument("--out-dir", default="/tmp/ckpttool-bench-verify")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--caches", default="cold,warm")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--case-timeout", type=float, default=1800)
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--plot")
    add_rank_args(p)
    p.add_argument("--_single", help=argparse.SUPPRESS)
    p.add_argument("--_src", help=argparse.SUPPRESS)
    p.add_argument("--_gen", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._gen:
        init_rank(args)
        dst, cfg, mesh, how = args._gen
        finish_rank(args, gen_rank(args, dst, json.loads(cfg), mesh, how))
        return 0
    if args._single:
        write_json(args._result, single_case(args._single, args._src))
        return 0

    out_dir = os.path.abspath(args.out_dir)
    work = os.path.join(out_dir, "work")
    os.makedirs(work, exist_ok=True)
    caches = [c for c in args.caches.split(",") if c]
    if "cold" in caches and not can_drop_caches():
        print("cannot drop the page cache (needs root): cold cases skipped", file=sys.stderr)
        caches = [c for c in caches if c != "cold"]
    machine = machine_facts(out_dir)
    print(f"machine: {json.dumps(machine)}", flush=True)
    src_gb = sum(os.path.getsize(x) for x in dcp_files(dcp_dir_of(os.path.abspath(args.src)))) / GB if args.src else args.size
    if src_gb > 0.5 and not args.no_wait:
        wait_for_convert()
    made = None
    if args.src:
        step_dir = dcp_dir_of(os.path.abspath(args.src))
        info_path = os.path.abspath(args.src).rstrip("/") + ".json"
        info = json.load(open(info_path)) if os.path.exists(info_path) else {}
    else:
        root = os.path.join(out_dir, f"ckpt-{args.size:g}GB-on-2")
        info_path = root + ".json"
        if args.keep and os.path.exists(info_path) and os.path.isdir(root):
            info = json.load(open(info_path))
        else:
            print(f"saving {args.size:g} GB with ckpttool on 2 ranks ...", flush=True)
            info = generate(SCRIPT, root, model_dims(args.size), "2", "ckpttool", work, "gen")
            write_json(info_path, info)
        step_dir = dcp_dir_of(root)
        made = None if args.keep else root
    info["file_bytes"] = sum(os.path.getsize(p) for p in dcp_files(step_dir))
    print(f"   {step_dir}: {info['file_bytes'] / GB:.2f} GB of DCP files", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {n: [] for n in CASES} for c in caches}
    for rnd in range(args.repeat):
        for cache in caches:
            for name in CASES:
                r = measure(name, step_dir, cache == "cold", args, work)
                runs[cache][name].append(r)
                if r.get("ok"):
                    print(f"   [{rnd + 1}/{args.repeat}] {cache} {CASES[name]:<36} {r['seconds']:7.2f} s"
                          f"  {info['file_bytes'] / r['seconds'] / GB:6.2f} GB/s  peak {r['peak_kib'] / 1024:6.0f} MiB", flush=True)
    results = {"command": " ".join([os.path.relpath(sys.executable), os.path.relpath(SCRIPT), *(argv if argv is not None else sys.argv[1:])]),
               "started": started, "machine": machine, "repeat": args.repeat, "checkpoint": info,
               "cases": {c: {n: best_of(rs, ["seconds", "process_wall_s"], ["peak_kib"]) for n, rs in d.items()} for c, d in runs.items()},
               "all_runs": runs, "torch": info.get("torch")}
    rows, checks = derive(results)
    results["rows"], results["checks"] = rows, checks
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    json_path = args.json or os.path.join(out_dir, "verify-results.json")
    write_json(json_path, results)
    print("\n" + render(rows, markdown=False) + "\n")
    print("\n".join(verdict_lines(checks)))
    print(f"\nresults: {json_path}")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md_header("Benchmark: ckpttool verify", results))
            fh.write(render(rows, markdown=True) + "\n\n" + verdict_md(checks) + "\n")
        print(f"markdown: {args.md}")
    if args.plot:
        print(plot(results, rows, args.plot))
    if made:
        remove(made)
        remove(made + ".json")
    remove(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
