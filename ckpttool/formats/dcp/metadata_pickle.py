"""DCP's ``.metadata`` pickle written without importing ``torch.distributed.checkpoint``.

Importing that package costs about a second (it pulls in DTensor and, through it, sympy), a large
part of an offline reshard of a small checkpoint, for nothing but the names its pickle carries. So the
offline sink builds the metadata from ckpttool's own classes (``metadata_types.py``: the ones the
reader unpickles into, one set for both) and pickles them with the C pickler: each class (and each
placeholder for a torch value: ``torch.Size``, a dtype, a layout) is a global of one of our modules,
which protocol 3 writes as one ``GLOBAL`` opcode, ``c<module>\n<name>\n``, the first time it is
used (a memo reference after that). Those opcodes are then rewritten to name torch's classes.
Nothing else in the bytes changes: torch (any release) unpickles the result into its own classes,
field for field what ``Metadata(...)`` built by torch's classes pickles to. Where torch pickles a
class its own way (``TensorProperties``, ``_StorageInfo``, ``torch.Size``), the pickler's
``dispatch_table`` does the same (:data:`_REDUCERS`).

The one way for that rewrite to touch something else is a string of the data (a key, a path)
that contains one of our modules' names; :func:`dumps` then returns None and the caller pickles
torch's own classes instead.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from ... import safe_torch
from ...dtypes import PLAIN
from . import metadata_types, torch_names
from .metadata_types import (  # noqa: F401 - the classes a .metadata is built from, exported for its builders
    CLASSES, BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata, _MEM_FORMAT_ENCODING, _StorageInfo,
)
from ...safe_torch import Size

MODULE = metadata_types.__name__

#: (our module, name) -> the torch module that holds the global of the same name
_RENAMES: dict[tuple[str, str], str] = {
    **{(cls.__module__, cls.__qualname__): module for (module, _), cls in CLASSES.items()},
    (safe_torch.__name__, "Size"): "torch",
}
#: what may appear in a pickle only as a renamed global
_OURS = (MODULE, safe_torch.__name__, torch_names.__name__)

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

#: how torch pickles the classes it does not pickle as their ``__dict__``: TensorProperties as its
#: five-field state (dtype, layout, requires_grad, memory format encoding, pin_memory: what every
#: release in the range reads, ``compat.dump_metadata``), _StorageInfo without its None fields,
#: torch.Size as ``Size(tuple)``
_REDUCERS: dict[type, Any] = {
    TensorProperties: lambda p: (copyreg.__newobj__, (TensorProperties,),  # type: ignore[attr-defined]
                                 (_VALUES[dtype_name(p.dtype)], _VALUES["strided"], False,
                                  _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False)),
    _StorageInfo: lambda i: (copyreg.__newobj__, (_StorageInfo,),  # type: ignore[attr-defined]
                             {k: v for k, v in i.__dict__.items() if v is not None}),
    Size: lambda s: (Size, (tuple(s),)),
}


def dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32`` or ckpttool's stand-in for it."""
    return str(dtype).removeprefix("torch.")


def metadata_index(fqn: str, offset: Size | None, index: int | None) -> MetadataIndex:
    """As torch's ``MetadataIndex.__init__`` fills its ``__dict__``: ``offset`` last, and only when set."""
    return MetadataIndex(fqn, offset, index)


def storage_info(file: str, offset: int, length: int, transforms: list[str] | None) -> _StorageInfo:
    """torch's ``_StorageInfo`` pickles its fields that are not None."""
    return _StorageInfo(file, offset, length, list(transforms) if transforms else None)


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
        return md.TensorProperties(dtype=getattr(torch, dtype_name(obj.dtype)))
    if isinstance(obj, MetadataIndex):
        return md.MetadataIndex(obj.fqn, to_torch(obj.offset), obj.index)
    if isinstance(obj, _StorageInfo):
        return compat.storage_info(obj.relative_path, obj.offset, obj.length, obj.transform_descriptors)
    if isinstance(obj, Metadata):
        return compat.dcp_metadata(**{f.name: to_torch(getattr(obj, f.name)) for f in fields(obj) if f.name != "version"})
    if type(obj) in CLASSES.values():
        return getattr(md, type(obj).__name__)(**{f.name: to_torch(getattr(obj, f.name)) for f in fields(obj)})
    return obj


def dumps(metadata: Metadata, strings: Iterable[str], dtypes: Iterable[str]) -> bytes | None:
    """The pickle of ``metadata`` naming torch's classes and values, or None when one of
    ``strings`` (every key and path in it) contains one of our modules' names (see the module's
    doc) or one of ``dtypes`` (the names in its TensorProperties) has no placeholder."""
    if not {dtype_name(d) for d in dtypes} <= PLAIN.keys() or any(m in s for s in strings for m in _OURS):
        return None
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=3)  # no frames (4): the renames change lengths
    pickler.dispatch_table = {**copyreg.dispatch_table, **_REDUCERS}
    pickler.dump(metadata)
    data = buf.getvalue()
    for (module, name), torch_module in _RENAMES.items():
        data = data.replace(f"c{module}\n{name}\n".encode(), f"c{torch_module}\n{name}\n".encode(), 1)
    for name, module in _TORCH_NAMES.items():
        data = data.replace(f"c{torch_names.__name__}\n{name}\n".encode(), f"c{module}\n{name}\n".encode(), 1)
    if any(m.encode() in data for m in _OURS):  # a global left unrenamed (a bug)
        raise AssertionError(f"one of {_OURS} left in a .metadata pickle")
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


def metadata_bytes(described: Described, save_id: str, shared: tuple[list[str], list[bytes]] | None = None) -> bytes:
    """The ``.metadata`` pickle of ``described``: written opcode by opcode (``metadata_emit.py``),
    else pickled from the stand-ins (no import of torch.distributed.checkpoint), or from torch's
    own classes where :func:`dumps` declines. ``shared``: the keys whose chunks the ranks'
    fragments hold, and the fragments (``metadata_emit.metadata_stream``; ``described`` must be
    one that writer spells)."""
    from ...compat import DCP_VERSION
    from .metadata_emit import metadata_stream

    data = metadata_stream(described, save_id, DCP_VERSION, shared)
    if data is None and shared is not None:
        raise ValueError("fragments of .metadata given for a step the stream writer does not spell")
    return data if data is not None else pickled_metadata(described, save_id)


def pickled_metadata(described: Described, save_id: str) -> bytes:
    """:func:`metadata_bytes` by way of the object graph (the stand-ins' pickle, or torch's)."""
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
        # one Size object per distinct value in a tensor (a chunk's offsets in its MetadataIndex and
        # its chunk entry; the chunks' common sizes): pickle writes a value it has seen as a
        # back-reference of a few bytes, and the merge builds a fraction of the objects
        sizes_of: dict[tuple, Size] = {}
        for i, (offsets, sizes, (file, offset, length, transforms)) in enumerate(chunks):
            at = Size(offsets)
            size = sizes_of.get(sizes)
            if size is None:
                size = sizes_of[sizes] = Size(sizes)
            storage[metadata_index(key, at, i)] = storage_info(file, offset, length, transforms)
            md_chunks.append(ChunkStorageMetadata(offsets=at, sizes=size))
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
