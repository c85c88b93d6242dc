"""``convert``: any checkpoint to any format ckpttool writes, or to a ``save_pretrained`` folder
like another (``--to hf --like``), as a plan the engine (engine.py) streams into a format's sink,
committed whole or not at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import formats
from ..bulk import no_gc
from ..choices import CAST_DTYPES, parse_size
from ..engine import DEFAULT_BUDGET, Plan, plan_entries, run
from ..errors import MismatchError, UsageError
from ..formats.base import ObjectSpec, Progress, SinkOptions, Source, TensorSpec
from ..index import TensorEntry
from ..storage import Location, resolve
from .output import WriteReport, check_options, check_output

DTYPE_NAMES = {name: getattr(torch, name) for name in CAST_DTYPES}


@dataclass
class ConvertReport(WriteReport):
    src_format: str = ""
    dst_format: str = ""
    dropped: list[str] = field(default_factory=list)


def _cast_to(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``--dtype``'s torch dtype (a name of :data:`DTYPE_NAMES`, or one already)."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise UsageError(f"unknown --dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_NAMES)}")
        return DTYPE_NAMES[dtype]
    return dtype


@no_gc()  # (the collector held off: bulk.py, docs/benchmarks.md)
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
    check_options(fmt, options)
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
