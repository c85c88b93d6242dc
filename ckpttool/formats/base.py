"""What every format implements: a Format (detection, integrity), a Source (index + region reads)
and a Sink (streamed writes).

Sources answer ``index()`` and ``read_tensor(key, box)`` for any box of a tensor, reading only the
bytes that box needs, so callers control memory. Sinks are told up front what will be written
(``begin``), then pull each tensor through a ``read(box)`` callback in slabs no bigger than the
memory budget, and ``finalize()`` commits the output (through the storage's commit policy: nothing
looks complete at the destination until then).
"""

from __future__ import annotations

import ctypes
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields
from typing import IO, TYPE_CHECKING, Any, ClassVar

from ..errors import CkptError, FormatError
from ..index import Entry, Index, ObjectEntry, ObjPath, TensorEntry, dtype_size
from ..layout import Box, Layout, slabs, whole
from ..storage import Location

if TYPE_CHECKING:
    import torch

    from ..report import Report
    from . import Reading

ReadFn = Callable[[Box], "torch.Tensor"]
#: progress(done_bytes, total_bytes, key) — the CLI renders it; nothing below the CLI prints.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the sink will receive: its key, nesting path, global shape and (output) dtype."""

    key: str
    path: ObjPath
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class ObjectSpec:
    key: str
    path: ObjPath
    value: Any


def split(entries: Sequence[TensorSpec | ObjectSpec]) -> tuple[list[TensorSpec], list[ObjectSpec]]:
    return [e for e in entries if isinstance(e, TensorSpec)], [e for e in entries if isinstance(e, ObjectSpec)]


@dataclass(frozen=True)
class SinkOptions:
    """Output options a format may accept (``Format.sink_options`` names the ones it does)."""

    max_shard_size: int | None = None  # split the output into files of at most this many bytes
    layout: Layout | None = None  # which rank's file stores which box of each tensor
    compress: str | None = None  # store each record compressed (``"zstd"``)

    def given(self) -> set[str]:
        return {f.name for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Probe:
    """What detection looks at, gathered once: a directory's entries or a file's first bytes."""

    loc: Location
    is_dir: bool
    names: tuple[str, ...] = ()
    head: bytes = b""
    size: int = 0


class Source(ABC):
    """A checkpoint opened for reading. Cheap to open; ``index()`` reads only metadata."""

    format: str = ""

    def __init__(self, location: Location):
        self.location = location
        self.notes: list[str] = []  # what a reader should know (values it read from one rank, files it did not read)
        self._tiled: set[str] = set()  # keys whose chunks were checked to tile the tensor

    @abstractmethod
    def index(self) -> Index: ...

    def checked_entry(self, key: str) -> TensorEntry:
        """The entry of tensor ``key``, once checked to be safe to read: its chunks tile its shape
        (no gap to leave uninitialised). Checked once per key, not at every slab read."""
        entry = self.entry(key, TensorEntry)
        if key not in self._tiled:
            entry.check_coverage(self.location.url)
            self._tiled.add(key)
        return entry

    def describe_parts(self) -> list[dict[str, Any]] | None:
        """For a checkpoint made of parts in several formats (a trainer folder): each part's file,
        format and top-level key, for inspect; None otherwise."""
        return None

    def placement(self, key: str) -> str | None:
        """How a sharded tensor was laid out over its job's mesh, where the format records it."""
        return None

    @abstractmethod
    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of ``box`` (default: all) of tensor ``key`` as a contiguous CPU tensor: a new
        one, or ``out`` (of the box's shape and the entry's dtype) filled in place, so a caller
        streaming many slabs can reuse one buffer instead of faulting in fresh pages each time."""

    def _destination(self, key: str, box: Box | None, out: torch.Tensor | None) -> tuple[TensorEntry, Box, torch.Tensor]:
        """For a read of chunked tensor ``key``: its entry (checked: its chunks tile it), the box to
        read (default: all of it) and the tensor to read into (``out``, or a new one)."""
        import torch

        entry = self.checked_entry(key)  # the chunks must tile the tensor: no gap read as memory
        box = box if box is not None else whole(entry.shape)
        return entry, box, out if out is not None else torch.empty(box[1], dtype=entry.dtype)

    def read_object(self, key: str) -> Any:
        """The value of object ``key`` (formats whose index holds the values need not override this)."""
        return self.entry(key, ObjectEntry).location

    def entry(self, key: str, kind: type[Entry]) -> Any:
        """The index entry of ``key``, which must be a ``kind`` (TensorEntry or ObjectEntry)."""
        entry = self.index()[key]
        if not isinstance(entry, kind):
            raise FormatError(f"{key!r} is {'a tensor' if isinstance(entry, TensorEntry) else 'an object'}, "
                              f"not {'a tensor' if kind is TensorEntry else 'an object'}", where=self.location.url)
        return entry

    @abstractmethod
    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        """(file, start, end) of the raw bytes of each stored chunk of tensor ``key``, in chunk order."""

    @property
    def world_size(self) -> int:
        """How many ranks wrote this checkpoint, where the format records it (else 1)."""
        return 1

    def chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        """The name of the file that holds a chunk (for inspect and error messages)."""
        return self.location.name

    def files(self) -> list[str]:
        """Names of the data files this checkpoint consists of."""
        return [self.location.name]

    def aux_files(self) -> list[str]:
        """Names of the other files of a directory checkpoint that it reads (metadata, an index)."""
        return []

    def unread(self) -> list[str]:
        """Names in a directory checkpoint that are no part of it, so nothing read them (a README,
        a config.json, a stray copy): every command says so rather than pass over them."""
        if not self.location.isdir():
            return []
        own = {*self.files(), *self.aux_files()}
        return sorted(n for n in self.location.listdir() if n not in own)

    def unreadable(self) -> list[tuple[str, str]]:
        """(file, why) of the parts of a checkpoint made of several (a trainer folder) that could
        not be read: verify fails over them, every other command names them."""
        return []

    def read_notes(self) -> list[str]:
        """:attr:`notes`, and the names of the files in the directory it did not read."""
        unread = self.unread()
        return [*self.notes, *([f"not part of the checkpoint, not read: {', '.join(unread)}"] if unread else [])]

    def all_notes(self) -> list[str]:
        """:meth:`read_notes` and the parts that could not be read, with why."""
        return [*self.read_notes(), *(f"not read: {name}: {why}" for name, why in self.unreadable())]

    def check_in_parts(self) -> None:
        """Let reads that take a record in consecutive parts check it as the parts go by (one pass
        over its bytes instead of a scan before the first part): the caller then calls
        :meth:`settle` before it trusts what it read (an offline command: before its commit)."""

    def settle(self) -> None:
        """Finish the checks of the records read in parts (those not read to their end are scanned
        now); raises as the checks do."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Sink(ABC):
    """An output being written where its commit policy stages it; nothing complete until finalize."""

    format: str = ""

    def __init__(self, location: Location):
        self.location = location
        self.policy = location.commit_policy
        self.tmp = self.policy.staging(location)
        self.dropped: list[str] = []  # object keys the format could not hold
        self._files = ExitStack()
        self._current: ExitStack | None = None
        self.share = (0, 1)  # (this worker, workers): which of the output's files this process writes

    # --- splitting one output between workers (``--nproc``, torchrun) ----------------------------
    @property
    def splittable(self) -> bool:
        """Whether the output has several files that workers can write apart (shards, ranks' files)."""
        return False

    def mine(self, i: int, count: int) -> bool:
        """Whether this worker writes file ``i`` of the output's ``count``: each worker takes a
        contiguous run of them, so neighbouring files, which read neighbouring source bytes (the
        two halves of one source record when a reshard doubles the ranks), are one worker's and
        each source byte is fetched by one worker."""
        return i * self.share[1] // max(1, count) == self.share[0]

    def writes(self, spec: TensorSpec) -> bool:
        """Whether this worker writes tensor ``spec`` (every tensor, for one worker)."""
        return True

    def pieces(self) -> Any:
        """What this worker wrote that the marker file (written by worker 0) must describe."""
        return None

    def merge(self, pieces: list[Any]) -> None:
        """Worker 0, before :meth:`finalize`: take in every worker's :meth:`pieces`, in worker order."""

    def open_file(self, loc: Location) -> IO[bytes]:
        """Open one file of the output: closed (an upload completed) by :meth:`finalize`,
        discarded (an upload aborted) by :meth:`abort`."""
        return self._files.enter_context(loc.open_write())

    def enter(self, cm: Any) -> Any:
        """Enter a context (an archive writer) that ends with the output's files: normally at
        :meth:`finalize`, with the error at :meth:`abort`."""
        return self._files.enter_context(cm)

    def next_file(self, loc: Location) -> IO[bytes]:
        """Close the file the previous call opened, then open ``loc``: for outputs written one
        file after another (shards), so only one is open at a time."""
        if self._current is not None:
            self._current.close()
        self._current = self._files.enter_context(ExitStack())
        return self._current.enter_context(loc.open_write())

    def close_files(self) -> None:
        self._files.close()

    def order(self, tensors: list[TensorSpec]) -> list[TensorSpec]:
        """The order tensors will be written in (a format may need its own, e.g. for alignment)."""
        return tensors

    def start(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        """Prepare the destination (replacing an old output was checked before) and :meth:`begin`."""
        self.policy.prepare(self.tmp, self.location)
        self.begin(entries)

    @abstractmethod
    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        """Everything that will be written, in the source's order (objects carry their values)."""

    @abstractmethod
    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        """Write one tensor (tensors arrive in ``begin``'s order), pulling slabs of <= budget bytes."""

    def read_order(self, tensors: list[TensorSpec]) -> list[tuple[TensorSpec, Box | None]]:
        """The (tensor, box) reads :meth:`write` will make, in order (None: the whole tensor); the
        engine reads ahead along it. A sink that overrides :meth:`write` overrides this too."""
        return [(spec, None) for spec in tensors if self.writes(spec)]

    def write(self, tensors: list[TensorSpec], reader_for: Callable[[TensorSpec], tuple[ReadFn, int]],
              done: Callable[[int, str], None]) -> None:
        """Write every tensor, in :meth:`order`: ``reader_for(spec)`` gives its read callback and slab
        budget, ``done(nbytes, key)`` reports progress. A sink with many files overrides this to
        write them one at a time."""
        for spec in tensors:
            if not self.writes(spec):
                continue
            read, budget = reader_for(spec)
            self.add_tensor(spec, read, budget)
            done(spec.nbytes, spec.key)

    def finish_files(self) -> None:
        """Finish and close the files this worker writes (every worker, before worker 0's
        :meth:`complete`); calling it again does nothing."""
        self.close_files()

    def complete(self) -> None:
        """Write what makes the output complete (an index, a pickle, metadata) after the data
        (worker 0 only, once every worker's files are finished)."""

    def finalize(self) -> None:
        """Commit: the output appears at its destination whole, or not at all."""
        self.finish_files()
        self.complete()
        self.close_files()
        self.policy.publish(self.tmp, self.location)

    def abort(self, error: BaseException, discard: bool = True) -> None:
        """Discard the output after ``error`` (or an interrupt): open uploads are aborted, never
        completed, and (unless another worker does it: ``discard`` false) what was written is removed."""
        try:
            self._files.__exit__(type(error), error, error.__traceback__)
        except BaseException:  # noqa: BLE001 - closing a half-written file may fail again; removal matters more
            pass
        if discard:
            self.policy.discard(self.tmp)


class Format(ABC):
    """A checkpoint format: how to recognise it, read it, write it and check its integrity.

    Subclasses are registered with one line in ``formats/__init__.py``; every command, the
    conformance suite and the fuzz tests iterate the registry.
    """

    name: ClassVar[str]
    #: whether the format stores checksums, so integrity checks catch a flipped bit in tensor data
    checksums: ClassVar[bool] = False
    #: whether ``check_integrity`` can split its work between workers (``verify --nproc``)
    splits_integrity: ClassVar[bool] = False
    #: the :class:`SinkOptions` fields its sink accepts
    sink_options: ClassVar[frozenset[str]] = frozenset()
    #: whether its chunks are the boxes of a job's ranks, so ``reshard`` reads it (DCP, per-rank folders)
    ranked: ClassVar[bool] = False

    @abstractmethod
    def sniff(self, probe: Probe) -> bool:
        """Whether the path is in this format, by content."""

    def diagnose(self, probe: Probe) -> CkptError | None:
        """For a path that is almost this format (a DCP directory without ``.metadata``), the error
        that says what is wrong with it; None otherwise."""
        return None

    @abstractmethod
    def open_source(self, loc: Location, verify: bool = True, reading: Reading | None = None) -> Source:
        """Open for reading; with ``verify``, stored checksums are checked as the data is read (a
        mismatch raises :class:`ChecksumError`). ``verify`` itself opens without, to report instead.
        ``reading`` (:class:`ckpttool.formats.Reading`): a load's rank and live optimizers, for the
        formats that use them."""

    @abstractmethod
    def make_sink(self, loc: Location, options: SinkOptions) -> Sink: ...

    @abstractmethod
    def check_integrity(self, source: Source, report: Report, only: str | None, progress: Progress | None,
                        share: tuple[int, int] | None = None) -> list[tuple[int, Report]] | None:
        """This format's part of ``verify``: add a problem to ``report`` for everything wrong with
        the checkpoint's entries (those under the top-level key ``only``, when given): their files,
        byte ranges, tiling, decoding and checksums. A format that can split the work between
        workers (``splits_integrity``) takes ``share`` (worker, workers) and returns what it found
        per entry (see the DCP format's); the others are only called without it."""


class SlabBuffers:
    """Growable byte buffers viewed as any shape and dtype, reused from slab to slab.

    A sink writes each slab before it asks for the next, so one buffer per role serves every slab;
    a fresh allocation would fault in new pages for every slab, which costs more than the disk.
    """

    def __init__(self, count: int):
        self._bufs: list[torch.Tensor | None] = [None] * count  # made at the first view (torch imported then)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, which: int) -> torch.Tensor:
        import torch

        n = math.prod(shape) * dtype_size(dtype)
        buf = self._bufs[which]
        if buf is None or buf.numel() < n:
            buf = self._bufs[which] = torch.empty(n, dtype=torch.uint8)
        return buf[:n].view(dtype).view(shape)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, no numpy)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_char * n).from_address(t.data_ptr())
    array.owner = t  # the view keeps the array alive, the array keeps the tensor alive
    return memoryview(array).cast("B")


def read_c_order_box(reader, offset: int, shape: tuple[int, ...], dtype: torch.dtype, box: Box,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Read ``box`` of a tensor stored C-contiguous at byte ``offset``, into ``out`` when given.

    A box spanning whole rows is one read straight into the destination; otherwise the rows it
    touches are read and the inner slice copied (so a region costs the rows, not the tensor).
    """
    import torch

    if out is None:
        out = torch.empty(box[1], dtype=dtype)
    if not shape:
        reader.readinto(offset, tensor_buffer(out))
        return out
    item = dtype_size(dtype)
    row = math.prod(shape[1:]) * item
    start = offset + box[0][0] * row
    inner_whole = all(o == 0 and n == s for o, n, s in zip(box[0][1:], box[1][1:], shape[1:]))
    if inner_whole and out.is_contiguous():
        reader.readinto(start, tensor_buffer(out))
        return out
    rows = torch.empty((box[1][0], *shape[1:]), dtype=dtype)
    reader.readinto(start, tensor_buffer(rows))
    out.copy_(rows[(slice(None), *(slice(o, o + n) for o, n in zip(box[0][1:], box[1][1:])))])
    return out


class ReadAhead:
    """Reads the slabs a sink will ask for, in the order it will ask (``schedule``), one ahead:
    slab k+1 is read (and checked) in a background thread while slab k is written (and hashed),
    in two sets of buffers, so a convert costs about the larger of reading and writing rather than
    their sum. A request that is not the next one scheduled is read directly (and ends the
    read-ahead): the output never depends on the schedule being right."""

    def __init__(self, schedule: list[tuple[str, Box]], read_into: Callable[[str, Box, int], torch.Tensor], pool: Any):
        self._schedule = schedule  # (key, box) of every slab, in the sink's order
        self._read_into = read_into  # (key, box, buffer set 0 or 1) -> the slab, in that set's buffers
        self._pool = pool
        self._next = 0  # the index of the next slab the sink will ask for
        self._futures: dict[int, Any] = {}
        self._on = pool is not None and bool(schedule)

    def _submit(self, i: int) -> None:
        if i < len(self._schedule) and i not in self._futures:
            key, box = self._schedule[i]
            self._futures[i] = self._pool.submit(self._read_into, key, box, i % 2)

    def read(self, key: str, box: Box) -> torch.Tensor:
        i = self._next
        if self._on and i < len(self._schedule) and self._schedule[i] == (key, box):
            self._next += 1
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


def stream_tensor(write: Callable[[torch.Tensor], Any], spec: TensorSpec, read: ReadFn, budget: int, box: Box | None = None) -> None:
    """Feed the C-order slabs of ``box`` (default whole) of a tensor to ``write``, one at a time."""
    for slab in stream_slabs(spec, budget, box):
        write(tensor_buffer(read(slab).contiguous()))


def stream_slabs(spec: TensorSpec, budget: int, box: Box | None = None) -> list[Box]:
    """The slabs :func:`stream_tensor` reads, in order (the read-ahead schedule follows them)."""
    return list(slabs(spec.shape, dtype_size(spec.dtype), budget, box if box is not None else whole(spec.shape)))
