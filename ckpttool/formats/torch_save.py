"""One ``torch.save`` file of a nested state dict, as a Source and a Sink.

Reading never materialises the file: the archive's pickle is unpickled through the allow-list with
tensors as references, and each tensor's bytes are read by range. Writing streams each tensor into
its own zip record and writes the pickle last, so ``torch.load(out, weights_only=True)`` returns the
nested dict, and memory holds one slab at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import FormatError
from ..index import Chunk, Index, ObjectEntry, TensorEntry, flatten, unflatten
from ..layout import Box, whole
from ..safe_pickle import TensorRef
from ..storage import Location
from .base import ObjectSpec, ReadFn, Sink, Source, TensorSpec, stream_tensor
from .torchzip import ArchiveWriter, read_archive, read_tensor_box, tensor_buffer


def _is_ref(value: Any) -> bool:
    return isinstance(value, TensorRef)


class TorchSaveSource(Source):
    format = "torch"

    def __init__(self, location: Location):
        super().__init__(location)
        self._reader = location.open_reader()
        self._archive = read_archive(self._reader, 0, None, location.url)
        obj = self._archive.obj
        if isinstance(obj, TensorRef):
            obj = {"tensor": obj}
        if not isinstance(obj, Mapping):
            raise FormatError(
                f"top level of the file is a {type(obj).__name__}, not a dict", where=location.url, hint="ckpttool reads state dicts"
            )
        flat, paths = flatten(obj, is_tensor=_is_ref)
        self._values = flat
        idx = Index()
        for key, value in flat.items():
            if isinstance(value, TensorRef):
                idx.add(TensorEntry(key, value.shape, value.dtype, (Chunk(tuple(0 for _ in value.shape), value.shape, value),)), paths[key])
            else:
                idx.add(ObjectEntry(key, value), paths[key])
        self._index = idx

    def index(self) -> Index:
        return self._index

    def storage_of(self, ref: TensorRef):
        return self._archive.storages[ref.storage.key]

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        entry = self._index[key]
        if not isinstance(entry, TensorEntry):
            raise FormatError(f"{key!r} is an object, not a tensor")
        ref: TensorRef = entry.chunks[0].location
        box = box if box is not None else whole(entry.shape)
        return read_tensor_box(self._reader, ref, self.storage_of(ref), box, f"{self.location.url} (key {key!r})", out)

    def read_object(self, key: str) -> Any:
        entry = self._index[key]
        if not isinstance(entry, ObjectEntry):
            raise FormatError(f"{key!r} is a tensor, not an object")
        return entry.location

    def close(self) -> None:
        self._reader.close()


class TorchSaveSink(Sink):
    format = "torch"

    def __init__(self, location: Location):
        super().__init__(location)
        self._cm = None
        self._f = None
        self._writer: ArchiveWriter | None = None
        self._flat: dict[str, Any] = {}
        self._paths: dict[str, tuple] = {}

    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        self._cm = self.tmp.open_write()
        self._f = self._cm.__enter__()
        self._writer = ArchiveWriter(self._f, name="archive")
        for spec in entries:  # the pickled dict keeps the source's key order
            self._flat[spec.key] = spec.value if isinstance(spec, ObjectSpec) else None
            self._paths[spec.key] = tuple(spec.path)

    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        placeholder, stream = self._writer.new_tensor(spec.dtype, spec.shape)
        with stream:
            stream_tensor(lambda t: stream.write(tensor_buffer(t.contiguous())), spec, read, budget)
        self._flat[spec.key] = placeholder

    def finalize(self) -> None:
        self._writer.finish(unflatten(self._flat, self._paths))
        super().finalize()

    def _close(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)
