"""What a ``torch.save`` pickle describes, before any byte of it is read: a tensor as a reference to
a range of a storage record. Pure data (the allow-listed unpickler makes them; formats read them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .dtypes import DType, dtype_of

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StorageRef:
    """A persistent-id reference to ``data/<key>`` in a torch zip archive."""

    key: str
    element_type: DType | None  # None for UntypedStorage (dtype comes from _rebuild_tensor_v3)
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor described by a ``torch.save`` pickle, not yet read: ``element_type`` is its dtype
    without torch, ``dtype`` torch's (importing torch)."""

    storage: StorageRef
    element_type: DType
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "element_type", dtype_of(self.element_type))

    @property
    def dtype(self) -> torch.dtype:
        return self.element_type.torch

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True
