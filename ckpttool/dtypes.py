"""Element types without torch: :class:`DType` names a torch dtype and knows its size, so a
checkpoint is described and checked (``inspect``, ``verify``) without importing torch.

The index keeps a DType per tensor (``TensorEntry.element_type``); ``.torch`` gives torch's own
dtype where a tensor is made, importing torch then. Every format stores a dtype by one of torch's
names (a DCP or ``torch.save`` pickle names the global ``torch.float32``, a legacy storage class
``FloatStorage``; safetensors its own code, mapped in ``formats/safetensors.py``).
"""

from __future__ import annotations

import sys
from typing import Any

from .errors import FormatError


class DType:
    """A torch dtype by its name (``"float32"``): ``itemsize`` is the bytes per element of a
    plain dtype (bool is one byte, as every format stores it), None for one whose elements are not
    plain bytes (quantized, sub-byte). One instance per name (made by :func:`dtype_of` and the
    tables below, never directly), so ``==`` and ``is`` agree."""

    __slots__ = ("name", "itemsize", "_torch")

    def __init__(self, name: str, itemsize: int | None):
        self.name = name
        self.itemsize = itemsize
        self._torch: Any = None

    def __reduce__(self) -> tuple[Any, tuple[str, int | None]]:  # (sent between workers: the same instance back)
        return _intern, (self.name, self.itemsize)

    def __str__(self) -> str:
        return f"torch.{self.name}"  # as torch spells its dtypes, so messages read the same either way

    __repr__ = __str__

    @property
    def plain(self) -> bool:
        return self.itemsize is not None

    @property
    def torch(self) -> Any:
        """torch's own dtype (imports torch): where a tensor is made."""
        if self._torch is None:
            import torch

            value = getattr(torch, self.name, None)
            if not isinstance(value, torch.dtype):
                raise FormatError(f"dtype {self} does not exist in torch {torch.__version__}",
                                  hint="read the checkpoint with the torch release that wrote it")
            self._torch = value
        return self._torch


_BY_NAME: dict[str, DType] = {}


def _intern(name: str, itemsize: int | None) -> DType:
    dt = _BY_NAME.get(name)
    if dt is None:
        dt = _BY_NAME[name] = DType(name, itemsize)
    return dt


#: the plain dtypes (elements are plain bytes: the only ones read or written), with their sizes
PLAIN: dict[str, DType] = {name: _intern(name, size) for name, size in (
    ("float64", 8), ("float32", 4), ("float16", 2), ("bfloat16", 2), ("complex128", 16), ("complex64", 8),
    ("complex32", 4), ("bool", 1), ("int64", 8), ("int32", 4), ("int16", 2), ("int8", 1), ("uint64", 8),
    ("uint32", 4), ("uint16", 2), ("uint8", 1), ("float8_e4m3fn", 1), ("float8_e5m2", 1), ("float8_e4m3fnuz", 1),
    ("float8_e5m2fnuz", 1), ("float8_e8m0fnu", 1),
)}

#: torch's other names of plain dtypes (``torch.float`` is ``torch.float32``)
ALIASES: dict[str, DType] = {alias: PLAIN[name] for alias, name in (
    ("double", "float64"), ("float", "float32"), ("half", "float16"), ("cdouble", "complex128"), ("cfloat", "complex64"),
    ("chalf", "complex32"), ("long", "int64"), ("int", "int32"), ("short", "int16"),
)}

#: the legacy typed-storage class names ``torch.save`` writes into its pickle, per dtype name (a
#: fixed part of the format; ``compat.LEGACY_STORAGE_NAMES`` is the same table keyed by torch's dtypes)
LEGACY_STORAGE: dict[str, str] = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "int64": "LongStorage",
    "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "bfloat16": "BFloat16Storage", "complex128": "ComplexDoubleStorage", "complex64": "ComplexFloatStorage",
    "qint8": "QInt8Storage", "qint32": "QInt32Storage", "quint8": "QUInt8Storage", "quint4x2": "QUInt4x2Storage",
    "quint2x4": "QUInt2x4Storage",
}
#: 'FloatStorage' -> DType float32, ... (quantized ones are not plain: read, then refused by size)
STORAGE_DTYPES: dict[str, DType] = {storage: PLAIN.get(name) or _intern(name, None) for name, storage in LEGACY_STORAGE.items()}

_FROM_TORCH: dict[Any, DType] = {}


def named(name: str) -> DType | None:
    """The plain dtype torch calls ``name`` (an alias included), None for any other name."""
    return PLAIN.get(name) or ALIASES.get(name)


def dtype_of(dtype: Any) -> DType:
    """The DType of a torch dtype (or a DType); a dtype we know no size of (quantized, sub-byte)
    is a DType with no ``itemsize``."""
    if isinstance(dtype, DType):
        return dtype
    dt = _FROM_TORCH.get(dtype)
    if dt is None:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(dtype, torch.dtype):
            raise TypeError(f"not a dtype: {dtype!r}")
        name = str(dtype).removeprefix("torch.")
        dt = _FROM_TORCH[dtype] = named(name) or _intern(name, None)
    return dt


def torch_dtype(dtype: Any) -> Any:
    """torch's dtype of a DType or of a torch dtype (imports torch): where a tensor is made."""
    return dtype.torch if isinstance(dtype, DType) else dtype


def dtype_size(dtype: Any) -> int:
    """Bytes per element of a DType or torch dtype; :class:`FormatError` for one whose elements
    are not plain bytes (quantized tensors, for example)."""
    size = _SIZES.get(dtype)  # (asked ~20 times a record: a lookup)
    if size is None:
        size = dtype_of(dtype).itemsize
        if size is None:
            raise FormatError(f"dtype {dtype} is not supported", hint="ckpttool reads plain (non-quantized) tensors")
        _SIZES[dtype] = size
    return size


_SIZES: dict[Any, int] = {}


__all__ = ["ALIASES", "DType", "LEGACY_STORAGE", "PLAIN", "STORAGE_DTYPES", "dtype_of", "dtype_size", "named", "torch_dtype"]
