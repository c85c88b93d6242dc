"""Benchmark: zstd-compressed DCP (``--compress zstd``) against plain records and plain torch.

A training state (an FSDP2 Transformer's fp32 params and AdamW state, random values: _dist's generator) is saved
with ckpttool on 2 gloo ranks; each case runs in a fresh child (peak RSS is its own), the page cache dropped
before it unless ``--warm``. Seconds: the work plus an fsync of its output, the fastest run. Every figure is a
ratio within the run: time against the raw copy and the plain-record case, size against the plain output.

  raw copy           the DCP files read and written to one file + fsync (the disk's limit)
  write plain, zstd  ckpttool convert SRC -> DCP (plain records; --compress zstd)
  torch write zstd   plain torch: full load, then dcp.save(FileSystemWriter(_extensions=[ZStandard()]))
  read plain, zstd   ckpttool convert of that output -> safetensors (zstd: decompress, check, write)

    .venv/bin/python bench/compress.py --size 1 --repeat 2

Random-valued fp32 state compresses little (its mantissas are noise), as do real trained weights; optimizer
state early in training and zero-initialised buffers compress more.
"""

import os
import time

from _common import GB, drop_caches, fsync_tree, path_bytes, raw_copy, remove
from _dist import dcp_files  # importing _dist puts this repository first on sys.path: its ckpttool is the one measured
from harness import Column, Set, Spec, main

from ckpttool.choices import parse_size

CASES = {  # name: label, output in the work folder (a read case reads its write case's)
    "raw_copy": ("raw copy (cp of the DCP files)", "copy.bin"),
    "write_plain": ("ckpttool convert -> DCP", "plain"),
    "write_zstd": ("ckpttool convert -> DCP --compress zstd", "zstd"),
    "torch_write_zstd": ("torch dcp.save, ZStandard extension", "torch-zstd"),
    "read_plain": ("ckpttool convert plain DCP -> safetensors", "plain.safetensors"),
    "read_zstd": ("ckpttool convert zstd DCP -> safetensors", "zstd.safetensors"),
}


def single_case(args) -> dict:
    """One case in its child: seconds of the work (raw copy: its own timing) plus an fsync of its output."""
    name, src, dst = args._case, args._src, args._dst
    if name == "raw_copy":
        r = raw_copy(dcp_files(src), dst)
        return {"ok": True, "seconds": r["seconds"], "out_bytes": r["bytes"]}
    from ckpttool.offline.convert import convert

    t0 = time.perf_counter()
    if name == "torch_write_zstd":  # plain torch, one process: the whole checkpoint read, then saved with its zstd extension
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import _extension, state_dict_loader

        warnings.simplefilter("ignore")
        state = state_dict_loader._load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(src))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dst, _extensions=[_extension.ZStandard()]))
    else:
        convert(src, dst, memory_budget=args.budget, **({"compress": "zstd"} if name == "write_zstd" else {}))
    fsync_tree(dst)
    return {"ok": True, "seconds": time.perf_counter() - t0, "out_bytes": path_bytes(dst)}


def sets(run):
    """The cases on the checkpoint, each run in a fresh child with the page cache dropped before it (unless warm)."""
    parse_size(run.args.budget)  # a bad --budget fails now, not in every case
    src, info = run.checkpoint(run.args.size, "2")

    def measure(name: str) -> dict:
        dst, inp = (os.path.join(run.work, CASES[n][1]) for n in (name, name.replace("read", "write")))
        remove(dst)
        if run.cold:
            drop_caches()
        args = ["--_case", name, "--_src", inp if name.startswith("read") else src, "--_dst", dst, "--budget", run.args.budget]
        return run.child(name, args)[0]

    yield Set(list(CASES), measure,
              lambda n, r: f"{CASES[n][0]:<44} {r['seconds']:7.1f} s  {r['out_bytes'] / GB:6.3f} GB  peak {r['peak_kib'] / 1024:6.0f} MiB",
              heading=f"{info['file_bytes'] / GB:.2f} GB checkpoint saved on 2 ranks, page cache {'cold' if run.cold else 'warm'}",
              info=info)


def derive(res: dict, run) -> tuple[list, list]:
    """Time against the raw copy and against the plain case of the same direction; output size against the plain output."""
    cases, rows = res["cases"], []
    copy, ref = cases["raw_copy"].get("seconds"), cases["write_plain"].get("out_bytes")
    for name, c in cases.items():
        rows.append(r := {"case": name, "label": CASES[name][0], "failed": c.get("failed")})
        if not r["failed"]:
            plain = cases["read_plain" if name.startswith("read") else "write_plain"].get("seconds")
            size = None if name.startswith("read") else c["out_bytes"]
            r.update(seconds=c["seconds"], x_copy=c["seconds"] / copy if copy else None,
                     x_plain=c["seconds"] / plain if plain and name != "raw_copy" else None,
                     out_gb=size / GB if size else None, x_size=size / ref if size and ref else None, peak_mib=c["peak_kib"] / 1024)
    return rows, []


SPEC = Spec("compress", "Benchmark: zstd-compressed DCP", __doc__, os.path.abspath(__file__), sets, derive,
            options={"--size": dict(type=float, default=1.0, help="checkpoint size in GB (default 1)")},
            columns=[Column("case", "label", None), Column("seconds", "seconds", ".1f"), Column("x raw copy", "x_copy"),
                     Column("x plain", "x_plain"), Column("output GB", "out_gb"), Column("x plain size", "x_size", ".3f"),
                     Column("peak MiB", "peak_mib", ".0f")], child=single_case, flags=("budget", "warm", "keep"))

main(SPEC, __name__)
