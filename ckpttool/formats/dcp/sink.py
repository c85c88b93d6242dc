"""Writing a DCP directory offline: one ``__<rank>_0.distcp`` per target rank, ``.metadata`` last.

We write the same layout as torch's ``FileSystemWriter`` (each chunk or object a ``torch.save``
archive, records streamed slab by slab), so plain ``torch.distributed.checkpoint.load`` reads it.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import IO, Any

from ...buffers import tensor_buffer
from ...index import dtype_size
from ...layout import Box, Layout, SingleRank
from ...storage import Location
from ..base import ObjectSpec, ReadFn, Sink, TensorSpec, split, stream_tensor
from .metadata import METADATA_FILE, data_file_name
from . import metadata_pickle as mp
from .records import TEMPLATE_BYTES, Appending, write_object, write_small_tensor, write_tensor
from .transforms import check_compress, transform_names


OPEN_FILES = 64  # target ranks' files a worker writes at the same time (a local disk)
OPEN_UPLOADS = 16  # ... and to an object store, where each open file holds a part of >= 5 MiB in memory


class DcpSink(Sink):
    """``layout`` says which rank's file stores which box of each tensor (default: everything
    whole in rank 0's file); objects go to rank 0's file. Files are written one rank after the
    other, so one is open at a time whatever the world size. Split between workers, each writes
    a contiguous run of the target ranks' files and worker 0 writes ``.metadata`` from
    everyone's records, merged in rank order: the output's bytes do not depend on the split."""

    format = "dcp"

    def __init__(self, location: Location, layout: Layout | None = None, compress: str | None = None):
        super().__init__(location)
        self.layout = layout or SingleRank()
        check_compress(compress)
        self.compress = compress
        self._objects: list[ObjectSpec] = []
        self._tensors: list[TensorSpec] = []
        # target rank -> its file's records in file order: (key, None, None, start, length) for an
        # object, (key, offsets, sizes, start, length) for a tensor's chunk
        self._records: dict[int, list[tuple[str, Any, Any, int, int]]] = {}
        self._paths: dict[str, tuple] = {}
        self._order: list[str] = []

    @property
    def splittable(self) -> bool:
        return True

    @property
    def bytes_per_rank(self) -> dict[int, int]:
        return {rank: sum(r[4] for r in records) for rank, records in sorted(self._records.items())}

    def _pieces(self) -> Any:
        return self._records

    def _merge(self, pieces: list[Any]) -> None:
        for records in pieces:
            self._records.update(records)

    def _begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        self._tensors, self._objects = split(entries)
        self._order = [e.key for e in entries]
        self._paths = {e.key: tuple(e.path) for e in entries}
        self.tmp.makedirs()

    def _add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        self.write([spec], lambda s: (read, budget), lambda n, k: None)

    def _ranks(self) -> list[int]:
        return [rank for rank in range(self.layout.world_size) if self.share.mine(rank, self.layout.world_size)]

    def _groups(self) -> list[list[int]]:
        """This worker's target ranks in groups whose files are open at the same time."""
        ranks = self._ranks()
        n = OPEN_FILES if self.location.local_path is not None else OPEN_UPLOADS
        return [ranks[i:i + n] for i in range(0, len(ranks), n)]

    def read_order(self, tensors: list[TensorSpec]) -> list[tuple[TensorSpec, Box | None]]:
        return [(spec, box) for group in self._groups() for spec in tensors for rank in group
                for box in self.layout.boxes_of(rank, spec.key, spec.shape)]

    def write(self, tensors: list[TensorSpec], reader_for: Callable[[TensorSpec], tuple[ReadFn, int]],
              done: Callable[[int, str], None]) -> None:
        """Tensor by tensor, each target rank's boxes of it into that rank's file (a group of files
        open at once): the source is read once, front to back. Written one file after the other,
        a reshard read the source once per target file, each pass stopping inside records, and the
        kernel's read-ahead past each stop was evicted before the next pass came back for it: a
        32 GB reshard 2 -> 3 read 40.7-42.1 GB from the disk for 32.9 GB asked. Each file still
        gets its records in tensor order, so the output's bytes do not change."""
        for group in self._groups():  # the order read_order lists
            files = self._files.enter_context(ExitStack())
            out: dict[int, IO[bytes]] = {}
            for rank in group:  # every rank gets its file, even an empty one
                out[rank] = files.enter_context(self.tmp.child(data_file_name(rank)).open_write())
                records = self._records.setdefault(rank, [])
                if rank == 0:
                    for spec in self._objects:
                        self._add_object(out[rank], records, spec)
                    self._objects = []
            for spec in tensors:
                read, budget = reader_for(spec)
                for rank in group:
                    for box in self.layout.boxes_of(rank, spec.key, spec.shape):
                        self._add_chunk(out[rank], self._records[rank], spec, box, read, budget)
                        done(math.prod(box[1]) * dtype_size(spec.dtype), spec.key)
            files.close()

    def _add_object(self, f: IO[bytes], records: list, spec: ObjectSpec) -> None:
        start, length = write_object(f, spec.value, self.compress)
        records.append((spec.key, None, None, start, length))

    def _add_chunk(self, f: IO[bytes], records: list, spec: TensorSpec, box: Box, read: ReadFn, budget: int) -> None:
        box = (tuple(box[0]), tuple(box[1]))  # (the box stream_slabs makes of it: the read-ahead's schedule)
        nbytes = math.prod(box[1]) * dtype_size(spec.dtype)
        got = None
        if self.compress is None and nbytes <= min(budget, TEMPLATE_BYTES):  # one slab, from a template
            got = write_small_tensor(f, spec.dtype, box[1], lambda: tensor_buffer(read(box).contiguous()))
        start, length = got or write_tensor(Appending(f), spec.dtype, box[1], self.compress,
                                            lambda write: stream_tensor(write, spec, read, budget, box))
        records.append((spec.key, *box, start, length))

    def complete(self) -> None:
        # .metadata, the marker of a complete checkpoint, follows every data file (finished first)
        described = mp.Described()
        described.order = list(self._order)
        described.paths = dict(self._paths)
        transforms = transform_names(self.compress)
        chunks: dict[str, list[Any]] = {}
        for rank, records in sorted(self._records.items()):
            name = data_file_name(rank)
            for key, offsets, sizes, start, length in records:
                if offsets is None:
                    described.objects[key] = (name, start, length, transforms)
                else:
                    chunks.setdefault(key, []).append((offsets, sizes, (name, start, length, transforms)))
        for spec in self._tensors:
            described.tensors[spec.key] = (tuple(spec.shape), mp.dtype_name(spec.dtype), chunks.get(spec.key, []))
        self.tmp.child(METADATA_FILE).write_bytes(_with_digest_id(described))


#: the save's id while the rest is pickled: as long as a UUID, so the id takes its place in the bytes
_ID_PLACEHOLDER = "ckpttool:save-id-is-the-digest:00000"


def _with_digest_id(described: mp.Described) -> bytes:
    """``.metadata`` whose save id is a digest of what it describes, not a random one: the same input
    written by any number of workers, or again, gives the same bytes. Pickled once (a pickle of a
    checkpoint of many tensors takes seconds: docs/benchmarks.md) with a placeholder the id then
    replaces; twice where the placeholder is not found exactly once."""
    data = mp.metadata_bytes(described, _ID_PLACEHOLDER)
    placeholder = _ID_PLACEHOLDER.encode()
    save_id = str(uuid.UUID(bytes=hashlib.sha256(data).digest()[:16], version=4))
    if data.count(placeholder) == 1 and len(save_id) == len(_ID_PLACEHOLDER):
        return data.replace(placeholder, save_id.encode())
    return mp.metadata_bytes(described, save_id)
