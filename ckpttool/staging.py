"""Staging an async save: a host copy of each rank's state, in buffers reused from save to save.

``save(blocking=False)`` must return while training goes on, and what it writes must be the
state at the call. :class:`Stager` copies every tensor this rank writes into a host buffer that
is allocated once and reused while the tensor's shape and dtype hold (no fresh pages per save);
what the writer gets is a :class:`HostShard`: the copy, its box in the global tensor, and
whether this rank stores it (decided at the call, while the DTensor is at hand).

On CUDA the buffers are pinned and the copies of parameters and optimizer state are issued on a
side stream, so the training stream keeps running; the snapshot is fenced before the optimizer's
next step may change them (:meth:`Stager.fence`, run by an optimizer pre-step hook, makes the
training stream wait for the copies; forward and backward overlap them). Tensors a forward pass
may change in place (module buffers such as running statistics) are copied on the training
stream itself, in order. Nothing is ever copied to a second place on the device. On the CPU,
when a fence exists (an optimizer was given), the same buffers are filled by a background thread
that the fence joins, so ``save()`` returns before the copy is done and forward and backward
overlap it; without an optimizer (nothing to fence on) they are filled at the call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .compat import Box, local_shard_box
from .formats.dcp import HostShard
from .index import flatten, unflatten


class Stager:
    """The host buffers of one Checkpointer's async saves, and the copy in flight."""

    def __init__(self, before_copy: Callable[[], None] | None = None) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._stream: Any = None  # the side CUDA stream, made on first use
        self._copied: Any = None  # the CUDA event recorded after the side-stream copies
        self._copier: threading.Thread | None = None  # the background CPU copy in flight
        self._copy_error: BaseException | None = None
        self._before_copy = before_copy  # tests slow the background copy down here
        self._boxes: dict[str, tuple[Any, Any, Box, bool]] = {}  # per key: ((shape, placements), mesh, box, store)

    def stage(self, state: dict[str, Any], rank: int, stores: Any, in_order: set[int] = frozenset(),
              background: bool = False) -> dict[str, Any]:
        """``state`` with every tensor replaced by a :class:`HostShard` of this rank's part.

        ``stores(value)`` says whether this rank writes a DTensor's box (plain tensors: rank 0);
        tensors whose memory starts at an address in ``in_order`` (module buffers: a forward may
        change them) are copied on the training stream. Addresses, not names: a state dict's keys
        are not the module's names under torch.compile or DDP. ``background``: the caller fences
        the next change of the other tensors (:meth:`fence`), so CPU copies may run in a thread."""
        self.fence()  # a copy still in flight fills the buffers this call is about to reuse
        self._copy_error = None  # a failed copy was raised by its own save's writer; this is a new save
        from torch.distributed.tensor import DTensor

        flat, paths = flatten(state)
        out: dict[str, Any] = {}
        side: list[tuple[torch.Tensor, torch.Tensor]] = []
        cpu_side: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda_in_order = False
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor):
                out[key] = value
                continue
            if isinstance(value, DTensor):
                local, box, store = self._shard(key, value, stores)
            else:
                local, box = local_shard_box(value)
                local, store = local.detach(), rank == 0
            buf = self._buffer(key, local)
            if local.is_cuda and local.data_ptr() not in in_order:
                side.append((local, buf))
            elif background and not local.is_cuda and local.data_ptr() not in in_order:
                cpu_side.append((local, buf))
            else:
                buf.copy_(local, non_blocking=local.is_cuda)
                cuda_in_order |= local.is_cuda
            out[key] = HostShard(buf, box, tuple(value.shape), store)
        for gone in set(self.buffers) - set(flat):  # keys the state no longer has
            del self.buffers[gone]
            self._boxes.pop(gone, None)
        self._copied = None
        if side or cuda_in_order:
            training = torch.cuda.current_stream()
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            # the copies see every kernel issued before save(), the in-order copies included
            self._stream.wait_stream(training)
            with torch.cuda.stream(self._stream):
                for src, dst in side:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self._stream)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
        if cpu_side:
            self._copier = threading.Thread(target=self._copy, args=(cpu_side,), name="ckpttool-stage", daemon=False)
            self._copier.start()
        return unflatten(out, paths)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            if self._before_copy is not None:
                self._before_copy()
            for src, dst in pairs:
                dst.copy_(src)
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), in the writer
            self._copy_error = exc

    def _shard(self, key: str, value: Any, stores: Any) -> tuple[torch.Tensor, Box, bool]:
        """(local shard, its box, whether this rank stores it) of a DTensor. The box and the store
        decision depend only on the global shape, the placements and the mesh (this rank's place
        in it), so they are kept from the last save while those hold (DTensor's chunk arithmetic
        is Python: it was most of what save() still spent on the training thread)."""
        local = value.to_local().detach()
        sig = (tuple(value.shape), tuple(value.placements))
        kept = self._boxes.get(key)
        if kept is not None and kept[0] == sig and kept[1] is value.device_mesh:
            return local, kept[2], kept[3]
        _, box = local_shard_box(value)
        store = stores(value)
        self._boxes[key] = (sig, value.device_mesh, box, store)
        return local, box, store

    def _buffer(self, key: str, local: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        pinned = local.is_cuda
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype or buf.is_pinned() != pinned:
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=pinned)
            self.buffers[key] = buf
        return buf

    @property
    def copying(self) -> bool:
        """Whether a background copy is running (the next optimizer step, a load, the next save or
        ``wait`` waits for it)."""
        return self._copier is not None and self._copier.is_alive()

    def fence(self) -> None:
        """Order what comes next after the copies in flight (an optimizer pre-step hook, and
        anything else of ckpttool's that changes the state in place): on CUDA the training stream
        waits for the side stream; on the CPU this joins the background copy."""
        if self._copier is not None:
            self._copier.join()
            self._copier = None
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)

    def wait(self) -> None:
        """Block until the copies are in host memory (the background writer, before it reads);
        raises what a background CPU copy raised."""
        copier = self._copier
        if copier is not None:
            copier.join()
        if self._copy_error is not None:
            raise self._copy_error
        if self._copied is not None:
            self._copied.synchronize()
