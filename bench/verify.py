"""Benchmark: ``ckpttool verify`` of a checkpoint against reading and CRC-32-ing all of its bytes.

A ~4 GB checkpoint (fp32 params + AdamW state) is saved with ckpttool from 2 gloo CPU ranks (DCP files
and the commit record with its xxh3 manifest), or ``--src`` names one. Each case runs in a fresh
process, the page cache dropped before it (cold) or the checkpoint's files read just before (warm):

  raw read            the files read start to end (os.readv, 64 MiB buffer): the disk's limit
  read + CRC-32       the same, plus ``zlib.crc32`` of every byte: the reference pass
  ckpttool verify     ``ckpttool.offline.verify.verify_path(step)`` (what ``ckpttool verify STEP`` runs: files, byte
                      ranges, tiling, record decoding, the CRC-32 of every record, the manifest)
  ckpttool verify CLI ``ckpttool verify STEP -q``, the whole process (imports included)

Times: the work after imports, the whole process for the CLI. Peak RSS: the process tree (the larger of
its largest process's peak RSS and the polled peak of its summed anonymous + shmem pages). The fastest
run of each case is reported, every value from it.

    .venv/bin/python bench/verify.py --size 4 --md docs/bench/verify.md --plot docs/img/bench-verify.png

Targets (issue 16): <= 1.1x the read + CRC-32 pass (same cache state), the command as well as the
library call; peak RSS <= budget (1 GiB default) + 300 MB.
"""

import os
import sys
import time
import zlib
from typing import Any

from _common import (GB, MiB, RAW_BUFFER, cache_states, drop_caches, proc_status, raw_read, read_chunks, report_failure, reset_peak_rss,
                     run_child)
from _dist import dcp_files  # importing _dist puts this repository first on sys.path: its ckpttool is the one measured
from harness import Chart, Column, Panel, Set, Spec, check, main, peak_check

LIMIT_MIB = ((1 << 30) + 300 * 1000**2) / MiB  # verify's default --memory-budget (1GiB) + 300 MB
CLI = os.path.join(os.path.dirname(sys.executable), "ckpttool")
CASES = {"raw_read": "raw read of the files", "crc_read": "read + zlib.crc32 of every byte",
         "ckpt_verify": "ckpttool verify (library call)", "ckpt_verify_cli": "ckpttool verify -q (whole process)"}


def single_case(args) -> dict[str, Any]:
    """A case in its child: the work after imports, with the peak RSS it adds."""
    if args._case == "ckpt_verify":
        for m in ("torch", "ckpttool.formats.dcp"):
            __import__(m)  # imports are not the work
        from ckpttool.offline.verify import verify_path
    rss0, t0, ok = reset_peak_rss(), time.perf_counter(), True
    if args._case == "raw_read":
        out = raw_read(dcp_files(args._src))
    elif args._case == "crc_read":  # raw_read plus the CRC-32 of every byte: what verify must at least do
        buf, crc, nbytes = bytearray(RAW_BUFFER), 0, 0
        for n in (n for p in dcp_files(args._src) for n in read_chunks(p, buf)):
            crc, nbytes = zlib.crc32(memoryview(buf)[:n], crc), nbytes + n
        out = {"bytes": nbytes, "crc32": f"{crc:08x}"}
    else:
        rep = verify_path(args._src)
        ok, out = rep.ok, {"tensors": rep.tensors_checked, "bytes": rep.bytes_checked, "objects": rep.objects_checked,
                           "problems": [p.line() for p in rep.problems][:5], "notes": rep.notes}
    seconds = time.perf_counter() - t0
    return {"ok": ok, "seconds": seconds, "out": out, "rss0_kib": rss0, "hwm_growth_kib": (proc_status("VmHWM") or 0) - rss0}


def measure(run, key: str, step: str) -> dict[str, Any]:
    """One run of a case in a fresh process, after dropping the page cache (cold) or reading the files (warm)."""
    cache, name = key.split(":")
    dropped = cache == "cold" and drop_caches()
    if cache != "cold":
        raw_read(dcp_files(step))
    if name != "ckpt_verify_cli":
        return {**run.child(name, ["--_case", name, "--_src", step])[0], "cache_dropped": dropped}
    proc = run_child([CLI, "-q", "verify", step], os.path.join(run.work, "cli.json"), os.path.join(run.work, f"{name}.log"),
                     timeout_s=run.args.case_timeout)
    if proc.rc != 0:
        report_failure(name, proc)
    return {"ok": proc.rc == 0, "seconds": proc.wall_s, "peak_kib": proc.peak_kib, "process_wall_s": proc.wall_s, "cache_dropped": dropped,
            "rc": proc.rc}


def sets(run):
    """The checkpoint (or --src); every case in every cache state."""
    step, info = run.checkpoint(run.args.size, "2")
    yield Set([f"{c}:{n}" for c in cache_states(run.args.caches) for n in CASES], lambda key: measure(run, key, step),
              lambda key, r: (f"{key.split(':')[0]} {CASES[key.split(':')[1]]:<36} {r['seconds']:7.2f} s  "
                              f"{info['file_bytes'] / r['seconds'] / GB:6.2f} GB/s  peak {r['peak_kib'] / 1024:6.0f} MiB"), info=info)


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows (ratios to the read + CRC-32 pass and the raw read in the same cache state) and the verdicts."""
    nbytes, cases, rows, checks = res["checkpoint"]["file_bytes"], res["cases"], [], []
    for key, c in cases.items():
        cache, name = key.split(":")
        rows.append(row := {"case": name, "cache": cache, "label": CASES[name], "failed": not c.get("ok")})
        if row["failed"]:
            continue
        crc, raw = cases.get(f"{cache}:crc_read", {}), cases.get(f"{cache}:raw_read", {})
        row.update(seconds=c["seconds"], gbps=nbytes / c["seconds"] / GB, peak_mib=c["peak_kib"] / 1024,
                   x_crc=c["seconds"] / crc["seconds"] if crc.get("ok") else None,
                   x_raw=c["seconds"] / raw["seconds"] if raw.get("ok") else None)
        if not name.startswith("ckpt"):
            continue
        tag = f"{nbytes / GB:.1f} GB, {cache} cache, {'the command' if name == 'ckpt_verify_cli' else 'library call'}"
        if row["x_crc"] is not None:
            checks.append(check("<= 1.1x the read + CRC-32 pass", tag,
                                f"{c['seconds']:.2f} s vs {crc['seconds']:.2f} s = {row['x_crc']:.2f}x", row["x_crc"] <= 1.1))
        checks.append(peak_check(tag, row["peak_mib"], LIMIT_MIB))
    return rows, checks


SPEC = Spec(
    "verify", "Benchmark: ckpttool verify", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--size": dict(type=float, default=4.0, help="checkpoint size in GB (default 4)"),
             "--src": dict(help="an existing ckpttool step directory or training root to verify instead of writing one"),
             "--caches": dict(default="cold,warm", help="cache states to run each case in (default cold,warm)")},
    columns=[Column("case", "label", None), Column("cache", "cache", None), Column("time s", "seconds"), Column("GB/s", "gbps"),
             Column("× read+CRC-32", "x_crc"), Column("× raw read", "x_raw"), Column("peak RSS MiB", "peak_mib", ".0f")],
    # the target line is 1.1x the read + CRC-32 time of the same cache state: drawn on the ratio (a panel has one line for all caches)
    chart=Chart([Panel("seconds", "seconds", note=lambda r: f"{r['seconds']:.1f} s, {r['peak_mib']:.0f} MiB"),
                 Panel("x_crc", "× read + CRC-32 (same cache)", limit=lambda res: 1.1, limit_label="target: 1.1x read + CRC-32")],
                title=lambda res: f"ckpttool verify of {res['checkpoint']['file_bytes'] / GB:.2f} GB", split="cache"),
    child=single_case, flags=("keep",))

main(SPEC, __name__)
