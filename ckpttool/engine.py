"""The streaming engine: Source -> transforms -> Sink, tensor by tensor under a memory budget.

Transforms are *select* (``only``: keep one top-level key and drop its prefix) and *cast*
(``dtype``: floating-point tensors only), planned by :func:`plan_entries`; :func:`run` streams
the plan. Memory: a sink pulls each tensor in slabs of at most the budget, so no more than about
one slab (plus its cast) is in memory at once, whatever the size. The offline commands
(``commands.py``: convert, reshard) and verify are built on it.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import dist
from .choices import DEFAULT_BUDGET
from .errors import StorageError, UsageError
from .formats.base import ObjectSpec, Progress, ReadAhead, ReadFn, Sink, SlabBuffers, Source, TensorSpec, stream_slabs
from .index import TensorEntry, dtype_size, strip_prefix
from .layout import Box
from .storage import describe_os_error


def _castable(entry: TensorEntry) -> bool:
    """``--dtype`` casts floating-point tensors; integers and 0-d counters (AdamW's ``step``) keep theirs."""
    return entry.dtype.is_floating_point and len(entry.shape) > 0


@dataclass
class Plan:
    """What a run of the engine will write: output specs and where each reads from."""

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
    selected = strip_prefix(index.paths, only) if only is not None else {k: (k, index.path(k)) for k in index}
    entries: list[TensorSpec | ObjectSpec] = []
    source_key: dict[str, str] = {}
    for key, (out_key, path) in selected.items():
        entry = index[key]
        source_key[out_key] = key
        if isinstance(entry, TensorEntry):
            entry.check_coverage(source.location.url)
            out_dtype = dtype if (dtype is not None and _castable(entry)) else entry.dtype
            entries.append(TensorSpec(out_key, tuple(path), entry.shape, out_dtype))
        else:
            entries.append(ObjectSpec(out_key, tuple(path), source.read_object(key)))
    if only is not None and not source_key:
        tops = sorted({str(index.path(k)[0]) for k in index})
        raise UsageError(f"no entries under the top-level key {only!r}", hint=f"top-level keys are: {', '.join(tops)}")
    return Plan(entries, source_key)


def run(source: Source, sink: Sink, plan: Plan, budget: int = DEFAULT_BUDGET, progress: Progress | None = None,
        read_ahead: bool = True, parallel: bool = False) -> None:
    """Stream every planned entry from ``source`` into ``sink`` and commit; on any failure (or
    Ctrl-C) remove the partial output and re-raise. With ``read_ahead`` the next slab (of this
    tensor or the next) is read while the current one is written: two slabs of half the budget.

    With ``parallel``, every process of the torch.distributed group runs this together and each
    writes its share of the output's files (:mod:`ckpttool.parallel`): the same bytes as one
    process writes, committed once every worker has finished, or nothing when any one fails."""
    workers = dist.world_size() if parallel else 1
    if workers > 1:
        if not sink.splittable:
            raise UsageError(f"{workers} workers cannot share a single-file {sink.format} output",
                             hint="split the output (--max-shard-size), write DCP, or run one worker")
        sink.share = (dist.rank(), workers)
    tensors = sink.order(plan.tensors)
    index = source.index()
    shared = None
    if workers > 1:
        from .parallel import SharedProgress

        shared = progress = SharedProgress(progress, sum(s.nbytes for s in tensors), sink.location.url)
    # two sets of buffers (source dtype, cast), reused from slab to slab: no fresh pages per slab;
    # one set is read into in the background while the other is written
    scratch = SlabBuffers(4)
    pool = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-read") if read_ahead else None
    specs = {spec.key: spec for spec in tensors}

    def slab_budget(spec: TensorSpec) -> int:
        # a slab held at the source dtype, plus its cast when there is one, twice when reading
        # ahead: all of it under the budget
        src_dtype = index[plan.source_key[spec.key]].dtype
        out_size = dtype_size(spec.dtype)
        held = (out_size if src_dtype == spec.dtype else dtype_size(src_dtype) + out_size) * (2 if pool else 1)
        return max(1, budget * out_size // held)

    def read_into(key: str, box: Box, which: int) -> torch.Tensor:
        spec = specs[key]
        src_key = plan.source_key[key]
        src_dtype = index[src_key].dtype
        t = source.read_tensor(src_key, box, out=scratch.view(box[1], src_dtype, 2 * which))
        if t.dtype == spec.dtype:
            return t
        return scratch.view(box[1], spec.dtype, 2 * which + 1).copy_(t)

    ahead = ReadAhead([], read_into, None)
    done = total = 0

    def reader_for(spec: TensorSpec) -> tuple[ReadFn, int]:
        return (lambda box: ahead.read(spec.key, box)), slab_budget(spec)

    def advance(nbytes: int, key: str) -> None:
        nonlocal done
        dist.pause_point("offline-chunk")
        done += nbytes
        if progress:
            progress(done, total, key)

    def write() -> None:
        nonlocal ahead, total
        if workers > 1:
            _start_shared(sink, plan)
        else:
            sink.start(plan.entries)
        # the slabs this process will write, in order (after start: a sink plans its files there)
        schedule = [(spec.key, slab) for spec, box in sink.read_order(tensors) for slab in stream_slabs(spec, slab_budget(spec), box)]
        total = sum(math.prod(box[1]) * dtype_size(specs[key].dtype) for key, box in schedule)
        ahead = ReadAhead(schedule if pool else [], read_into, pool)
        source.check_in_parts()
        sink.write(tensors, reader_for, advance)
        ahead.stop()
        source.settle()  # every record read is checked before the output is committed
        sink.finish_files()

    try:
        try:
            write()
        except OSError as exc:  # a write the storage refused (disk full): one line naming the output
            raise StorageError(describe_os_error(exc, "write"), where=sink.location.url) from None
        finally:
            ahead.stop()
            if pool is not None:
                pool.shutdown(wait=True)
        if workers > 1:
            dist.agree(None)
            shared.close(finished=True)
            pieces = dist.gather(sink.pieces())  # worker 0 alone writes the file that describes them
            if pieces is not None:
                sink.merge(pieces)
                dist.agree_on(sink.finalize)
            else:
                dist.agree_on(lambda: None)
        else:
            sink.finalize()
    except BaseException as exc:
        if shared is not None:
            shared.close(finished=False)
        agreed = workers == 1 or getattr(exc, "_agreed", False)
        if not agreed and isinstance(exc, Exception):  # an interrupt (SIGTERM, Ctrl-C) stops without a word
            try:
                exc, agreed = dist.agreed_error(exc), True
            except Exception:  # noqa: BLE001 - a worker is gone (killed): no agreement to be had
                pass
        # worker 0 removes the shared staging directory after an agreed failure; when the workers
        # could not agree, every one removes it (some may not be there to do it)
        sink.abort(exc, discard=not agreed or dist.rank() == 0)
        if isinstance(exc, OSError):  # a commit the storage refused
            raise StorageError(describe_os_error(exc, "write"), where=sink.location.url) from None
        raise exc from None


def _start_shared(sink: Sink, plan: Plan) -> None:
    """Every worker writes into one staging directory: worker 0's (or the one ``--nproc`` chose),
    prepared by worker 0 once every worker has checked the output."""
    from .parallel import staging_name

    if sink.tmp.url != sink.location.url:
        sink.tmp = sink.location.sibling(dist.broadcast(staging_name() or sink.tmp.name))
    dist.agree(None)  # every worker has checked the output before worker 0 prepares it
    dist.agree_on(lambda: sink.policy.prepare(sink.tmp, sink.location) if dist.rank() == 0 else None)
    dist.agree_on(lambda: sink.begin(plan.entries))
