"""Benchmark: a checkpoint larger than memory (issue 29, item 6), each command against ``cp -r``.

Writes one DCP checkpoint of ``--size`` GB (default 32: more than this machine's RAM) as a ckpttool step saved on 2
ranks holds it (``__0_0.distcp``, ``__1_0.distcp``: FSDP2's Shard(0) boxes of every tensor; ``.metadata``; the commit
record with its manifest, xxh3 of every record): the bundled Transformer's fp32 parameters with AdamW's exp_avg and
exp_avg_sq (12 bytes a parameter), as many blocks as make ``--size``, from 8 GB at a Llama-3.2-3B-like width (vocabulary
128256, dim 3072: six tensors of 1.58 GB, more than the memory budget, streamed region by region). Nothing holds it in
memory: ckpttool's own offline writer (the engine and DCP sink of ``ckpttool reshard``) streams a synthetic source
(deterministic values, generated per region), then the records are hashed into the commit record as the Checkpointer does.

Then, each in a fresh process, the page cache dropped before it (as root):

  cp -r      ``cp -r SRC DST`` + an fsync of every file of DST: the limit for a tool that reads and writes every byte
             once (run before each ckpttool case: each ratio compares two commands minutes apart)
  convert    ``ckpttool convert SRC DST.safetensors --to safetensors`` (one file)
  reshard    ``ckpttool reshard SRC DST --world-size 3`` (2 -> 3 ranks)

Time: the whole command (spawn to exit) plus an fsync of its output (ckpttool fsyncs its files, cp does not): both timed
to the bytes on disk. Peak memory of the process tree, two ways, the larger checked: ``ru_maxrss`` (what
``/usr/bin/time -f %M`` prints: the largest process's peak VmRSS, mapped file pages included) and the polled peak (50 ms)
of the tree's RssAnon + RssShmem. Every 0.5 s of a ckpttool case, to the JSON and a second plot (``--plot``'s name +
``-timeline``): VmRSS, the tree's anon+shmem, RssFile, disk reads and writes (``/proc/PID/io``; against the checkpoint's
size: any read amplification, ~0.1 GB of libraries included), CPU time and the load average. The table has the load
average before and after each case: a busy machine slows ckpttool, which checksums every byte on the CPU, more than cp.

Disk: the source and one output at a time, so about 2x ``--size`` + 2 GB free on ``--out-dir``'s disk; with less it
refuses (a failed verdict saying how much it needs). What it writes is removed at the end, also on failure or SIGTERM.

    .venv/bin/python bench/large.py --size 32 --md docs/bench/large.md --plot docs/img/bench-large.png

Targets (issue 29, item 6): peak RSS < 1.5 GB and <= 1.1x the time of cp -r, for a checkpoint larger than RAM.
"""
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from typing import Any

from _common import (GB, GiB, MiB, code_version, drop_caches, fsync_tree, path_bytes, proc_io, proc_status, read_text, remove,
                     report_failure, run_child)
from _dist import fit_layers, n_params  # importing _dist puts this repository first on sys.path: its ckpttool is the one measured
from harness import Chart, Column, Panel, Set, Spec, check, main

from ckpttool.choices import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, RESHARD_TO = 2, 3  # the ranks the checkpoint was "saved" on; reshard's target
SMOKE_SIZE, SMOKE_BUDGET = 0.2, "16MiB"
RSS_LIMIT, TIME_LIMIT = 1.5 * GB, 1.1  # the targets: peak RSS under 1.5 GB, at most 1.1x the time of cp -r
HEADROOM = 2 * GB  # free space beyond the source and one output
PATTERN = (1 << 24) + 43  # period (elements) of the values' cycle: 64 MiB of fp32 per kind
LABELS = {"cp_convert": "cp -r (+fsync), before convert", "convert": "ckpttool convert --to safetensors",  # cp_X: the cp -r before X
          "cp_reshard": "cp -r (+fsync), before reshard", "reshard": f"ckpttool reshard --world-size {RESHARD_TO}"}
TIMELINE = ["seconds", "tree anon+shmem KiB", "VmRSS KiB", "RssFile KiB", "read_bytes", "write_bytes", "CPU s (user+sys)", "load avg 1 min"]


def model_config(size_gb: float) -> dict[str, int]:
    """The bundled Transformer with as many blocks (at least one) as make its fp32 params + AdamW state reach ``size_gb``
    GB, rounded up (never smaller than asked: 32 stays above a 24 GiB machine's RAM). From 8 GB: Llama-3.2-3B's
    vocabulary and width; from 0.5 GB: 32000 x 2048 (262 MB); below: 8192 x 512."""
    vocab, dim, heads, seq = ((128256, 3072, 24, 4096) if size_gb >= 8 else (32000, 2048, 16, 2048) if size_gb >= 0.5
                              else (8192, 512, 8, 512))
    return fit_layers(dict(vocab_size=vocab, dim=dim, n_layers=1, n_heads=heads, seq_len=seq), size_gb, up=True)


def make_source(cfg: dict[str, int], where: str):
    """A ckpttool Source of the training state ``{"model", "optim", "extra"}`` of the Transformer ``cfg`` with AdamW after
    one step, keyed as ``get_state_dict`` flattens it, its values generated for any region asked: element i of a tensor
    is element ``(i + hash(key)) % PATTERN`` of a random cycle of its kind (weights +-0.05, exp_avg +-1e-3, exp_avg_sq in
    [0, 1e-6); step 1.0). Deterministic, incompressible, nothing held but the three cycles (192 MiB)."""
    import torch

    from ckpttool.formats.base import Source
    from ckpttool.index import Chunk, Index, ObjectEntry, TensorEntry
    from ckpttool.storage import resolve
    from ckpttool.training.trainer.model import ModelConfig, Transformer

    with torch.device("meta"):
        params = [(name, tuple(p.shape)) for name, p in Transformer(ModelConfig(**cfg)).named_parameters()]
    gen = torch.Generator().manual_seed(29)
    cycles = {kind: torch.rand(PATTERN, generator=gen).mul_(scale).sub_(low)
              for kind, scale, low in (("param", 0.1, 0.05), ("exp_avg", 2e-3, 1e-3), ("exp_avg_sq", 1e-6, 0.0))}
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True, "params": [n for n, _ in params]}
    index = Index()
    tensors = [(("model", n), s) for n, s in params] + [(("optim", "state", n, k), () if k == "step" else s)
                                                         for n, s in params for k in ("step", "exp_avg", "exp_avg_sq")]
    for path, shape in tensors:  # AdamW's state, per parameter, after the parameters: as get_state_dict keys it
        index.add(TensorEntry(".".join(path), shape, torch.float32, (Chunk((0,) * len(shape), shape),)), path)
    for path, value in [*((("optim", "param_groups", 0, k), v) for k, v in group.items()), (("extra", "step"), 1),
                        (("extra", "note"), "bench/large.py")]:
        index.add(ObjectEntry(".".join(map(str, path)), value), path)

    class SyntheticSource(Source):
        format = "synthetic"

        def index(self) -> Index:
            return index

        def data_spans(self, key: str) -> list:
            raise NotImplementedError("a synthetic source has no files")

        def read_tensor(self, key: str, box=None, out=None):
            shape = tuple(index[key].shape)
            box = box if box is not None else ((0,) * len(shape), shape)
            out = torch.empty(box[1], dtype=torch.float32) if out is None else out
            if not shape:
                return out.fill_(1.0)  # AdamW's step after one step
            cycle = cycles[key.rsplit(".", 1)[1] if key.startswith("optim.") else "param"]
            whole_rows = all(o == 0 and n == s for o, n, s in zip(box[0][1:], box[1][1:], shape[1:]))
            rows = out if whole_rows and out.is_contiguous() else torch.empty((box[1][0], *shape[1:]), dtype=torch.float32)
            flat, done = rows.view(-1), 0
            at = (box[0][0] * math.prod(shape[1:]) + int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little")) % PATTERN
            while done < flat.numel():  # the cycle, from the box's first element on
                k = min(flat.numel() - done, PATTERN - at)
                flat[done:done + k].copy_(cycle[at:at + k])
                done, at = done + k, 0
            if rows is not out:
                out.copy_(rows[(slice(None), *(slice(o, o + m) for o, m in zip(box[0][1:], box[1][1:])))])
            return out

    return SyntheticSource(resolve(where))


def generate(args) -> dict[str, Any]:
    """The generator child: stream the synthetic state into a DCP step laid out on WORLD ranks (ckpttool's engine and DCP
    sink, under ``--budget``; its progress in the log), then write the commit record with the manifest (the records
    hashed, as the Checkpointer does) and fsync everything."""
    import torch

    from ckpttool.engine import plan_entries, run
    from ckpttool.formats.dcp import DcpSink, DcpSource
    from ckpttool.training.fallback import hash_records, metadata_row
    from ckpttool.layout import FsdpLayout, Mesh
    from ckpttool.steps import COMMIT_FILE, commit_record
    from ckpttool.storage import resolve

    torch.set_num_threads(1)
    cfg, loc, last, t0 = model_config(args.size), resolve(args._dst), [0.0], time.perf_counter()
    plan = plan_entries(source := make_source(cfg, os.path.join(os.path.dirname(args._result), "synthetic-source")))

    def progress(done: int, total: int, key: str) -> None:
        if time.perf_counter() - last[0] >= 10 or done == total:
            last[0] = time.perf_counter()
            print(f"   writing: {done / GB:6.1f} / {total / GB:.1f} GB  {done / GB / max(1e-9, last[0] - t0):.2f} GB/s", flush=True)

    run(source, DcpSink(loc, layout=FsdpLayout(Mesh(1, WORLD))), plan, parse_size(args.budget, "--budget"), progress)
    t1 = time.perf_counter()
    manifest = hash_records(loc)
    manifest["files"] = metadata_row(loc)  # the manifest covers .metadata too, as the Checkpointer's
    loc.child(COMMIT_FILE).write_bytes(commit_record(1, WORLD, {"manifest": manifest}))
    fsync_tree(args._dst)
    t2 = time.perf_counter()
    with DcpSource(loc) as back:  # a ckpttool step: its commit record and manifest read back as valid
        assert back.checks is not None and back.world_size == WORLD
    sizes = [s.nbytes for s in plan.tensors]
    return {"ok": True, "cfg": cfg, "params": n_params(cfg), "tensors": len(sizes), "objects": len(plan.objects),
            "tensor_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "tensors_over_1gb": sum(s >= GB for s in sizes),
            "file_bytes": path_bytes(args._dst), "files": sorted(os.listdir(args._dst)), "write_s": t1 - t0, "hash_s": t2 - t1,
            "records": sum(len(v) for v in manifest["records"].values()), "gen_hwm_kib": proc_status("VmHWM"), "torch": torch.__version__}


def json_report(log_file: str) -> dict[str, Any] | None:
    """The JSON document a ckpttool command printed (``--json``) in its log, if any."""
    text = read_text(log_file)
    for at in (i for i, ch in enumerate(text) if ch == "{"):
        with contextlib.suppress(ValueError):
            return json.JSONDecoder().raw_decode(text, at)[0]
    return None


def measure(run, name: str, src: str) -> dict[str, Any]:
    """One run of a case in a fresh process: its wall time plus an fsync of its output, its peak memory (both ways) and,
    for ckpttool, its timeline; the output is removed afterwards (and with the work folder, if this fails)."""
    ck, timeline, last, log = not name.startswith("cp"), [], [-1.0], os.path.join(run.work, f"{name}.log")
    dst = os.path.join(run.work, {"convert": "out.safetensors", "reshard": f"resharded-{RESHARD_TO}"}.get(name, "copy"))
    remove(dst)
    dropped = drop_caches() if run.cold else False
    how = {"convert": ["convert", src, dst, "--to", "safetensors"], "reshard": ["reshard", src, dst, "--world-size", str(RESHARD_TO)]}
    argv = [sys.executable, "-m", "ckpttool", *how[name], "--memory-budget", run.args.budget, "--json"] if ck else ["cp", "-r", src, dst]

    def sample(t: float, tree_kib: int, pid: int) -> None:  # run_child's poll skips a sample that raises (the process gone)
        if t - last[0] >= 0.5:
            last[0], io = t, proc_io(pid)
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read().rsplit(")", 1)[1].split()  # CPU seconds: utime + stime, in clock ticks
            timeline.append([round(t, 2), tree_kib, proc_status("VmRSS", pid) or 0, proc_status("RssFile", pid) or 0,
                             io.get("read_bytes", 0), io.get("write_bytes", 0),
                             round((int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), 2), round(os.getloadavg()[0], 2)])

    # the ckpttool measured is this repository's (the one this script is in), wherever the run starts
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    print(f"   {LABELS[name]}: {' '.join(os.path.relpath(a) if a == sys.executable else a for a in argv)}", flush=True)
    load_before = os.getloadavg()[0]
    proc = run_child(argv, os.path.join(run.work, f"{name}.result.json"), log, env=env, timeout_s=run.args.case_timeout,
                     on_poll=sample if ck else None)
    r: dict[str, Any] = {"case": name, "argv": argv, "rc": proc.rc, "ok": proc.rc == 0, "cache_dropped": dropped,
                         "timed_out": proc.timed_out, "loadavg": [load_before, os.getloadavg()[0]]}
    if proc.rc == 0:
        t0 = time.perf_counter()
        out_bytes = fsync_tree(dst)
        fsync_s = time.perf_counter() - t0
        r.update(command_s=proc.wall_s, fsync_s=fsync_s, seconds=proc.wall_s + fsync_s, out_bytes=out_bytes, maxrss_kib=proc.maxrss_kib,
                 tree_peak_kib=proc.tree_peak_kib, peak_kib=proc.peak_kib, user_s=proc.user_s, sys_s=proc.sys_s,
                 timeline_columns=TIMELINE, rss_timeline=timeline, report=json_report(log) if ck else None)
    else:
        report_failure(name, proc)
        r["log_tail"] = proc.log_tail[-4000:]
    remove(dst)
    return r


def sets(run):
    """The checkpoint (unless the disk is too small: then a refusal), then each ckpttool case after its cp -r."""
    args = run.args
    if args.smoke:
        args.size, args.budget = SMOKE_SIZE, SMOKE_BUDGET
    parse_size(args.budget, "--budget")
    names = [n for n in args.cases.split(",") if n]
    if any(n not in ("convert", "reshard") for n in names):
        raise SystemExit(f"large.py: unknown case in --cases {args.cases!r}: convert, reshard")
    est = 12 * n_params(model_config(args.size)) + 64 * MiB  # 12 bytes a parameter, the records' headers and the metadata
    need, free, ram = 2 * est + HEADROOM, shutil.disk_usage(run.out_dir).free, (run.machine.get("mem_total_gib") or 0) * GiB
    run.extra.update(size_gb=args.size, budget=args.budget, code=code_version(REPO), estimated_bytes=est, disk_needed=need, disk_free=free)
    print(f"checkpoint: ~{est / GB:.1f} GB ({est / ram:.2f}x RAM of {ram / GB:.1f} GB); disk: needs {need / GB:.1f} GB free "
          f"on {run.out_dir}, has {free / GB:.1f} GB", flush=True)
    if free < need:
        why = (f"not enough free disk on {run.out_dir}: a {est / GB:.1f} GB checkpoint needs {need / GB:.1f} GB (the source, one output "
               f"at a time, {HEADROOM / GB:.0f} GB headroom), there are {free / GB:.1f} GB; free {math.ceil((need - free) / GB)} GB more, "
               f"or pass a smaller --size or another --out-dir")
        print(f"large.py: {why}", file=sys.stderr)
        yield Set(["refused"], lambda n: {"ok": False}, lambda n, r: "", info={"refused": why, "size_gb": args.size})
        return
    src = os.path.join(run.work, "ckpt", "step-1")
    print(f"\n== writing the checkpoint with ckpttool's DCP sink on {WORLD} ranks: {src}", flush=True)
    info, _ = run.child("generate", ["--_case", "generate", "--_dst", src, "--size", str(args.size), "--budget", args.budget])
    if not info["ok"]:
        raise SystemExit(f"writing the checkpoint failed (exit {info['rc']})")
    info.update(gen_wall_s=info.pop("process_wall_s"), gen_peak_kib=info.pop("peak_kib"))
    cfg = info["cfg"]  # the checkpoint in one sentence: the set's heading
    heading = (f"{info['file_bytes'] / GB:.2f} GB of DCP files ({info['tensor_bytes'] / GB:.2f} GB of tensors: {info['params'] / 1e9:.2f}B "
               f"fp32 parameters + AdamW exp_avg, exp_avg_sq), as a ckpttool step saved on {WORLD} ranks: {', '.join(info['files'])}. "
               f"Transformer of vocabulary {cfg['vocab_size']}, dim {cfg['dim']}, {cfg['n_layers']} blocks; {info['tensors']} tensors, "
               f"{info['objects']} objects, {info['records']} records; largest tensor {info['largest_tensor_bytes'] / GB:.2f} GB "
               f"({info['tensors_over_1gb']} of >= 1 GB); memory budget {args.budget}. Written in {info['write_s']:.0f} s, hashed for "
               f"the manifest in {info['hash_s']:.0f} s.")
    yield Set([c for n in names for c in ("cp_" + n, n)], lambda n: measure(run, n, src),
              lambda n, r: (f"{LABELS[n]:<36} {r['seconds']:7.1f} s ({r['command_s']:.1f} + fsync {r['fsync_s']:.1f})  "
                            f"{info['file_bytes'] / r['seconds'] / GB:5.2f} GB/s  peak RSS {r['peak_kib'] / 1024:6.0f} MiB "
                            f"(ru_maxrss {r['maxrss_kib'] / 1024:.0f}, tree {r['tree_peak_kib'] / 1024:.0f})"),
              heading=heading, info=info, time_keys=["seconds"])
    run.extra["code_at_end"] = code_version(REPO)
    if run.extra["code_at_end"] != run.extra["code"]:
        print(f"warning: ckpttool/ changed during the run: {run.extra['code']} -> {run.extra['code_at_end']}", file=sys.stderr)


def ram_x(nbytes: int, res: dict[str, Any]) -> str:
    return f"{nbytes / ((res['machine'].get('mem_total_gib') or 1) * GiB):.2f}x RAM"


def title(res: dict[str, Any]) -> str:
    return f"{res['checkpoint']['file_bytes'] / GB:.1f} GB checkpoint ({ram_x(res['checkpoint']['file_bytes'], res)}) vs cp -r"


def derive(res: dict[str, Any], run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows (time, GB/s, ratio to its cp, memory) and the verdicts; a refusal's verdict says why."""
    info, cases, rows, checks = res["checkpoint"], res["cases"], [], []
    if "refused" in info:
        return ([{"case": "refused", "label": "refused", "failed": True}],
                [check("runs", f"{info['size_gb']:g} GB", f"refused: {info['refused']}", False)])
    nbytes = info["file_bytes"]
    for name, c in cases.items():
        tag, ck = f"{LABELS[name]} @ {nbytes / GB:.1f} GB DCP on {WORLD} ranks ({ram_x(nbytes, res)})", not name.startswith("cp")
        if not c.get("ok"):
            rows.append({"case": name, "label": LABELS[name], "failed": True})
            if ck:
                checks.append(check("the command completes", tag, f"failed (exit {c['runs'][-1].get('rc')})", False))
            continue
        ref, tl = cases.get("cp_" + name, {}), c.get("rss_timeline") or []
        x = c["seconds"] / ref["seconds"] if ref.get("ok") else None
        rows.append(row := {"case": name, "label": LABELS[name], "seconds": c["seconds"], "command_s": c["command_s"],
                            "fsync_s": c["fsync_s"], "gbps": nbytes / c["seconds"] / GB, "x_cp": x, "peak_mib": c["peak_kib"] / 1024,
                            "maxrss_mib": c["maxrss_kib"] / 1024, "tree_mib": c["tree_peak_kib"] / 1024, "cpu_s": c["user_s"] + c["sys_s"],
                            "out_gb": c["out_bytes"] / GB, "loadavg": c.get("loadavg"),
                            # the bytes it read from the disk, at the last sample (up to 0.5 s before it ended)
                            "disk_read_gb": tl[-1][4] / GB if tl and len(tl[-1]) >= 7 else None})
        if ck:
            checks += [check(f"<= {TIME_LIMIT}x the time of cp -r (+fsync) of the same checkpoint", tag,
                             f"{c['seconds']:.1f} s vs {ref['seconds']:.1f} s = {x:.2f}x", x <= TIME_LIMIT)] if x is not None else []
            checks.append(check(f"peak RSS < {RSS_LIMIT / GB:g} GB ({RSS_LIMIT / MiB:.0f} MiB)", tag,
                                f"{row['peak_mib']:.0f} MiB (ru_maxrss {row['maxrss_mib']:.0f}, tree anon+shmem {row['tree_mib']:.0f})",
                                row["peak_mib"] * MiB < RSS_LIMIT))
    return rows, checks


def draw_timeline(plt, path: str, res: dict[str, Any]) -> str | None:
    """The ckpttool commands' RSS over time (left), their disk reads and writes over time (right): line plots, which
    harness's chart does not draw, in a second PNG beside ``--plot``'s (``path``) with ``-timeline`` in its name."""
    series = [(LABELS[n], c["rss_timeline"]) for n, c in res["cases"].items() if c.get("rss_timeline")]  # cp's is empty
    if not series:
        return None
    fig, (rss, disk) = plt.subplots(1, 2, figsize=(13, 5))
    for label, tl in series:
        color = rss.plot([p[0] for p in tl], [p[2] / 1024 for p in tl], label=f"{label}: VmRSS")[0].get_color()
        rss.plot([p[0] for p in tl], [p[1] / 1024 for p in tl], ls="--", color=color, label="  anon+shmem (tree)")
        for k, ls, what in ((4, "-", f"{label}: read"), (5, ":", "  write")) if len(tl) > 2 else ():
            steps = list(zip(tl, tl[1:]))
            disk.plot([(a[0] + b[0]) / 2 for a, b in steps], [(b[k] - a[k]) / max(1e-6, b[0] - a[0]) / 1e6 for a, b in steps],
                      color=color, ls=ls, label=what)
    rss.axhline(RSS_LIMIT / MiB, color="r", ls="-.", label=f"target {RSS_LIMIT / GB:g} GB")
    for ax, ylabel in ((rss, "MiB"), (disk, "MB/s from/to the disk (/proc/PID/io, 0.5 s steps)")):
        ax.set(xlabel="seconds since the command started", ylabel=ylabel, ylim=(0, None))
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle(f"{title(res)}: the ckpttool commands over time, torch {res.get('torch')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path := "{0}-timeline{1}".format(*os.path.splitext(path)), dpi=110)
    plt.close(fig)
    return path


SPEC = Spec(
    "large", "Benchmark: a checkpoint larger than memory", __doc__, os.path.abspath(__file__), sets, derive,
    options={"--size": dict(type=float, default=32.0, help="checkpoint size in GB of tensor data (default 32)"),
             "--smoke": dict(action="store_true", help=f"--size {SMOKE_SIZE:g} --budget {SMOKE_BUDGET}: checks the plumbing only"),
             "--budget": dict(default="1GiB", help="ckpttool --memory-budget, also the writer's (default 1GiB)"),
             "--cases": dict(default="convert,reshard", help="ckpttool cases to run, each after its cp -r (default convert,reshard)")},
    columns=[Column("case", "label", None),
             Column("time s (command + fsync)", lambda r: f"{r['seconds']:.1f} ({r['command_s']:.1f} + {r['fsync_s']:.1f})", ""),
             Column("GB/s", "gbps"), Column("× its cp -r", "x_cp"), Column("peak RSS MiB", "peak_mib", ".0f"),
             Column("ru_maxrss MiB", "maxrss_mib", ".0f"), Column("tree anon+shmem MiB", "tree_mib", ".0f"),
             Column("CPU s", "cpu_s", ".0f"), Column("output GB", "out_gb"), Column("read from disk GB", "disk_read_gb"),
             Column("load avg before/after", lambda r: "/".join(f"{x:.1f}" for x in r["loadavg"]) if r.get("loadavg") else None, "")],
    chart=Chart([Panel("seconds", "seconds: whole command + fsync of its output (grey: cp -r, blue: ckpttool)",
                       note=lambda r: f"{r['seconds']:.0f} s" + (f" ({r['x_cp']:.2f}x cp)" if r["x_cp"] else ""))],
                title=title, color=lambda r: "#888888" if r["case"].startswith("cp") else "#1f77b4", more=draw_timeline),
    child=generate, flags=("warm",), repeat=1, case_timeout=7200, verdict_widths=(52, 60),
    exit=lambda results: 2 if "refused" in results["sets"][0]["checkpoint"] else 0)  # 2: refused for lack of disk

main(SPEC, __name__)
