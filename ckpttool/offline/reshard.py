"""``reshard``: a DCP checkpoint or a per-rank folder laid out for another job's ranks (FSDP2, HSDP,
FSDP+TP, or exactly as another checkpoint), as a plan the engine (engine.py) streams into a
format's sink, committed whole or not at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import formats
from ..bulk import no_gc
from ..choices import parse_size
from ..engine import DEFAULT_BUDGET, Plan, plan_entries, run
from ..errors import FormatError, MismatchError, UsageError
from ..formats.base import Progress, SinkOptions, Source
from ..index import TensorEntry
from ..layout import MAX_WORLD_SIZE, Box, ChunkLayout, FsdpLayout, Mesh, TpLayout, matches, stored_replicated
from ..storage import Location, resolve
from .output import WriteReport, check_output


@dataclass
class ReshardReport(WriteReport):
    source_world_size: int = 1
    world_size: int = 1
    mesh: str = ""
    bytes_per_rank: dict[int, int] = field(default_factory=dict)


def replicated_keys(source: Source, plan: Plan) -> frozenset[str]:
    """Output keys of the tensors ``source`` stores replicated (buffers, 0-d scalars): they stay
    whole on rank 0 when resharded, as FSDP2 saves them."""
    index = source.index()
    src_mesh = Mesh(1, source.world_size)
    out = set()
    for spec in plan.tensors:
        entry = index[plan.source_key[spec.key]]
        if stored_replicated(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks], src_mesh):
            out.add(spec.key)
    return frozenset(out)


def _listed(keys: list[str], most: int = 5) -> str:
    return ", ".join(repr(k) for k in keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def like_layout(plan: Plan, other: Source) -> ChunkLayout:
    """``other``'s layout for the tensors of ``plan``: every key's chunks exactly as ``other`` stores
    them, each in the file of the rank that stores it there (``__<rank>_<n>.distcp``; a rank's
    several files become one). Tensor keys and shapes must match; dtypes may differ (the output
    keeps the source's bits, and ``dcp.load`` copies them into the model's dtype)."""
    from ..formats.dcp.metadata import file_rank

    where = other.location.url
    index = other.index()
    theirs = {k: index[k] for k in index if isinstance(index[k], TensorEntry)}
    ours = {spec.key: spec for spec in plan.tensors}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        what = "; ".join(([f"not in it: {_listed(missing)}"] if missing else []) + ([f"only in it: {_listed(extra)}"] if extra else []))
        raise MismatchError(f"the checkpoint given to --like holds other tensors ({what})", where=where,
                            hint="--like takes a checkpoint of the same model (its initial state saved on the new job's mesh)")
    world_size = other.world_size  # the highest rank in its file names, plus one: bounded before any use
    if world_size > MAX_WORLD_SIZE:
        raise FormatError(f"its file names say it was written by {world_size} ranks, more than ckpttool writes ({MAX_WORLD_SIZE})",
                          where=where, hint="one file per rank: --like takes the checkpoint of a job of at most that size")
    boxes: dict[str, dict[int, tuple[Box, ...]]] = {}
    for key, spec in ours.items():
        entry = theirs[key]
        if tuple(entry.shape) != tuple(spec.shape):
            raise MismatchError(f"tensor {key!r} has shape {list(spec.shape)} in the source but {list(entry.shape)} in --like",
                                where=where, hint="--like takes a checkpoint of the same model")
        entry.check_coverage(where)
        per_rank: dict[int, list[Box]] = {}
        for name, chunk in zip(other.about(key).files, entry.chunks):
            rank = file_rank(name)  # below world_size: that counts every file's rank
            if rank is None:
                raise FormatError(f"tensor {key!r} is stored in {name!r}, not a __<rank>_<n>.distcp file: its rank cannot be told",
                                  where=where)
            per_rank.setdefault(rank, []).append((tuple(chunk.offsets), tuple(chunk.sizes)))
        boxes[key] = {rank: tuple(b) for rank, b in per_rank.items()}
    return ChunkLayout(world_size, boxes)


def _reshard_target(world_size: int | None, mesh: str | None, like: Any, tp_plan: bool, to: str,
                    compress: str | None) -> Mesh | None:
    """The target mesh of ``reshard`` (None with ``like``), its arguments checked together."""
    if (like is None) == (world_size is None):
        raise UsageError("give either --world-size or --like", hint="--like OTHER lays DST out as the DCP checkpoint OTHER is")
    if like is not None and mesh is not None:
        raise UsageError("--mesh goes with --world-size, not with --like (OTHER's layout is used as it is)")
    if tp_plan and mesh is None:
        raise UsageError("--tp-colwise/--tp-rowwise need --mesh DPxTP (data-parallel x tensor-parallel ranks)")
    target = Mesh.parse(world_size, mesh) if world_size is not None else None
    if to not in formats.reshard_outputs():
        raise UsageError(f"reshard writes {' or '.join(formats.reshard_outputs())}, not {to!r}")
    if to != "dcp" and (like is not None or tp_plan or compress):
        raise UsageError("--to torch-ranks writes FSDP2's Shard(0) layouts: --world-size [--mesh RxS], no --like, "
                         "tensor parallelism or --compress")
    return target


def _target_layout(source: Source, plan: Plan, target: Mesh, colwise: tuple[str, ...],
                   rowwise: tuple[str, ...]) -> tuple[FsdpLayout | TpLayout, str]:
    """FSDP2's layout on ``target`` (HSDP when it has replicas), or with tensor parallelism over its
    second dimension when ``colwise``/``rowwise`` name layers; and how to describe it."""
    if not (colwise or rowwise):
        return FsdpLayout(target, replicated_keys(source, plan)), f"{target.replicate}x{target.shard}"
    keys = [spec.key for spec in plan.tensors]
    for flag, pattern in [("--tp-colwise", p) for p in colwise] + [("--tp-rowwise", p) for p in rowwise]:
        if not any(matches(k, pattern) for k in keys):
            raise UsageError(f"{flag} {pattern!r} matches no tensor of the checkpoint",
                             hint="name a layer as its keys do (w1 matches model.w1.weight), or a glob of whole keys")
    layout = TpLayout(target.replicate, target.shard, colwise, rowwise, replicated_keys(source, plan))
    return layout, f"{target.replicate}x{target.shard} (dp x tp)"


@no_gc()  # (the collector held off: bulk.py, docs/benchmarks.md)
def reshard(
    src: str | Location,
    dst: str | Location,
    *,
    world_size: int | None = None,
    mesh: str | None = None,
    like: str | Location | None = None,
    tp_colwise: list[str] | tuple[str, ...] = (),
    tp_rowwise: list[str] | tuple[str, ...] = (),
    only: str | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    force: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    compress: str | None = None,
    read_ahead: bool = True,
    parallel: bool = False,
    to: str = "dcp",
    optimizer_order: str | None = None,
) -> ReshardReport:
    """Rewrite a DCP checkpoint as FSDP2 would lay it out on ``world_size`` ranks (or an HSDP
    ``mesh`` "RxS"), or exactly as the DCP checkpoint ``like`` is laid out (any mesh, FSDP+TP
    included): one ``__<rank>_0.distcp`` per target rank holding exactly that rank's boxes.

    One process, no process group, streaming under ``memory_budget``; with ``parallel`` every
    process of the group calls this and writes its share of the target ranks' files. ``to="torch-ranks"``
    writes a per-rank torch.save folder instead, as the new job's ranks would with FSDP2's manual
    sharded checkpointing (``Shard(0)`` over ``world_size``, or HSDP ``mesh``). Raises :class:`UsageError`
    for a bad world size or mesh, :class:`FormatError` when SRC (or ``like``) is not DCP,
    :class:`MismatchError` when ``like`` holds other tensors or shapes. ``optimizer_order``: as
    :func:`convert`'s.
    """
    target = _reshard_target(world_size, mesh, like, bool(tp_colwise or tp_rowwise), to, compress)
    src_loc = resolve(src, storage_options)
    dst_loc = resolve(dst, storage_options)
    budget = parse_size(memory_budget, "--memory-budget")
    with formats.open_source(src_loc, reading=formats.Reading(optimizer_order=optimizer_order)) as source:
        formats.check_optimizer_order(optimizer_order, src_loc.url, source.format)
        if not formats.get(source.format).ranked:
            raise FormatError(
                f"reshard reads DCP checkpoints and per-rank torch.save folders; this is {source.format}",
                where=src_loc.url,
                hint=f"convert it first: ckpttool convert {src_loc.url} DIR --to dcp",
            )
        check_output(src_loc, dst_loc, force)
        plan = plan_entries(source, only, None)
        if target is not None:
            layout, described = _target_layout(source, plan, target, tuple(tp_colwise), tuple(tp_rowwise))
        else:
            like_loc = resolve(like, storage_options)
            with formats.open_source(like_loc) as other:
                if other.format != "dcp":
                    raise FormatError(f"--like takes a DCP checkpoint; this is {other.format}", where=like_loc.url)
                layout = like_layout(plan, other)
            described = f"like {like_loc.url}"
        sink = formats.get(to).make_sink(dst_loc, SinkOptions(layout=layout, compress=compress))
        run(source, sink, plan, budget, progress, read_ahead=read_ahead, parallel=parallel)
        return ReshardReport.of(src_loc, dst_loc, plan, sink, source, source_world_size=source.world_size,
                                world_size=layout.world_size, mesh=described,
                                bytes_per_rank=dict(sorted(sink.bytes_per_rank.items())))
