"""DCP's ``.metadata`` pickle written without importing ``torch.distributed.checkpoint``.

Importing that package costs 0.8-1.3 s here (it pulls in DTensor and, through it, sympy), a
quarter to half of a 1 GB offline reshard, for nothing but the names its pickle carries. So the
offline sink builds the metadata from the stand-ins below and pickles them with the C pickler:
each stand-in class (and each placeholder for a torch value: ``torch.Size``, a dtype, a layout) is
a global of this module, which protocol 3 writes as one ``GLOBAL`` opcode, ``c<module>\\n<name>\\n``,
the first time it is used (a memo reference after that). Those opcodes are then rewritten to
name torch's classes. Nothing else in the bytes changes: torch (any release) unpickles the result
into its own classes, field for field what ``Metadata(...)`` built by torch's classes pickles to.

The one way for that rewrite to touch something else is a string of the data (a key, a path)
that contains this module's name; :func:`dumps` then returns None and the caller pickles torch's
own classes instead.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from ...dtypes import PLAIN
from . import torch_names

MODULE = __name__
_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"

#: this module's global -> the module that holds the torch global of the same name
_RENAMES: dict[str, str] = {}


def _rename(module: str) -> Any:
    def register(obj: Any) -> Any:
        obj.__module__ = MODULE
        _RENAMES[obj.__qualname__] = module
        return obj

    return register


class _Record:
    """A dataclass instance as pickle sees it: the class, then its ``__dict__`` (``BUILD``)."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


@_rename(_METADATA)
class Metadata(_Record):
    pass


@_rename(_METADATA)
class MetadataIndex(_Record):
    pass


@_rename(_METADATA)
class TensorStorageMetadata(_Record):
    pass


@_rename(_METADATA)
class BytesStorageMetadata(_Record):
    pass


@_rename(_METADATA)
class ChunkStorageMetadata(_Record):
    pass


@_rename(_METADATA)
class StorageMeta(_Record):
    pass


@_rename(_FILESYSTEM)
class _StorageInfo(_Record):
    pass


@_rename(_METADATA)
class TensorProperties:
    """Pickled as torch's five-field state (dtype, layout, requires_grad, memory format
    encoding, pin_memory): what every release in the range reads (``compat.dump_metadata``)."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def __getstate__(self) -> tuple[Any, ...]:
        return (_VALUES[self.dtype], _VALUES["strided"], False, _CONTIGUOUS, False)


@_rename(_METADATA)
class _MEM_FORMAT_ENCODING:  # noqa: N801 - torch's name, as the pickle spells it
    def __init__(self, value: int):
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _MEM_FORMAT_ENCODING, (self.value,)


_CONTIGUOUS = _MEM_FORMAT_ENCODING(0)  # TORCH_CONTIGUOUS_FORMAT


@_rename("torch")
class Size(tuple):
    """``torch.Size(tuple)``, as torch's own ``__reduce__`` writes it."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[tuple[int, ...]]]:
        return Size, (tuple(self),)


#: torch_names' placeholder -> the torch module that holds the global of the same name
_TORCH_NAMES: dict[str, str] = {}


def _placeholder(name: str, module: str = "torch") -> Any:
    """A function named ``name`` in :mod:`.torch_names`: pickle writes it as that module's global,
    rewritten to ``module.name`` (a dtype is a global of ``torch``)."""

    def ref(*args: Any) -> None:  # never called: only its name is pickled
        raise AssertionError(name)

    ref.__name__ = ref.__qualname__ = name
    ref.__module__ = torch_names.__name__
    setattr(torch_names, name, ref)
    _TORCH_NAMES[name] = module
    return ref


class _Layout:
    """``torch.strided``, as torch pickles a layout: ``torch.serialization._get_layout("torch.strided")``."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _GET_LAYOUT, ("torch.strided",)


_GET_LAYOUT = _placeholder("_get_layout", "torch.serialization")
#: every plain dtype (safe_torch's names are torch's) and the one layout, by name
_VALUES: dict[str, Any] = {**{name: _placeholder(name) for name in PLAIN}, "strided": _Layout()}


def dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32`` or ckpttool's stand-in for it."""
    return str(dtype).removeprefix("torch.")


def metadata_index(fqn: str, offset: Size | None, index: int | None) -> MetadataIndex:
    """As torch's ``MetadataIndex.__init__`` fills its ``__dict__``: ``offset`` last, and only when set."""
    record = MetadataIndex(fqn=fqn, index=index)
    if offset is not None:
        record.offset = offset
    return record


def storage_info(file: str, offset: int, length: int, transforms: list[str] | None) -> _StorageInfo:
    """torch's ``_StorageInfo`` pickles its fields that are not None."""
    record = _StorageInfo(relative_path=file, offset=offset, length=length)
    if transforms:
        record.transform_descriptors = list(transforms)
    return record


def metadata(**fields: Any) -> Metadata:
    """``Metadata`` with ``version`` (torch >= 2.9 writes it; an older torch ignores the attribute)."""
    from ...compat import DCP_VERSION

    return Metadata(**fields, version=DCP_VERSION)


def to_torch(obj: Any) -> Any:
    """The same metadata built from torch's classes (imports torch.distributed.checkpoint): for
    the rare metadata :func:`dumps` declines."""
    import torch

    from ... import compat
    from torch.distributed.checkpoint import metadata as md

    if isinstance(obj, dict):
        return {to_torch(k): to_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_torch(v) for v in obj]
    if isinstance(obj, Size):
        return torch.Size(obj)
    if isinstance(obj, TensorProperties):
        return md.TensorProperties(dtype=getattr(torch, obj.dtype))
    if isinstance(obj, MetadataIndex):
        return md.MetadataIndex(obj.fqn, to_torch(getattr(obj, "offset", None)), obj.index)
    if isinstance(obj, _StorageInfo):
        return compat.storage_info(obj.relative_path, obj.offset, obj.length, getattr(obj, "transform_descriptors", None))
    if isinstance(obj, Metadata):
        fields = {k: to_torch(v) for k, v in obj.__dict__.items() if k != "version"}
        return compat.dcp_metadata(**fields)
    if isinstance(obj, _Record):
        return getattr(md, type(obj).__name__)(**{k: to_torch(v) for k, v in obj.__dict__.items()})
    return obj


def dumps(metadata: Metadata, strings: Iterable[str], dtypes: Iterable[str]) -> bytes | None:
    """The pickle of ``metadata`` naming torch's classes and values, or None when one of
    ``strings`` (every key and path in it) contains a placeholder module's name (see the module's
    doc) or one of ``dtypes`` (the names in its TensorProperties) has no placeholder."""
    if not set(dtypes) <= PLAIN.keys() or any(MODULE in s or torch_names.__name__ in s for s in strings):
        return None
    data = pickle.dumps(metadata, protocol=3)  # no frames (4): the renames change lengths
    for name, module in _RENAMES.items():
        data = data.replace(f"c{MODULE}\n{name}\n".encode(), f"c{module}\n{name}\n".encode(), 1)
    for name, module in _TORCH_NAMES.items():
        data = data.replace(f"c{torch_names.__name__}\n{name}\n".encode(), f"c{module}\n{name}\n".encode(), 1)
    if MODULE.encode() in data or torch_names.__name__.encode() in data:  # a global left unrenamed (a bug)
        raise AssertionError(f"{MODULE} left in a .metadata pickle")
    return data


class Described:
    """What a step's ``.metadata`` describes, whoever wrote the records (the training writer from
    its ranks' indexes, the offline sink from its files): keys in order, each key's planner path,
    each object's record and each tensor's shape, dtype and chunks' records. A record is
    (file, offset, length, transforms); a chunk is (offsets, sizes, record)."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.paths: dict[str, tuple] = {}
        self.objects: dict[str, tuple[str, int, int, list[str] | None]] = {}
        self.tensors: dict[str, tuple[tuple[int, ...], str, list[tuple[tuple, tuple, tuple]]]] = {}


def metadata_bytes(described: Described, save_id: str) -> bytes:
    """The ``.metadata`` pickle of ``described``: from the stand-ins (no import of
    torch.distributed.checkpoint), or torch's own classes where :func:`dumps` declines."""
    # one string object per key: pickle writes a string it has seen as a back-reference, so the
    # bytes do not depend on which copy of a key (a worker's, another rank's index) came where
    own = {k: k for k in described.order}
    state_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key, (file, offset, length, transforms) in described.objects.items():
        key = own.get(key, key)
        storage[metadata_index(key, None, None)] = storage_info(file, offset, length, transforms)
        state_md[key] = BytesStorageMetadata()
    dtypes = {}
    for key, (shape, dtype, chunks) in described.tensors.items():
        key = own.get(key, key)
        md_chunks = []
        for i, (offsets, sizes, (file, offset, length, transforms)) in enumerate(chunks):
            storage[metadata_index(key, Size(offsets), i)] = storage_info(file, offset, length, transforms)
            md_chunks.append(ChunkStorageMetadata(offsets=Size(offsets), sizes=Size(sizes)))
        dtypes[key] = dtype
        state_md[key] = TensorStorageMetadata(properties=TensorProperties(dtype), size=Size(shape), chunks=md_chunks)
    planner = {own[k]: described.paths[k] for k in described.order if k in described.paths}
    md = metadata(state_dict_metadata={own[k]: state_md[k] for k in described.order if k in state_md},
                  planner_data=planner, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=None, save_id=save_id, load_id=None, modules=[]))
    # what may hold the stand-ins' module name: keys and paths (file names are ckpttool's)
    strings = [*described.order, *(p for path in planner.values() for p in path if isinstance(p, str))]
    data = dumps(md, strings, dtypes.values())
    if data is None:
        from ...compat import dump_metadata

        return dump_metadata(to_torch(md))
    return data
