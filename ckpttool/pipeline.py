"""Source -> transforms -> Sink, tensor by tensor under a memory budget: ``convert`` lives here.

Transforms are *select* (``only``: keep one top-level key and drop its prefix) and *cast*
(``dtype``: floating-point tensors only). Memory: a sink pulls each tensor in slabs of at most the
budget, so no more than about one slab (plus its cast) is in memory at once, whatever the size.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import OutputExistsError, UsageError
from .formats import FORMATS, ObjectSpec, Sink, Source, TensorSpec, format_from_name, make_sink, open_source
from .formats.base import SlabBuffers
from .index import TensorEntry, dtype_size, key_of
from .layout import Box, Mesh, stored_boxes, whole
from .storage import Location, resolve

DEFAULT_BUDGET = 1 << 30
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: progress(done_bytes, total_bytes, key) — the CLI renders it; nothing below the CLI prints.
Progress = Callable[[int, int, str], None]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"1GiB"``, ``"500MB"``, ``"2G"``, ``"4096"`` -> bytes (K/M/G/T are powers of 1024 with or without i)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"cannot read size {text!r}", hint="write e.g. 512MiB, 2GB or a number of bytes")
    number, unit, _ = m.groups()
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit.lower()]
    value = int(float(number) * scale)
    if value < 1:
        raise UsageError(f"size must be positive, got {text!r}")
    return value


def _castable(entry: TensorEntry) -> bool:
    """``--dtype`` casts floating-point tensors; integers and 0-d counters (AdamW's ``step``) keep theirs."""
    return entry.dtype.is_floating_point and len(entry.shape) > 0


@dataclass
class Plan:
    """What a run of the pipeline will write: output specs and where each reads from."""

    entries: list[TensorSpec | ObjectSpec]  # in the source's order
    source_key: dict[str, str] = field(default_factory=dict)  # output key -> source key

    @property
    def tensors(self) -> list[TensorSpec]:
        return [e for e in self.entries if isinstance(e, TensorSpec)]

    @property
    def objects(self) -> list[ObjectSpec]:
        return [e for e in self.entries if isinstance(e, ObjectSpec)]


def plan_entries(source: Source, only: str | None = None, dtype: torch.dtype | None = None) -> Plan:
    """Apply select and cast to the source's index; objects are read here (they are small)."""
    index = source.index()
    entries: list[TensorSpec | ObjectSpec] = []
    source_key: dict[str, str] = {}
    for key in index:
        path = index.path(key)
        if only is not None:
            if len(path) < 2 or str(path[0]) != only:
                continue
            path = path[1:]
        out_key = key_of(path) if only is not None else key
        entry = index[key]
        source_key[out_key] = key
        if isinstance(entry, TensorEntry):
            out_dtype = dtype if (dtype is not None and _castable(entry)) else entry.dtype
            entries.append(TensorSpec(out_key, tuple(path), entry.shape, out_dtype))
        else:
            entries.append(ObjectSpec(out_key, tuple(path), source.read_object(key)))
    if only is not None and not source_key:
        tops = sorted({str(index.path(k)[0]) for k in index})
        raise UsageError(f"no entries under the top-level key {only!r}", hint=f"top-level keys are: {', '.join(tops)}")
    return Plan(entries, source_key)


def run(source: Source, sink: Sink, plan: Plan, budget: int = DEFAULT_BUDGET, progress: Progress | None = None) -> None:
    """Stream every planned entry from ``source`` into ``sink`` and commit; on any failure (or
    Ctrl-C) remove the partial output and re-raise."""
    tensors = sink.order(plan.tensors)
    total = sum(s.nbytes for s in tensors)
    done = 0
    index = source.index()
    scratch = SlabBuffers(2)  # reused from slab to slab: no fresh pages per slab
    try:
        if sink.tmp == sink.location and sink.location.exists():
            sink.location.remove()  # in-place output (object stores) replacing an old one: --force was given
        sink.begin(plan.entries)
        for spec in tensors:
            src_key = plan.source_key[spec.key]
            src_dtype = index[src_key].dtype

            def read(box: Box, src_key=src_key, src_dtype=src_dtype, out_dtype=spec.dtype) -> torch.Tensor:
                t = source.read_tensor(src_key, box, out=scratch.view(box[1], src_dtype, 0))
                if t.dtype == out_dtype:
                    return t
                return scratch.view(box[1], out_dtype, 1).copy_(t)

            # a slab held at the source dtype, plus its cast when there is one: both under the budget
            out_size = dtype_size(spec.dtype)
            held = out_size if src_dtype == spec.dtype else dtype_size(src_dtype) + out_size
            slab_budget = max(1, budget * out_size // held)
            sink.add_tensor(spec, read, slab_budget)
            done += spec.nbytes
            if progress:
                progress(done, total, spec.key)
        sink.finalize()
    except BaseException:
        sink.abort()
        raise


@dataclass
class ConvertReport:
    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: int
    objects: int
    bytes: int
    dropped: list[str]


def check_output(dst: Location, force: bool) -> None:
    if dst.exists() and not force:
        raise OutputExistsError("output already exists", where=dst.url, hint="pass --force to replace it")


def convert(
    src: str | Location,
    dst: str | Location,
    *,
    to: str | None = None,
    only: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    force: bool = False,
    src_format: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ConvertReport:
    """Convert a checkpoint between dcp, torch and safetensors, streaming under ``memory_budget``.

    Raises :class:`OutputExistsError` before writing anything when ``dst`` exists and ``force`` is
    not set, :class:`UsageError` for bad options; the output appears only once complete.
    """
    src_loc = resolve(src, storage_options)
    dst_loc = resolve(dst, storage_options)
    if to is not None and to not in FORMATS:
        raise UsageError(f"unknown format {to!r} for --to", hint=f"choose one of {', '.join(FORMATS)}")
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise UsageError(f"unknown --dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_NAMES)}")
        dtype = DTYPE_NAMES[dtype]
    budget = parse_size(memory_budget)
    shard = parse_size(max_shard_size) if max_shard_size is not None else None
    fmt = to or format_from_name(dst_loc)
    if shard is not None and fmt != "safetensors":
        raise UsageError("--max-shard-size applies to safetensors output only")
    if src_loc.url == dst_loc.url:
        raise UsageError("source and destination are the same path", where=dst_loc.url)
    with open_source(src_loc, src_format) as source:
        check_output(dst_loc, force)
        plan = plan_entries(source, only, dtype)
        sink = make_sink(dst_loc, fmt, max_shard_size=shard)
        run(source, sink, plan, budget, progress)
        return ConvertReport(
            src=src_loc.url,
            dst=dst_loc.url,
            src_format=source.format,
            dst_format=fmt,
            tensors=len(plan.tensors),
            objects=len(plan.objects) - len(sink.dropped),
            bytes=sum(s.nbytes for s in plan.tensors),
            dropped=list(sink.dropped),
        )


# --- reshard --------------------------------------------------------------------------------------


@dataclass
class ReshardReport:
    src: str
    dst: str
    source_world_size: int
    world_size: int
    mesh: str
    tensors: int
    objects: int
    bytes: int
    bytes_per_rank: dict[int, int]


def source_world_size(source: Source) -> int:
    """How many ranks wrote a DCP checkpoint, from its ``__<rank>_<i>.distcp`` file names."""
    ranks = set()
    for name in source.files():
        m = re.match(r"^__(\d+)_\d+\.distcp$", name)
        if m:
            ranks.add(int(m.group(1)))
    return max(ranks) + 1 if ranks else 1


def fsdp_placement(source: Source, mesh: Mesh):
    """Where each tensor goes on ``mesh``: FSDP2 ``Shard(0)`` boxes, each stored once, except
    entries the source stores replicated (buffers, 0-d scalars), which stay whole on rank 0.

    A tensor is taken as replicated when the source keeps it as one whole chunk although sharding
    it over the source's world size would have made several. From a world-size-1 source that cannot
    be told, so buffers are sharded like parameters there (plain DCP loads either way).
    """
    index = source.index()
    w_src = source_world_size(source)
    src_mesh = Mesh(1, w_src)

    def replicated(key: str) -> bool:
        entry = index[key]
        if not entry.shape:
            return True
        if len(entry.chunks) != 1 or entry.chunks[0].sizes != entry.shape:
            return False
        return len(stored_boxes(entry.shape, src_mesh)) > 1

    def place(spec: TensorSpec) -> list[tuple[int, Box]]:
        src_key = source_keys.get(spec.key, spec.key)
        if replicated(src_key):
            return [(0, whole(spec.shape))]
        return stored_boxes(spec.shape, mesh)

    source_keys: dict[str, str] = {}
    return place, source_keys


def reshard(
    src: str | Location,
    dst: str | Location,
    *,
    world_size: int,
    mesh: str | None = None,
    only: str | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    force: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ReshardReport:
    """Rewrite a DCP checkpoint as FSDP2 would lay it out on ``world_size`` ranks (or an HSDP
    ``mesh`` "RxS"): one ``__<rank>_0.distcp`` per target rank holding exactly that rank's boxes.

    One process, no process group, streaming under ``memory_budget``. Raises :class:`UsageError`
    for a bad world size or mesh, :class:`FormatError` when SRC is not DCP.
    """
    from .errors import FormatError
    from .formats.dcp import DcpSink

    target = Mesh.parse(world_size, mesh)
    src_loc = resolve(src, storage_options)
    dst_loc = resolve(dst, storage_options)
    budget = parse_size(memory_budget)
    if src_loc.url == dst_loc.url:
        raise UsageError("source and destination are the same path", where=dst_loc.url)
    with open_source(src_loc, None) as source:
        if source.format != "dcp":
            raise FormatError(
                f"reshard reads DCP checkpoints; this is {source.format}",
                where=src_loc.url,
                hint=f"convert it first: ckpttool convert {src_loc.url} DIR --to dcp",
            )
        check_output(dst_loc, force)
        plan = plan_entries(source, only, None)
        place, source_keys = fsdp_placement(source, target)
        source_keys.update(plan.source_key)
        sink = DcpSink(dst_loc, placement=place, world_size=target.world_size)
        run(source, sink, plan, budget, progress)
        return ReshardReport(
            src=src_loc.url,
            dst=dst_loc.url,
            source_world_size=source_world_size(source),
            world_size=target.world_size,
            mesh=f"{target.replicate}x{target.shard}",
            tensors=len(plan.tensors),
            objects=len(plan.objects),
            bytes=sum(s.nbytes for s in plan.tensors),
            bytes_per_rank=dict(sorted(sink.bytes_per_rank.items())),
        )
