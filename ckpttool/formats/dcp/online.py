"""DCP saves in the training loop: torch's own writer (one fsync'ed file per rank) and the step's
manifest. Loads go through ``load.py``, not torch's reader.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from ... import compat
from ...checksums import ALGORITHM, hash_bytes, hash_range, new_block
from ...storage import Location
from .metadata import METADATA_FILE, file_rank, read_metadata, read_metadata_bytes


def dcp_writer(loc: Location, storage_options: dict[str, Any] | None = None, compress: str | None = None):
    """A DCP StorageWriter for ``loc`` (a single file per rank, fsync'ed; with ``compress``,
    torch's own zstd extension on every record)."""
    extra: dict[str, Any] = {}
    if compress is not None:
        extra["_extensions"] = [compat.zstd_extension()]
    if loc.local_path is not None:
        return FileSystemWriter(loc.local_path, single_file_per_rank=True, sync_files=True, **extra)
    FsspecWriter = compat.fsspec_writer_class()
    return FsspecWriter(loc.url, single_file_per_rank=True, sync_files=True, **extra, **(storage_options or {}))


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


def metadata_row(step_dir: Location) -> dict[str, list[Any]]:
    """The manifest's entry for ``.metadata`` itself: ``{".metadata": [length, hexdigest]}``."""
    raw = read_metadata_bytes(step_dir)
    return {METADATA_FILE: [len(raw), hash_bytes(raw)]}
