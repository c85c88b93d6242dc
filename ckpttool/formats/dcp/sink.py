"""Writing a DCP directory offline: one ``__<rank>_0.distcp`` per target rank, ``.metadata`` last.

We write the same layout as torch's ``FileSystemWriter`` (each chunk or object a ``torch.save``
archive, records streamed slab by slab), so plain ``torch.distributed.checkpoint.load`` reads it.
"""

from __future__ import annotations

import hashlib
import io
import math
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import IO, Any

import torch

from ...compat import dump_metadata
from ...index import dtype_size
from ...layout import Box, Layout, SingleRank
from ...storage import Location
from ..base import ObjectSpec, ReadFn, Sink, TensorSpec, split, stream_tensor
from ..torchzip import ArchiveWriter
from .metadata import METADATA_FILE, data_file_name
from . import metadata_pickle as mp
from .transforms import check_compress, record_stream, transform_names


OPEN_FILES = 64  # target ranks' files a worker writes at the same time (a local disk)
OPEN_UPLOADS = 16  # ... and to an object store, where each open file holds a part of >= 5 MiB in memory


class _Appending(io.RawIOBase):
    """``f`` written front to back only: zipfile then puts each entry's sizes and CRC-32 in a data
    descriptor after its data (as torch's own writer does) instead of seeking back to patch the
    entry's header, and each such seek flushed the output's buffer (30 030 seeks in a 1 GB reshard
    to 4 ranks)."""

    def __init__(self, f: IO[bytes]):
        self._f = f

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._f.tell()

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        return len(memoryview(b).cast("B")) if n is None else n


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

    def pieces(self) -> Any:
        return self._records

    def merge(self, pieces: list[Any]) -> None:
        for records in pieces:
            self._records.update(records)

    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        self._tensors, self._objects = split(entries)
        self._order = [e.key for e in entries]
        self._paths = {e.key: tuple(e.path) for e in entries}
        self.tmp.makedirs()

    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        self.write([spec], lambda s: (read, budget), lambda n, k: None)

    def _ranks(self) -> list[int]:
        return [rank for rank in range(self.layout.world_size) if self.mine(rank, self.layout.world_size)]

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
                for rank in group:
                    for box in self.layout.boxes_of(rank, spec.key, spec.shape):
                        read, budget = reader_for(spec)
                        self._add_chunk(out[rank], self._records[rank], spec, box, read, budget)
                        done(math.prod(box[1]) * dtype_size(spec.dtype), spec.key)
            files.close()

    def _add_object(self, f: IO[bytes], records: list, spec: ObjectSpec) -> None:
        start = f.tell()
        buf = io.BytesIO()
        torch.save(spec.value, buf)
        with record_stream(f, self.compress) as out:
            out.write(buf.getvalue())
        records.append((spec.key, None, None, start, f.tell() - start))

    def _add_chunk(self, f: IO[bytes], records: list, spec: TensorSpec, box: Box, read: ReadFn, budget: int) -> None:
        start = f.tell()
        with record_stream(_Appending(f), self.compress) as out, ArchiveWriter(out) as writer:
            placeholder, stream = writer.new_tensor(spec.dtype, box[1])
            with stream:
                stream_tensor(stream.write, spec, read, budget, box)
            writer.finish(placeholder)
        records.append((spec.key, tuple(box[0]), tuple(box[1]), start, f.tell() - start))

    def complete(self) -> None:
        # .metadata, the marker of a complete checkpoint, follows every data file (finished first).
        # It is built from metadata_pickle's stand-ins, pickled under torch's names without
        # importing torch.distributed.checkpoint (0.8-1.3 s of a reshard's time)
        state_md: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        chunks: dict[str, list[Any]] = {}
        # the keys as this sink holds them: a worker's records arrive as copies, and pickle writes a
        # string it has seen once as a back-reference, so the bytes would depend on who wrote what
        own = {k: k for k in self._order}
        transforms = transform_names(self.compress)
        for rank, records in sorted(self._records.items()):
            name = data_file_name(rank)
            for key, offsets, sizes, start, length in records:
                key = own.get(key, key)
                info = mp.storage_info(name, start, length, transforms)
                if offsets is None:
                    storage[mp.metadata_index(key, None, None)] = info
                    state_md[key] = mp.BytesStorageMetadata()
                    continue
                mine = chunks.setdefault(key, [])
                storage[mp.metadata_index(key, mp.Size(offsets), len(mine))] = info
                mine.append(mp.ChunkStorageMetadata(offsets=mp.Size(offsets), sizes=mp.Size(sizes)))
        dtypes = {}
        for spec in self._tensors:
            dtypes[spec.key] = mp.dtype_name(spec.dtype)
            state_md[spec.key] = mp.TensorStorageMetadata(properties=mp.TensorProperties(dtypes[spec.key]),
                                                          size=mp.Size(spec.shape), chunks=chunks.get(spec.key, []))
        planner = {k: self._paths[k] for k in self._order if k in self._paths}
        # what may hold the stand-ins' module name: keys and paths from the source (file names are ours)
        strings = [*self._order, *(p for path in planner.values() for p in path if isinstance(p, str))]

        def metadata(save_id: str) -> bytes:
            md = mp.metadata(state_dict_metadata={k: state_md[k] for k in self._order if k in state_md},
                             planner_data=planner, storage_data=storage,
                             storage_meta=mp.StorageMeta(checkpoint_id=None, save_id=save_id, load_id=None, modules=[]))
            data = mp.dumps(md, strings, dtypes.values())
            return dump_metadata(mp.to_torch(md)) if data is None else data

        # the save's id is a digest of what it describes, not a random one: the same input written
        # by any number of workers, or again, gives the same bytes
        save_id = str(uuid.UUID(bytes=hashlib.sha256(metadata("")).digest()[:16], version=4))
        self.tmp.child(METADATA_FILE).write_bytes(metadata(save_id))
