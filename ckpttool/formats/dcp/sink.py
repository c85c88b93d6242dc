"""Writing a DCP directory offline: one ``__<rank>_0.distcp`` per target rank, ``.metadata`` last.

We write the same layout as torch's ``FileSystemWriter`` (each chunk or object a ``torch.save``
archive, records streamed slab by slab), so plain ``torch.distributed.checkpoint.load`` reads it.
"""

from __future__ import annotations

import io
import pickle
import uuid
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...layout import Layout, SingleRank
from ...storage import Location
from ..base import ObjectSpec, ReadFn, Sink, TensorSpec, split, stream_tensor
from ..torchzip import ArchiveWriter
from .metadata import DCP_VERSION, METADATA_FILE, data_file_name


class DcpSink(Sink):
    """``layout`` says which rank's file stores which box of each tensor (default: everything
    whole in rank 0's file); objects go to rank 0's file."""

    format = "dcp"

    def __init__(self, location: Location, layout: Layout | None = None):
        super().__init__(location)
        self.layout = layout or SingleRank()
        self._files_by_rank: dict[int, IO[bytes]] = {}
        self._state_md: dict[str, Any] = {}
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._paths: dict[str, tuple] = {}
        self._order: list[str] = []
        self.bytes_per_rank: dict[int, int] = {}

    def _file(self, rank: int) -> IO[bytes]:
        f = self._files_by_rank.get(rank)
        if f is None:
            f = self._files_by_rank[rank] = self.open_file(self.tmp.child(data_file_name(rank)))
        return f

    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        _, objects = split(entries)
        self._order = [e.key for e in entries]
        self.tmp.makedirs()
        for r in range(self.layout.world_size):
            self._file(r)  # every target rank gets its file, even one with nothing to hold
        for spec in objects:
            f = self._file(0)
            start = f.tell()
            buf = io.BytesIO()
            torch.save(spec.value, buf)
            f.write(buf.getvalue())
            self._storage[MetadataIndex(spec.key)] = _StorageInfo(data_file_name(0), start, f.tell() - start)
            self._state_md[spec.key] = BytesStorageMetadata()
            self._paths[spec.key] = tuple(spec.path)

    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        chunks = []
        for i, (rank, box) in enumerate(self.layout.boxes(spec.key, spec.shape)):
            f = self._file(rank)
            start = f.tell()
            with ArchiveWriter(f) as writer:
                placeholder, stream = writer.new_tensor(spec.dtype, box[1])
                with stream:
                    stream_tensor(stream.write, spec, read, budget, box)
                length = writer.finish(placeholder)
            self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + length
            self._storage[MetadataIndex(spec.key, box[0], i)] = _StorageInfo(data_file_name(rank), start, length)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(box[0]), sizes=torch.Size(box[1])))
        self._state_md[spec.key] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), torch.Size(spec.shape), chunks)
        self._paths[spec.key] = tuple(spec.path)

    def complete(self) -> None:
        self.close_files()  # .metadata, the marker of a complete checkpoint, follows every data file
        self._files_by_rank.clear()
        metadata = Metadata(
            state_dict_metadata=self._state_md,
            planner_data={k: self._paths[k] for k in self._order if k in self._paths},
            storage_data=self._storage,
            storage_meta=StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4()), load_id=None),
            version=DCP_VERSION,
        )
        self.tmp.child(METADATA_FILE).write_bytes(pickle.dumps(metadata))
