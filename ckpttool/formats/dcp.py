"""DCP (``torch.distributed.checkpoint``) directories: a Source, a Sink, and safe online reader/writer.

Layout (FileSystemWriter): ``.metadata`` (a pickle of ``Metadata``: per key the global shape, dtype
and chunks; per chunk the file, offset and length of its record) and ``__<rank>_<i>.distcp`` files,
each a run of ``torch.save`` archives, one per chunk or object. We read ``.metadata`` through the
allow-listed unpickler and each record's bytes by range; we write the same layout so plain
``torch.distributed.checkpoint.load`` reads what we write.
"""

from __future__ import annotations

import io
import pickle
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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

from ..errors import CorruptCheckpointError, FormatError, NotACheckpointError, NotFoundError, UnsafePickleError
from ..index import Chunk, Index, ObjectEntry, TensorEntry
from ..layout import Box, intersect, relative, whole
from ..safe_pickle import load_dcp_metadata
from ..storage import Location, RangeReader, resolve
from .base import ObjectSpec, ReadFn, Sink, Source, TensorSpec, split, stream_tensor
from .torchzip import Archive, ArchiveWriter, REMOTE_RECORD, read_archive, read_tensor_box

METADATA_FILE = ".metadata"
DCP_VERSION = "1.0.0"


def read_metadata(loc: Location) -> Metadata:
    """``.metadata`` of a DCP directory, unpickled through the allow-list."""
    md_loc = loc.child(METADATA_FILE)
    if not loc.exists():
        raise NotFoundError("checkpoint does not exist", where=loc.url, hint="check the path")
    if not md_loc.exists():
        raise NotACheckpointError(
            "directory has no .metadata, so it is not a complete DCP checkpoint",
            where=loc.url,
            hint="the save may have been interrupted; use an earlier step or `ckpttool inspect` the root",
        )
    metadata = load_dcp_metadata(md_loc.read_bytes(), md_loc.url)
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError("the .metadata file does not hold DCP metadata", where=md_loc.url)
    return metadata


# --- online: torch's reader/writer with our safety rules --------------------------------------


class _SafeMetadataMixin:
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # noqa: D401 - DCP hook
        metadata = read_metadata(self._ckpt_location)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    pass


def dcp_reader(loc: Location, storage_options: dict[str, Any] | None = None):
    """A DCP StorageReader for ``loc`` whose ``.metadata`` goes through the allow-list."""
    if loc.is_local:
        reader = _SafeFileSystemReader(loc.path)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class _SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
            pass

        reader = _SafeFsspecReader(loc.url, **(storage_options or {}))
    reader._ckpt_location = loc
    return reader


def dcp_writer(loc: Location, storage_options: dict[str, Any] | None = None):
    """A DCP StorageWriter for ``loc`` (a single file per rank, fsync'ed)."""
    if loc.is_local:
        return FileSystemWriter(loc.path, single_file_per_rank=True, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(loc.url, single_file_per_rank=True, sync_files=True, **(storage_options or {}))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but objects are unpickled with ``weights_only=True`` (DCP uses False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _load_object(value.getvalue(), fqn, "")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _load_object(data: bytes, key: str, where: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        culprit = text.split("GLOBAL", 1)[1].split()[0] if "GLOBAL" in text else "a global"
        raise UnsafePickleError(
            f"object {key!r} asks to unpickle {culprit}, which is not allowed",
            where=where or None,
            hint="nothing from it was run; objects in checkpoints must be plain data (numbers, strings, lists, dicts)",
        ) from None
    except Exception as exc:
        raise CorruptCheckpointError(f"cannot read object {key!r} ({type(exc).__name__}: {exc})", where=where or None) from None


# --- offline Source ------------------------------------------------------------------------------


class DcpSource(Source):
    format = "dcp"

    def __init__(self, location: Location):
        super().__init__(location)
        self.metadata = read_metadata(location)
        self._storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for mi, info in (self.metadata.storage_data or {}).items():
            self._storage[(mi.fqn, None if mi.offset is None else tuple(mi.offset))] = info
        self._readers: dict[str, RangeReader] = {}
        self._archives: OrderedDict[tuple[str, int], Archive] = OrderedDict()
        self._index: Index | None = None

    def index(self) -> Index:
        if self._index is not None:
            return self._index
        paths = self.metadata.planner_data if isinstance(self.metadata.planner_data, dict) else {}
        idx = Index()
        stored = self.metadata.state_dict_metadata
        # the order of the saved state dict (planner_data keeps it), not the order ranks reported in
        order = {k: i for i, k in enumerate(paths)}
        for key in sorted(stored, key=lambda k: order.get(k, len(order))):
            md = stored[key]
            path = tuple(paths.get(key, (key,)))
            if isinstance(md, TensorStorageMetadata):
                _check_tensor_metadata(key, md, self.location.child(METADATA_FILE).url)
                chunks = []
                for c in md.chunks:
                    offs = tuple(int(o) for o in c.offsets)
                    info = self._storage.get((key, offs))
                    if info is None:
                        raise CorruptCheckpointError(
                            f"tensor {key!r}: chunk at {offs} has no storage entry in .metadata",
                            where=self.location.child(METADATA_FILE).url,
                        )
                    chunks.append(Chunk(offs, tuple(int(s) for s in c.sizes), info))
                idx.add(TensorEntry(key, tuple(int(s) for s in md.size), md.properties.dtype, tuple(chunks)), path)
            elif isinstance(md, BytesStorageMetadata):
                info = self._storage.get((key, None))
                if info is None:
                    raise CorruptCheckpointError(f"object {key!r} has no storage entry in .metadata", where=self.location.url)
                idx.add(ObjectEntry(key, info), path)
            else:
                raise FormatError(f"unknown entry type {type(md).__name__} for {key!r}", where=self.location.url)
        self._index = idx
        return idx

    def files(self) -> list[str]:
        names = {getattr(info, "relative_path", "?") for info in self._storage.values()}
        return sorted(names)

    def chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        return entry.chunks[chunk_index].location.relative_path

    def _reader(self, relative_path: str) -> RangeReader:
        r = self._readers.get(relative_path)
        if r is None:
            loc = self.location.child(relative_path)
            if not loc.exists():
                raise NotFoundError(
                    "data file named in .metadata is missing", where=loc.url, hint="restore the file or use another checkpoint"
                )
            r = self._readers[relative_path] = loc.open_reader()
        return r

    def archive(self, info: Any, key: str) -> Archive:
        """The parsed record behind a storage entry (cached: many reads hit the same chunk)."""
        if getattr(info, "transform_descriptors", None):
            raise FormatError(
                f"record of {key!r} uses storage transforms {info.transform_descriptors}",
                where=self.location.child(info.relative_path).url,
                hint="ckpttool reads plain DCP records only",
            )
        cache_key = (info.relative_path, info.offset)
        arch = self._archives.get(cache_key)
        if arch is None:
            where = f"{self.location.child(info.relative_path).url} (record of {key!r} at byte {info.offset})"
            reader = self._reader(info.relative_path)
            for other in self._readers.values():  # at most one record held in memory per source
                if other is not reader:
                    other.release()
            arch = read_archive(reader, info.offset, info.length, where,
                                whole_up_to=0 if self.location.is_local else REMOTE_RECORD)
            self._archives[cache_key] = arch
            if len(self._archives) > 4096:
                self._archives.popitem(last=False)
        return arch

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.index()[key]
        if not isinstance(entry, TensorEntry):
            raise FormatError(f"{key!r} is an object, not a tensor")
        box = box if box is not None else whole(entry.shape)
        if out is None:
            out = torch.empty(box[1], dtype=entry.dtype)
        for chunk in entry.chunks:
            part = intersect((chunk.offsets, chunk.sizes), box)
            if part is None:
                continue
            arch = self.archive(chunk.location, key)
            ref = arch.obj
            where = f"{self.location.child(chunk.location.relative_path).url} (key {key!r})"
            if tuple(getattr(ref, "shape", ())) != chunk.sizes or getattr(ref, "dtype", None) != entry.dtype:
                raise CorruptCheckpointError(
                    f"record of {key!r} at {chunk.offsets} holds {getattr(ref, 'dtype', '?')}{list(getattr(ref, 'shape', []))}, "
                    f".metadata says {entry.dtype}{list(chunk.sizes)}",
                    where=where,
                )
            storage = arch.storages.get(ref.storage.key)
            if storage is None:
                raise CorruptCheckpointError(f"record of {key!r} lacks its data", where=where)
            local = tuple((s.start for s in relative(part, (chunk.offsets, chunk.sizes))))
            # read straight into the destination when its slice is contiguous (whole rows)
            read_tensor_box(self._reader(chunk.location.relative_path), ref, storage, (local, part[1]), where,
                            out=out[relative(part, box)])
        return out

    def read_object(self, key: str) -> Any:
        entry = self.index()[key]
        if not isinstance(entry, ObjectEntry):
            raise FormatError(f"{key!r} is a tensor, not an object")
        info = entry.location
        loc = self.location.child(info.relative_path)
        data = self._reader(info.relative_path).read(info.offset, info.length)
        return _load_object(data, key, loc.url)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


def _check_tensor_metadata(key: str, md: Any, where: str) -> None:
    """Types and ranks of one entry, so a damaged .metadata is a clear error, not a crash later."""
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    size = getattr(md, "size", None)
    ok = isinstance(dtype, torch.dtype) and isinstance(size, (tuple, list)) and all(isinstance(s, int) and s >= 0 for s in size)
    if ok:
        for c in md.chunks:
            offs, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if not (isinstance(offs, (tuple, list)) and isinstance(sizes, (tuple, list)) and len(offs) == len(sizes) == len(size)
                    and all(isinstance(x, int) and x >= 0 for x in (*offs, *sizes))):
                ok = False
                break
    if not ok:
        raise CorruptCheckpointError(
            f"entry {key!r} in .metadata is malformed", where=where, hint="the .metadata file is damaged; restore it"
        )


# --- offline Sink --------------------------------------------------------------------------------

Placement = Callable[[TensorSpec], list[tuple[int, Box]]]


def single_rank(spec: TensorSpec) -> list[tuple[int, Box]]:
    return [(0, whole(spec.shape))]


class DcpSink(Sink):
    """Write a DCP directory: one ``__<rank>_0.distcp`` per target rank, ``.metadata`` last.

    ``placement`` says which rank's file stores which box of each tensor (default: all on rank 0,
    one chunk per tensor); objects go to rank 0's file.
    """

    format = "dcp"

    def __init__(self, location: Location, placement: Placement = single_rank, world_size: int = 1):
        super().__init__(location)
        self.placement = placement
        self.world_size = world_size
        self._files: dict[int, Any] = {}
        self._stack: list[Any] = []
        self._state_md: dict[str, Any] = {}
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._paths: dict[str, tuple] = {}
        self._order: list[str] = []
        self.bytes_per_rank: dict[int, int] = {}

    def _file(self, rank: int):
        f = self._files.get(rank)
        if f is None:
            loc = self.tmp.child(_file_name(rank))
            cm = loc.open_write()
            f = cm.__enter__()
            self._stack.append(cm)
            self._files[rank] = f
        return f

    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        _, objects = split(entries)
        self._order = [e.key for e in entries]
        self.tmp.makedirs()
        for r in range(self.world_size):
            self._file(r)  # every target rank gets its file, even one with nothing to hold
        for spec in objects:
            f = self._file(0)
            start = f.tell()
            buf = io.BytesIO()
            torch.save(spec.value, buf)
            f.write(buf.getvalue())
            self._storage[MetadataIndex(spec.key)] = _StorageInfo(_file_name(0), start, f.tell() - start)
            self._state_md[spec.key] = BytesStorageMetadata()
            self._paths[spec.key] = tuple(spec.path)

    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        chunks = []
        for i, (rank, box) in enumerate(self.placement(spec)):
            f = self._file(rank)
            start = f.tell()
            writer = ArchiveWriter(f)
            placeholder, stream = writer.new_tensor(spec.dtype, box[1])
            with stream:
                stream_tensor(lambda t: stream.write(_bytes(t)), spec, read, budget, box)
            length = writer.finish(placeholder)
            self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + length
            self._storage[MetadataIndex(spec.key, box[0], i)] = _StorageInfo(_file_name(rank), start, length)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(box[0]), sizes=torch.Size(box[1])))
        self._state_md[spec.key] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), torch.Size(spec.shape), chunks)
        self._paths[spec.key] = tuple(spec.path)

    def _close(self) -> None:
        while self._stack:
            self._stack.pop().__exit__(None, None, None)
        self._files.clear()

    def finalize(self) -> None:
        self._close()
        metadata = Metadata(
            state_dict_metadata=self._state_md,
            planner_data={k: self._paths[k] for k in self._order if k in self._paths},
            storage_data=self._storage,
            storage_meta=StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4()), load_id=None),
            version=DCP_VERSION,
        )
        self.tmp.child(METADATA_FILE).write_bytes(pickle.dumps(metadata))
        super().finalize()


def _file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _bytes(t: torch.Tensor) -> memoryview:
    from .torchzip import tensor_buffer

    return tensor_buffer(t.contiguous())


def open_dcp(url: str, storage_options: dict[str, Any] | None = None) -> DcpSource:
    return DcpSource(resolve(url, storage_options))
