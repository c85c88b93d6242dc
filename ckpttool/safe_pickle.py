"""Allow-listed unpickling of every pickle in a checkpoint, so no checkpoint runs code.

One policy, ours, for DCP ``.metadata``, DCP object records and ``torch.save`` files (not
``torch.load(weights_only=True)``, whose process-global allow-list changes between torch versions).

``pickle.Unpickler.find_class`` is the only door through which a pickle reaches code; ours admits
a fixed list of classes and refuses everything else with :class:`UnsafePickleError` naming the file
and the global, before anything from the pickle has been called.

Tensors in ``torch.save`` pickles are not materialised: they come back as :class:`TensorRef`
(dtype, shape, stride, storage key) so callers read their bytes by range, under a memory budget.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsafePickleError


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """How protocol-2 pickles spell ``bytes``: ``_codecs.encode(str, 'latin1')``; nothing else."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise UnsafePickleError(f"refused _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


# Classes DCP metadata pickles (torch 2.4 .. 2.13): dataclasses of torch.distributed.checkpoint.
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
}

def _get_layout(name: str) -> torch.layout:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise UnsafePickleError(f"unknown tensor layout {name!r}")
    return value


_COMMON = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): bytearray,
    ("torch", "device"): torch.device,
    ("_codecs", "encode"): _latin1_encode,
}


def _torch_global(module: str, name: str) -> Any | None:
    """dtypes, layouts and memory formats are module attributes of ``torch``; admit only those."""
    if module != "torch":
        return None
    value = getattr(torch, name, None)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    return None


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str, extra: dict[tuple[str, str], Any] | None = None):
        super().__init__(io.BytesIO(data))
        self._source = source
        self._extra = extra or {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self._extra:
            return self._extra[key]
        if key in _COMMON:
            return _COMMON[key]
        if key in _DCP_CLASSES:
            return super().find_class(module, name)
        value = _torch_global(module, name)
        if value is not None:
            return value
        raise UnsafePickleError(
            f"refused to unpickle global '{module}.{name}'",
            where=self._source,
            hint="the file asks to run code that a checkpoint never needs; nothing from it was run. "
            "If you wrote this file yourself and trust it, load it with plain torch",
        )


def load_dcp_metadata(data: bytes, source: str) -> Any:
    """Unpickle a DCP ``.metadata`` file, admitting only DCP's own metadata classes."""
    try:
        return _AllowListUnpickler(data, source).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # a truncated or random file: say so, with the file
        raise CorruptCheckpointError(
            f"cannot read DCP metadata ({type(exc).__name__}: {exc})",
            where=source,
            hint="the .metadata file is damaged; restore it or use another step",
        ) from None


# --- torch.save pickles --------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageRef:
    """A persistent-id reference to ``data/<key>`` in a torch zip archive."""

    key: str
    dtype: torch.dtype | None  # None for UntypedStorage (dtype comes from _rebuild_tensor_v3)
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor described by a ``torch.save`` pickle, not yet read."""

    storage: StorageRef
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return TensorRef(storage, storage.dtype, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return TensorRef(storage, dtype, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad, hooks):
    return data


def _rebuild_parameter_with_state(data, requires_grad, hooks, state):
    return data


class _StorageType:
    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype


def _storage_class(module: str, name: str) -> _StorageType | None:
    if (module, name) in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
        return _StorageType(None)
    if module == "torch" and name in _LEGACY_STORAGE_DTYPES:
        return _StorageType(_LEGACY_STORAGE_DTYPES[name])
    return None


# 'FloatStorage' -> torch.float32, ... (the legacy typed-storage names torch.save still writes)
_LEGACY_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


class _TorchSaveUnpickler(_AllowListUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        storage = _storage_class(module, name)
        if storage is not None:
            return storage
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"unexpected persistent id {pid!r}", where=self._source)
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise UnsafePickleError(f"unexpected storage type {storage_type!r}", where=self._source)
        return StorageRef(str(key), storage_type.dtype, int(numel))


_TORCH_REBUILDERS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
}


def load_torch_pickle(data: bytes, source: str) -> Any:
    """Unpickle a ``torch.save`` ``data.pkl``: containers and scalars as themselves, tensors as
    :class:`TensorRef`. Admits what ``torch.load(weights_only=True)`` admits for plain state dicts.
    Used for ``torch.save`` files and for DCP's object records (each a ``torch.save`` archive)."""
    try:
        return _TorchSaveUnpickler(data, source, _TORCH_REBUILDERS).load()
    except UnsafePickleError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(
            f"cannot read the pickle ({type(exc).__name__}: {exc})",
            where=source,
            hint="the file is damaged or not written by torch.save",
        ) from None
