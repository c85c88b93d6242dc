"""Benchmark: zstd-compressed DCP (``--compress zstd``) against plain records and plain torch.

It saves a training state (an FSDP2 Transformer's fp32 parameters and AdamW state, random values
as bench/_dist.py fills them) with ckpttool on 2 gloo ranks, then runs each case in a fresh child
process (peak RSS is the case's own), dropping the page cache before each one unless ``--warm``:

  raw copy          the DCP files read and written to one file + fsync (the disk's limit)
  write plain       ckpttool convert SRC -> DCP (plain records)
  write zstd        ckpttool convert SRC -> DCP --compress zstd
  torch write zstd  plain torch: full load, then dcp.save(FileSystemWriter(_extensions=[ZStandard()]))
  read plain        ckpttool convert of the plain output -> safetensors
  read zstd         ckpttool convert of the zstd output -> safetensors (decompress, check, write)

Every figure is a ratio measured in the same run: time against the raw copy and against the
plain-record case, output size against the plain output.

    .venv/bin/python bench/compress.py --size 1 --repeat 2

Random-valued fp32 state compresses little (its mantissas are noise); real trained weights are
close to that; optimizer state early in training and zero-initialised buffers compress more.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, add_run_args, best_of, cold_cache, drop_caches, f, fsync_tree, json_path, measure_child, now, parse_size, parser,
    path_bytes, raw_copy, remove, report_failure, run_header, run_rounds, start_run, table, write_json, write_markdown,
)
from _dist import add_rank_args, checkpoint, dcp_bytes, dcp_dir_of, dcp_files, gen_mode  # noqa: E402

SCRIPT = os.path.abspath(__file__)
SAVED_ON = "2"
CASES = {
    "raw_copy": "raw copy (cp of the DCP files)",
    "write_plain": "ckpttool convert -> DCP",
    "write_zstd": "ckpttool convert -> DCP --compress zstd",
    "torch_write_zstd": "torch dcp.save, ZStandard extension",
    "read_plain": "ckpttool convert plain DCP -> safetensors",
    "read_zstd": "ckpttool convert zstd DCP -> safetensors",
}


def single_case(name: str, src: str, work: str, budget: str) -> dict[str, Any]:
    """One case, in this (fresh) process: seconds of the work plus an fsync of its output."""
    out = {"write_plain": "plain", "write_zstd": "zstd", "torch_write_zstd": "torch-zstd"}.get(name, f"{name}.safetensors")
    out = os.path.join(work, out)
    remove(out)
    if name == "raw_copy":
        r = raw_copy(dcp_files(src), out)
        return {"ok": True, "seconds": r["seconds"], "out_bytes": r["bytes"]}
    from ckpttool.commands import convert

    t0 = time.perf_counter()
    if name == "write_plain":
        convert(src, out, memory_budget=budget)
    elif name == "write_zstd":
        convert(src, out, compress="zstd", memory_budget=budget)
    elif name == "torch_write_zstd":
        torch_write_zstd(src, out)
    else:  # reads the output of the matching write case
        convert(os.path.join(work, "plain" if name == "read_plain" else "zstd"), out, memory_budget=budget)
    fsync_tree(out)
    seconds = time.perf_counter() - t0
    return {"ok": True, "seconds": seconds, "out_bytes": path_bytes(out)}


def torch_write_zstd(src: str, out: str) -> None:
    """Plain torch, one process: read the whole checkpoint, save it with torch's zstd extension."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys(storage_reader=FileSystemReader(src))
        dcp.save(state, storage_writer=FileSystemWriter(out, _extensions=[ZStandard()]))


def measure(name: str, args: Any, work: str, src: str) -> dict[str, Any]:
    if not args.warm:
        drop_caches()
    run = measure_child(SCRIPT, ["--_single", name, "--_src", src, "--_work", work, "--budget", args.budget], work, name,
                        timeout_s=args.case_timeout)
    if run.rc != 0 or not run.result.get("ok"):
        report_failure(name, run)
        return {"ok": False}
    return {**run.result, "peak_kib": run.peak_kib, "process_wall_s": run.wall_s}


def rows(cases: dict[str, dict[str, Any]], src_bytes: int) -> list[list[str]]:
    copy = cases.get("raw_copy", {}).get("seconds")
    out = []
    for name, label in CASES.items():
        r = cases.get(name)
        if not r or not r.get("ok"):
            out.append([label, "failed", "", "", "", "", ""])
            continue
        plain = cases.get("read_plain" if name.startswith("read") else "write_plain", {}).get("seconds")
        size_ref = cases.get("write_plain", {}).get("out_bytes")
        size = r["out_bytes"] if not name.startswith("read") else None
        out.append([label, f(r["seconds"], ".1f"), f(r["seconds"] / copy if copy else None),
                    f(r["seconds"] / plain if plain and name != "raw_copy" else None),
                    f(size / GB if size else None), f(size / size_ref if size and size_ref else None, ".3f"),
                    f(r["peak_kib"] / 1024, ".0f")])
    return out


HEAD = ["case", "seconds", "x raw copy", "x plain", "output GB", "x plain size", "peak MiB"]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=1.0, help="checkpoint size in GB (default 1)")
    p.add_argument("--budget", default="1GiB", help="ckpttool's --memory-budget (default 1GiB)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each case, rounds interleaved; the fastest is reported")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the generated checkpoint")
    add_run_args(p, "compress", "/tmp/ckpttool-bench-compress")
    add_rank_args(p, "--_single", "--_src", "--_work", gen=True)
    args = p.parse_args(argv)
    if gen_mode(args):
        return 0
    if args._single:
        write_json(args._result, single_case(args._single, args._src, args._work, args.budget))
        return 0
    parse_size(args.budget)
    out_dir, work, machine = start_run(args.out_dir)
    args.warm = not cold_cache(args.warm)
    root, info = checkpoint(SCRIPT, out_dir, args.size, SAVED_ON, args.keep, work)
    src = dcp_dir_of(root)
    src_bytes = dcp_bytes(src)
    print(f"   {src}: {src_bytes / GB:.2f} GB of DCP files; cache {'warm' if args.warm else 'cold'}", flush=True)
    runs = run_rounds(args.repeat, list(CASES), lambda n: measure(n, args, work, src),
                      lambda n, r: f"{CASES[n]:<44} {r['seconds']:7.1f} s  {r['out_bytes'] / GB:6.3f} GB  peak {r['peak_kib'] / 1024:6.0f} MiB")
    cases = {n: best_of(rs, ["seconds", "process_wall_s"], ["peak_kib"]) for n, rs in runs.items()}
    results = {**run_header(SCRIPT, argv, machine), "cold": not args.warm, "checkpoint": info, "src_bytes": src_bytes,
               "cases": cases, "all_runs": runs, "finished": now()}
    write_json(json_path(args, out_dir, "compress"), results)
    print("\n" + table(HEAD, rows(cases, src_bytes), markdown=False))
    write_markdown(args.md, table(HEAD, rows(cases, src_bytes), markdown=True) + "\n")
    if not args.keep:
        remove(root)
    remove(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
