"""One ``torch.save`` file of a nested state dict: the registered format, its Source and Sink.

Reading never materialises the file: the archive's pickle is unpickled through the allow-list with
tensors as references, and each tensor's bytes are read by range. Writing streams each tensor into
its own zip record and writes the pickle last, so ``torch.load(out, weights_only=True)`` returns the
nested dict, and memory holds one slab at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

import torch

from ..checksums import new_block, scan
from ..errors import ChecksumError, CkptError, CorruptCheckpointError, FormatError
from ..index import Chunk, Index, ObjectEntry, TensorEntry, dtype_size, flatten, unflatten
from ..layout import Box, whole
from ..report import Report
from ..safe_pickle import TensorRef
from ..storage import Location
from .base import Format, ObjectSpec, Probe, Progress, ReadFn, Sink, SinkOptions, Source, TensorSpec, stream_tensor
from .torchzip import ArchiveWriter, StoredStorage, check_ref, read_archive, read_tensor_box, span_bytes

ZIP_MAGIC = b"PK\x03\x04"


def _is_ref(value: Any) -> bool:
    return isinstance(value, TensorRef)


class TorchSaveSource(Source):
    """With ``verify`` (the default) each storage record's CRC-32 is checked before its first read."""

    format = "torch"

    def __init__(self, location: Location, verify: bool = True):
        super().__init__(location)
        self._crc_checked: set[str] | None = set() if verify else None  # storages whose CRC was checked
        self.reader = location.open_reader()
        self._archive = read_archive(self.reader, 0, None, location.url)
        obj = self._archive.obj
        if isinstance(obj, TensorRef):
            obj = {"tensor": obj}
        if not isinstance(obj, Mapping):
            raise FormatError(
                f"top level of the file is a {type(obj).__name__}, not a dict", where=location.url, hint="ckpttool reads state dicts"
            )
        flat, paths = flatten(obj, is_tensor=_is_ref)
        idx = Index()
        for key, value in flat.items():
            if isinstance(value, TensorRef):
                check_ref(value, self.storage_of(value, key), f"{location.url} (key {key!r})")
                idx.add(TensorEntry(key, value.shape, value.dtype, (Chunk(tuple(0 for _ in value.shape), value.shape, value),)), paths[key])
            else:
                idx.add(ObjectEntry(key, value), paths[key])
        self._index = idx

    def index(self) -> Index:
        return self._index

    def storage_of(self, ref: TensorRef, key: str) -> StoredStorage:
        """Where the bytes of the storage ``ref`` views lie."""
        storage = self._archive.storages.get(ref.storage.key)
        if storage is None:
            raise CorruptCheckpointError("tensor's storage record is missing from the archive", where=f"{self.location.url} (key {key!r})")
        return storage

    def _checked_storage(self, ref: TensorRef, key: str) -> StoredStorage:
        storage = self.storage_of(ref, key)
        if self._crc_checked is not None and storage.name not in self._crc_checked:
            crc = scan(self.reader, storage.offset, storage.nbytes, new_block())
            if crc != storage.crc32:
                raise ChecksumError(f"data of {key!r} does not match its CRC-32 (stored {storage.crc32:08x}, computed {crc:08x})",
                                    where=self.location.url, hint="the file changed after it was written; restore it")
            self._crc_checked.add(storage.name)
        return storage

    def _ref(self, key: str) -> TensorRef:
        return self.entry(key, TensorEntry).chunks[0].location

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        ref = self._ref(key)
        box = box if box is not None else whole(ref.shape)
        return read_tensor_box(self.reader, ref, self._checked_storage(ref, key), box, f"{self.location.url} (key {key!r})", out)

    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        storage = self.storage_of(self._ref(key), key)
        return [(self.location, storage.offset, storage.offset + storage.nbytes)]

    def close(self) -> None:
        self.reader.close()


class TorchSaveSink(Sink):
    format = "torch"

    def __init__(self, location: Location):
        super().__init__(location)
        self._writer: ArchiveWriter | None = None
        self._flat: dict[str, Any] = {}
        self._paths: dict[str, tuple] = {}

    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        f: IO[bytes] = self.open_file(self.tmp)
        self._writer = self.enter(ArchiveWriter(f, name="archive"))
        for spec in entries:  # the pickled dict keeps the source's key order
            self._flat[spec.key] = spec.value if isinstance(spec, ObjectSpec) else None
            self._paths[spec.key] = tuple(spec.path)

    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        placeholder, stream = self._writer.new_tensor(spec.dtype, spec.shape)
        with stream:
            stream_tensor(stream.write, spec, read, budget)
        self._flat[spec.key] = placeholder

    def complete(self) -> None:
        self._writer.finish(unflatten(self._flat, self._paths))


class TorchSaveFormat(Format):
    name = "torch"
    checksums = True  # the zip's CRC-32 of every storage record

    def sniff(self, probe: Probe) -> bool:
        return not probe.is_dir and probe.head[:4] == ZIP_MAGIC

    def diagnose(self, probe: Probe) -> FormatError | None:
        if not probe.is_dir and probe.head[:1] == b"\x80":
            return FormatError("legacy (pre-1.6, non-zip) torch.save file", where=probe.loc.url,
                               hint="load and re-save it with a current torch")
        return None

    def open_source(self, loc: Location, verify: bool = True) -> TorchSaveSource:
        return TorchSaveSource(loc, verify=verify)

    def make_sink(self, loc: Location, options: SinkOptions) -> TorchSaveSink:
        return TorchSaveSink(loc)

    def check_integrity(self, source: TorchSaveSource, report: Report, only: str | None, progress: Progress | None) -> None:
        """The zip's CRC-32 of every storage record the entries use, and each tensor inside its record."""
        buf = new_block()
        checked: set[str] = set()
        index = source.index()
        keys = index.under(only)
        total = sum(index[k].nbytes for k in keys if isinstance(index[k], TensorEntry))
        done = 0
        for key in keys:
            entry = index[key]
            if not isinstance(entry, TensorEntry):
                report.objects_checked += 1
                continue
            ref = entry.chunks[0].location
            try:
                storage = source.storage_of(ref, key)
            except CkptError as exc:
                report.add(exc.what, source.location.url, key)
                continue
            if storage.name not in checked:
                checked.add(storage.name)
                crc = scan(source.reader, storage.offset, storage.nbytes, buf)
                if crc != storage.crc32:
                    report.add(f"data of {storage.name} does not match its CRC-32 (stored {storage.crc32:08x}, computed {crc:08x})",
                               source.location.url, key, hint="the file changed after it was written; restore it")
            if ref.storage_offset * dtype_size(ref.dtype) + span_bytes(ref) > storage.nbytes:
                report.add("tensor extends past its storage record", source.location.url, key)
            report.checked_tensor(entry.nbytes)
            done += entry.nbytes
            if progress:
                progress(done, total, key)


FORMAT = TorchSaveFormat()
