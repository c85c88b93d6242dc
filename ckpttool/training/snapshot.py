"""Keeping an async save's snapshot exact while training goes on: write guards for the copies in flight.

An async ``save()`` returns before its tensors are in host memory: their copy runs beside forward
and backward. Anything that writes one of those tensors in place before its copy is done would
tear the snapshot. Two guards make every such write wait for the copy of what it writes:

- **Every optimizer's step** (torch's global step pre-hook, so a second optimizer that was not
  passed to ``save`` is covered too) finishes all copies in flight first.
- **Any other in-place write on the thread that called ``save()``** (an EMA written back into the
  model, a manual edit, ``p.data.copy_``, a ``_foreach`` op, ``load_state_dict``): while copies are
  in flight a ``TorchDispatchMode`` (``compat.dispatch_mode_class``) sits on that thread's
  dispatch stack, finds the ops whose schema writes a tensor argument (``Tensor(a!)``) and, when
  one of those shares memory with a tensor still being copied, copies that tensor first (on CUDA:
  makes the current stream wait for the side-stream copies). The op then runs as the user wrote
  it; the copy holds the values of the call. Other ops pass through untouched. Once nothing is
  in flight it is a pass-through, and it leaves the stack at the next optimizer step, ``save``,
  ``wait``, ``close`` or ``load``.

What no guard sees (a write from another thread, through ``.numpy()`` or a raw pointer, or inside
code compiled by ``torch.compile``) is caught where torch's version counter shows it: a tensor
whose version moved before its copy was done makes the save fail, never commit
(:class:`~ckpttool.errors.SnapshotError`).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Protocol

import torch

from ..compat import dispatch_mode_class, dispatch_stack, in_dynamo_frame, local_tensor


class InFlight(Protocol):
    """What a guard protects: copies that can be finished (or ordered) before a write."""

    def before_write(self, spans: list[tuple[int, int]] | None) -> None:
        """Finish (or order) the copy of every tensor whose memory meets one of ``spans`` (byte
        address ranges ``[start, end)``; None: all of them)."""

    def in_flight(self) -> bool:
        """Whether any copy is still in flight."""


_lock = threading.Lock()
_in_flight: weakref.WeakSet = weakref.WeakSet()  # every InFlight with copies pending, on any thread
_hook: Any = None  # the global optimizer step pre-hook, registered on first use
_local = threading.local()  # .guard: the WriteGuard pushed on this thread, if any; .own: inside ckpttool's own copy


def watch(copies: InFlight) -> bool:
    """Guard ``copies`` until they are done: every optimizer step fences them, and writes on this
    thread are guarded. Returns False (nothing is guarded) when another dispatch mode is active on
    this thread: a mode of ours pushed above it would be popped by its ``__exit__``; the caller
    then copies at the call instead."""
    guard = getattr(_local, "guard", None)
    if guard is None or not _on_stack(guard):
        if dispatch_stack():
            return False
        guard = WriteGuard()
        guard.__enter__()
        _local.guard = guard
    _ensure_hook()
    with _lock:
        _in_flight.add(copies)
    guard.watching = True
    return True


def fence_all() -> None:
    """Finish every copy in flight (an optimizer is about to step; a Checkpointer call on the
    training thread), then take this thread's guard off its stack if nothing is left to guard
    (not from inside code torch.compile runs: its frame restores the dispatch state it entered
    with, and a mode popped under it leaves torch's Python dispatch key on with no mode)."""
    with _lock:
        pending = list(_in_flight)
    for copies in pending:
        copies.before_write(None)
    # (the stack walk only where there is a guard to take off: this runs before every optimizer step)
    if getattr(_local, "guard", None) is not None and not _under_dynamo():
        release()


def _under_dynamo() -> bool:
    """Whether a frame of torch._dynamo (a compiled function being run or traced) is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if in_dynamo_frame(frame):
            return True
        frame = frame.f_back
    return False




def forget(copies: InFlight) -> None:
    """``copies`` are done (or abandoned): nothing guards them any more."""
    with _lock:
        _in_flight.discard(copies)


def release() -> None:
    """Take this thread's guard off the dispatch stack once nothing it guards is in flight (only
    when it is on top: a mode the user pushed after it is theirs to pop first)."""
    guard = getattr(_local, "guard", None)
    if guard is None:
        return
    with _lock:
        busy = any(c.in_flight() for c in _in_flight)
    if busy:
        return
    guard.watching = False
    if _on_top(guard):
        guard.__exit__(None, None, None)
        _local.guard = None
    elif not _on_stack(guard):
        _local.guard = None


class own_copy:
    """ckpttool's own copies on this thread (a fence finishing the copy) pass the guard unchecked:
    they write host buffers, never a tensor being copied."""

    def __enter__(self) -> None:
        self.before = getattr(_local, "own", False)
        _local.own = True

    def __exit__(self, *exc: Any) -> None:
        _local.own = self.before


def guarded() -> bool:
    """Whether this thread's dispatch stack holds a write guard (tests read it)."""
    guard = getattr(_local, "guard", None)
    return guard is not None and _on_stack(guard)


def _on_top(mode: Any) -> bool:
    stack = dispatch_stack()
    return bool(stack) and stack[-1] is mode


def _on_stack(mode: Any) -> bool:
    return any(m is mode for m in dispatch_stack())


def _ensure_hook() -> None:
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        with _lock:
            if _hook is None:
                # (also when nothing is in flight: this thread's guard leaves the stack here once
                # its copies are done, or every later op would pass through it)
                _hook = register_optimizer_step_pre_hook(lambda *_: fence_all() if _in_flight or guarded() else None)


#: per op: the positions and keyword names of the arguments its schema writes (``Tensor(a!)``)
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    found = _WRITES.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = ()
        if schema is not None:
            # torch.distributed's collectives (c10d::allreduce_, broadcast_, ...) write their tensors
            # in place without saying so in their schemas: every tensor they take counts as written
            collective = getattr(func, "namespace", None) == "c10d"
            found = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                          if (a.alias_info is not None and a.alias_info.is_write) or (collective and "Tensor" in str(a.type)))
        _WRITES[func] = found
    return found


def _spans(values: list[Any]) -> list[tuple[int, int]] | None:
    """The byte address ranges the tensors ``values`` view (a DTensor by its local part): what a
    write to them may touch. None when one of them cannot be told (a tensor subclass without
    memory of its own): then anything may be written."""
    out: list[tuple[int, int]] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            found = _spans(list(value))
            if found is None:
                return None
            out += found
        elif isinstance(value, torch.Tensor):
            local = local_tensor(value)
            try:
                span = memory_span(local)
            except Exception:  # noqa: BLE001 - a wrapper subclass: assume it may write anything
                return None
            if span is not None:
                out.append(span)
    return out


def memory_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first byte, past the last byte)`` of the memory a tensor views (None when it views none)."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1) + 1
    return start, start + extent * t.element_size()


class WriteGuard(dispatch_mode_class()):  # type: ignore[misc]
    """Finishes the copy of a tensor before an op on this thread writes it (see the module's text)."""

    supports_higher_order_operators = True  # (passed through: they are not in-place ops of a tensor we copy)

    def __init__(self) -> None:
        super().__init__()
        self.watching = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # torch.compile'd code runs compiled (its forward and backward do not write parameters)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.watching and not getattr(_local, "own", False):
            written = _written(func)
            if written:
                self._before(written, args, kwargs)
        return func(*args, **kwargs)

    def _before(self, written: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> None:
        values = [args[i] if i < len(args) else kwargs.get(name) for i, name in written]
        spans = _spans(values)
        with _lock:
            pending = [c for c in _in_flight if c.in_flight()]
        if not pending:
            self.watching = False
            return
        for copies in pending:
            copies.before_write(spans)
