"""What every format implements: a Format (detection, integrity), a Source (index + region reads)
and a Sink (streamed writes).

Sources answer ``index()`` and ``read_tensor(key, box)`` for any box of a tensor, reading only the
bytes that box needs, so callers control memory. Sinks are told up front what will be written
(``begin``), then pull each tensor through a ``read(box)`` callback in slabs no bigger than the
memory budget, and ``finalize()`` commits the output (through the storage's commit policy: nothing
looks complete at the destination until then).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from typing import IO, TYPE_CHECKING, Any, ClassVar

from ..errors import CkptError, FormatError
from ..buffers import tensor_buffer
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

    @cached_property  # (asked for at every step of a tensor's way: the schedule, the budget, each sink)
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
    # the output's files by name, each with the keys of the tensors it holds, in order (an HF folder
    # laid out as another one is: ``convert --to hf --like``); with an index unless it is one file
    # named as save_pretrained names an unsharded one
    shard_files: tuple[tuple[str, tuple[str, ...]], ...] | None = None
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


@dataclass(frozen=True)
class About:
    """Where a tensor is, for inspect and error messages: the file of each stored chunk (in chunk
    order) and how it was laid out over its job's mesh, where the format records it."""

    files: tuple[str, ...]
    placement: str | None = None


@dataclass(frozen=True)
class NotRead:
    """What a read passed over: ``notes`` a reader should know (values taken from one rank, files in
    the directory that are no part of the checkpoint), and the parts that could not be read, with why
    (verify fails over those; every other command names them)."""

    notes: tuple[str, ...] = ()
    unreadable: tuple[tuple[str, str], ...] = ()

    def lines(self) -> list[str]:
        return [*self.notes, *(f"not read: {name}: {why}" for name, why in self.unreadable)]


class Source(ABC):
    """A checkpoint opened for reading. Cheap to open; ``index()`` reads only metadata.

    Fifteen public methods: the index and its entries, the reads, where the bytes are (``data_spans``,
    ``files``, ``aux_files``, ``about``, ``world_size``, ``describe_parts``), what was not read, the
    checks of records read in parts, a training step's commit record, close. The rest are hooks a
    format overrides (``_check``, ``_chunk_file``, ...)."""

    format: str = ""
    #: a reader that checks each record in the same pass that reads it into a tensor (DCP's
    #: ``RecordChecks``: ``done``, ``read_chunk``), or None: the format checks a record before its first read
    checks: Any = None

    def __init__(self, location: Location):
        self.location = location
        self.notes: list[str] = []  # what a reader should know (values it read from one rank, files it did not read)
        self._checked: set[str] = set()  # keys checked safe to read (:meth:`_check`)

    @abstractmethod
    def index(self) -> Index: ...

    def entry(self, key: str, kind: type[Entry], checked: bool = False) -> Any:
        """The index entry of ``key``, which must be a ``kind`` (TensorEntry or ObjectEntry); with
        ``checked``, a tensor's entry once checked to be safe to read (:meth:`_check`, once per key,
        not at every slab read)."""
        entry = self.index()[key]
        if not isinstance(entry, kind):
            raise FormatError(f"{key!r} is {'a tensor' if isinstance(entry, TensorEntry) else 'an object'}, "
                              f"not {'a tensor' if kind is TensorEntry else 'an object'}", where=self.location.url)
        if checked and key not in self._checked:
            self._check(key, entry)
            self._checked.add(key)
        return entry

    def _check(self, key: str, entry: TensorEntry) -> None:
        """Check that tensor ``key`` is safe to read: its chunks tile its shape (no gap to leave
        uninitialised); a format adds what it can check before reading (records inside their files)."""
        entry.check_coverage(self.location.url)

    @abstractmethod
    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of ``box`` (default: all) of tensor ``key`` as a contiguous CPU tensor: a new
        one, or ``out`` (of the box's shape and the entry's dtype) filled in place, so a caller
        streaming many slabs can reuse one buffer instead of faulting in fresh pages each time."""

    def read_tensors(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Whole tensors, each into its ``out`` (contiguous, of its shape and dtype), in order: as
        many :meth:`read_tensor` calls here; a format reads runs of small records together."""
        for key, out in items:
            self.read_tensor(key, None, out=out)

    def _destination(self, key: str, box: Box | None, out: torch.Tensor | None) -> tuple[TensorEntry, Box, torch.Tensor]:
        """For a read of chunked tensor ``key``: its entry (checked: its chunks tile it), the box to
        read (default: all of it) and the tensor to read into (``out``, or a new one)."""
        import torch

        entry = self.entry(key, TensorEntry, checked=True)  # the chunks must tile the tensor: no gap read as memory
        box = box if box is not None else whole(entry.shape)
        return entry, box, out if out is not None else torch.empty(box[1], dtype=entry.dtype)

    def read_object(self, key: str) -> Any:
        """The value of object ``key`` (formats whose index holds the values need not override this)."""
        return self.entry(key, ObjectEntry).location

    @abstractmethod
    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        """(file, start, end) of the raw bytes of each stored chunk of tensor ``key``, in chunk order."""

    @property
    def world_size(self) -> int:
        """How many ranks wrote this checkpoint, where the format records it (else 1)."""
        return 1

    def files(self) -> list[str]:
        """Names of the data files this checkpoint consists of."""
        return [self.location.name]

    def about(self, key: str) -> About:
        """The file of each chunk of tensor ``key`` and its placement (for inspect and messages)."""
        entry = self.entry(key, TensorEntry)
        return About(tuple(self._chunk_file(entry, i) for i in range(len(entry.chunks))), self._placement(key))

    def _chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        return self.location.name

    def _placement(self, key: str) -> str | None:
        return None

    def describe_parts(self) -> list[dict[str, Any]] | None:
        """For a checkpoint made of parts in several formats (a trainer folder): each part's file,
        format and top-level key, for inspect; None otherwise."""
        return None

    def not_read(self) -> NotRead:
        """:attr:`notes`, the names in the directory that are no part of the checkpoint (a README, a
        config.json, a stray copy: every command says so rather than pass over them), and the parts
        that could not be read (a trainer folder's)."""
        unread = []
        if self.location.isdir():
            own = {*self.files(), *self.aux_files()}
            unread = sorted(n for n in self.location.listdir() if n not in own)
        return NotRead(tuple([*self.notes, *([f"not part of the checkpoint, not read: {', '.join(unread)}"] if unread else [])]))

    def aux_files(self) -> list[str]:
        """Names of the other files of a directory checkpoint that it reads (metadata, an index),
        beside its data files (:meth:`files`)."""
        return []

    @contextmanager
    def checked_in_parts(self) -> Iterator[None]:
        """Inside, reads that take a record in consecutive parts check it as the parts go by (one pass
        over its bytes instead of a scan before the first part); on leaving without an error, the
        records not read to their end are scanned (raising as the checks do): the caller trusts what
        it read only after (an offline command: before its commit)."""
        self._check_in_parts()
        yield
        self._settle()

    def _check_in_parts(self) -> None:
        pass

    def will_read(self, locations: Iterable[Any] | None) -> None:
        """The records the caller is about to read (chunk and object locations; None: all of them),
        so that a format can fetch neighbours together (a DCP file's adjacent small records in one
        read). Reads outside them are served as ever."""

    def _settle(self) -> None:
        pass

    def commit_record(self) -> dict | None:
        """The commit record of a ckpttool training step (the DCP format's), else None."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True)
class Share:
    """The part of an output one worker writes when several split it (``--nproc``, torchrun): the
    engine gives each sink its own; a splittable sink asks :meth:`mine` of each of its files."""

    worker: int = 0
    workers: int = 1

    def mine(self, i: int, count: int) -> bool:
        """Whether this worker writes file ``i`` of the output's ``count``: each worker takes a
        contiguous run of them, so neighbouring files, which read neighbouring source bytes (the
        two halves of one source record when a reshard doubles the ranks), are one worker's and
        each source byte is fetched by one worker."""
        return i * self.workers // max(1, count) == self.worker


class Sink(ABC):
    """An output being written where its commit policy stages it; nothing complete until finalize.

    What the engine calls: ``order``, ``start``, ``read_order``, ``write``, ``finish_files``,
    ``merge`` (workers), ``complete``, ``finalize``, ``abort``; a format implements ``_begin`` and
    ``_add_tensor`` (and, splitting between workers, ``splittable``, ``_writes``, ``_pieces``, ``_merge``)."""

    format: str = ""

    def __init__(self, location: Location):
        self.location = location
        self.policy = location.commit_policy
        self.tmp = self.policy.staging(location)
        self.dropped: list[str] = []  # object keys the format could not hold
        self._files = ExitStack()
        self._current: ExitStack | None = None
        self.share = Share()  # which part of the output this process writes (the engine's, with workers)
        self.also: list[tuple[str, Location]] = []  # files copied into the output as they are (convert --to hf)

    @property
    def splittable(self) -> bool:
        """Whether the output has several files that workers can write apart (shards, ranks' files)."""
        return False

    def _writes(self, spec: TensorSpec) -> bool:
        """Whether this worker writes tensor ``spec`` (every tensor, for one worker)."""
        return True

    def merge(self, gather: Callable[[Any], list[Any] | None]) -> bool:
        """Workers, after every one finished its files: hand what this one wrote (that the file
        describing the output, worker 0's, must name) to ``gather``, which gives worker 0 every
        worker's in worker order; worker 0 takes them in. True on worker 0."""
        pieces = gather(self._pieces())
        if pieces is None:
            return False
        self._merge(pieces)
        return True

    def _pieces(self) -> Any:
        return None

    def _merge(self, pieces: list[Any]) -> None:
        pass

    def _enter(self, cm: Any) -> Any:
        """Enter a context (an archive writer) that ends with the output's files: normally at
        :meth:`finalize`, with the error at :meth:`abort`."""
        return self._files.enter_context(cm)

    def _next_file(self, loc: Location) -> IO[bytes]:
        """Close the file the previous call opened, then open ``loc`` (closed, an upload completed,
        by :meth:`finalize`; discarded, an upload aborted, by :meth:`abort`): for outputs written one
        file after another (shards), so only one is open at a time."""
        if self._current is not None:
            self._current.close()
        self._current = self._files.enter_context(ExitStack())
        return self._current.enter_context(loc.open_write())

    def order(self, tensors: list[TensorSpec]) -> list[TensorSpec]:
        """The order tensors will be written in (a format may need its own, e.g. for alignment)."""
        return tensors

    def start(self, entries: list[TensorSpec | ObjectSpec], prepare: bool = True) -> None:
        """Prepare the destination (replacing an old output was checked before; workers: worker 0
        prepared it, ``prepare`` false) and learn everything that will be written (:meth:`_begin`)."""
        if prepare:
            self.policy.prepare(self.tmp, self.location)
        self._begin(entries)

    @abstractmethod
    def _begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        """Everything that will be written, in the source's order (objects carry their values)."""

    @abstractmethod
    def _add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        """Write one tensor (tensors arrive in ``_begin``'s order), pulling slabs of <= budget bytes."""

    def read_order(self, tensors: list[TensorSpec]) -> list[tuple[TensorSpec, Box | None]]:
        """The (tensor, box) reads :meth:`write` will make, in order (None: the whole tensor); the
        engine reads ahead along it. A sink that overrides :meth:`write` overrides this too."""
        return [(spec, None) for spec in tensors if self._writes(spec)]

    def write(self, tensors: list[TensorSpec], reader_for: Callable[[TensorSpec], tuple[ReadFn, int]],
              done: Callable[[int, str], None]) -> None:
        """Write every tensor, in :meth:`order`: ``reader_for(spec)`` gives its read callback and slab
        budget, ``done(nbytes, key)`` reports progress. A sink with many files overrides this to
        write them one at a time."""
        for spec in tensors:
            if not self._writes(spec):
                continue
            read, budget = reader_for(spec)
            self._add_tensor(spec, read, budget)
            done(spec.nbytes, spec.key)

    def finish_files(self) -> None:
        """Finish and close the files this worker writes (every worker, before worker 0's
        :meth:`complete`); calling it again does nothing."""
        self._files.close()

    def complete(self) -> None:
        """Write what makes the output complete (an index, a pickle, metadata) after the data
        (worker 0 only, once every worker's files are finished)."""

    def finalize(self) -> None:
        """Commit: the output appears at its destination whole, or not at all."""
        self.finish_files()
        self.complete()
        for name, src in self.also:  # copied in 64 MiB pieces: a file's size is not trusted to fit in memory
            size = src.size()
            with self.tmp.child(name).open_write() as out:
                for start in range(0, size, 1 << 26):
                    out.write(src.read_bytes(start, min(size, start + (1 << 26))))
        self._files.close()
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
    #: whether it holds optimizers keyed by parameter index that a stated order names (``Reading.optimizer_order``)
    names_by_order: ClassVar[bool] = False

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
        ``reading`` (:class:`ckpttool.formats.Reading`): a load's rank and live optimizers, a stated
        optimizer order, for the formats that use them."""

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


def stream_tensor(write: Callable[[torch.Tensor], Any], spec: TensorSpec, read: ReadFn, budget: int, box: Box | None = None) -> None:
    """Feed the C-order slabs of ``box`` (default whole) of a tensor to ``write``, one at a time."""
    for slab in stream_slabs(spec, budget, box):
        write(tensor_buffer(read(slab).contiguous()))


def stream_slabs(spec: TensorSpec, budget: int, box: Box | None = None) -> list[Box]:
    """The slabs :func:`stream_tensor` reads, in order (the read-ahead schedule follows them)."""
    return list(slabs(spec.shape, dtype_size(spec.dtype), budget, box if box is not None else whole(spec.shape)))
