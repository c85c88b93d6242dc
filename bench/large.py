"""Benchmark: a checkpoint larger than memory (issue 29, item 6), each command against ``cp -r``.

Writes one DCP checkpoint of ``--size`` GB (default 32: more than this machine's RAM) as a ckpttool
step saved on 2 ranks holds it: ``__0_0.distcp``, ``__1_0.distcp`` (FSDP2's Shard(0) boxes of every
tensor), ``.metadata`` and the commit record with its manifest (xxh3 of every record). Nothing
holds the checkpoint in memory: a synthetic source (deterministic values, generated per region)
is streamed by ckpttool's own offline writer (the engine and the DCP sink that ``ckpttool reshard``
uses) into the 2 ranks' files, then the records are hashed into the commit record as the
Checkpointer writes it. The state is the bundled Transformer's fp32 parameters with AdamW's
exp_avg and exp_avg_sq (12 bytes a parameter) at a Llama-3.2-3B-like width from 8 GB up
(vocabulary 128256, dim 3072: the embedding, the output layer and their AdamW state are six
tensors of 1.58 GB, more than the memory budget, so they are streamed region by region), as many
blocks as make ``--size``.

Then, each in a fresh process with the page cache dropped before it (when run as root):

  cp -r                 ``cp -r SRC DST``, then an fsync of every file of DST: the limit for a tool
                        that reads and writes every byte once (run before each ckpttool case,
                        so each ratio compares two commands minutes apart)
  convert               ``ckpttool convert SRC DST.safetensors --to safetensors`` (one file)
  reshard               ``ckpttool reshard SRC DST --world-size 3`` (2 -> 3 ranks)

Time: the whole command (spawn to exit: interpreter and imports included) plus an fsync of every
output file afterwards (ckpttool fsyncs its files itself; cp does not), so both are timed to the
bytes being on disk. Peak memory of the command's process tree, two ways: ``ru_maxrss`` from
``wait4`` (what ``/usr/bin/time -f %M`` prints: the largest single process's peak VmRSS, file-backed
pages of the libraries and of any mapped file included) and the polled peak of the tree's summed
RssAnon + RssShmem (``/proc/PID/status`` every 50 ms); the larger is the one checked. Each ckpttool
case's RSS over time (VmRSS, anon+shmem of the tree, RssFile) and its disk reads, writes and CPU
time (``/proc/PID/io`` and ``stat``), every 0.5 s, go to the JSON and the plot; the bytes it read
from the disk (the ~0.1 GB of libraries it loads included), against the checkpoint's size, show any
read amplification. The 1-minute load average before and after each case is in the table: a busy
machine slows ckpttool, which checksums every byte on the CPU, more than cp, which copies in the
kernel.

Disk: the source and one output at a time (each case's output, cp's copy too, is removed before
the next case), so about 2x ``--size`` plus 2 GB must be free on ``--out-dir``'s disk; the script
refuses to start with less, and says how much it needs. Everything it writes under ``--out-dir``
is removed at the end, on failure and on Ctrl-C / SIGTERM too.

    .venv/bin/python bench/large.py --size 32 --md docs/bench/large.md --plot docs/img/bench-large.png
    .venv/bin/python bench/large.py --size 2 --budget 256MiB        # a few minutes
    .venv/bin/python bench/large.py --smoke                        # 0.2 GB: the plumbing only

Targets (issue 29, item 6): peak RSS < 1.5 GB and <= 1.1x the time of cp -r, for a checkpoint larger
than RAM.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    GB, MiB, add_hidden_args, add_run_args, bar_labels, code_version, cold_cache, drop_caches,
    f, fsync_tree, json_path, machine_brief, md_header, measure_child, now, parse_size, parser, path_bytes,
    plot_file, print_results, proc_status, remove, run_child, run_header, start_run, table, verdict_md,
    wait_for_convert, write_json, write_markdown,
)
from _dist import n_params  # noqa: E402

SCRIPT = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(SCRIPT))
WORLD = 2  # the ranks the checkpoint was "saved" on
RESHARD_TO = 3
SMOKE_SIZE, SMOKE_BUDGET = 0.2, "16MiB"
RSS_LIMIT = 1.5 * GB  # the target: peak RSS under 1.5 GB ...
TIME_LIMIT = 1.1  # ... and at most 1.1x the time of cp -r
HEADROOM = 2 * GB  # free space beyond the source and one output
PATTERN = (1 << 24) + 43  # period (elements) of the values' cycle: 64 MiB of fp32 per kind


# --- the checkpoint ------------------------------------------------------------------------------


def model_config(size_gb: float) -> dict[str, int]:
    """The bundled Transformer at a width for ``size_gb``, with as many blocks (at least one) as
    make its fp32 params + AdamW state reach ``size_gb`` GB (rounded up: the checkpoint is never
    smaller than asked, so 32 stays above a 24 GiB machine's RAM).

    From 8 GB: Llama-3.2-3B's vocabulary and width (128256 x 3072: 1.58 GB embedding and output
    weights, and their AdamW state); from 0.5 GB: 32000 x 2048 (262 MB); below: 8192 x 512."""
    if size_gb >= 8:
        cfg = dict(vocab_size=128256, dim=3072, n_layers=1, n_heads=24, seq_len=4096)
    elif size_gb >= 0.5:
        cfg = dict(vocab_size=32000, dim=2048, n_layers=1, n_heads=16, seq_len=2048)
    else:
        cfg = dict(vocab_size=8192, dim=512, n_layers=1, n_heads=8, seq_len=512)
    fixed = n_params({**cfg, "n_layers": 0})
    per_layer = n_params({**cfg, "n_layers": 1}) - fixed
    cfg["n_layers"] = max(1, math.ceil((size_gb * GB / 12 - fixed) / per_layer))
    return cfg


def estimated_bytes(cfg: dict[str, int]) -> int:
    """The checkpoint's size on disk, before writing it: 12 bytes a parameter plus the records'
    archive headers (a few KB each) and the metadata."""
    params = n_params(cfg)
    return 12 * params + 64 * MiB


def make_source(cfg: dict[str, int], where: str):
    """A ckpttool Source of the training state ``{"model", "optim", "extra"}`` of the Transformer
    ``cfg`` with AdamW after one step, as ``get_state_dict`` flattens it (the keys of a ckpttool
    step), whose values are generated for any region asked: element i of a tensor is element
    ``(i + hash(key)) % PATTERN`` of a random cycle of its kind (weights uniform in +-0.05, exp_avg
    +-1e-3, exp_avg_sq in [0, 1e-6); step 1.0). Deterministic, incompressible, nothing held but
    the three cycles (192 MiB)."""
    import hashlib

    import torch

    from ckpttool.formats.base import Source
    from ckpttool.index import Chunk, Index, ObjectEntry, TensorEntry
    from ckpttool.storage import resolve
    from ckpttool.trainer.model import ModelConfig, Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(**cfg))
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    gen = torch.Generator().manual_seed(29)
    cycles = {"param": torch.rand(PATTERN, generator=gen).mul_(0.1).sub_(0.05),
              "exp_avg": torch.rand(PATTERN, generator=gen).mul_(2e-3).sub_(1e-3),
              "exp_avg_sq": torch.rand(PATTERN, generator=gen).mul_(1e-6)}

    class SyntheticSource(Source):
        format = "synthetic"

        def __init__(self) -> None:
            super().__init__(resolve(where))
            idx = Index()

            def tensor(key: str, path: tuple, shape: tuple[int, ...]) -> None:
                idx.add(TensorEntry(key, shape, torch.float32, (Chunk((0,) * len(shape), shape),)), path)

            for name, shape in params:
                tensor(f"model.{name}", ("model", name), shape)
            for name, shape in params:  # AdamW's state, per parameter, as get_state_dict keys it
                tensor(f"optim.state.{name}.step", ("optim", "state", name, "step"), ())
                tensor(f"optim.state.{name}.exp_avg", ("optim", "state", name, "exp_avg"), shape)
                tensor(f"optim.state.{name}.exp_avg_sq", ("optim", "state", name, "exp_avg_sq"), shape)
            group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
                     "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                     "decoupled_weight_decay": True, "params": [name for name, _ in params]}
            self.values: dict[str, Any] = {}
            for k, v in group.items():
                self._object(idx, f"optim.param_groups.0.{k}", ("optim", "param_groups", 0, k), v)
            self._object(idx, "extra.step", ("extra", "step"), 1)
            self._object(idx, "extra.note", ("extra", "note"), "bench/large.py")
            self._index = idx

        def _object(self, idx: Index, key: str, path: tuple, value: Any) -> None:
            idx.add(ObjectEntry(key, value), path)

        def index(self) -> Index:
            return self._index

        def data_spans(self, key: str) -> list:
            raise NotImplementedError("a synthetic source has no files")

        def read_tensor(self, key: str, box=None, out=None):
            entry = self._index[key]
            shape = tuple(entry.shape)
            box = box if box is not None else ((0,) * len(shape), shape)
            if out is None:
                out = torch.empty(box[1], dtype=torch.float32)
            if not shape:
                return out.fill_(1.0)  # AdamW's step after one step
            kind = key.rsplit(".", 1)[1] if key.startswith("optim.") else "param"
            cycle = cycles[kind]
            shift = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little") % PATTERN
            row = math.prod(shape[1:])
            whole_rows = all(o == 0 and n == s for o, n, s in zip(box[0][1:], box[1][1:], shape[1:]))
            rows = out if whole_rows and out.is_contiguous() else torch.empty((box[1][0], *shape[1:]), dtype=torch.float32)
            flat = rows.view(-1)
            at, n = (box[0][0] * row + shift) % PATTERN, flat.numel()
            done = 0
            while done < n:  # the cycle, from the box's first element on
                k = min(n - done, PATTERN - at)
                flat[done:done + k].copy_(cycle[at:at + k])
                done, at = done + k, 0
            if rows is not out:
                out.copy_(rows[(slice(None), *(slice(o, o + m) for o, m in zip(box[0][1:], box[1][1:])))])
            return out

    return SyntheticSource()


def generate(step_dir: str, size_gb: float, budget: str, work: str) -> dict[str, Any]:
    """In the child: stream the synthetic state into a DCP step laid out on WORLD ranks (ckpttool's
    engine and DCP sink, under ``budget``), then write its commit record with the manifest (the
    records hashed, as the Checkpointer does) and fsync everything."""
    import torch

    from ckpttool.choices import parse_size as ck_parse_size
    from ckpttool.engine import plan_entries, run
    from ckpttool.formats.dcp import DcpSink, DcpSource, hash_records, metadata_row
    from ckpttool.layout import FsdpLayout, Mesh
    from ckpttool.steps import COMMIT_FILE, commit_record
    from ckpttool.storage import resolve

    torch.set_num_threads(1)
    cfg = model_config(size_gb)
    source = make_source(cfg, os.path.join(work, "synthetic-source"))
    plan = plan_entries(source)
    loc = resolve(step_dir)
    sink = DcpSink(loc, layout=FsdpLayout(Mesh(1, WORLD)))
    total_bytes = sum(s.nbytes for s in plan.tensors)
    last = [0.0]
    t0 = time.perf_counter()

    def progress(done: int, total: int, key: str) -> None:
        if time.perf_counter() - last[0] >= 10 or done == total:
            last[0] = time.perf_counter()
            print(f"   writing: {done / GB:6.1f} / {total / GB:.1f} GB  {done / GB / max(1e-9, last[0] - t0):.2f} GB/s",
                  flush=True)

    run(source, sink, plan, ck_parse_size(budget, "--budget"), progress)
    t1 = time.perf_counter()
    manifest = hash_records(loc)
    manifest["files"] = metadata_row(loc)  # the manifest covers .metadata too, as the Checkpointer's
    loc.child(COMMIT_FILE).write_bytes(commit_record(1, WORLD, {"manifest": manifest}))
    fsync_tree(step_dir)
    t2 = time.perf_counter()
    with DcpSource(loc) as check:  # a ckpttool step: its commit record and manifest read back as valid
        assert check.checks is not None and check.world_size == WORLD
    sizes = [s.nbytes for s in plan.tensors]
    return {"ok": True, "cfg": cfg, "params": n_params(cfg), "tensors": len(plan.tensors), "objects": len(plan.objects),
            "tensor_bytes": total_bytes, "largest_tensor_bytes": max(sizes), "tensors_over_1gb": sum(s >= GB for s in sizes),
            "file_bytes": path_bytes(step_dir), "files": sorted(os.listdir(step_dir)), "write_s": t1 - t0,
            "hash_s": t2 - t1, "records": sum(len(v) for v in manifest["records"].values()),
            "gen_hwm_kib": proc_status("VmHWM"), "torch": torch.__version__}


# --- the cases -----------------------------------------------------------------------------------

CASES = {
    "cp_convert": {"label": "cp -r (+fsync), before convert", "kind": "cp", "out": "copy"},
    "convert": {"label": "ckpttool convert --to safetensors", "kind": "ckpttool", "out": "out.safetensors", "ref": "cp_convert"},
    "cp_reshard": {"label": "cp -r (+fsync), before reshard", "kind": "cp", "out": "copy"},
    "reshard": {"label": f"ckpttool reshard --world-size {RESHARD_TO}", "kind": "ckpttool", "out": f"resharded-{RESHARD_TO}",
                "ref": "cp_reshard"},
}


def command(name: str, src: str, dst: str, budget: str) -> list[str]:
    """The command line of a case."""
    if CASES[name]["kind"] == "cp":
        return ["cp", "-r", src, dst]
    ck = [sys.executable, "-m", "ckpttool"]
    if name == "convert":
        return [*ck, "convert", src, dst, "--to", "safetensors", "--memory-budget", budget, "--json"]
    return [*ck, "reshard", src, dst, "--world-size", str(RESHARD_TO), "--memory-budget", budget, "--json"]


TIMELINE = ["seconds", "tree anon+shmem KiB", "VmRSS KiB", "RssFile KiB", "read_bytes", "write_bytes", "CPU s (user+sys)",
            "load avg 1 min"]


def proc_io(pid: int) -> list[float]:
    """Bytes ``pid`` has read from and written to the disk (``/proc/PID/io``) and its CPU seconds so far."""
    out: list[float] = [0, 0, 0.0]
    try:
        with open(f"/proc/{pid}/io") as fh:
            io = {line.split(":")[0]: int(line.split()[1]) for line in fh}
        out[0], out[1] = io.get("read_bytes", 0), io.get("write_bytes", 0)
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        out[2] = round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        pass
    return out


def json_report(log_file: str) -> dict[str, Any] | None:
    """The JSON document a ckpttool command printed (``--json``) from its log, if any."""
    try:
        with open(log_file, errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    at = text.find("{")
    while at >= 0:
        try:
            return json.JSONDecoder().raw_decode(text[at:])[0]
        except ValueError:
            at = text.find("{", at + 1)
    return None


def measure(name: str, src: str, work: str, scratch: str, budget: str, cold: bool, timeout_s: float) -> dict[str, Any]:
    """One run of a case in a fresh process: its wall time plus an fsync of its output, its peak
    memory (both ways) and, for ckpttool, its RSS over time; the output is removed afterwards."""
    dst = os.path.join(scratch, CASES[name]["out"])
    remove(dst)
    dropped = drop_caches() if cold else False
    argv = command(name, src, dst, budget)
    log = os.path.join(work, f"{name}.log")
    timeline: list[list[float]] = []
    last = [-1.0]

    def sample(t: float, tree_kib: int, pid: int) -> None:
        if t - last[0] >= 0.5:
            last[0] = t
            timeline.append([round(t, 2), tree_kib, proc_status("VmRSS", pid) or 0, proc_status("RssFile", pid) or 0,
                             *proc_io(pid), round(os.getloadavg()[0], 2)])

    # the ckpttool measured is this repository's (the one this script is in), wherever the run starts
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    print(f"   {CASES[name]['label']}: {' '.join(os.path.relpath(a) if a == sys.executable else a for a in argv)}", flush=True)
    load_before = os.getloadavg()[0]
    run = run_child(argv, os.path.join(work, f"{name}.result.json"), log, env=env, timeout_s=timeout_s,
                    on_poll=sample if CASES[name]["kind"] == "ckpttool" else None)
    r: dict[str, Any] = {"case": name, "argv": argv, "rc": run.rc, "ok": run.rc == 0, "cache_dropped": dropped,
                         "timed_out": run.timed_out, "loadavg": [load_before, os.getloadavg()[0]]}
    try:
        if run.rc == 0:
            t0 = time.perf_counter()
            out_bytes = fsync_tree(dst)
            fsync_s = time.perf_counter() - t0
            r.update(command_s=run.wall_s, fsync_s=fsync_s, seconds=run.wall_s + fsync_s, out_bytes=out_bytes,
                     maxrss_kib=run.maxrss_kib, tree_peak_kib=run.tree_peak_kib, peak_kib=run.peak_kib,
                     user_s=run.user_s, sys_s=run.sys_s, timeline_columns=TIMELINE, rss_timeline=timeline,
                     report=json_report(log) if CASES[name]["kind"] == "ckpttool" else None)
        else:
            print(f"  !! {name} failed (exit {run.rc}{', timed out' if run.timed_out else ''}):\n{run.log_tail[-4000:]}",
                  file=sys.stderr)
            r["log_tail"] = run.log_tail[-4000:]
    finally:
        remove(dst)
    return r


# --- results -------------------------------------------------------------------------------------


def derive(results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The table's rows (time, GB/s, ratio to its cp, memory) and the verdicts."""
    info, cases = results["checkpoint"], results["cases"]
    nbytes = info["file_bytes"]
    rows, checks = [], []
    size_tag = f"{nbytes / GB:.1f} GB DCP on {WORLD} ranks ({nbytes / (results['machine'].get('mem_total_gib') or 1) / (1 << 30):.2f}x RAM)"
    for name, c in cases.items():
        if not c.get("ok"):
            rows.append({"case": name, "failed": True})
            if CASES[name]["kind"] == "ckpttool":
                checks.append({"target": "the command completes", "case": f"{CASES[name]['label']} @ {size_tag}",
                               "value": f"failed (exit {c.get('rc')})", "pass": False})
            continue
        ref = cases.get(CASES[name].get("ref", ""), {})
        x = c["seconds"] / ref["seconds"] if ref.get("ok") else None
        row = {"case": name, "seconds": c["seconds"], "command_s": c["command_s"], "fsync_s": c["fsync_s"],
               "gbps": nbytes / c["seconds"] / GB, "x_cp": x, "peak_mib": c["peak_kib"] / 1024,
               "maxrss_mib": c["maxrss_kib"] / 1024, "tree_mib": c["tree_peak_kib"] / 1024, "cpu_s": c["user_s"] + c["sys_s"],
               "out_gb": c["out_bytes"] / GB, "loadavg": c.get("loadavg")}
        tl = c.get("rss_timeline") or []
        if tl and len(tl[-1]) >= 7:  # the disk bytes it read, at the last sample (up to 0.5 s before it ended)
            row["disk_read_gb"] = tl[-1][4] / GB
        rows.append(row)
        if CASES[name]["kind"] != "ckpttool":
            continue
        tag = f"{CASES[name]['label']} @ {size_tag}"
        if x is not None:
            checks.append({"target": f"<= {TIME_LIMIT}x the time of cp -r (+fsync) of the same checkpoint", "case": tag,
                           "value": f"{c['seconds']:.1f} s vs {ref['seconds']:.1f} s = {x:.2f}x", "pass": x <= TIME_LIMIT})
        checks.append({"target": f"peak RSS < {RSS_LIMIT / GB:g} GB ({RSS_LIMIT / MiB:.0f} MiB)", "case": tag,
                       "value": f"{row['peak_mib']:.0f} MiB (ru_maxrss {row['maxrss_mib']:.0f}, tree anon+shmem {row['tree_mib']:.0f})",
                       "pass": row["peak_mib"] * MiB < RSS_LIMIT})
    return rows, checks


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    """The results table."""
    head = ["case", "time s (command + fsync)", "GB/s", "× its cp -r", "peak RSS MiB", "ru_maxrss MiB",
            "tree anon+shmem MiB", "CPU s", "output GB", "read from disk GB", "load avg before/after"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append([CASES[r["case"]]["label"], "failed"] + [""] * (len(head) - 2))
            continue
        lines.append([CASES[r["case"]]["label"], f"{r['seconds']:.1f} ({r['command_s']:.1f} + {r['fsync_s']:.1f})",
                      f(r["gbps"]), f(r["x_cp"]), f"{r['peak_mib']:.0f}", f"{r['maxrss_mib']:.0f}", f"{r['tree_mib']:.0f}",
                      f"{r['cpu_s']:.0f}", f"{r['out_gb']:.2f}", f(r.get("disk_read_gb")),
                      "/".join(f"{x:.1f}" for x in r["loadavg"]) if r.get("loadavg") else "–"])
    return table(head, lines, markdown)


def describe(info: dict[str, Any], budget: str) -> str:
    """The checkpoint in one sentence."""
    cfg = info["cfg"]
    return (f"{info['file_bytes'] / GB:.2f} GB of DCP files ({info['tensor_bytes'] / GB:.2f} GB of tensors: "
            f"{info['params'] / 1e9:.2f}B fp32 parameters + AdamW exp_avg, exp_avg_sq), as a ckpttool step saved on "
            f"{WORLD} ranks: {', '.join(info['files'])}. Transformer of vocabulary {cfg['vocab_size']}, dim {cfg['dim']}, "
            f"{cfg['n_layers']} blocks; {info['tensors']} tensors, {info['objects']} objects, {info['records']} records; "
            f"largest tensor {info['largest_tensor_bytes'] / GB:.2f} GB ({info['tensors_over_1gb']} of >= 1 GB); "
            f"memory budget {budget}. Written in {info['write_s']:.0f} s, hashed for the manifest in {info['hash_s']:.0f} s.")


def draw(plt, results: dict[str, Any], rows: list[dict[str, Any]]):
    """Time of each command (left), the ckpttool commands' RSS over time (middle) and their disk
    reads and writes over time (right)."""
    ok = [r for r in rows if not r.get("failed")]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(19, 5))
    colors = ["#888888" if CASES[r["case"]]["kind"] == "cp" else "#1f77b4" for r in ok]
    ax1.barh(range(len(ok)), [r["seconds"] for r in ok], color=colors)
    for i, r in enumerate(ok):
        ax1.text(r["seconds"], i, f" {r['seconds']:.0f} s" + (f" ({r['x_cp']:.2f}x cp)" if r["x_cp"] else ""), va="center", fontsize=8)
    bar_labels(ax1, [CASES[r["case"]]["label"] for r in ok])
    ax1.set_xlabel("seconds: whole command + fsync of its output (grey: cp -r, blue: ckpttool)")
    ax1.grid(axis="x", alpha=0.3)
    for name, c in results["cases"].items():
        if CASES[name]["kind"] == "ckpttool" and c.get("ok") and c.get("rss_timeline"):
            t = [p[0] for p in c["rss_timeline"]]
            line = ax2.plot(t, [p[2] / 1024 for p in c["rss_timeline"]], label=f"{CASES[name]['label']}: VmRSS")[0]
            ax2.plot(t, [p[1] / 1024 for p in c["rss_timeline"]], ls="--", color=line.get_color(), label="  anon+shmem (tree)")
            tl = [p for p in c["rss_timeline"] if len(p) >= 7]
            if len(tl) > 2:
                mid = [(a[0] + b[0]) / 2 for a, b in zip(tl, tl[1:])]
                rate = [[(b[k] - a[k]) / max(1e-6, b[0] - a[0]) / 1e6 for a, b in zip(tl, tl[1:])] for k in (4, 5)]
                ax3.plot(mid, rate[0], color=line.get_color(), label=f"{CASES[name]['label']}: read")
                ax3.plot(mid, rate[1], color=line.get_color(), ls=":", label="  write")
    ax2.axhline(RSS_LIMIT / MiB, color="r", ls="-.", label=f"target {RSS_LIMIT / GB:g} GB")
    ax2.set_xlabel("seconds since the command started")
    ax2.set_ylabel("MiB")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    ax3.set_xlabel("seconds since the command started")
    ax3.set_ylabel("MB/s from/to the disk (/proc/PID/io, 0.5 s steps)")
    ax3.set_ylim(bottom=0)
    ax3.grid(alpha=0.3)
    if ax3.get_lines():
        ax3.legend(fontsize=8)
    info = results["checkpoint"]
    ram = (results["machine"].get("mem_total_gib") or 0) * (1 << 30)
    return fig, (f"{info['file_bytes'] / GB:.1f} GB checkpoint ({info['file_bytes'] / ram:.2f}x RAM) vs cp -r: "
                 f"{machine_brief(results)}, torch {results.get('torch')}")


def refuse(args, out_json: str, results: dict[str, Any], why: str) -> int:
    """Stop before writing anything big: say why, and leave a result whose verdict says it too."""
    print(f"large.py: {why}", file=sys.stderr)
    results["checks"] = [{"target": "runs", "case": f"{args.size:g} GB", "value": f"refused: {why}", "pass": False}]
    results["finished"] = now()
    write_json(out_json, results)
    write_markdown(args.md, md_header("Benchmark: a checkpoint larger than memory", results) + verdict_md(results["checks"]) + "\n")
    return 2


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=32.0, help="checkpoint size in GB of tensor data (default 32)")
    p.add_argument("--smoke", action="store_true", help=f"--size {SMOKE_SIZE:g} --budget {SMOKE_BUDGET}: checks the plumbing only")
    p.add_argument("--budget", default="1GiB", help="ckpttool --memory-budget, also the writer's (default 1GiB)")
    p.add_argument("--cases", default="convert,reshard", help="ckpttool cases to run, each after its cp -r (default convert,reshard)")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before each case")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a running bench/convert.py")
    add_run_args(p, "large", "/tmp/ckpttool-bench-large", case_timeout=7200)
    p.add_argument("--from-json", metavar="JSON", help="run nothing: render the table, --md and --plot from a saved --json")
    add_hidden_args(p, "--_gen", "--_result")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.budget = SMOKE_SIZE, SMOKE_BUDGET
    if args._gen:
        write_json(args._result, generate(args._gen, args.size, args.budget, os.path.dirname(args._result)))
        return 0
    if args.from_json:
        with open(args.from_json) as fh:
            report(json.load(fh), args, None)
        return 0

    parse_size(args.budget)
    names = [n for n in args.cases.split(",") if n]
    for n in names:
        if n not in CASES or CASES[n]["kind"] != "ckpttool":
            p.error(f"unknown case {n!r}: convert, reshard")
    existed = os.path.isdir(args.out_dir)
    out_dir, work, machine = start_run(args.out_dir)
    scratch = os.path.join(out_dir, "large-scratch")  # everything big goes here; removed whatever happens
    out_json = json_path(args, out_dir, "large")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    results: dict[str, Any] = {**run_header(SCRIPT, argv, machine), "size_gb": args.size, "budget": args.budget,
                               "code": code_version(REPO)}

    def on_term(signum, frame):  # SIGTERM (a timeout, kill PID): leave through the finally below
        raise SystemExit(128 + signum)

    def tidy() -> None:  # OUT_DIR itself, when this run made it and nothing of it is left
        if not existed:
            try:
                os.rmdir(out_dir)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, on_term)
    finished = False
    try:
        cfg = model_config(args.size)
        est = estimated_bytes(cfg)
        need = 2 * est + HEADROOM  # the source, then one output at a time (cp's copy or ckpttool's)
        free = shutil.disk_usage(out_dir).free
        results.update(estimated_bytes=est, disk_needed=need, disk_free=free)
        ram = (machine.get("mem_total_gib") or 0) * (1 << 30)
        print(f"checkpoint: ~{est / GB:.1f} GB ({est / ram:.2f}x RAM of {ram / GB:.1f} GB); disk: needs {need / GB:.1f} GB free "
              f"on {out_dir}, has {free / GB:.1f} GB", flush=True)
        if free < need:
            return refuse(args, out_json, results,
                          f"not enough free disk on {out_dir}: a {est / GB:.1f} GB checkpoint needs {need / GB:.1f} GB "
                          f"(the source, one output at a time, {HEADROOM / GB:.0f} GB headroom), there are {free / GB:.1f} GB; "
                          f"free {math.ceil((need - free) / GB)} GB more, or pass a smaller --size or another --out-dir")
        cold = cold_cache(args.warm)
        wait_for_convert(args.size, args.no_wait)
        os.makedirs(scratch, exist_ok=True)
        src = os.path.join(scratch, "ckpt", "step-1")
        print(f"\n== writing the checkpoint with ckpttool's DCP sink on {WORLD} ranks: {src}", flush=True)
        gen = measure_child(SCRIPT, ["--_gen", src, "--size", str(args.size), "--budget", args.budget], work, "generate",
                            timeout_s=args.case_timeout)
        if gen.rc != 0 or not gen.result.get("ok"):
            print(gen.log_tail, file=sys.stderr)
            raise SystemExit(f"writing the checkpoint failed (exit {gen.rc})")
        info = gen.result
        info.update(gen_wall_s=gen.wall_s, gen_peak_kib=gen.peak_kib)
        results["checkpoint"], results["torch"] = info, info.get("torch")
        print(f"   {describe(info, args.budget)}", flush=True)
        results["cases"] = {}
        for name in names:
            for case in (CASES[name]["ref"], name):
                r = measure(case, src, work, scratch, args.budget, cold, args.case_timeout)
                results["cases"][case] = r
                if r["ok"]:
                    print(f"   -> {r['seconds']:7.1f} s ({r['command_s']:.1f} + fsync {r['fsync_s']:.1f})  "
                          f"{info['file_bytes'] / r['seconds'] / GB:5.2f} GB/s  peak RSS {r['peak_kib'] / 1024:6.0f} MiB "
                          f"(ru_maxrss {r['maxrss_kib'] / 1024:.0f}, tree {r['tree_peak_kib'] / 1024:.0f})", flush=True)
                write_json(out_json, results)
        results["cold"] = cold
        finished = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        remove(scratch)
        remove(work)
        if not finished:
            tidy()
    results["finished"] = now()
    results["code_at_end"] = code_version(REPO)
    if results["code_at_end"] != results["code"]:
        print(f"warning: ckpttool/ changed during the run: {results['code']} -> {results['code_at_end']}", file=sys.stderr)
    report(results, args, out_json)
    tidy()
    return 0


def report(results: dict[str, Any], args, out_json: str | None) -> None:
    """Derive the rows and verdicts, print the table, write the JSON, --md and --plot."""
    rows, checks = derive(results)
    results["rows"], results["checks"] = rows, checks
    if out_json:
        write_json(out_json, results)
    head = describe(results["checkpoint"], results.get("budget", args.budget))
    print_results(render(rows, markdown=False), checks, widths=(52, 60))
    if out_json:
        print(f"\nresults: {out_json}")
    write_markdown(args.md, md_header("Benchmark: a checkpoint larger than memory", results) + head + "\n\n"
                   + render(rows, markdown=True) + "\n\n" + verdict_md(checks) + "\n")
    if args.plot:
        print(plot_file(args.plot, draw, results, rows))


if __name__ == "__main__":
    sys.exit(main())
