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

Targets (issue 16): <= 1.1x the read + CRC-32 pass, the command as well as the library call (same cache state); peak RSS <= budget
(1 GiB default) + 300 MB.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, MiB, RAW_BUFFER, add_run_args, bar_labels, best_of, cache_states, drop_caches, f, failed_row, json_path,
    machine_brief, md_header, measure_child, now, parser, plot_file, print_results, proc_status, raw_read, read_chunks,
    remove, report_failure, reset_peak_rss, run_child, run_header, run_rounds, start_run, table, verdict_md,
    wait_for_convert, write_json, write_markdown,
)
from _dist import (  # noqa: E402
    add_rank_args, checkpoint, dcp_bytes, dcp_dir_of, dcp_files, existing_checkpoint, gen_mode, remove_checkpoint,
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
    """The reference pass: ``_common.raw_read`` plus the CRC-32 of every byte (what verify must at least do)."""
    buf = bytearray(buf_size)
    view = memoryview(buf)
    total = 0
    crcs = {}
    t0 = time.perf_counter()
    for p in paths:
        crc = 0
        for n in read_chunks(p, buf):
            crc = zlib.crc32(view[:n], crc)
            total += n
        crcs[os.path.basename(p)] = f"{crc:08x}"
    return {"seconds": time.perf_counter() - t0, "bytes": total, "crc32": crcs}


def single_case(name: str, step_dir: str) -> dict[str, Any]:
    """A case in its child: the work after imports, with the peak RSS it adds."""
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
    """One run of a case in a fresh process, after dropping the page cache (cold) or reading the files (warm)."""
    if cold:
        dropped = drop_caches()
    else:
        raw_read(dcp_files(step_dir))
        dropped = False
    if name == "ckpt_verify_cli":
        run = run_child([CLI, "-q", "verify", step_dir], os.path.join(work, "result.json"), os.path.join(work, f"{name}.log"),
                        timeout_s=args.case_timeout)
        r = {"ok": run.rc == 0, "seconds": run.wall_s}
    else:
        run = measure_child(SCRIPT, ["--_single", name, "--_src", step_dir], work, name, timeout_s=args.case_timeout)
        r = dict(run.result)
        r["ok"] = run.rc == 0 and bool(run.result.get("ok"))
    if not r["ok"]:
        report_failure(name, run)
    r.update(peak_kib=run.peak_kib, process_wall_s=run.wall_s, cache_dropped=dropped, rc=run.rc)
    return r


def derive(results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of the table (ratios to the read + CRC-32 pass and to the raw read, per cache state)
    and the verdict on each target."""
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
            if name in ("ckpt_verify", "ckpt_verify_cli"):
                tag = f"{nbytes / GB:.1f} GB, {cache} cache, {'the command' if name == 'ckpt_verify_cli' else 'library call'}"
                if row["x_crc"] is not None:
                    checks.append({"target": "<= 1.1x the read + CRC-32 pass", "case": tag,
                                   "value": f"{c['seconds']:.2f} s vs {crc['seconds']:.2f} s = {row['x_crc']:.2f}x", "pass": row["x_crc"] <= 1.1})
                checks.append({"target": f"peak RSS <= budget + 300 MB ({lim:.0f} MiB)", "case": tag,
                               "value": f"{row['peak_mib']:.0f} MiB", "pass": row["peak_mib"] <= lim})
    return rows, checks


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    """The results table."""
    head = ["case", "cache", "time s", "GB/s", "× read+CRC-32", "× raw read", "peak RSS MiB"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append(failed_row(head, CASES[r["case"]], r["cache"]))
            continue
        lines.append([CASES[r["case"]], r["cache"], f(r["seconds"]), f(r["gbps"]), f(r["x_crc"]), f(r["x_raw"]), f(r["peak_mib"], ".0f")])
    return table(head, lines, markdown, left=(0, 1))


def draw(plt, results: dict[str, Any], rows: list[dict[str, Any]]):
    """Time and peak memory of each case, cold (left) and warm (right), against the target."""
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
        bar_labels(ax, [CASES[r["case"]] for r in rs])
        ax.set_xlabel("seconds")
        ax.set_title(f"page cache {cache}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    return fig, f"ckpttool verify of {results['checkpoint']['file_bytes'] / GB:.2f} GB: {machine_brief(results)}"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=4.0, help="checkpoint size in GB (default 4)")
    p.add_argument("--src", help="an existing ckpttool step directory or training root to verify instead of writing one")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the generated checkpoint")
    p.add_argument("--caches", default="cold,warm", help="cache states to run each case in (default cold,warm)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each case, rounds interleaved; the fastest is reported (default 2)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a running bench/convert.py")
    add_run_args(p, "verify", "/tmp/ckpttool-bench-verify")
    add_rank_args(p, "--_single", "--_src", gen=True)
    args = p.parse_args(argv)

    if gen_mode(args):
        return 0
    if args._single:
        write_json(args._result, single_case(args._single, args._src))
        return 0

    out_dir, work, machine = start_run(args.out_dir)
    caches = cache_states(args.caches)
    wait_for_convert(dcp_bytes(dcp_dir_of(os.path.abspath(args.src))) / GB if args.src else args.size, args.no_wait)
    made = None
    if args.src:
        step_dir, info = existing_checkpoint(args.src)
    else:
        root, info = checkpoint(SCRIPT, out_dir, args.size, "2", args.keep, work)
        step_dir = dcp_dir_of(root)
        made = None if args.keep else root
    info["file_bytes"] = dcp_bytes(step_dir)
    print(f"   {step_dir}: {info['file_bytes'] / GB:.2f} GB of DCP files", flush=True)
    header = run_header(SCRIPT, argv, machine)
    flat = run_rounds(args.repeat, [(c, n) for c in caches for n in CASES], lambda cn: measure(cn[1], step_dir, cn[0] == "cold", args, work),
                      lambda cn, r: f"{cn[0]} {CASES[cn[1]]:<36} {r['seconds']:7.2f} s"
                                    f"  {info['file_bytes'] / r['seconds'] / GB:6.2f} GB/s  peak {r['peak_kib'] / 1024:6.0f} MiB")
    runs = {c: {n: flat[(c, n)] for n in CASES} for c in caches}
    results = {**header, "repeat": args.repeat, "checkpoint": info,
               "cases": {c: {n: best_of(rs, ["seconds", "process_wall_s"], ["peak_kib"]) for n, rs in d.items()} for c, d in runs.items()},
               "all_runs": runs, "torch": info.get("torch")}
    rows, checks = derive(results)
    results["rows"], results["checks"] = rows, checks
    results["finished"] = now()
    out_json = json_path(args, out_dir, "verify")
    write_json(out_json, results)
    print_results(render(rows, markdown=False), checks)
    print(f"\nresults: {out_json}")
    write_markdown(args.md, md_header("Benchmark: ckpttool verify", results) + render(rows, markdown=True) + "\n\n" + verdict_md(checks) + "\n")
    if args.plot:
        print(plot_file(args.plot, draw, results, rows))
    if made:
        remove_checkpoint(made)
    remove(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
