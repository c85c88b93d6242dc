"""Writing a DCP directory offline: one ``__<rank>_0.distcp`` per target rank, ``.metadata`` last.

We write the same layout as torch's ``FileSystemWriter`` (each chunk or object a ``torch.save``
archive, records streamed slab by slab), so plain ``torch.distributed.checkpoint.load`` reads it.
"""

from __future__ import annotations

import io
import math
import uuid
from collections.abc import Callable
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...compat import dcp_metadata, dump_metadata
from ...index import dtype_size
from ...layout import Box, Layout, SingleRank
from ...storage import Location
from ..base import ObjectSpec, ReadFn, Sink, TensorSpec, split, stream_tensor
from ..torchzip import ArchiveWriter
from .metadata import METADATA_FILE, data_file_name
from .transforms import check_compress, record_stream, storage_info


class DcpSink(Sink):
    """``layout`` says which rank's file stores which box of each tensor (default: everything
    whole in rank 0's file); objects go to rank 0's file. Files are written one rank after the
    other, so one is open at a time whatever the world size."""

    format = "dcp"

    def __init__(self, location: Location, layout: Layout | None = None, compress: str | None = None):
        super().__init__(location)
        self.layout = layout or SingleRank()
        check_compress(compress)
        self.compress = compress
        self._objects: list[ObjectSpec] = []
        self._chunks: dict[str, list[ChunkStorageMetadata]] = {}
        self._state_md: dict[str, Any] = {}
        self._storage: dict[MetadataIndex, Any] = {}
        self._paths: dict[str, tuple] = {}
        self._order: list[str] = []
        self.bytes_per_rank: dict[int, int] = {}

    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        _, self._objects = split(entries)
        self._order = [e.key for e in entries]
        self._paths = {e.key: tuple(e.path) for e in entries}
        self.tmp.makedirs()

    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        self.write([spec], lambda s: (read, budget), lambda n, k: None)

    def read_order(self, tensors: list[TensorSpec]) -> list[tuple[TensorSpec, Box | None]]:
        return [(spec, box) for rank in range(self.layout.world_size) for spec in tensors
                for box in self.layout.boxes_of(rank, spec.key, spec.shape)]

    def write(self, tensors: list[TensorSpec], reader_for: Callable[[TensorSpec], tuple[ReadFn, int]],
              done: Callable[[int, str], None]) -> None:
        for rank in range(self.layout.world_size):  # the order read_order lists
            f = self.next_file(self.tmp.child(data_file_name(rank)))  # every rank gets its file, even an empty one
            if rank == 0:
                for spec in self._objects:
                    self._add_object(f, spec)
                self._objects = []
            for spec in tensors:
                for box in self.layout.boxes_of(rank, spec.key, spec.shape):
                    read, budget = reader_for(spec)
                    self._add_chunk(f, rank, spec, box, read, budget)
                    done(math.prod(box[1]) * dtype_size(spec.dtype), spec.key)
        for spec in tensors:
            self._state_md[spec.key] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), torch.Size(spec.shape),
                                                             self._chunks.pop(spec.key, []))

    def _add_object(self, f: IO[bytes], spec: ObjectSpec) -> None:
        start = f.tell()
        buf = io.BytesIO()
        torch.save(spec.value, buf)
        with record_stream(f, self.compress) as out:
            out.write(buf.getvalue())
        self._storage[MetadataIndex(spec.key)] = storage_info(data_file_name(0), start, f.tell() - start, self.compress)
        self._state_md[spec.key] = BytesStorageMetadata()

    def _add_chunk(self, f: IO[bytes], rank: int, spec: TensorSpec, box: Box, read: ReadFn, budget: int) -> None:
        chunks = self._chunks.setdefault(spec.key, [])
        start = f.tell()
        with record_stream(f, self.compress) as out, ArchiveWriter(out) as writer:
            placeholder, stream = writer.new_tensor(spec.dtype, box[1])
            with stream:
                stream_tensor(stream.write, spec, read, budget, box)
            writer.finish(placeholder)
        length = f.tell() - start
        self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + length
        self._storage[MetadataIndex(spec.key, box[0], len(chunks))] = storage_info(data_file_name(rank), start, length, self.compress)
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(box[0]), sizes=torch.Size(box[1])))

    def complete(self) -> None:
        self.close_files()  # .metadata, the marker of a complete checkpoint, follows every data file
        metadata = dcp_metadata(
            state_dict_metadata={k: self._state_md[k] for k in self._order if k in self._state_md},
            planner_data={k: self._paths[k] for k in self._order if k in self._paths},
            storage_data=self._storage,
            storage_meta=StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4()), load_id=None),
        )
        self.tmp.child(METADATA_FILE).write_bytes(dump_metadata(metadata))
