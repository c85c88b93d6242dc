"""The streaming engine: Source -> transforms -> Sink, tensor by tensor under a memory budget.

Transforms are *select* (``only``: keep one top-level key and drop its prefix) and *cast*
(``dtype``: floating-point tensors only), planned by :func:`plan_entries`; :func:`run` streams
the plan. Memory: a sink pulls each tensor in slabs of at most the budget, so no more than about
one slab (plus its cast) is in memory at once, whatever the size. The offline commands
(``offline/``: convert, reshard, verify) are built on it.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import rendezvous
from .buffers import SlabBuffers
from .bulk import no_gc
from .checksums import HASH_BLOCK
from .choices import DEFAULT_BUDGET
from .errors import StorageError, UsageError
from .formats.base import ObjectSpec, Progress, ReadFn, Share, Sink, Source, TensorSpec, stream_slabs
from .index import TensorEntry, dtype_size, strip_prefix
from .layout import Box, relative, whole
from .storage import describe_os_error

#: slabs smaller than this are read when the sink asks for them, not ahead in the thread (ReadAhead)
AHEAD_BYTES = 1 << 20

#: a tensor of at most this many bytes is *small*: a run of the slabs that read small tensors whole,
#: one after another in the sink's order, is read together, up to BATCH_BYTES at a time, with one
#: ``Source.read_tensors`` (a DCP file's back-to-back records in one read, each checked from it):
#: read one by one, a small record's lookup, parse and checks cost many times the CPU its bytes do
#: (docs/benchmarks.md, small records). A small tensor that a sink asks for in parts (a reshard's
#: boxes of it, one per target rank, one after the other) is read so too, whole, and its parts
#: copied from it: a part of a record this small reads and hashes its whole manifest block anyway. Parts only where the sink
#: asks for all of a tensor's parts one after the other (the DCP sink; not the torch-ranks sink,
#: which reads rank by rank) and in one process: there the parts together are the whole tensor, so
#: no byte is read that was not read before; a worker of several writes only its target ranks'
#: parts, and reads only the records they need.
WHOLE_PART_BYTES = HASH_BLOCK
#: the most bytes of small tensors read together (and at most an eighth of the budget), held beside
#: the budget's slabs until the sink has asked for each of them
BATCH_BYTES = 1 << 20


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
    # a run reads every record it selects, mostly in file order: a format may fetch neighbours together.
    # (All records, also with --only: naming the selected ones would walk every chunk of a large step's
    # rule-made index. A top-level key's records lie together in a file, so what spans fetch past
    # the selection is about one span per file.)
    source.will_read(None)
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
    workers = rendezvous.world_size() if parallel else 1
    if workers > 1 and not sink.splittable:
        raise UsageError(f"{workers} workers cannot share a single-file {sink.format} output",
                         hint="split the output (--max-shard-size), write DCP, or run one worker")
    streaming = _Streaming(source, sink, plan, budget, progress, read_ahead, workers)
    try:
        try:
            streaming.write()
        except OSError as exc:  # a write the storage refused (disk full): one line naming the output
            raise StorageError(describe_os_error(exc, "write"), where=sink.location.url) from None
        finally:
            streaming.stop_reading()
        streaming.commit()
    except BaseException as exc:
        raise streaming.abort(exc) from None


class _Streaming:
    """One run of :func:`run`: the slabs' budget, the reads (ahead of the writes, into reused
    buffers, cast on the way), progress, and the workers' commit or abort."""

    def __init__(self, source: Source, sink: Sink, plan: Plan, budget: int, progress: Progress | None, read_ahead: bool,
                 workers: int):
        self.source, self.sink, self.plan, self.budget, self.workers = source, sink, plan, budget, workers
        if workers > 1:
            sink.share = Share(rendezvous.rank(), workers)
        self.tensors = sink.order(plan.tensors)
        self.index = source.index()
        self.specs = {spec.key: spec for spec in self.tensors}
        self.shared = None
        if workers > 1:
            from .parallel import SharedProgress

            self.shared = progress = SharedProgress(progress, sum(s.nbytes for s in self.tensors), sink.location.url)
        self.progress = progress
        # two sets of buffers (source dtype, cast), reused from slab to slab: no fresh pages per slab;
        # one set is read into in the background while the other is written
        self.scratch = SlabBuffers(4)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-read") if read_ahead else None
        self.ahead = ReadAhead([], self._read_into, None)
        self.done = self.total = 0
        self.pausing = rendezvous.pausing()  # (crash tests set a pause point before the command starts)
        self._batch = SlabBuffers(1)  # small tensors read together (BATCH_BYTES)
        self._held: dict[str, torch.Tensor] = {}  # source key -> its tensor, in the batch buffer
        # source key of a small tensor -> (its run: (source key, bytes, shape, dtype) of each, its place in it)
        self._runs: dict[str, tuple[list[tuple[str, int, tuple[int, ...], torch.dtype]], int]] = {}
        self._batch_bytes = min(BATCH_BYTES, budget // 8)
        self._budgets: dict[str, int] = {}  # output key -> its slabs' budget (worked out once a tensor)

    def _slab_budget(self, spec: TensorSpec) -> int:
        """A slab held at the source dtype, plus its cast when there is one, twice when reading
        ahead: all of it under the budget."""
        budget = self._budgets.get(spec.key)
        if budget is None:
            budget = self._budgets[spec.key] = self._budget_of(spec)
        return budget

    def _budget_of(self, spec: TensorSpec) -> int:
        src_dtype = self.index[self.plan.source_key[spec.key]].dtype
        out_size = dtype_size(spec.dtype)
        held = (out_size if src_dtype == spec.dtype else dtype_size(src_dtype) + out_size) * (2 if self.pool else 1)
        return max(1, self.budget * out_size // held)

    def _read_into(self, key: str, box: Box, which: int) -> torch.Tensor:
        spec = self.specs[key]
        src_key = self.plan.source_key[key]
        src_dtype = self.index[src_key].dtype
        if src_key in self._runs:
            t = self._small_part(src_key, spec.shape, src_dtype, box, which)
        else:
            t = self.source.read_tensor(src_key, box, out=self.scratch.view(box[1], src_dtype, 2 * which))
        if t.dtype == spec.dtype:
            return t
        return self.scratch.view(box[1], spec.dtype, 2 * which + 1).copy_(t)

    def _small_part(self, src_key: str, shape: tuple[int, ...], dtype: torch.dtype, box: Box, which: int) -> torch.Tensor:
        """``box`` of a small tensor (:data:`WHOLE_PART_BYTES`): from the batch that holds it,
        read (and checked) with the small tensors after it in its run when it is not held (slabs
        under AHEAD_BYTES are read in the caller's thread, one at a time: never beside a read ahead)."""
        held = self._held.get(src_key)
        if held is None:
            self._held = {}  # (a read that fails holds nothing)
            run, at = self._runs[src_key]
            taken, size = [], 0
            for k, nbytes, k_shape, k_dtype in run[at:]:
                if taken and size + nbytes > self._batch_bytes:
                    break
                taken.append((k, size, nbytes, k_shape, k_dtype))
                size += -(-nbytes // 64) * 64
            buf = self._batch.view((size,), torch.uint8, 0)
            items = [(k, buf[o:o + n].view(k_dtype).view(k_shape)) for k, o, n, k_shape, k_dtype in taken]
            self.source.read_tensors(items)
            self._held = dict(items)
            held = self._held[src_key]
        if tuple(box[1]) == tuple(shape):
            return held
        part = held[relative(box, whole(shape))]  # (a view of the batch, as the whole tensor above is)
        return part if part.is_contiguous() else self.scratch.view(box[1], dtype, 2 * which).copy_(part)

    def _reader_for(self, spec: TensorSpec) -> tuple[ReadFn, int]:
        return (lambda box: self.ahead.read(spec.key, box)), self._slab_budget(spec)

    def _advance(self, nbytes: int, key: str) -> None:
        if self.pausing:
            rendezvous.pause_point("offline-chunk")
        self.done += nbytes
        if self.progress:
            self.progress(self.done, self.total, key)

    def write(self) -> None:
        sink, source = self.sink, self.source
        if self.workers > 1:
            _start_shared(sink, self.plan)
        else:
            sink.start(self.plan.entries)
        # the slabs this process will write, in order (after start: a sink plans its files there)
        schedule = [(spec.key, slab) for spec, box in sink.read_order(self.tensors)
                    for slab in stream_slabs(spec, self._slab_budget(spec), box)]
        sizes = [math.prod(box[1]) * dtype_size(self.specs[key].dtype) for key, box in schedule]
        self._runs = self._small_runs(schedule)
        self.total = sum(sizes)
        self.ahead = ReadAhead(schedule if self.pool else [], self._read_into, self.pool, sizes, AHEAD_BYTES)
        # every record read is checked before the output is committed; the cyclic collector held off:
        # a record's reads and writes make dicts, tuples and lists and no cycle, and collecting them
        # as they came took 18% of the CPU of a convert of 5,000 small records (docs/benchmarks.md)
        with source.checked_in_parts(), no_gc():
            sink.write(self.tensors, self._reader_for, self._advance)
            self.ahead.stop()
        sink.finish_files()

    def _small_runs(self, schedule: list[tuple[str, Box]]) -> dict[str, tuple[list[tuple[str, int, tuple[int, ...], torch.dtype]], int]]:
        """The small tensors (source keys) read whole, in runs of those the sink asks for one after
        another in ``schedule``: each key with its run and its place in it. Small: at most
        :data:`WHOLE_PART_BYTES` and a slab; read whole where its slab is, or (one process) where
        its slabs are all its parts, asked for one after the other."""
        together = _asked_together(schedule) if self.workers == 1 else set()
        runs: dict[str, tuple[list[tuple[str, int, tuple[int, ...], torch.dtype]], int]] = {}
        run: list[tuple[str, int, tuple[int, ...], torch.dtype]] = []  # (source key, bytes, shape, dtype)
        for key, box in schedule:
            spec = self.specs[key]
            src_key = self.plan.source_key[key]
            entry = self.index[src_key]
            nbytes = math.prod(spec.shape) * dtype_size(entry.dtype)
            small = (nbytes <= WHOLE_PART_BYTES and nbytes <= self._slab_budget(spec)
                     and (tuple(box[1]) == tuple(spec.shape) or key in together))
            if not small:
                run = []
            elif src_key not in runs:
                run.append((src_key, nbytes, entry.shape, entry.dtype))
                runs[src_key] = (run, len(run) - 1)
            elif runs[src_key][0] is not run:  # (asked for again, later: read again, on its own)
                runs[src_key] = ([(src_key, nbytes, entry.shape, entry.dtype)], 0)
        return runs

    def stop_reading(self) -> None:
        self.ahead.stop()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.ahead = None  # (it holds self._read_into: freed by reference counting, not the collector)

    def commit(self) -> None:
        """One process: finalize. Workers: agree that every one finished, then worker 0 merges the
        pieces and finalizes, agreed."""
        sink = self.sink
        if self.workers == 1:
            sink.finalize()
            return
        rendezvous.agree(None)
        self.shared.close(finished=True)
        if sink.merge(rendezvous.gather):  # worker 0 alone writes the file that describes the pieces
            rendezvous.agree_on(sink.finalize)
        else:
            rendezvous.agree_on(lambda: None)

    def abort(self, exc: BaseException) -> BaseException:
        """Remove the partial output after ``exc``; returns what to raise (every worker the same
        error where they can agree on one)."""
        if self.shared is not None:
            self.shared.close(finished=False)
        agreed = self.workers == 1 or getattr(exc, "_agreed", False)
        if not agreed and isinstance(exc, Exception):  # an interrupt (SIGTERM, Ctrl-C) stops without a word
            try:
                exc, agreed = rendezvous.agreed_error(exc), True
            except Exception:  # noqa: BLE001 - a worker is gone (killed): no agreement to be had
                pass
        # worker 0 removes the shared staging directory after an agreed failure; when the workers
        # could not agree, every one removes it (some may not be there to do it)
        self.sink.abort(exc, discard=not agreed or rendezvous.rank() == 0)
        if isinstance(exc, OSError):  # a commit the storage refused
            return StorageError(describe_os_error(exc, "write"), where=self.sink.location.url)
        return exc


def _asked_together(schedule: list[tuple[str, Box]]) -> set[str]:
    """The keys whose slabs come one after the other in ``schedule`` (one run each)."""
    runs: dict[str, int] = {}
    last = None
    for key, _box in schedule:
        if key != last:
            runs[key] = runs.get(key, 0) + 1
            last = key
    return {key for key, n in runs.items() if n == 1}


def _start_shared(sink: Sink, plan: Plan) -> None:
    """Every worker writes into one staging directory: worker 0's (or the one ``--nproc`` chose),
    prepared by worker 0 once every worker has checked the output."""
    from .parallel import staging_name

    if sink.tmp.url != sink.location.url:
        sink.tmp = sink.location.sibling(rendezvous.broadcast(staging_name() or sink.tmp.name))
    rendezvous.agree(None)  # every worker has checked the output before worker 0 prepares it
    rendezvous.agree_on(lambda: sink.policy.prepare(sink.tmp, sink.location) if rendezvous.rank() == 0 else None)
    rendezvous.agree_on(lambda: sink.start(plan.entries, prepare=False))


class ReadAhead:
    """Reads the slabs a sink will ask for, in the order it will ask (``schedule``), one ahead:
    slab k+1 is read (and checked) in a background thread while slab k is written (and hashed),
    in two sets of buffers, so a convert costs about the larger of reading and writing rather than
    their sum. A request that is not the next one scheduled is read directly (and ends the
    read-ahead): the output never depends on the schedule being right.

    A slab of fewer than ``min_bytes`` (``sizes``: each slab's bytes) is read in the caller's
    thread when its turn comes, with no read in flight (a source is not read by two threads at
    once: its readers' held spans and its checks' buffers are shared): handing a small read to the
    thread and back costs more CPU than it hides (docs/benchmarks.md: the mix of tensor sizes)."""

    def __init__(self, schedule: list[tuple[str, Box]], read_into: Callable[[str, Box, int], torch.Tensor], pool: Any,
                 sizes: list[int] | None = None, min_bytes: int = 0):
        self._schedule = schedule  # (key, box) of every slab, in the sink's order
        self._ahead = [n >= min_bytes for n in sizes] if sizes is not None else [True] * len(schedule)
        self._read_into = read_into  # (key, box, buffer set 0 or 1) -> the slab, in that set's buffers
        self._pool = pool
        self._next = 0  # the index of the next slab the sink will ask for
        self._futures: dict[int, Any] = {}
        self._on = pool is not None and bool(schedule)

    def _submit(self, i: int) -> None:
        if i < len(self._schedule) and i not in self._futures and self._ahead[i]:
            key, box = self._schedule[i]
            self._futures[i] = self._pool.submit(self._read_into, key, box, i % 2)

    def read(self, key: str, box: Box) -> torch.Tensor:
        i = self._next
        if self._on and i < len(self._schedule) and self._schedule[i] == (key, box):
            self._next += 1
            if not self._ahead[i]:
                # read here, and only then start the next one: the source is read by one thread at a time
                slab = self._read_into(key, box, i % 2)
                self._submit(i + 1)
                return slab
            self._submit(i)  # (the first one)
            # slab i-1 has been written (the sink asks in order), so its buffers take slab i+1
            self._submit(i + 1)
            return self._futures.pop(i).result()
        self.stop()
        return self._read_into(key, box, 0)

    def stop(self) -> None:
        """Wait for every read in flight (their buffers may be reused or freed next)."""
        self._on = False
        for future in self._futures.values():
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a read nobody asked for: its error does not matter (Ctrl-C is)
                pass
        self._futures.clear()
