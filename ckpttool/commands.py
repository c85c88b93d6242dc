"""The offline commands that write a checkpoint: ``convert`` (any format to any other) and
``reshard`` (a DCP or per-rank checkpoint laid out for another job), each a plan streamed by the
engine (engine.py) into a format's sink, committed whole or not at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import formats
from .choices import CAST_DTYPES, parse_size
from .engine import DEFAULT_BUDGET, Plan, plan_entries, run
from .errors import FormatError, MismatchError, OutputExistsError, UsageError
from .formats.base import ObjectSpec, Progress, Sink, SinkOptions, Source, TensorSpec
from .index import TensorEntry
from .layout import MAX_WORLD_SIZE, Box, ChunkLayout, FsdpLayout, Mesh, TpLayout, matches, stored_replicated
from .steps import is_training_root, list_root
from .storage import Location, resolve

DTYPE_NAMES = {name: getattr(torch, name) for name in CAST_DTYPES}


@dataclass
class WriteReport:
    """What an offline command wrote (the CLI renders it; ``--json`` prints its fields)."""

    src: str
    dst: str
    tensors: int
    objects: int
    bytes: int
    notes: list[str] = field(default_factory=list)  # what the source said it did not read, or read from one rank

    @classmethod
    def of(cls, src: Location, dst: Location, plan: Plan, sink: Sink, source: Source, **more: Any):
        return cls(src=src.url, dst=dst.url, tensors=len(plan.tensors), objects=len(plan.objects) - len(sink.dropped),
                   bytes=sum(s.nbytes for s in plan.tensors), notes=source.not_read().lines(), **more)


@dataclass
class ConvertReport(WriteReport):
    src_format: str = ""
    dst_format: str = ""
    dropped: list[str] = field(default_factory=list)


_OPTION_FLAGS = {"max_shard_size": "--max-shard-size", "layout": "--world-size", "compress": "--compress"}


def _check_options(fmt: formats.Format, options: SinkOptions) -> None:
    """An option the output format cannot honour is a usage error naming the formats that can."""
    for name in sorted(options.given() - fmt.sink_options):
        able = [f.name for f in formats.all_formats() if name in f.sink_options]
        raise UsageError(f"{_OPTION_FLAGS.get(name, name)} applies to {' or '.join(able)} output only",
                         hint=f"the output format here is {fmt.name}")


def check_output(src: Location, dst: Location, force: bool) -> None:
    """Refuse an output that would destroy more than DST: one that contains SRC or lies inside it,
    or a training root holding committed steps (even with ``force``); an existing DST without
    ``force``."""
    if src.url == dst.url:
        raise UsageError("source and destination are the same path", where=dst.url)
    if dst.contains(src):
        raise UsageError("the destination contains the source", where=dst.url,
                         hint="write the output beside the checkpoint, not around it; --force never replaces a source")
    if src.contains(dst):
        raise UsageError("the destination lies inside the source checkpoint", where=dst.url,
                         hint="write the output beside the checkpoint, not into it")
    if not dst.exists():
        return
    if dst.isdir() and is_training_root(dst) and list_root(dst).committed:
        raise UsageError("the destination is a training root holding committed steps", where=dst.url,
                         hint="--force replaces one output, never a training run; choose another destination")
    if not force:
        raise OutputExistsError("output already exists", where=dst.url, hint="pass --force to replace it")


def _cast_to(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``--dtype``'s torch dtype (a name of :data:`DTYPE_NAMES`, or one already)."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise UsageError(f"unknown --dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_NAMES)}")
        return DTYPE_NAMES[dtype]
    return dtype


def convert(
    src: str | Location,
    dst: str | Location,
    *,
    to: str | None = None,
    only: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    compress: str | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    force: bool = False,
    src_format: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    read_ahead: bool = True,
    parallel: bool = False,
    like: str | Location | None = None,
    key_map: dict[str, str] | None = None,
    optimizer_order: str | None = None,
) -> ConvertReport:
    """Convert a checkpoint between dcp, torch and safetensors, streaming under ``memory_budget``.

    ``to="hf"`` with ``like`` (a ``save_pretrained`` folder): the model's tensors under the names
    of ``like``'s checkpoint (the step's ``model.`` dropped, ``key_map``'s renames applied), in
    ``like``'s files (one ``model.safetensors``, or its shards with the same tensors in each and
    their index; ``max_shard_size``: shards of that size instead), with ``like``'s other
    files (config.json, generation_config.json, tokenizer files) copied: a folder
    ``from_pretrained`` reads. Names and shapes are checked against ``like`` before anything is
    written.

    Raises :class:`OutputExistsError` before writing anything when ``dst`` exists and ``force`` is
    not set, :class:`UsageError` for bad options; the output appears only once complete.
    ``optimizer_order="model"``: a per-rank folder's optimizer without recorded names numbered the
    model's parameters in the order the model lists them (the output records that its names rest
    on this). With ``parallel``, every process of the group writes its share (:func:`run`).
    """
    src_loc = resolve(src, storage_options)
    dst_loc = resolve(dst, storage_options)
    if (to == "hf") != (like is not None):
        raise UsageError("--to hf and --like HF_DIR go together", hint="--to hf --like a save_pretrained folder of the model")
    dtype = _cast_to(dtype)
    reading = formats.Reading(optimizer_order=optimizer_order)
    if like is not None:  # (--to hf)
        return _export_hf(src_loc, dst_loc, resolve(like, storage_options), key_map, dtype, max_shard_size, memory_budget,
                          force, src_format, progress, read_ahead, parallel, reading)
    if to is not None and to not in formats.output_names():
        raise UsageError(f"unknown format {to!r} for --to", hint=f"choose one of {', '.join(formats.output_names())}")
    budget = parse_size(memory_budget, "--memory-budget")
    options = SinkOptions(max_shard_size=parse_size(max_shard_size, "--max-shard-size") if max_shard_size is not None else None,
                          compress=compress)
    fmt = formats.get(formats.output_format(dst_loc.name, to, sharded=options.max_shard_size is not None))
    _check_options(fmt, options)
    with formats.open_source(src_loc, src_format, reading=reading) as source:
        formats.check_optimizer_order(optimizer_order, src_loc.url, source.format)
        check_output(src_loc, dst_loc, force)
        plan = plan_entries(source, only, dtype)
        sink = fmt.make_sink(dst_loc, options)
        run(source, sink, plan, budget, progress, read_ahead=read_ahead, parallel=parallel)
        return ConvertReport.of(src_loc, dst_loc, plan, sink, source, src_format=source.format, dst_format=fmt.name,
                                dropped=list(sink.dropped))


#: where a save_pretrained folder keeps its weights, in the order from_pretrained looks
HF_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
#: files of a save_pretrained folder that hold weights (written anew), never copied
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".safetensors.index.json", ".bin.index.json")


def _export_hf(src: Location, dst: Location, like: Location, key_map: dict[str, str] | None, dtype: Any,
               max_shard_size: int | str | None, memory_budget: int | str, force: bool, src_format: str | None,
               progress: Progress | None, read_ahead: bool, parallel: bool, reading: formats.Reading) -> ConvertReport:
    """``convert --to hf --like``: see :func:`convert`."""
    import re

    weights = next((like.child(n) for n in HF_WEIGHTS if like.isdir() and like.child(n).exists()), None)
    if weights is None:
        raise UsageError("--like takes a save_pretrained folder (with model.safetensors, its index, or pytorch_model.bin)",
                         where=like.url)
    with formats.open_source(like if weights.name.endswith(".json") else weights) as theirs:
        wanted = {key: tuple(e.shape) for key in theirs.index() if isinstance(e := theirs.index()[key], TensorEntry)}
        files = _like_shards(theirs, wanted, indexed=weights.name.endswith(".json"))
    rules = [(re.compile(p), r) for p, r in (key_map or {}).items()]
    fmt = formats.get("safetensors")
    # DST's files as --like's are (its names, the same tensors in each), unless --max-shard-size says otherwise
    options = (SinkOptions(max_shard_size=parse_size(max_shard_size, "--max-shard-size")) if max_shard_size is not None
               else SinkOptions(shard_files=files))
    with formats.open_source(src, src_format, reading=reading) as source:
        formats.check_optimizer_order(reading.optimizer_order, src.url, source.format)
        check_output(src, dst, force)
        tops = {str(p[0]) for p in source.index().paths.values()}
        plan = plan_entries(source, "model" if "model" in tops and len(tops) > 1 else None, dtype)
        renamed: dict[str, Any] = {}
        for spec in plan.tensors:
            name = spec.key
            for pattern, repl in rules:
                name = pattern.sub(repl, name)
            renamed[name] = spec
        for key, shape in wanted.items():
            if key not in renamed:
                raise MismatchError(f"key {key!r} of --like's checkpoint is not in the source", where=src.url,
                                    hint="--key-map REGEX=REPLACEMENT renames the source's keys")
            if tuple(renamed[key].shape) != shape:
                raise MismatchError(f"shape mismatch for {key!r}: --like has {list(shape)}, the source {list(renamed[key].shape)}",
                                    where=src.url, hint="--like takes a save_pretrained folder of the same model")
        entries: list[TensorSpec | ObjectSpec] = [TensorSpec(k, (k,), renamed[k].shape, renamed[k].dtype) for k in wanted]
        out = Plan(entries, {k: plan.source_key[renamed[k].key] for k in wanted})
        left = [k for k in renamed if k not in wanted] + [o.key for o in plan.objects]
        sink = fmt.make_sink(dst, options)
        sink.also = _like_files(like)
        run(source, sink, out, parse_size(memory_budget, "--memory-budget"), progress, read_ahead=read_ahead, parallel=parallel)
        report = ConvertReport.of(src, dst, out, sink, source, src_format=source.format, dst_format="hf", dropped=list(sink.dropped))
        if left:
            report.notes.append(f"not in --like's checkpoint, not written: {', '.join(left)}")
        return report


def _like_shards(theirs: Source, wanted: dict[str, Any], indexed: bool) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The safetensors files of a save_pretrained folder like ``theirs`` (names, and the tensors each
    holds): its own files, a torch file's name as save_pretrained names the safetensors one
    (``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``); one unsharded
    file without an index is ``model.safetensors``."""
    files: dict[str, list[str]] = {}
    for key in wanted:
        name = theirs.about(key).files[0]
        if not indexed:
            name = "model.safetensors"
        elif not name.endswith(".safetensors"):
            stem = name.rsplit(".", 1)[0]
            name = ("model" + stem[len("pytorch_model"):] if stem.startswith("pytorch_model") else stem) + ".safetensors"
        files.setdefault(name, []).append(key)
    return tuple((name, tuple(keys)) for name, keys in files.items())


def _like_files(like: Location) -> list[tuple[str, Location]]:
    """The files of a save_pretrained folder other than its weights (config, generation config,
    tokenizer files): regular files at its top level (a link is not followed out of it)."""
    out = []
    for name in like.listdir():
        loc = like.child(name)
        if name.startswith(".") or name.endswith(_WEIGHT_SUFFIXES) or loc.islink() or not loc.isfile():
            continue
        out.append((name, loc))
    return out


# --- reshard --------------------------------------------------------------------------------------


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
    from .formats.dcp.metadata import file_rank

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
