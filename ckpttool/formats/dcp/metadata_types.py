"""DCP's ``.metadata`` classes as plain dataclasses of ours: the one set ckpttool reads and writes,
so a DCP checkpoint is read and written without importing ``torch.distributed.checkpoint``. The
allow-listed unpickler builds these where the pickle names torch's (same fields, defaults and
pickled state, ``TensorProperties`` of any release), with torch's values as ``safe_torch``
stand-ins; ``metadata_pickle`` pickles them under torch's names for every writer (the training
save and the offline sink), bytes equal to torch's own pickling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ...compat import check_properties_state
from ...dtypes import PLAIN
from ...safe_torch import LAYOUTS, MEMORY_FORMATS, Size


@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


class _MEM_FORMAT_ENCODING(Enum):  # noqa: N801 - torch's name, as the pickle spells it
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {
    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: MEMORY_FORMATS["contiguous_format"],
    _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: MEMORY_FORMATS["channels_last"],
    _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: MEMORY_FORMATS["preserve_format"],
}


@dataclass
class TensorProperties:
    """Pickled as the tuple (dtype, layout, requires_grad, memory format encoding, pin_memory),
    plus strides since torch 2.15 (``compat.tensor_properties_reader`` reads both into torch's)."""

    dtype: Any = field(default_factory=lambda: PLAIN["float32"])
    layout: Any = LAYOUTS["strided"]
    requires_grad: bool = False
    memory_format: Any = MEMORY_FORMATS["contiguous_format"]
    pin_memory: bool = False
    strides: tuple[int, ...] | None = None

    def __setstate__(self, state: Any) -> None:
        strides = check_properties_state(state)
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state[:5]
        if encoding not in _MEMORY_FORMATS:
            raise RuntimeError(f"Invalid torch.memory_format encoding: {encoding}")
        self.memory_format = _MEMORY_FORMATS[encoding]
        self.strides = strides


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Any = None, index: int | None = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", Size(offset))


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


@dataclass
class _StoragePrefix:
    prefix: str


_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"

#: what the allow-listed unpickler builds for each DCP class a ``.metadata`` pickle names
CLASSES: dict[tuple[str, str], type] = {
    **{(_METADATA, cls.__name__): cls for cls in (Metadata, MetadataIndex, TensorStorageMetadata, BytesStorageMetadata,
                                                  ChunkStorageMetadata, TensorProperties, StorageMeta, _MEM_FORMAT_ENCODING)},
    (_FILESYSTEM, "_StorageInfo"): _StorageInfo,
    (_FILESYSTEM, "_StoragePrefix"): _StoragePrefix,
}
