"""Staging an async save: a host copy of each rank's state, in buffers reused from save to save.

``save(blocking=False)`` must return while training goes on, and what it writes must be the
state at the call. :class:`Stager` copies every tensor this rank writes into a host buffer that
is allocated once and reused while the tensor's shape and dtype hold (no fresh pages per save);
what the writer gets is a :class:`HostShard`: the copy, its box in the global tensor, and
whether this rank stores it (decided at the call, while the DTensor is at hand, and kept from
save to save while the same tensor comes back: the walk over the state is then a few
microseconds a tensor). A tensor inside an object (a tuple is one object to DCP) is cloned.

On CUDA the buffers are pinned and, when the copies may run in the background (an optimizer was
given), the copies of parameters and optimizer state are issued on a side stream, so the training
stream keeps running. On the CPU the same buffers are filled by a background thread (the
Checkpointer's copy thread, :meth:`Stager.copy`), tensor by tensor. Either way ``save()``
returns before the copy is done, and forward and backward overlap it. Tensors a forward pass may
change in place (module buffers such as running statistics) are copied at the call, in order.
Nothing is ever copied to a second place on the device. Without an optimizer everything is
copied at the call.

While copies are in flight, ``snapshot.py`` guards them: every optimizer's next step finishes
them first, and an in-place write on the saving thread to a tensor not yet copied copies that
tensor first (:meth:`Stager.before_write`). A tensor whose version counter moved before its
copy was done (a write no guard saw) fails the save (:class:`SnapshotError`).
"""

from __future__ import annotations

import bisect
import copy
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..formats.dcp.records import TEMPLATE_BYTES
from . import snapshot
from .snapshot import memory_span
from ..compat import Box, dtensor_spec, local_shard_box, local_tensor, version_counter
from ..errors import CorruptCheckpointError, SnapshotError
from .step_writer import HostShard
from .writer_process import SharedBlock


_ALIGN = 64  # bytes: each buffer in the block starts at a multiple (any dtype's view, vector loads)
#: a buffer of more bytes starts at a page of the block, itself page-aligned: its record's data
#: starts at a page of the file (``write_tensor``'s ``at``), and the data file's writer sends it to
#: disk from there by O_DIRECT, without copying it into its own buffer (``LocalFile``)
_PAGE, _PAGE_FROM = 4096, TEMPLATE_BYTES


class Stager:
    """The host buffers of one Checkpointer's async saves, and the copy in flight."""

    def __init__(self, before_copy: Callable[[], None] | None = None,
                 on_fence: Callable[[float, float], None] | None = None, shared: bool = False) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.block: SharedBlock | None = None  # (``shared``) the CPU buffers' block, in shared memory for a writer process
        self._shared = shared
        self._stream: Any = None  # the side CUDA stream, made on first use
        self._copied: Any = None  # the CUDA event recorded after the side-stream copies
        self._side: list[_Item] = []  # what the side stream copies, until fenced (its versions are checked then)
        self._fenced = True  # whether the training stream waits for the side-stream copies
        self._pending: _Copy | None = None  # the CPU copy of the last stage(background=True), until run and fenced
        self._copy_error: BaseException | None = None
        self._torn: list[str] = []  # keys written before their copy was done (the save fails)
        self._before_copy = before_copy  # tests slow the background copy down here
        self._on_fence = on_fence  # on_fence(start, end): a write (an optimizer step, ...) waited for the copy
        self._plans: dict[str, _Plan] = {}  # per key: what the last save found and made for it
        self._boxes: dict[str, tuple[Any, Any, Box, bool]] = {}  # per key: ((shape, placements), mesh, box, store)
        self._layout: dict[str, tuple[torch.Size, torch.dtype]] = {}  # per key: what its view of the CPU block holds
        self.planned = 0  # tensors planned afresh by the last stage() (the others were kept: tests read it)

    def stage(self, state: dict[str, Any], rank: int, stores: Any, in_order: set[int] = frozenset(),
              background: bool = False) -> dict[str, Any]:
        """``state`` with every tensor replaced by a :class:`HostShard` of this rank's part.

        ``stores(value)`` says whether this rank writes a DTensor's box (plain tensors: rank 0);
        tensors whose memory starts at an address in ``in_order`` (module buffers: a forward may
        change them) are copied on the training stream. Addresses, not names: a state dict's keys
        are not the module's names under torch.compile or DDP. ``background``: the caller fences
        the next change of the other tensors (:meth:`fence`), so CPU copies may run in a thread.

        What a tensor needs (its local shard, box, whether this rank stores it, its buffer) is
        worked out once and kept while the same tensor object comes back under the same key with
        the same spec and a local part of the same shape, dtype and device: a DTensor's
        ``to_local()`` and chunk arithmetic are Python, and were most of what this call spent."""
        self.fence()  # a copy still in flight fills the buffers this call is about to reuse
        self._copy_error = None  # a failed copy was raised by its own save's writer; this is a new save
        self._torn = []
        out, copies = self._walk(state, rank, stores)
        self._start_copies(copies, in_order, background)
        return out

    def _walk(self, state: dict[str, Any], rank: int, stores: Any) -> tuple[dict[str, Any], list[tuple]]:
        """``state`` with every tensor replaced by its planned :class:`HostShard` (planned afresh
        where the kept plan no longer fits), and (key, local, tensor, plan) of every tensor."""
        copies: list[tuple[str, torch.Tensor, torch.Tensor, _Plan]] = []
        plans = self._plans
        seen: set[str] = set()
        fresh: list[str] = []  # keys planned by this call (their buffers are placed after the walk)
        self.planned = 0

        def shard(key: str, value: torch.Tensor) -> HostShard:
            if key in seen:  # as index.flatten: two entries may not share a key
                raise CorruptCheckpointError(f"two entries flatten to the same key {key!r}")
            seen.add(key)
            local = local_tensor(value)
            plan = plans.get(key)
            if (plan is None or plan.value() is not value or plan.spec is not dtensor_spec(value)
                    or plan.shape != local.shape or plan.dtype is not local.dtype or plan.cuda is not local.is_cuda):
                plan = plans[key] = self._plan(key, value, local, rank, stores)
                fresh.append(key)
                self.planned += 1
            copies.append((key, local, value, plan))
            return plan.shard

        try:
            with torch.no_grad():  # a parameter's local tensor may require grad; its copy must not record it
                out = {str(k): _map_tensors(v, str(k), shard) for k, v in state.items()}
        except BaseException:
            for key in fresh:  # plans without a buffer are never kept
                plans.pop(key, None)
            raise
        if len(plans) != len(seen) or len(self.buffers) != len(seen):
            for gone in (set(plans) | set(self.buffers)) - seen:  # keys the state no longer has
                plans.pop(gone, None)
                self.buffers.pop(gone, None)
                self._boxes.pop(gone, None)
                self._layout.pop(gone, None)
        if self.planned:
            self._place(plans)
        return out, copies

    def _start_copies(self, copies: list[tuple], in_order: set[int], background: bool) -> None:
        """Copy the tensors in order (module buffers; everything unless ``background``), or start
        their copies: CUDA on a side stream, CPU as a :class:`_Copy` the guards watch."""
        side: list[_Item] = []
        cpu_side: list[_Item] = []
        cuda_in_order = False
        with torch.no_grad():
            for key, local, value, plan in copies:
                buf = plan.shard.local
                if background and local.data_ptr() not in in_order:
                    # copied in the background: from an alias of the memory it has now (a later
                    # ``p.data = other`` does not move what is copied), checked by its version
                    src = local if local is not value else local.detach()
                    (side if plan.cuda else cpu_side).append(_Item(key, src, buf, value, version_counter(value)))
                else:
                    buf.copy_(local, non_blocking=plan.cuda)
                    cuda_in_order |= plan.cuda
        self._copied = None
        self._side = side
        self._fenced = not side
        if side or cuda_in_order:
            training = torch.cuda.current_stream()
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            # the copies see every kernel issued before save(), the in-order copies included
            self._stream.wait_stream(training)
            with torch.cuda.stream(self._stream), torch.no_grad():
                for item in side:
                    item.dst.copy_(item.src, non_blocking=True)
                    item.src.record_stream(self._stream)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
        if cpu_side:
            self._pending = _Copy(cpu_side, self._before_copy, self)
        if (side or cpu_side) and not snapshot.watch(self):
            self.fence()  # another dispatch mode is active here: nothing may guard the copies, so they end now

    def _place(self, plans: dict[str, _Plan]) -> None:
        """Give every plan a host buffer. CPU tensors' buffers are views of one block of host
        memory, allocated again only when a tensor comes that has no place in it (a new key, a
        new shape or dtype): one allocation of the state's size, mapped apart from the heap where
        training's short-lived tensors come and go (buffers allocated one by one from that heap
        can keep it from shrinking when training frees what lies around them). CUDA tensors'
        buffers are pinned, one per tensor."""
        layout = self._layout
        if any(not p.cuda and layout.get(k) != (p.shape, p.dtype) for k, p in plans.items()):
            offsets, total, paged = {}, 0, False
            for key, plan in plans.items():
                if not plan.cuda:
                    nbytes = plan.shape.numel() * plan.dtype.itemsize
                    if nbytes > _PAGE_FROM:
                        total, paged = -(-total // _PAGE) * _PAGE, True
                    offsets[key] = total
                    total += -(-nbytes // _ALIGN) * _ALIGN
            if self._shared:
                self.block = SharedBlock(total)  # (a mapping: page-aligned)
                block = self.block.tensor
            else:
                block = torch.empty(total + _PAGE * paged, dtype=torch.uint8)
                block = block[(-block.data_ptr()) % _PAGE * paged:][:total]
            self._layout = {}
            for key, at in offsets.items():
                plan = plans[key]
                nbytes = plan.shape.numel() * plan.dtype.itemsize
                self.buffers[key] = block[at:at + nbytes].view(plan.dtype).view(plan.shape)
                self._layout[key] = (plan.shape, plan.dtype)
        for key, plan in plans.items():
            if plan.cuda:
                plan.shard.local = self._buffer(key, plan.shape, plan.dtype)
            else:
                plan.shard.local = self.buffers[key]

    def copy(self) -> None:
        """Run the pending CPU copy in the calling thread (the Checkpointer's copy thread), tensor
        by tensor; tensors another thread took first (a fence, a guarded write) are waited for."""
        pending = self._pending
        if pending is not None:
            pending.run()

    def in_flight(self) -> bool:
        """Whether a copy is in flight that a write could still tear (:class:`snapshot.InFlight`)."""
        cpu = self._pending
        return (cpu is not None and not cpu.done.is_set()) or not self._fenced

    def before_write(self, spans: list[tuple[int, int]] | None) -> None:
        """Something is about to write the memory ``spans`` (None: any): the copies of the tensors
        there are finished first (CPU: in the calling thread, or waited for), or (CUDA) the current
        stream is made to wait for the side-stream copies. Called by the write guards."""
        cpu = self._pending
        start = time.perf_counter()
        waited = False
        if cpu is not None and not cpu.done.is_set():
            waited = True
            cpu.finish(spans)
        if not self._fenced:
            waited = True
            self._fenced = True
            self._torn += _moved(self._side)  # launched before this fence: it may have raced the copy
            self._side = []
            torch.cuda.current_stream().wait_event(self._copied)
        if not self.in_flight():
            snapshot.forget(self)
        if waited and self._on_fence is not None:
            self._on_fence(start, time.perf_counter())

    def _plan(self, key: str, value: torch.Tensor, local: torch.Tensor, rank: int, stores: Any) -> _Plan:
        """What a tensor needs: its box in the global tensor, whether this rank stores it
        (DTensors: ``stores``; plain tensors: rank 0) and the host buffer of its local shard.
        A DTensor's box and store decision depend only on its global shape, placements and mesh,
        so they are kept by key while those hold, even across tensor objects (a state dict
        taken afresh has new ones)."""
        from torch.distributed.tensor import DTensor

        spec = None
        if isinstance(value, DTensor):
            spec = dtensor_spec(value)
            sig = (tuple(value.shape), tuple(value.placements))
            kept = self._boxes.get(key)
            if kept is not None and kept[0] == sig and kept[1] is value.device_mesh:
                box, store = kept[2], kept[3]
            else:
                _, box = local_shard_box(value)
                store = stores(value)
                self._boxes[key] = (sig, value.device_mesh, box, store)
        else:
            _, box = local_shard_box(value)
            store = rank == 0
        return _Plan(weakref.ref(value), spec, local,
                     HostShard(None, box, tuple(value.shape), store, plain=not isinstance(value, DTensor)))  # its buffer: _place

    def _buffer(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer of its own (CUDA tensors), reused while its shape and dtype hold."""
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype or not buf.is_pinned():
            buf = torch.empty(shape, dtype=dtype, pin_memory=True)
            self.buffers[key] = buf
            self._layout.pop(key, None)
        return buf

    @property
    def copying(self) -> bool:
        """Whether a background copy is pending or running (the next optimizer step, a load, the
        next save or ``wait`` waits for it)."""
        return self._pending is not None and not self._pending.done.is_set()

    def fence(self) -> None:
        """Order what comes next after the copies in flight (ckpttool's own calls on the training
        thread: a save, a load, ``wait``): on CUDA the training stream waits for the side stream;
        on the CPU the rest of the copy runs here (or is waited for). Every optimizer step does the
        same through ``snapshot.py``'s hook."""
        self.before_write(None)
        if self._pending is not None and self._pending.done.is_set():
            self._copy_error = self._copy_error or self._pending.error
            self._torn += self._pending.torn
            self._pending = None
        snapshot.release()

    def wait(self, run: bool = True) -> None:
        """Block until the copies are in host memory (the background writer, before it reads);
        raises what a background CPU copy raised, and :class:`SnapshotError` when a tensor was
        written before its copy was done. ``run``: run the CPU copy here if no thread has started
        it yet (else only wait for the thread that runs it)."""
        pending = self._pending  # (read before _torn: a fence moves the copy's findings there, then drops it)
        torn = []
        if pending is not None:
            if run:
                pending.run()
            pending.done.wait()
            if pending.error is not None:
                raise pending.error
            torn += pending.torn
        torn += self._torn
        if self._copy_error is not None:
            raise self._copy_error
        if self._copied is not None:
            self._copied.synchronize()
            if not self._fenced:  # no fence came: a version that moved by now is a write no guard saw
                torn += _moved(self._side)
        torn = list(dict.fromkeys(torn))  # (a fence moved the copy's findings into _torn: once each)
        if torn:
            raise SnapshotError(
                f"{len(torn)} tensor(s) were changed in place after save() returned and before their copy was done, "
                f"first {torn[0]!r}; the step was not committed",
                hint="a write no guard sees (another thread, .numpy(), a raw pointer, torch.compile'd code): "
                     "call ckpt.wait() before such writes, or make them on the thread that calls save()")


class _Item:
    """One tensor of a background copy: what is copied where, and the tensor whose version
    counter tells whether it was written since the call (a DTensor's own: its in-place ops do
    not move its local tensor's)."""

    __slots__ = ("key", "src", "dst", "owner", "version", "local_version", "state")

    def __init__(self, key: str, src: torch.Tensor, dst: torch.Tensor, owner: torch.Tensor, version: int):
        self.key = key
        self.src = src
        self.dst = dst
        self.owner = owner
        self.version = version
        self.local_version = version_counter(src)  # (a DTensor's to_local() written in place moves only this one)
        self.state = _PENDING


_PENDING, _COPYING, _DONE = 0, 1, 2


def _moved(items: list[_Item]) -> list[str]:
    return [item.key for item in items
            if version_counter(item.owner) != item.version or version_counter(item.src) != item.local_version]


class _Copy:
    """A background CPU copy: its tensors are taken one at a time by whichever thread comes first
    (the copy thread in order; the training thread for what it is about to write, or for all of
    it at a fence), and each is checked against its version once copied."""

    def __init__(self, items: list[_Item], before_run: Callable[[], None] | None, owner: Any):
        self.items = items
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.torn: list[str] = []
        self._left = len(items)
        self._cond = threading.Condition()
        self._before_run = before_run  # tests slow the copy thread down here
        self._owner = owner  # the Stager, forgotten by the guards once every tensor is copied
        self._spans: list[tuple[int, int] | None] = [None] * len(items)  # each tensor's memory, found on demand
        self._starts: list[int] | None = None  # (sorted by start, for the guard's lookups)
        self._order: list[int] = []
        self._widest = 0

    def run(self) -> None:
        """Copy every tensor not taken yet, in order, then wait for those others took."""
        if self._before_run is not None and not self.done.is_set():
            try:
                self._before_run()
            except BaseException as exc:  # noqa: BLE001 - raised by the writer's wait()
                self.error = self.error or exc
        items = self.items
        self._take(range(len(items)), items)

    def finish(self, spans: list[tuple[int, int]] | None) -> None:
        """Copy (or wait for) the tensors whose memory meets ``spans`` (None: all of them) in this
        thread. A copy made for a write the guard saw coming is not checked against the tensor's
        version: the write has not run yet, and some ops move the counter before they run
        (``torch.library`` custom ops with ``mutates_args``). Runs on the saving thread only (the
        guards'); the copy thread may finish meanwhile and let go of ``self.items``: this call
        keeps its own reference."""
        items = self.items
        if spans is None:
            self._take(range(len(items)), items)
            return
        if not items:
            return  # every tensor is copied
        if self._starts is None:
            order = sorted(range(len(items)), key=lambda i: self._span(i, items)[0])
            self._order = order
            self._starts = [self._span(i, items)[0] for i in order]
        hit = set()
        for lo, hi in spans:
            k = bisect.bisect_left(self._starts, hi)  # items that start before the write ends
            while k > 0:
                k -= 1
                i = self._order[k]
                start, end = self._span(i, items)
                if end > lo:
                    hit.add(i)
                elif start + self._widest <= lo:
                    break  # (no item is wider than the widest: none that starts earlier reaches lo)
        if hit:
            self._take(sorted(hit), items, check=False)

    def _span(self, i: int, items: list[_Item]) -> tuple[int, int]:
        span = self._spans[i]
        if span is None:
            span = self._spans[i] = memory_span(items[i].src) or (0, 0)
            self._widest = max(self._widest, span[1] - span[0])
        return span

    def _take(self, which: Any, items: list[_Item], check: bool = True) -> None:
        cond = self._cond
        waiting = []
        for i in which:
            item = items[i]
            with cond:
                if item.state != _PENDING:
                    if item.state == _COPYING:
                        waiting.append(item)
                    continue
                item.state = _COPYING
            try:
                if self.error is None:
                    with torch.no_grad(), snapshot.own_copy():
                        item.dst.copy_(item.src)
                    if check and _moved([item]):
                        self.torn.append(item.key)
            except BaseException as exc:  # noqa: BLE001 - raised by the writer's wait()
                self.error = self.error or exc
            finally:
                with cond:
                    item.state = _DONE
                    self._left -= 1
                    last = self._left == 0
                    cond.notify_all()
                if last:
                    self.items = []  # nothing of the state is kept alive by a finished copy
                    self.done.set()
                    snapshot.forget(self._owner)
        with cond:
            while any(item.state != _DONE for item in waiting):
                cond.wait()


class _Plan:
    """What :meth:`Stager.stage` made for one key, and what it was made for: the tensor (weakly: a
    replaced optimizer state must not stay alive here), a DTensor's spec (global shape,
    placements, mesh; by identity), the shape, dtype and device kind of its local part; and the
    :class:`HostShard` the writer gets (the buffer, the box, whether this rank stores it). It
    holds while all of these are the same (the copy reads the live local tensor at every save,
    wherever its memory is now)."""

    __slots__ = ("value", "spec", "shape", "dtype", "cuda", "shard")

    def __init__(self, value: weakref.ref, spec: Any, local: torch.Tensor, shard: HostShard):
        self.value = value
        self.spec = spec
        self.shape = local.shape
        self.dtype = local.dtype
        self.cuda = local.is_cuda
        self.shard = shard


def _map_tensors(value: Any, key: str, fn: Callable[[str, torch.Tensor], Any]) -> Any:
    """``value`` with every tensor replaced by ``fn(its flat key, it)``, walked as
    :func:`ckpttool.index.iter_leaves` walks a state dict (DCP's rule: mappings are traversed, a
    list only if something inside it must be), so the keys are the writer's. Mappings come back
    as dicts with ``str`` keys, as ``unflatten(*flatten(value))`` would give them; one pass, no
    flat copy of the state (this runs on the training thread)."""
    if isinstance(value, torch.Tensor):
        return fn(key, value)
    if isinstance(value, Mapping):
        return {str(k): _map_tensors(v, f"{key}.{k}", fn) for k, v in value.items()}
    if isinstance(value, list) and _traversed(value):
        return [_map_tensors(v, f"{key}.{i}", fn) for i, v in enumerate(value)]
    return frozen(value)


#: values that cannot change after the call: kept as they are (anything else is copied at the call)
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, range)


def frozen(value: Any) -> Any:
    """A value stored as one object, as it is at the call: the writer pickles it later and the
    caller may change it meanwhile (a list appended to, a scheduler's ``base_lrs``, a tensor inside
    a tuple), so anything mutable is copied now (tensors cloned, other objects deep-copied). The
    value itself when it holds only values that cannot change (``betas``, a list of numbers)."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [frozen(v) for v in value]
    if isinstance(value, tuple):
        items = [frozen(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if type(value) is dict:
        return {k: frozen(v) for k, v in value.items()}
    return copy.deepcopy(value)


def _traversed(value: list) -> bool:
    """Whether DCP's traversal enters a list: it holds a tensor, a mapping or a list it enters."""
    return any(isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and _traversed(v)) for v in value)
