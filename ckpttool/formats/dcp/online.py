"""DCP in the training loop: torch's own reader and writer with our rules, and the step's manifest.

``.metadata`` and every object record go through the allow-listed unpickler (torch would unpickle
objects with ``weights_only=False``); saves write one fsync'ed file per rank.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ...checksums import ALGORITHM, hash_range, new_block
from ...storage import BytesReader, Location
from ..torchzip import load_object_record
from .metadata import file_rank, read_metadata


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
    if loc.local_path is not None:
        reader = _SafeFileSystemReader(loc.local_path)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class _SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
            pass

        reader = _SafeFsspecReader(loc.url, **(storage_options or {}))
    reader._ckpt_location = loc
    return reader


def dcp_writer(loc: Location, storage_options: dict[str, Any] | None = None):
    """A DCP StorageWriter for ``loc`` (a single file per rank, fsync'ed)."""
    if loc.local_path is not None:
        return FileSystemWriter(loc.local_path, single_file_per_rank=True, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(loc.url, single_file_per_rank=True, sync_files=True, **(storage_options or {}))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but object records are read through our allow-list (DCP uses ``weights_only=False``)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        data = value.getvalue()
        obj = load_object_record(BytesReader(data, f"object {fqn!r}"), 0, len(data), f"object {fqn!r}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def hash_records(step_dir: Location, rank: int | None = None) -> dict[str, Any]:
    """The manifest rows of a step's data files (only those ``rank`` wrote, when given):
    ``{"algorithm": ..., "records": {FILE: [[offset, length, hexdigest], ...]}}``."""
    metadata = read_metadata(step_dir)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        if rank is None or file_rank(info.relative_path) == rank:
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    buf = new_block()
    records: dict[str, list[list[Any]]] = {}
    for name, spans in sorted(by_file.items()):
        reader = step_dir.child(name).open_reader()
        try:
            records[name] = [[off, length, hash_range(reader, off, length, buf)] for off, length in sorted(spans)]
        finally:
            reader.close()
    return {"algorithm": ALGORITHM, "records": records}
