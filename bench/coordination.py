"""Coordination at scale, no processes needed: rank 0's commit and one rank's load plan of a
Llama-3-8B-shaped FSDP2 + AdamW training step at N = 256 ... 16384 ranks, simulated in one process
per case.

The state: Llama-3-8B (vocab 128256, dim 4096, 32 layers, 8 KV heads of 128, FFN 14336), fp32,
keys as torch's ``get_state_dict`` names them ("model.<fqn>", "optim.state.<fqn>.step|exp_avg|
exp_avg_sq", "optim.param_groups.0.*"). Every parameter and both AdamW moments are DTensors
sharded on dim 0 over N ranks as FSDP2 shards them (torch.chunk: ceil(rows/N) rows a rank, the last
ranks fewer or none); ``step`` is a plain 0-dim fp32 tensor (rank 0 stores it, as ckpttool stores
every plain tensor).

For each N (each stage a fresh child process):

1. gen (not timed): every rank's index, exactly as ``step_writer.write_rank`` publishes it (the
   same RankIndex fields in the same order, record offsets and lengths laid out by ckpttool's own
   record writer, one 16-hex-digit digest per 64 KiB block of data, the health findings of a
   steady-state save compared with the previous one; only the digest values are random) is
   written as its JSON part file (``rendezvous.part_name``) into a pristine folder, and every
   rank's data file is created sparse at the size the rank would write (the load plan checks
   record ranges against file sizes; nothing is read).
2. commit (timed): the parts hard-linked into the step directory (not timed), then rank 0's
   commit as ``Saves._commit_own`` runs it: ``read_rank_indexes`` (await_parts + json.loads of
   every part), ``commit_metadata`` (merge, tiling check, ``.metadata``, parts removed), the commit
   record (step_bytes, phases, per-rank keys, ``health.merge_ranks``, ``steps.commit_record``) and
   its write. Peak memory: VmHWM after the commit, reset just before it (/proc/self/clear_refs),
   minus the RSS before it; and the absolute VmHWM.
3. load (timed): one rank (N//2, the same sharding) plans its load as ``ckpttool.load`` /
   ``read_into.load_into`` do before reading bytes: ``formats.detect`` + ``open_source`` (the
   commit record and the step's load index, or where it has none the allow-listed unpickler of
   .metadata), ``index()``,
   ``entry(key, TensorEntry, checked=True)`` for every tensor of its state (coverage and record
   ranges), then ``TensorEntry.chunks_in(box)`` for its boxes and the byte range of each part
   (the record's data range from the manifest row, block-aligned for a partial read, as
   ``RecordChecks.read_blocks`` computes it). Where ckpttool refuses the step (a size limit), the
   refusal is reported and the plan is timed again with the limit lifted in that process only.
4. torch (timed, per-case timeout): torch's own global save planning for the same state,
   ``DefaultSavePlanner().create_global_plan`` over N SavePlans of WriteItems (one per chunk on
   every rank, plus every rank's replicated ``step`` and param_groups items, as dcp.save makes
   them; building the plans is not timed); then torch's ``Metadata`` with ``storage_data`` (one
   ``_StorageInfo`` per chunk keyed by the planned ``MetadataIndex``) and ``storage_meta`` as
   FileSystemWriter.finish fills them, pickled as torch does (``pickle.dump``), for its size.

``--check`` proves the synthetic indexes: on one process (a "fake" process group per rank) it
builds real DTensors of a tiny state of the same structure, runs the real ``write_rank`` twice
(the second save compares with the first, as in steady state) and compares its published index
with the synthetic one for the same shapes, ignoring digest values (and phase timings) only; it
also checks the box arithmetic against torch's ``Shard.local_shard_size_and_offset`` for every
rank of every N.

    .venv/bin/python bench/coordination.py --check
    .venv/bin/python bench/coordination.py --ranks 256,1024,4096,16384 --json /tmp/coord.json
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MB = 1e6
LLAMA3_8B = {"vocab": 128256, "dim": 4096, "layers": 32, "kv_dim": 8 * 128, "ffn": 14336}
STEP, SINCE = 200, 100  # the step committed, and the previous committed step its health compares with
TARGETS = {"commit_s": 2.0, "commit_at": 4096, "peak_gb": 2.0, "peak_at": 16384, "load_s": 0.5, "load_at": 16384}


# --- the state -----------------------------------------------------------------------------------

def param_shapes(cfg: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters in module order (torchtitan's Llama), fqn -> global shape."""
    d, kv, f = cfg["dim"], cfg["kv_dim"], cfg["ffn"]
    out = [("tok_embeddings.weight", (cfg["vocab"], d))]
    for i in range(cfg["layers"]):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (d, d)), (p + "attention.wk.weight", (kv, d)), (p + "attention.wv.weight", (kv, d)),
                (p + "attention.wo.weight", (d, d)), (p + "feed_forward.w1.weight", (f, d)), (p + "feed_forward.w2.weight", (d, f)),
                (p + "feed_forward.w3.weight", (f, d)), (p + "attention_norm.weight", (d,)), (p + "ffn_norm.weight", (d,))]
    out += [("norm.weight", (d,)), ("output.weight", (cfg["vocab"], d))]
    return out


def param_group(fqns: list[str]) -> dict[str, Any]:
    """One AdamW param group as get_state_dict packs it (every field of torch's, then the FQNs)."""
    import torch

    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1).param_groups[0]
    packed = {k: v for k, v in group.items() if k != "params"}
    packed["params"] = list(fqns)
    return packed


class _T:
    """A tensor's place in the skeleton state (flatten treats it as a tensor)."""

    __slots__ = ("shape", "plain")

    def __init__(self, shape: tuple[int, ...], plain: bool = False):
        self.shape, self.plain = shape, plain


def skeleton(cfg: dict[str, int]) -> dict[str, Any]:
    params = param_shapes(cfg)
    return {"model": {f: _T(s) for f, s in params},
            "optim": {"state": {f: {"step": _T((), plain=True), "exp_avg": _T(s), "exp_avg_sq": _T(s)} for f, s in params},
                      "param_groups": [param_group([f for f, _ in params])]}}


def shard_box(shape: tuple[int, ...], n: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank ``rank``'s box of a Shard(0) DTensor over ``n`` ranks (torch.chunk; an empty shard lies
    at offset rows, as DTensor's __create_chunk_list__ says)."""
    rows = shape[0]
    c = -(-rows // n)
    o = min(rank * c, rows)
    return (o,) + (0,) * (len(shape) - 1), (max(0, min(c, rows - o)),) + tuple(shape[1:])


class _Count(io.RawIOBase):
    """A write-only, non-seekable sink that counts bytes (as the rank's _HashingWriter looks to the record writer)."""

    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.n

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n


class Spec:
    """The flat state (keys, paths, what each is) and the record layouts, for one model config."""

    def __init__(self, cfg: dict[str, int]):
        from ckpttool.index import flatten

        self.cfg = cfg
        flat, paths = flatten(skeleton(cfg), is_tensor=lambda v: isinstance(v, _T))
        self.paths = {k: list(p) for k, p in paths.items()}
        self.entries: list[tuple[str, str, Any]] = []  # (key, "dtensor" | "plain" | "object", shape or value)
        for key, value in flat.items():
            if isinstance(value, _T):
                self.entries.append((key, "plain" if value.plain else "dtensor", value.shape))
            else:
                self.entries.append((key, "object", value))
        self.trainable = {f"model.{f}" for f, _ in param_shapes(cfg)}
        self._layouts: dict[tuple[int, ...], tuple[int, int, int]] = {}
        self.object_len = {key: self._object_len(v) for key, kind, v in self.entries if kind == "object"}

    @staticmethod
    def _object_len(value: Any) -> int:
        from ckpttool.formats.dcp.records import write_object

        out = _Count()
        return write_object(out, value, None)[1]

    def layout(self, sizes: tuple[int, ...]) -> tuple[int, int, int]:
        """(data start in the record, record length, data bytes) of an fp32 record of ``sizes``, from
        ckpttool's own record writer (a record's bytes depend only on its dtype and shape)."""
        got = self._layouts.get(sizes)
        if got is None:
            import torch

            from ckpttool.formats.dcp.records import write_tensor

            nbytes = math.prod(sizes) * 4
            out, head = _Count(), []
            zeros = bytes(nbytes)
            _, length = write_tensor(out, torch.float32, sizes, None, lambda write: write(zeros), lambda: head.append(out.tell()))
            got = self._layouts[sizes] = (head[0], length, nbytes)
        return got


def _digest(rng: random.Random) -> str:
    return "%016x" % rng.getrandbits(64)


def synth_index(sp: Spec, n: int, rank: int, rng: random.Random, health: str = "steady", empty: str = "record",
                phases: dict[str, float] | None = None, digests: bool = True) -> dict[str, Any]:
    """What ``write_rank`` publishes for rank ``rank`` of ``n`` (``index.__dict__``), digests random.

    ``empty="skip"`` is a what-if only (a rank with no rows of a tensor writing no record for it);
    ckpttool writes an empty record for it (every rank's DTensor shard is stored, ``stores()``: an
    offline reshard tells FSDP2's shards of a one-row tensor from a replicated one by them)."""
    from ckpttool.checksums import block_count

    tensors: dict[str, Any] = {}
    objects: dict[str, list[int]] = {}
    records: list[list[Any]] = []
    now: dict[str, str] = {}  # key -> the data digest the health tally keeps (block digests)
    pos = 0
    for key, kind, what in sp.entries:
        if kind == "object":
            if rank != 0:
                continue
            length = sp.object_len[key]
            objects[key] = [pos, length]
            records.append([pos, length, _digest(rng)])
            pos += length
            continue
        if kind == "plain":
            if rank != 0:
                continue
            off, size = (0,) * len(what), tuple(what)
        else:
            off, size = shard_box(what, n, rank)
        entry = tensors[key] = {"shape": list(what), "dtype": "float32", "chunks": []}
        if empty == "skip" and size and size[0] == 0:
            continue
        head, length, nbytes = sp.layout(size)
        entry["chunks"].append([list(off), list(size), pos, length])
        blocks = (rng.getrandbits(64 * block_count(nbytes)).to_bytes(8 * block_count(nbytes), "little").hex()
                  if nbytes and digests else "")
        records.append([pos, length, _digest(rng), {"data": [head, nbytes], "rest": _digest(rng), "blocks": blocks}])
        pos += length
        now[key] = blocks
    found: dict[str, Any] | None = None
    if health != "off":
        found = {"nonfinite": {}, "since": SINCE if health == "steady" else None}
        if health == "steady":  # the previous save's digests: every non-empty record changed since (training)
            stored = sorted(k for k in now if k in sp.trainable)
            same = [k for k in now if k in sp.trainable and now[k] == ""]
            moved = sorted({k[len("optim.state."):].rsplit(".", 1)[0] for k in now if k.startswith("optim.state.") and now[k] != ""})
            found["stale"] = {"stored": stored, "same": same, "moved": [f"model.{m}" for m in moved]}
        if rank == 0:
            found["zero_lr"] = []
    index = {"rank": rank, "file": f"__{rank}_0.distcp", "tensors": tensors, "objects": objects, "records": records,
             "paths": dict(sp.paths) if rank == 0 else {}, "error": None, "error_type": None, "compress": None, "files": {},
             "written": pos, "shared": 0, "per_rank": {}, "per_rank_paths": {}, "per_rank_buffers": {}, "health": found,
             "phases": dict(phases or {})}
    index["phases"]["write"] = 2.0 + rng.random()  # (write_rank's own: an unrounded float)
    return index


def published(index: dict[str, Any], step: str, sp: Spec, n: int) -> tuple[dict[str, Any], bytes]:
    """What ``write_rank`` does with the index at its end: the rank's manifest file (its records'
    rows) written into ``step``, its tail (``shared_chunks.rank_tail``: every DTensor of ``sp``
    declared as write_rank declares them), and the part it publishes (``published_part``)."""
    from ckpttool.storage import resolve
    from ckpttool.training import step_writer

    rank_index = step_writer.RankIndex(**index)
    rank_index.everyone = dict.fromkeys(key for key, kind, _ in sp.entries if kind == "dtensor")
    step_writer.finish_index(resolve(step), rank_index, n)
    step_writer.number_health(rank_index)
    return step_writer.published_part(rank_index)


def count_chunks(sp: Spec, n: int, empty: str = "record") -> dict[str, int]:
    total = nonempty = 0
    for _, kind, what in sp.entries:
        if kind == "dtensor":
            rows = what[0]
            c = -(-rows // n)
            ne = -(-rows // c)
            nonempty += ne
            total += n if empty == "record" else ne
        elif kind == "plain":
            total += 1
            nonempty += 1
    return {"chunks": total, "nonempty_chunks": nonempty}


# --- helpers -------------------------------------------------------------------------------------

def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


def limit_memory(gib: float) -> None:
    if gib > 0:
        limit = int(gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


def case_dirs(out_dir: str, n: int) -> tuple[str, str]:
    base = os.path.join(out_dir, f"n{n}")
    return os.path.join(base, "parts"), os.path.join(base, "step")


class GcTimer:
    """Seconds the cyclic garbage collector ran (gc.callbacks), and how often."""

    def __init__(self) -> None:
        self.seconds, self.runs, self._t = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.runs += 1


# --- child stages --------------------------------------------------------------------------------

def child_gen(a: argparse.Namespace) -> dict[str, Any]:
    """Write the part files of ranks ``shard::workers`` and their sparse data files."""
    sp = Spec(LLAMA3_8B)
    parts, step = case_dirs(a.out_dir, a.n)
    from ckpttool import rendezvous

    total = written = 0
    rng = random.Random(1000 + a.shard)
    phases = {"prepare": 0.012345, "state": 0.000812, "stage": 0.412345}
    t = time.perf_counter()
    for rank in range(a.shard, a.n, a.workers):
        index, fragment = published(synth_index(sp, a.n, rank, rng, a.health, a.empty, phases), step, sp, a.n)
        data = rendezvous.part_bytes(index, fragment)
        with open(os.path.join(parts, rendezvous.part_name(rank)), "wb") as f:
            f.write(data)
        with open(os.path.join(step, index["file"]), "wb") as f:
            f.truncate(index["written"])
        total += len(data)
        written += index["written"]
    return {"parts_bytes": total, "written": written, "seconds": time.perf_counter() - t}


def _link_parts(a: argparse.Namespace) -> None:
    from ckpttool import rendezvous
    from ckpttool.formats.dcp.metadata import METADATA_FILE
    from ckpttool.steps import COMMIT_FILE

    parts, step = case_dirs(a.out_dir, a.n)
    for name in (METADATA_FILE, COMMIT_FILE):
        if os.path.exists(os.path.join(step, name)):
            os.remove(os.path.join(step, name))
    for rank in range(a.n):
        name = rendezvous.part_name(rank)
        dst = os.path.join(step, name)
        if os.path.exists(dst):
            os.remove(dst)
        os.link(os.path.join(parts, name), dst)


def child_commit(a: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's commit of the step whose parts child_gen wrote, as Saves._commit_own runs it."""
    from ckpttool import health, steps
    from ckpttool.errors import StepTooLargeError
    from ckpttool.formats.dcp.metadata import METADATA_FILE
    from ckpttool.storage import resolve
    from ckpttool.training import step_writer

    _link_parts(a)
    _, step = case_dirs(a.out_dir, a.n)
    loc = resolve(step)
    gct = GcTimer()
    gc.callbacks.append(gct)
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    rss0 = reset_peak()
    load0 = os.getloadavg()[0]
    c0 = time.process_time()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    indexes = step_writer.read_rank_indexes(loc, a.n, timeout=60.0, step=STEP, roll=None)
    t1 = time.perf_counter()
    refused = None
    try:
        manifest = step_writer.commit_metadata(loc, indexes)
    except StepTooLargeError as exc:  # (the cost beyond the limit: the same commit with the limit lifted, reported as refused)
        refused = f"{exc.what} (after {time.perf_counter() - t1:.2f} s)"
        step_writer.MAX_METADATA_BYTES = 1 << 62
        manifest = step_writer.commit_metadata(loc, indexes)
    t2 = time.perf_counter()
    record = step_writer.commit_fields(loc, indexes, manifest, t2 - t1)
    if "health" in record:
        health.nonfinite_keys(record["health"])  # (Saves._judge_health: nothing non-finite here)
    t3 = time.perf_counter()
    raw = steps.commit_record(STEP, a.n, record)
    loc.child(steps.COMMIT_FILE).write_bytes(raw)
    t4 = time.perf_counter()
    if prof:
        prof.disable()
    cpu = time.process_time() - c0
    hwm = status_kib("VmHWM")
    gc.callbacks.remove(gct)
    out = {"cpu_s": cpu, "loadavg": [load0, os.getloadavg()[0]], "read_s": t1 - t0, "merge_s": t2 - t1, "health_s": t3 - t2, "record_s": t4 - t3, "commit_s": t4 - t0,
           "rss_before_mb": rss0 * 1024 / MB, "peak_mb": hwm * 1024 / MB, "peak_delta_mb": (hwm - rss0) * 1024 / MB,
           "metadata_bytes": os.path.getsize(os.path.join(step, METADATA_FILE)), "record_bytes": len(raw),
           "gc_s": gct.seconds, "gc_runs": gct.runs, "chunks": sum(len(t["chunks"]) for i in indexes for t in i.tensors.values())}
    if refused is not None:
        out["refused"] = refused
    if prof:
        import pstats

        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(12)
        st.sort_stats("cumulative").print_stats(25)
        out["profile"] = s.getvalue()
    return out


def _profiled(fn: Any, *args: Any) -> tuple[Any, str]:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        got = fn(*args)
    finally:
        prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(12)
    st.sort_stats("cumulative").print_stats(20)
    return got, s.getvalue()


def _plan_load(sp: Spec, n: int, rank: int, step: str) -> dict[str, Any]:
    """One rank's load plan (see the module's doc); returns seconds per phase and the ranges."""
    from ckpttool import formats
    from ckpttool.index import TensorEntry
    from ckpttool.layout import relative
    from ckpttool.storage import resolve

    t0 = time.perf_counter()
    loc = resolve(step)
    fmt = formats.detect(loc)
    source = fmt.open_source(loc, True, formats.Reading(rank=rank))
    t1 = time.perf_counter()
    index = source.index()
    t2 = time.perf_counter()
    boxes = {}
    for key, kind, what in sp.entries:
        if kind == "dtensor":
            boxes[key] = shard_box(what, n, rank)
        elif kind == "plain":
            boxes[key] = ((0,) * len(what), tuple(what))
    tensors = {key: source.entry(key, TensorEntry, checked=True) for key in boxes}  # load_into: every tensor, checked
    t3 = time.perf_counter()
    manifest = source.checks.manifest if source.checks is not None else None
    block = manifest.block if manifest is not None else 1 << 16
    ranges: list[tuple[str, int, int]] = []
    for key, entry in tensors.items():
        box = boxes[key]
        if math.prod(box[1]) == 0:
            continue  # (load_into: nothing to read into an empty shard)
        for chunk, part in entry.chunks_in(box):
            info = chunk.location
            row = manifest.rows_of(info.relative_path)[0].get(info.offset) if manifest is not None else None
            if row is None or row[2] is None:
                ranges.append((info.relative_path, info.offset, info.length))  # the whole record
                continue
            data_start, nbytes = row[2]["data"]
            base = info.offset + data_start
            if part == (chunk.offsets, chunk.sizes):  # read_chunk: the record's data, straight into the shard
                ranges.append((info.relative_path, base, nbytes))
                continue
            rel = relative(part, (chunk.offsets, chunk.sizes))  # read_blocks: the blocks the part touches
            strides = [math.prod(chunk.sizes[i + 1:]) for i in range(len(chunk.sizes))]
            lo = sum(s.start * st for s, st in zip(rel, strides)) * 4
            hi = (sum((s.stop - 1) * st for s, st in zip(rel, strides)) + 1) * 4
            blo, bhi = lo // block * block, min(-(-hi // block) * block, nbytes)
            ranges.append((info.relative_path, base + blo, bhi - blo))
    t4 = time.perf_counter()
    source.close()
    return {"open_s": t1 - t0, "index_s": t2 - t1, "check_s": t3 - t2, "ranges_s": t4 - t3, "load_s": t4 - t0,
            "ranges": len(ranges), "range_bytes": sum(r[2] for r in ranges), "keys": len(index)}


def child_load(a: argparse.Namespace) -> dict[str, Any]:
    from ckpttool.errors import CkptError

    sp = Spec(LLAMA3_8B)
    _, step = case_dirs(a.out_dir, a.n)
    rank = a.n // 2
    out: dict[str, Any] = {"rank": rank}
    rss0 = reset_peak()
    load0 = os.getloadavg()[0]
    c0 = time.process_time()
    t0 = time.perf_counter()
    plan = (lambda *x: _profiled(_plan_load, *x)) if a.profile else (lambda *x: (_plan_load(*x), None))
    try:
        got, out["profile"] = plan(sp, a.n, rank, step)
        out.update(got)
    except CkptError as exc:
        out["refused"] = f"{type(exc).__name__}: {exc.message() if hasattr(exc, 'message') else exc}"
        out["refused_after_s"] = time.perf_counter() - t0
        out["refused_peak_mb"] = status_kib("VmHWM") * 1024 / MB
    if out.get("refused"):  # (outside the handler: the traceback no longer holds the first attempt's objects)
        # the cost beyond the limit: the same plan with ckpttool's size limits lifted in this process
        import ckpttool.formats.dcp.metadata as md
        import ckpttool.steps as steps

        steps.MAX_COMMIT_BYTES = md.MAX_METADATA_BYTES = 1 << 62
        rss0 = reset_peak()
        c0 = time.process_time()
        got, out["profile"] = plan(sp, a.n, rank, step)
        out.update(got)
        out["lifted"] = True
    out["cpu_s"] = time.process_time() - c0
    out["loadavg"] = [load0, os.getloadavg()[0]]
    hwm = status_kib("VmHWM")
    out.update(peak_mb=hwm * 1024 / MB, peak_delta_mb=(hwm - rss0) * 1024 / MB)
    return out


def child_torch(a: argparse.Namespace) -> dict[str, Any]:
    """torch's global save planning for the same state, and the size of the .metadata torch writes."""
    import pickle
    import signal
    import uuid

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    except ImportError:  # pragma: no cover
        CURRENT_DCP_VERSION = None
    sp = Spec(LLAMA3_8B)
    n = a.n
    props = TensorProperties(dtype=torch.float32)
    planner_data = {k: tuple(p) for k, p in sp.paths.items()}
    out: dict[str, Any] = {}

    t_build = time.perf_counter()
    md: Metadata | None = None
    plan_s = None
    if not a.no_plan:
        shared: list[WriteItem] = []  # every rank's replicated items (step tensors, param_groups): the same on each
        sizes = {}
        for key, kind, what in sp.entries:
            if kind == "object":
                shared.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            elif kind == "plain":
                off = torch.Size([0] * len(what))
                shared.append(WriteItem(index=MetadataIndex(key, off), type=WriteItemType.TENSOR,
                                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, torch.Size(what)),
                                                                    properties=props, size=torch.Size(what))))
            else:
                sizes[key] = torch.Size(what)
        plans = []
        for rank in range(n):
            items = []
            for key, kind, what in sp.entries:
                if kind != "dtensor":
                    continue
                off, size = shard_box(what, n, rank)
                off, size = torch.Size(off), torch.Size(size)
                items.append(WriteItem(index=MetadataIndex(key, off), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, size), properties=props,
                                                                   size=sizes[key])))
            plans.append(SavePlan(items + shared, planner_data=planner_data))  # (each rank's plan carries the mappings)
        out["build_plans_s"] = time.perf_counter() - t_build

        def expired(*_: Any) -> None:
            raise TimeoutError

        signal.signal(signal.SIGALRM, expired)
        signal.alarm(a.torch_timeout)
        try:
            t0 = time.perf_counter()
            global_plan, md = DefaultSavePlanner().create_global_plan(plans)
            plan_s = time.perf_counter() - t0
        except TimeoutError:
            out["plan_error"] = f"did not finish in {a.torch_timeout} s"
            md = None
        finally:
            signal.alarm(0)
        out["plan_s"] = plan_s
        del plans
    if md is None:  # torch's Metadata for the same chunks, built directly (as create_default_global_save_plan fills it)
        sdm: dict[str, Any] = {}
        for key, kind, what in sp.entries:
            if kind == "object":
                sdm[key] = BytesStorageMetadata()
            elif kind == "plain":
                sdm[key] = TensorStorageMetadata(props, torch.Size(what), [ChunkStorageMetadata(torch.Size([0] * len(what)), torch.Size(what))])
            else:
                sdm[key] = TensorStorageMetadata(props, torch.Size(what), [])
        for rank in range(n):
            for key, kind, what in sp.entries:
                if kind == "dtensor":
                    off, size = shard_box(what, n, rank)
                    sdm[key].chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
        md = Metadata(state_dict_metadata=sdm, planner_data=planner_data)
        global_plan = None
    # storage_data as FileSystemWriter.finish fills it: {write item's index: _StorageInfo}, where each
    # record lies as ckpttool's writer lays it out (torch's FileSystemWriter: one file per rank, the
    # same records; torch writes an empty shard's record too); rank 0's replicated items

    t0 = time.perf_counter()
    storage: dict[Any, Any] = {}
    rank0 = synth_index(sp, n, 0, random.Random(0), "off", "record", digests=False)
    for key, (off, length) in rank0["objects"].items():
        storage[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", off, length)
    chunk_no = {key: 0 for key, kind, _ in sp.entries if kind != "object"}
    for rank in range(n):
        idx = rank0 if rank == 0 else synth_index(sp, n, rank, random.Random(0), "off", "record", digests=False)
        for key, t in idx["tensors"].items():
            for offsets, _sizes, start, length in t["chunks"]:
                mi = MetadataIndex(key, torch.Size(offsets), chunk_no[key])
                chunk_no[key] += 1
                storage[mi] = _StorageInfo(f"__{rank}_0.distcp", start, length)
        del idx
    md.storage_data = storage
    md.storage_meta = StorageMeta(checkpoint_id=os.path.join(a.out_dir, f"n{n}", "step"), save_id=str(uuid.uuid4()))
    if CURRENT_DCP_VERSION is not None:
        md.version = CURRENT_DCP_VERSION
    out["storage_s"] = time.perf_counter() - t0
    del global_plan
    t0 = time.perf_counter()
    sink = _Count()
    pickle.dump(md, sink)  # FileSystemWriter.finish: pickle.dump(metadata, metadata_file)
    out["pickle_s"] = time.perf_counter() - t0
    out["metadata_bytes"] = sink.n
    out["storage_entries"] = len(storage)
    out["peak_mb"] = status_kib("VmHWM") * 1024 / MB
    return out


def run_child(stage: str, a: argparse.Namespace, n: int, timeout: float, extra: list[str] | None = None,
              mem_gib: float | None = None) -> dict[str, Any]:
    """One stage in a fresh process; its JSON result, or {"error": why}."""
    out = os.path.join(a.out_dir, f"n{n}", f"{stage}{'-' + extra[-1] if extra else ''}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", stage, "--_n", str(n), "--out-dir", a.out_dir,
           "--_result", out, "--health", a.health, "--empty-shards", a.empty, "--torch-timeout", str(a.torch_timeout),
           "--_mem", str(a.mem_limit_gb if mem_gib is None else mem_gib), *(extra or [])]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t}
    if p.returncode != 0 or not os.path.exists(out):
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        why = "MemoryError" if any("MemoryError" in x for x in tail) else " | ".join(tail)
        return {"error": f"exit {p.returncode}: {why}", "wall_s": time.perf_counter() - t}
    with open(out) as f:
        got = json.load(f)
    got["wall_s"] = time.perf_counter() - t
    return got


# --- the check -----------------------------------------------------------------------------------

def _normalize(index: dict[str, Any]) -> dict[str, Any]:
    """The index with digest values and phase timings replaced (lengths kept)."""
    out = json.loads(json.dumps(index))
    if out.get("manifest"):
        out["manifest"][2] = "d" * len(out["manifest"][2])
        out["manifest"][1] = 0  # (its length follows the digests' values' JSON: checked through the rows)
    for row in out["records"]:
        row[2] = "d" * len(row[2])
        if len(row) > 3:
            row[3]["rest"] = "r" * len(row[3]["rest"])
            row[3]["blocks"] = "b" * len(row[3]["blocks"])
    out["phases"] = {k: 0 for k in out["phases"]}
    return out


def run_check(a: argparse.Namespace) -> bool:
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ckpttool import health as hl
    from ckpttool import rendezvous
    from ckpttool.storage import resolve
    from ckpttool.training import step_writer

    ok = True
    # 1. the box arithmetic against torch's, every rank of every N, every row count of the 8B state
    rows = sorted({s[0] for _, s in param_shapes(LLAMA3_8B)})
    bad = 0
    for n in (256, 1024, 4096, 16384):
        for r in rows:
            for rank in range(n):
                size, off = Shard.local_shard_size_and_offset(r, n, rank)
                (o, *_), (s, *_) = shard_box((r, 1), n, rank)
                bad += (o, s) != (off, size)
    print(f"box arithmetic vs torch's Shard.local_shard_size_and_offset ({len(rows)} row counts x every rank of "
          f"256/1024/4096/16384): {'same' if not bad else f'{bad} differ'}")
    ok &= bad == 0
    # 2. the real write_rank of real DTensors against synth_index, ignoring digests and timings
    tiny = {"vocab": 5000, "dim": 64, "layers": 2, "kv_dim": 16, "ffn": 96}
    sp = Spec(tiny)
    params = param_shapes(tiny)
    phases = {"prepare": 0.012345, "state": 0.000812, "stage": 0.412345}
    cases = [(1, 0), (3, 0), (3, 2), (64, 0), (64, 1), (64, 15), (64, 16), (64, 47), (64, 48), (64, 63)]
    for health_mode in ("steady", "first", "off"):
        for n, rank in cases:
            dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
            try:
                mesh = init_device_mesh("cpu", (n,))
                gen = torch.Generator().manual_seed(rank)

                def dt(shape: tuple[int, ...]) -> DTensor:
                    off, size = shard_box(shape, n, rank)
                    return DTensor.from_local(torch.randn(size, generator=gen), mesh, [Shard(0)], run_check=False,
                                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

                def state(step: float) -> dict[str, Any]:
                    return {"model": {f: dt(s) for f, s in params},
                            "optim": {"state": {f: {"step": torch.tensor(step), "exp_avg": dt(s), "exp_avg_sq": dt(s)} for f, s in params},
                                      "param_groups": [param_group([f for f, _ in params])]}}

                with tempfile.TemporaryDirectory() as tmp:
                    first, second = resolve(os.path.join(tmp, "a")), resolve(os.path.join(tmp, "b"))
                    check = hl.Check(sp.trainable, None, None) if health_mode != "off" else None
                    step_writer.write_rank(first, rank, state(1.0), health=check, phases=dict(phases), world_size=n)
                    if health_mode == "steady":
                        check = hl.Check(sp.trainable, check.tally.digests, SINCE)
                    elif health_mode == "first":
                        check = hl.Check(sp.trainable, None, None)
                    step_writer.write_rank(second, rank, state(2.0), health=check, phases=dict(phases), world_size=n)
                    with open(os.path.join(tmp, "b", rendezvous.part_name(rank)), "rb") as f:
                        raw = f.read()
                    real = json.loads(raw.partition(b"\0")[0])
                    real_fragment = raw.partition(b"\0")[2]
                    (real_manifest,) = json.load(open(os.path.join(tmp, "b", real["manifest"][0])))["records"].values()
                    size_on_disk = os.path.getsize(os.path.join(tmp, "b", real["file"]))
            finally:
                dist.destroy_process_group()
            with tempfile.TemporaryDirectory() as tmp:
                synth = synth_index(sp, n, rank, random.Random(rank), health_mode, "record", phases)
                synth_manifest = synth["records"]
                synth, synth_fragment = published(synth, tmp, sp, n)
            same = (json.dumps(_normalize(real)) == json.dumps(_normalize(synth)) and real_fragment == synth_fragment
                    and json.dumps(_normalize({"records": real_manifest, "phases": {}})) == json.dumps(_normalize({"records": synth_manifest, "phases": {}})))
            same_file = size_on_disk == synth["written"]
            print(f"  health={health_mode:6s} N={n:3d} rank={rank:2d}: index {'same' if same else 'DIFFERS'}"
                  f" ({len(raw)} vs {len(rendezvous.part_bytes(synth, synth_fragment))} bytes, phase timings aside), data file "
                  f"{size_on_disk} bytes {'= written' if same_file else '!= written ' + str(synth['written'])}")
            if not same:
                _diff(_normalize(real), _normalize(synth))
            ok &= same and same_file
    print("check:", "PASS: the synthetic indexes are what write_rank publishes (digest values aside)" if ok else "FAIL")
    return ok


def _diff(x: Any, y: Any, path: str = "") -> None:
    if type(x) is not type(y):
        print(f"    {path}: {type(x).__name__} vs {type(y).__name__}")
    elif isinstance(x, dict):
        if list(x) != list(y):
            print(f"    {path}: keys {list(x)[:8]} vs {list(y)[:8]}")
        for k in x:
            if k in y:
                _diff(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, list):
        if len(x) != len(y):
            print(f"    {path}: {len(x)} vs {len(y)} items")
        for i, (u, v) in enumerate(zip(x, y)):
            _diff(u, v, f"{path}[{i}]")
    elif x != y:
        print(f"    {path}: {x!r:.60} vs {y!r:.60}")


# --- the benchmark -------------------------------------------------------------------------------

def estimate_parts(sp: Spec, n: int, a: argparse.Namespace) -> int:
    """Bytes of every part, from a few ranks' parts (ranks differ in which shards are empty)."""
    sample = sorted({0, 1, n // 4, n // 2, (3 * n) // 4, n - 1})
    rng = random.Random(0)
    sizes = [len(json.dumps(synth_index(sp, n, r, rng, a.health, a.empty))) for r in sample]
    return int(sum(sizes) / len(sizes) * n)


def fmt_s(x: Any) -> str:
    return "–" if x is None else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def run_case(a: argparse.Namespace, sp: Spec, n: int, done: list[dict[str, Any]]) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n, **count_chunks(sp, n, a.empty)}
    parts, step = case_dirs(a.out_dir, n)
    shutil.rmtree(os.path.join(a.out_dir, f"n{n}"), ignore_errors=True)
    os.makedirs(parts)
    os.makedirs(step)
    est = estimate_parts(sp, n, a)
    free = shutil.disk_usage(a.out_dir).free
    res["parts_estimate_bytes"] = est
    need = int(est * 2.2) + (1 << 30)  # parts, .metadata and the commit record (each about the parts' size or less)
    print(f"[N={n}] parts ~{est / MB:.0f} MB estimated; {free / 1e9:.1f} GB free in {a.out_dir} (need ~{need / 1e9:.1f} GB)", flush=True)
    if free < need:
        res["skipped"] = f"not enough free space: {free / 1e9:.1f} GB free, ~{need / 1e9:.1f} GB needed"
        return res
    # predict the commit's memory and time from the largest case done (both grow with the chunks)
    prev = next((d for d in reversed(done) if "commit" in d and "error" not in d["commit"]), None)
    if prev is not None:
        scale = res["chunks"] / prev["chunks"]
        res["predicted_peak_mb"] = prev["commit"]["peak_mb"] * scale
        res["predicted_commit_s"] = prev["commit"]["commit_s"] * scale
        res["predicted_metadata_bytes"] = prev["commit"]["metadata_bytes"] * scale
        res["predicted_record_bytes"] = prev["commit"]["record_bytes"] * scale
        if "metadata_bytes" in (prev.get("torch") or {}):
            res["predicted_torch_metadata_bytes"] = prev["torch"]["metadata_bytes"] * scale
        if "load_s" in (prev.get("load") or {}):
            res["predicted_load_s"] = prev["load"]["load_s"] * scale
        print(f"[N={n}] predicted from N={prev['n']}: commit ~{res['predicted_commit_s']:.0f} s, peak ~{res['predicted_peak_mb'] / 1e3:.1f} GB "
              f"(limit {a.mem_limit_gb:.1f} GiB)", flush=True)
        if not a.force and res["predicted_peak_mb"] > a.mem_limit_gb * (1 << 30) / MB:
            res["skipped"] = (f"predicted commit peak {res['predicted_peak_mb'] / 1e3:.1f} GB > the {a.mem_limit_gb:.1f} GiB this "
                              f"machine can give it (linear in chunks from N={prev['n']})")
            return res
        if not a.force and res["predicted_commit_s"] > a.case_budget_s:
            res["skipped"] = f"predicted commit {res['predicted_commit_s']:.0f} s > {a.case_budget_s:.0f} s budget"
            return res
    t = time.perf_counter()
    gens = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", "gen", "--_n", str(n), "--out-dir", a.out_dir,
                              "--_result", os.path.join(a.out_dir, f"n{n}", f"gen{w}.json"), "--_shard", str(w),
                              "--_workers", str(a.workers), "--health", a.health, "--empty-shards", a.empty])
            for w in range(a.workers)]
    for p in gens:
        p.wait()
    if any(p.returncode for p in gens):
        res["skipped"] = "generating the parts failed"
        return res
    gen = [json.load(open(os.path.join(a.out_dir, f"n{n}", f"gen{w}.json"))) for w in range(a.workers)]
    res["parts_bytes"] = sum(g["parts_bytes"] for g in gen)
    res["data_bytes"] = sum(g["written"] for g in gen)
    print(f"[N={n}] parts written: {res['parts_bytes'] / MB:.0f} MB in {time.perf_counter() - t:.0f} s (not timed)", flush=True)
    if "commit" in a.stages:
        res["commit"] = run_child("commit", a, n, a.case_timeout)
        c = res["commit"]
        if "error" in c:
            print(f"[N={n}] commit: {c['error']}", flush=True)
        else:
            print(f"[N={n}] commit {c['commit_s']:.2f} s, {c['cpu_s']:.2f} s CPU (read {c['read_s']:.2f}, merge+.metadata "
                  f"{c['merge_s']:.2f}, health {c['health_s']:.2f}, record {c['record_s']:.2f}; gc {c['gc_s']:.2f} s in "
                  f"{c['gc_runs']} runs; load average {c['loadavg'][0]:.1f}-{c['loadavg'][1]:.1f}), peak {c['peak_mb']:.0f} MB "
                  f"(+{c['peak_delta_mb']:.0f}), .metadata {c['metadata_bytes'] / MB:.1f} MB, record {c['record_bytes'] / MB:.1f} MB"
                  + (f"; REFUSED first: {c['refused']}; figures with the limit lifted" if c.get("refused") else ""), flush=True)
    committed = "error" not in res.get("commit", {"error": "not run"})
    if n in a.profile:
        p = run_child("commit", a, n, a.case_timeout, extra=["--_profile", "prof"])
        res["profile"] = p.get("profile") or p.get("error")
        res["profile_commit_s"] = p.get("commit_s")
        committed = committed or "error" not in p
        print(f"[N={n}] profiled commit: {fmt_s(p.get('commit_s'))} s under cProfile", flush=True)
    if committed and "load" in a.stages:
        res["load"] = run_child("load", a, n, a.case_timeout)
        ld = res["load"]
        print(f"[N={n}] load plan: " + (ld["error"] if "error" in ld else
              f"{ld['load_s']:.2f} s, {ld['cpu_s']:.2f} s CPU (open {ld['open_s']:.2f}, index {ld['index_s']:.2f}, checks "
              f"{ld['check_s']:.2f}, ranges {ld['ranges_s']:.3f}; {ld['ranges']} ranges), peak {ld['peak_mb']:.0f} MB"
              + (f"; REFUSED first after {ld['refused_after_s']:.2f} s: {ld['refused']}" if ld.get("refused") else "")), flush=True)
    if committed and n in a.profile and a.profile_load:
        res["load_profile"] = run_child("load", a, n, a.case_timeout, extra=["--_profile", "prof"])
    if "torch" in a.stages:
        # torch: planning (skipped where its plans cannot fit, or would run far past the timeout) and .metadata size
        items = res["chunks"] + n * (len(sp.entries) - sum(1 for e in sp.entries if e[1] == "dtensor"))
        plan_gb = items * a.torch_item_bytes / 1e9
        measured = [(d["n"], d["torch"]["plan_s"]) for d in done if (d.get("torch") or {}).get("plan_s")]
        skip = "--skip-torch-plan" if a.skip_torch_plan else None
        if skip is None and plan_gb > a.mem_limit_gb * 0.9:
            skip = f"{items / 1e6:.1f} M write items need ~{plan_gb:.0f} GB (> {a.mem_limit_gb * 0.9:.0f} GiB)"
        if skip is None and measured:
            k = (math.log(measured[-1][1] / measured[-2][1]) / math.log(measured[-1][0] / measured[-2][0])) if len(measured) > 1 else 1.0
            predicted = measured[-1][1] * (n / measured[-1][0]) ** max(k, 1.0)
            res["torch_plan_predicted_s"] = predicted
            if predicted > 2 * a.torch_timeout and not a.force:
                skip = (f"predicted ~{predicted:.0f} s (N^{max(k, 1.0):.2f} from N={measured[-1][0]}) > 2x the "
                        f"{a.torch_timeout} s timeout")
        if skip:
            res["torch_plan_skipped"] = skip
        res["torch"] = run_child("torch", a, n, a.torch_timeout + 1200, extra=["--_no-plan", "noplan"] if skip else None)
        tr = res["torch"]
        print(f"[N={n}] torch: " + (tr["error"] if "error" in tr else
              f"planning {fmt_s(tr.get('plan_s'))} s{' (' + tr['plan_error'] + ')' if tr.get('plan_error') else ''}"
              f"{' (not run: ' + skip + ')' if skip else ''}, .metadata {tr['metadata_bytes'] / MB:.1f} MB (its pickle.dump "
              f"{tr['pickle_s']:.1f} s), peak {tr['peak_mb']:.0f} MB"), flush=True)
    if not a.keep:
        shutil.rmtree(os.path.join(a.out_dir, f"n{n}"), ignore_errors=True)
    return res


def verdicts(rows: list[dict[str, Any]]) -> None:
    prev = None
    for r in rows:
        v: dict[str, str] = {}
        c = r.get("commit") or {}
        if "commit_s" in c:
            budget = TARGETS["commit_s"] * max(1.0, r["n"] / TARGETS["commit_at"])
            v["commit"] = f"{'pass' if c['commit_s'] <= budget and not c.get('refused') else 'MISS'} (≤{budget:.0f} s)" + (
                "; REFUSED (.metadata too large)" if c.get("refused") else "")
            if prev is not None:
                k = math.log(c["commit_s"] / prev["commit"]["commit_s"]) / math.log(r["n"] / prev["n"])
                v["growth"] = f"{'pass' if k <= 1.05 else 'MISS'} (N^{k:.2f})"
            v["peak"] = f"{'pass' if c['peak_mb'] <= TARGETS['peak_gb'] * 1e3 else 'MISS'}"
            prev = r
        t = r.get("torch") or {}
        if "metadata_bytes" in c and "metadata_bytes" in t:
            v["metadata"] = f"{'pass' if c['metadata_bytes'] <= t['metadata_bytes'] else 'MISS'} ({c['metadata_bytes'] / t['metadata_bytes']:.2f}x)"
        ld = r.get("load") or {}
        if "load_s" in ld:
            ok = ld["load_s"] <= TARGETS["load_s"] and not ld.get("refused")
            v["load"] = "pass" if ok else ("MISS (refused)" if ld.get("refused") else "MISS")
        r["verdict"] = v


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print("| N | chunks (non-empty) | parts MB | commit s (read / merge+.metadata / record) | commit peak MB (+Δ) | "
          ".metadata MB (ours / torch's) | commit record MB | torch planning s | load plan s (rank N/2) | "
          "commit ≤2 s@4096, ≤linear | growth | peak ≤2 GB | .metadata ≤ torch | load plan ≤0.5 s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, t, ld, v = r.get("commit") or {}, r.get("torch") or {}, r.get("load") or {}, r.get("verdict") or {}
        chunks = f"{r['chunks'] / 1e6:.2f} M ({r['nonempty_chunks'] / 1e6:.2f} M)"
        if r.get("skipped"):
            pred = lambda k, f="%.0f": (f % (r[k] / MB) + " (pred.)") if k in r else "–"
            print(f"| {r['n']} | {chunks} | ~{r.get('parts_estimate_bytes', 0) / MB:.0f} (est.) | not run: {r['skipped']}"
                  f"{'; ≥%.0f s predicted (linear in chunks)' % r['predicted_commit_s'] if 'predicted_commit_s' in r else ''} | "
                  f"{'~%.0f (pred.)' % r['predicted_peak_mb'] if 'predicted_peak_mb' in r else '–'} | "
                  f"{pred('predicted_metadata_bytes')} / {pred('predicted_torch_metadata_bytes')} | {pred('predicted_record_bytes')} | "
                  f"not run | {'≥%.0f (pred.)' % r['predicted_load_s'] if 'predicted_load_s' in r else '–'} | "
                  f"{'MISS (pred.)' if 'predicted_commit_s' in r else '–'} | – | "
                  f"{'MISS (pred.)' if r.get('predicted_peak_mb', 0) > 2000 else '–'} | "
                  f"{'MISS (pred.)' if r.get('predicted_metadata_bytes', 0) > r.get('predicted_torch_metadata_bytes', 1e30) else '–'} | "
                  f"{'MISS (pred.)' if r.get('predicted_load_s', 0) > TARGETS['load_s'] else '–'} |")
            continue
        commit = (f"**{c['commit_s']:.2f}** ({c['read_s']:.2f} / {c['merge_s']:.2f} / {c['health_s'] + c['record_s']:.2f})"
                  if "commit_s" in c else c.get("error", "–"))
        peak = f"{c['peak_mb']:.0f} (+{c['peak_delta_mb']:.0f})" if "peak_mb" in c else "–"
        md = (f"{c['metadata_bytes'] / MB:.1f} / {t['metadata_bytes'] / MB:.1f}" if "metadata_bytes" in c and "metadata_bytes" in t
              else "–")
        rec = f"{c['record_bytes'] / MB:.1f}" if "record_bytes" in c else "–"
        if t.get("plan_s") is not None:
            tp = f"{t['plan_s']:.2f}"
        elif r.get("torch_plan_skipped"):
            tp = f"not run: {r['torch_plan_skipped']}"
        else:
            tp = t.get("plan_error") or t.get("error") or "–"
        if "load_s" in ld:
            lp = f"{ld['load_s']:.2f}"
            if ld.get("refused"):
                why = ld["refused"].split(": ", 2)[-1].split(" (")[0]  # (the message, without the error's type and path)
                lp = f"refused after {ld['refused_after_s']:.2f} s ({why}); {ld['load_s']:.2f} with the limit lifted"
        else:
            lp = ld.get("error", "–")
        print(f"| {r['n']} | {chunks} | {r['parts_bytes'] / MB:.0f} | {commit} | {peak} | {md} | {rec} | {tp} | {lp} | "
              f"{v.get('commit', '–')} | {v.get('growth', '–')} | {v.get('peak', '–')} | {v.get('metadata', '–')} | {v.get('load', '–')} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="256,1024,4096,16384", help="world sizes to simulate (comma-separated)")
    p.add_argument("--out-dir", default="/tmp/ckpttool-bench-coordination",
                   help="where the parts and steps go (about 2x the parts' size free per case: GBs at 16384)")
    p.add_argument("--json", help="write every measured figure here")
    p.add_argument("--check", action="store_true", help="only check the synthetic indexes against the real write_rank, then exit")
    p.add_argument("--health", choices=("steady", "first", "off"), default="steady",
                   help="the health findings each rank publishes: a save compared with the previous one (every save but "
                        "the first of a run; the default), the first save after a start, or health=False")
    p.add_argument("--empty-shards", dest="empty", choices=("record", "skip"), default="record",
                   help="record: what ckpttool does (a rank with no rows of a tensor still writes an empty record of it); "
                        "skip: a what-if, no record for an empty shard")
    p.add_argument("--profile", default="4096", help="cProfile rank 0's commit at these N (an extra, separate run; '' for none)")
    p.add_argument("--profile-load", action="store_true", help="also cProfile the load plan at those N")
    p.add_argument("--stages", default="commit,load,torch",
                   help="what to run per N: commit (timed), load (the load plan, on the committed step), torch")
    p.add_argument("--torch-timeout", type=int, default=300, help="seconds torch's planning may take per case")
    p.add_argument("--skip-torch-plan", action="store_true", help="only the size of torch's .metadata, not its planning")
    p.add_argument("--torch-item-bytes", type=float, default=1800,
                   help="memory per torch WriteItem, to skip planning that cannot fit (measured: ~1.8 kB at N=1024)")
    p.add_argument("--mem-limit-gb", type=float, default=None,
                   help="address-space limit of each child (GiB; default 85%% of MemAvailable at start)")
    p.add_argument("--case-timeout", type=float, default=1500, help="seconds a commit or load child may take")
    p.add_argument("--case-budget-s", type=float, default=900, help="skip a commit predicted to take longer")
    p.add_argument("--force", action="store_true", help="run a case even where the prediction says it will not fit")
    p.add_argument("--workers", type=int, default=2, help="processes writing the parts")
    p.add_argument("--keep", action="store_true", help="keep each case's files")
    p.add_argument("--from-json", help="print the table (and profiles) of an earlier run's --json file, run nothing")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    p.add_argument("--_n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    p.add_argument("--_shard", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_workers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--_mem", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--_profile", dest="_profile", help=argparse.SUPPRESS)
    p.add_argument("--_no-plan", dest="_no_plan", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._child:
        limit_memory(a._mem)
        a.n, a.shard, a.workers = a._n, a._shard, a._workers
        a.profile = bool(a._profile)
        a.no_plan = bool(a._no_plan)
        got = {"gen": child_gen, "commit": child_commit, "load": child_load, "torch": child_torch}[a._child](a)
        with open(a._result, "w") as f:
            json.dump(got, f)
        return 0
    if a.check:
        return 0 if run_check(a) else 1
    if a.from_json:
        with open(a.from_json) as f:
            rows = json.load(f)["rows"]
        verdicts(rows)
        print_table(rows)
        print_profiles(rows)
        return 0
    a.mem_limit_gb = a.mem_limit_gb or round(mem_available_gib() * 0.85, 1)
    a.profile = {int(x) for x in a.profile.split(",") if x}
    a.stages = set(a.stages.split(","))
    ranks = [int(x) for x in a.ranks.split(",")]
    os.makedirs(a.out_dir, exist_ok=True)
    sp = Spec(LLAMA3_8B)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--short", "ckpttool"], capture_output=True, text=True).stdout.split()
    import torch

    print(f"coordination: Llama-3-8B FSDP2 + AdamW, fp32, {len(sp.entries)} keys; ckpttool at {head}"
          f"{' with local changes in ' + ', '.join(dirty[1::2]) if dirty else ''}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs, {mem_available_gib():.1f} GiB available (children limited to {a.mem_limit_gb} GiB); "
          f"health={a.health}, empty shards: {a.empty}", flush=True)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for n in ranks:
        rows.append(run_case(a, sp, n, rows))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"rows": rows, "args": {k: v for k, v in vars(a).items() if not k.startswith("_") and k != "profile"}},
                          f, indent=1, default=str)
    verdicts(rows)
    print_table(rows)
    print_profiles(rows)
    print(f"total {time.perf_counter() - started:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "args": {k: v for k, v in vars(a).items() if not k.startswith("_")}}, f, indent=1, default=str)
    return 0


def print_profiles(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if r.get("profile"):
            print(f"\ncProfile of rank 0's commit at N={r['n']} ({fmt_s(r.get('profile_commit_s'))} s under the profiler):")
            print(r["profile"])
        lp = r.get("load_profile") or {}
        if lp.get("profile"):
            print(f"\ncProfile of rank {r['n'] // 2}'s load plan at N={r['n']} ({fmt_s(lp.get('load_s'))} s under the profiler"
                  f"{', limits lifted' if lp.get('lifted') else ''}):")
            print(lp["profile"])


if __name__ == "__main__":
    sys.exit(main())
