"""Allow-listed unpickling of every pickle in a checkpoint, so no checkpoint runs code.

One policy, ours, for DCP ``.metadata``, DCP object records and ``torch.save`` files (not
``torch.load(weights_only=True)``, whose process-global allow-list changes between torch versions).

``pickle.Unpickler.find_class`` is the only door through which a pickle reaches code; ours admits
a fixed list of classes and refuses everything else with :class:`UnsafePickleError` naming the file
and the global, before anything from the pickle has been called.

Tensors in ``torch.save`` pickles are not materialised: they come back as :class:`TensorRef`
(dtype, shape, stride, storage key) so callers read their bytes by range, under a memory budget.
torch's small values (dtypes, ``torch.Size``, layouts, devices) are read without importing torch
(``safe_torch.py``); a value holding one gets torch's own object back.
"""

from __future__ import annotations

import collections
import datetime
import functools
import io
import operator
import pathlib
import pickle
import struct
import sys
from collections.abc import Mapping
from typing import Any

from . import safe_dtensor, safe_numpy, safe_torch
from .dtypes import STORAGE_DTYPES, DType
from .refs import StorageRef, TensorRef
from .errors import CorruptCheckpointError, UnsafePickleError
from .pickle_scan import c_unpickler_may_read


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

def _empty_bytes(*args: Any) -> bytes:
    """How protocol-2 pickles spell ``b""``: ``bytes()``; any argument (a size, an iterable) is refused."""
    if args:
        raise UnsafePickleError("refused bytes() with arguments: a checkpoint's data is stored, not built by a call")
    return b""


def _bytearray(source: Any = b"", *args: Any) -> bytearray:
    """``bytearray`` from data (bytes, or a str with an encoding), never from a size: a 30-byte
    pickle must not be able to ask for gigabytes."""
    if isinstance(source, int):
        raise UnsafePickleError("refused bytearray(size): a checkpoint's data is stored, not allocated by a count")
    return bytearray(source, *args)


# --- plain stdlib values that training states hold ---------------------------------------------
# Each is rebuilt by a function of ours from checked arguments, never by calling the global the
# pickle names: torchtitan's losses kept as io.BytesIO, LR scheduler and data loader states.


class _BytesIOState:
    """Stands for a pickled ``io.BytesIO`` until the whole value is read (pickle builds it with
    NEWOBJ then BUILD: the class is "called" with no arguments, then given its state), then
    :func:`_finish` replaces it by a real ``io.BytesIO`` holding the same bytes, position and
    attributes."""

    __slots__ = ("state",)
    __hash__ = None  # type: ignore[assignment]  # never a set member or a dict key: _finish could not reach it

    def __new__(cls, *args: Any) -> _BytesIOState:
        if args:
            raise UnsafePickleError("refused io.BytesIO built with arguments")
        obj = super().__new__(cls)
        obj.state = None
        return obj

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], (bytes, bytearray))
                and type(state[1]) is int and 0 <= state[1] <= len(state[0]) and not state[2]):
            raise UnsafePickleError("refused an io.BytesIO whose state is not (bytes, a position inside them, "
                                    "no attributes)")
        self.state = state

    def build(self) -> io.BytesIO:
        if self.state is None:
            return io.BytesIO()
        value, pos, _ = self.state
        out = io.BytesIO(bytes(value))
        out.seek(pos)
        return out


class _Factory:
    """What a pickle gets for ``builtins.list``, ``dict``, ``tuple``, ``int``, ``float`` or ``str``:
    a name a defaultdict may take as its default factory, never a callable (``str`` of a shared
    structure would expand exponentially before any check could count it)."""

    def __init__(self, kind: type):
        self.kind = kind

    def __call__(self, *args: Any) -> Any:
        raise UnsafePickleError(f"refused to call builtins.{self.kind.__name__} from a pickle")

    def __repr__(self) -> str:
        return f"builtins.{self.kind.__name__}"


_FACTORY_NAMES = {t.__name__: _Factory(t) for t in (list, dict, tuple, int, float, str)}
# what a defaultdict may make for a missing key: the empty value of a plain type
_FACTORIES = (set, collections.OrderedDict)


def _defaultdict(factory: Any = None, *args: Any) -> collections.defaultdict:
    if isinstance(factory, _Factory):
        factory = factory.kind
    elif args or not (factory is None or factory in _FACTORIES):
        raise UnsafePickleError(f"refused collections.defaultdict with default factory {factory!r}")
    return collections.defaultdict(factory)


def _deque(items: Any = (), maxlen: Any = None) -> collections.deque:
    if not isinstance(items, (list, tuple)) or not (maxlen is None or (isinstance(maxlen, int) and maxlen >= 0)):
        raise UnsafePickleError("refused collections.deque from anything but a list and a length")
    return collections.deque(items, maxlen)


def _counter(items: Any = None) -> collections.Counter:
    if not (items is None or isinstance(items, dict)):
        raise UnsafePickleError("refused collections.Counter from anything but a dict")
    return collections.Counter(items or {})


def _checked(cls: type, *types: type) -> Any:
    """A datetime constructor whose arguments must be of ``types`` (a state in bytes, numbers, a tzinfo)."""

    def build(*args: Any) -> Any:
        if len(args) > 8 or not all(isinstance(a, types) for a in args):
            raise UnsafePickleError(f"refused {cls.__module__}.{cls.__name__}{tuple(type(a).__name__ for a in args)}")
        return cls(*args)

    return build


class _TorchVersion:
    """``torch.__version__`` (a ``str`` subclass), which training code stores in its extra state,
    for a pickle read into torch's own objects: pickle builds it with NEWOBJ(cls, text); this
    stand-in's ``__new__`` returns the real ``TorchVersion`` of a short string, and nothing else
    (read without torch: ``safe_torch.TorchVersion``)."""

    def __new__(cls, *args: Any) -> Any:
        from torch.torch_version import TorchVersion

        return TorchVersion(safe_torch.TorchVersion(*args))


_TZ = (datetime.timezone,)
_VALUES = {
    ("_io", "BytesIO"): _BytesIOState,
    ("io", "BytesIO"): _BytesIOState,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): _defaultdict,
    ("collections", "deque"): _deque,
    ("collections", "Counter"): _counter,
    ("datetime", "datetime"): _checked(datetime.datetime, bytes, int, *_TZ),
    ("datetime", "date"): _checked(datetime.date, bytes, int),
    ("datetime", "time"): _checked(datetime.time, bytes, int, *_TZ),
    ("datetime", "timedelta"): _checked(datetime.timedelta, int, float),
    ("datetime", "timezone"): _checked(datetime.timezone, datetime.timedelta, str),
}

#: the plain value types a checkpoint may hold besides containers, scalars and tensors (docs/security.md)
VALUE_TYPES = ("io.BytesIO", "collections.OrderedDict", "collections.defaultdict", "collections.deque",
               "collections.Counter", "datetime.datetime", "datetime.date", "datetime.time", "datetime.timedelta",
               "datetime.timezone", "torch.torch_version.TorchVersion")


def _finish(value: Any) -> Any:
    """Replace every stand-in in a freshly unpickled tree by its value (an :class:`_BytesIOState`
    by its ``io.BytesIO``, a numpy placeholder by its array or dtype); refuse a torch.distributed
    record found outside a DTensor."""
    if isinstance(value, (_BytesIOState, safe_numpy.NumpyPlaceholder)):
        return value.build()
    stray = safe_dtensor.stray_record(value)
    if stray is not None:
        raise UnsafePickleError(f"refused a {stray.kind} stored outside a DTensor",
                                hint="ckpttool reads DTensors, plain tensors and plain data")
    if isinstance(value, (list, collections.deque)):
        items = [_finish(v) for v in value]
        value.clear()
        value.extend(items)
    elif isinstance(value, tuple):
        return type(value)(_finish(v) for v in value) if type(value) is tuple else value
    elif isinstance(value, dict):
        for k in list(value):
            value[k] = _finish(value[k])
    return value


_COMMON = {
    **_VALUES,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("builtins", "set"): set,
    # plain types, only as a defaultdict's factory (calling one is refused: _Factory)
    **{("builtins", name): token for name, token in _FACTORY_NAMES.items()},
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "bytes"): _empty_bytes,
    ("_codecs", "encode"): _latin1_encode,
}


@functools.cache
def _torch_callables() -> dict[tuple[str, str], Any]:
    """torch's own objects for the torch callables a pickle may name (safe_torch.GLOBALS has their
    stand-ins): for a pickle read into torch's objects (``.metadata`` for torch's DCP classes)."""
    import torch

    return {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): safe_torch.real_layout,
        ("torch", "device"): torch.device,
        ("torch.torch_version", "TorchVersion"): _TorchVersion,
    }


#: pickles from this size are scanned for the C unpickler (pickle_scan.py: its regex compiles
#: once, ~7 ms here; a smaller pickle costs Python's unpickler little more than that)
C_SCAN_MIN = 64 << 10


def _c_may_read(data: bytes) -> bool:
    """Whether the C unpickler reads ``data`` (else Python's, whose memo is a dict: the C one sizes
    its memo array by the largest index a PUT names, five bytes of a hostile pickle make it
    allocate and clear gigabytes)."""
    return len(data) >= C_SCAN_MIN and c_unpickler_may_read(data)


class _AllowList:
    """``real_torch``: torch's own objects for the torch values a pickle names (importing torch),
    else the stand-ins of safe_torch.py (``standins`` says whether it handed one out)."""

    def __init__(self, data: bytes, source: str, extra: Mapping[tuple[str, str], Any] | None = None, real_torch: bool = False):
        super().__init__(io.BytesIO(data))
        self._source = source
        self._extra = extra or {}
        self._real = real_torch
        self.placeholders = False  # a value was read as a stand-in that _finish replaces
        self.standins = False  # a torch value was read as a stand-in (safe_torch.to_torch replaces it)
        self.devices = False  # ... a device among them (whose type only torch checks)

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles (torch.save's default) spell builtins as Python 2 did
        key = ("builtins" if module == "__builtin__" else module, name)
        if key in self._extra:
            return self._extra[key]
        if key in _COMMON:
            self.placeholders |= _COMMON[key] is _BytesIOState
            return _COMMON[key]
        if key in safe_numpy.GLOBALS:
            self.placeholders |= key in safe_numpy.PLACEHOLDER_GLOBALS
            return safe_numpy.GLOBALS[key]
        if key in safe_dtensor.GLOBALS:
            self.placeholders = True  # records that end up outside a DTensor are refused at the end
            return safe_dtensor.GLOBALS[key]
        if key in safe_torch.GLOBALS:
            if self._real:
                return _torch_callables()[key]
            self.standins = True
            self.devices |= key == ("torch", "device")
            return safe_torch.GLOBALS[key]
        if key == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            from .compat import tensor_properties_reader

            return tensor_properties_reader()  # the 5 fields of torch <= 2.14 or the 6 of 2.15
        if key in _DCP_CLASSES:
            return super().find_class(module, name)
        value = safe_torch.torch_global(name, self._real) if module == "torch" else None
        if value is not None:
            self.standins |= not self._real
            return value
        raise UnsafePickleError(
            f"refused to unpickle global '{module}.{name}': the file holds a {name} value, which is not plain "
            "checkpoint data (tensors, DTensors, numbers, strings, containers, numpy arrays)",
            where=self._source,
            hint="nothing from the file was run; if you trust the file, plain torch reads it (torch.load "
            "with weights_only=False): save the value as plain data",
        )


#: how deep containers may nest in an unpickled value (state dicts nest a few levels)
MAX_DEPTH = 100


def check_shape(value: Any, source: str, budget: int) -> Any:
    """Refuse a value nested deeper than :data:`MAX_DEPTH`, holding a reference cycle, or whose
    tree (shared containers counted each time they appear, as every walk over it will count them)
    has more than ``budget`` nodes: a few hundred bytes of pickle can otherwise describe a
    structure that no walk finishes."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    path: list[int] = []  # ids of the containers on the way down (a cycle returns to one of them)
    visits = 0
    while stack:
        node, depth = stack.pop()
        del path[depth:]
        visits += 1
        if visits > budget:
            raise CorruptCheckpointError("a pickled value expands to more entries than the file can hold", where=source,
                                         hint="it repeats shared containers (a 'billion laughs' pickle); the file is hostile or damaged")
        if isinstance(node, dict):
            children = [*node.keys(), *node.values()]
        elif isinstance(node, (list, tuple, set, frozenset, collections.deque)):
            children = list(node)
        else:
            continue
        if id(node) in path:
            raise CorruptCheckpointError("a pickled value contains itself (a reference cycle)", where=source,
                                         hint="a checkpoint holds trees of plain data; the file is hostile or damaged")
        if depth >= MAX_DEPTH:
            raise CorruptCheckpointError(f"a pickled value nests more than {MAX_DEPTH} levels deep", where=source,
                                         hint="state dicts nest a few levels; the file is hostile or damaged")
        path.append(id(node))
        stack.extend((child, depth + 1) for child in children)
    return value


def _unpickle(unpickler: pickle.Unpickler, data: bytes, source: str, what: str, hint: str) -> Any:
    try:
        value = unpickler.load()
    except (UnsafePickleError, CorruptCheckpointError) as exc:
        if exc.where is None:  # raised by an allow-listed constructor: add the file
            raise type(exc)(exc.what, where=source, hint=exc.hint) from None
        raise
    except RecursionError:
        raise CorruptCheckpointError(f"{what} nests too deeply to read", where=source, hint=hint) from None
    except Exception as exc:  # a truncated or random file: say so, with the file
        raise CorruptCheckpointError(f"cannot read {what} ({type(exc).__name__}: {exc})", where=source, hint=hint) from None
    value = check_shape(value, source, budget=100_000 + 4 * len(data))
    if getattr(unpickler, "placeholders", False):
        value = _finish(value)
    return value


def load_dcp_metadata(data: bytes, source: str, records: Mapping[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle a DCP ``.metadata`` file, admitting only DCP's own metadata classes: torch's
    (importing torch), or with ``records`` (a stand-in for each of them, ``formats/dcp/records.py``)
    those, with torch's values as safe_torch's stand-ins."""
    if records is not None and set(records) != _DCP_CLASSES:
        raise ValueError("records must stand for exactly DCP's metadata classes")
    unpickler = (_AllowListUnpickler if _c_may_read(data) else _AllowListPyUnpickler)(
        data, source, records, real_torch=records is None)
    return _unpickle(unpickler, data, source, "DCP metadata", "the .metadata file is damaged; restore it or use another step")


# --- torch.save pickles --------------------------------------------------------------------------


def _tensor_ref(storage: Any, dtype: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef:
    """A TensorRef whose fields have the types they claim (ints are ints, the dtype a dtype);
    whether they fit the bytes present is checked against the record (torchzip.check_ref)."""
    if not isinstance(storage, StorageRef) or not isinstance(dtype, DType):
        raise TypeError(f"a tensor rebuilt from {type(storage).__name__} with dtype {dtype!r}")
    shape = tuple(operator.index(x) for x in size)
    strides = tuple(operator.index(x) for x in stride)
    return TensorRef(storage, dtype, operator.index(storage_offset), shape, strides)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _tensor_ref(storage, getattr(storage, "element_type", None), storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _tensor_ref(storage, dtype, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad, hooks):
    return data


def _rebuild_parameter_with_state(data, requires_grad, hooks, state):
    return data


class _StorageType:
    def __init__(self, dtype: DType | None):
        self.dtype = dtype


def _storage_class(module: str, name: str) -> _StorageType | None:
    if (module, name) in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
        return _StorageType(None)
    if module == "torch" and name in STORAGE_DTYPES:  # the legacy typed-storage names torch.save still writes
        return _StorageType(STORAGE_DTYPES[name])
    return None


class _AllowListUnpickler(_AllowList, pickle.Unpickler):
    pass


class _AllowListPyUnpickler(_AllowList, pickle._Unpickler):  # type: ignore[name-defined]
    pass


class _TorchSave(_AllowList):
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
        return StorageRef(str(key), storage_type.dtype, operator.index(numel))


class _TorchSaveUnpickler(_TorchSave, pickle.Unpickler):
    pass


class _TorchSavePyUnpickler(_TorchSave, pickle._Unpickler):  # type: ignore[name-defined]
    pass


_TORCH_REBUILDERS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
}


def load_torch_pickle(data: bytes, source: str) -> Any:
    """Unpickle a ``torch.save`` ``data.pkl``: containers and scalars as themselves, tensors as
    :class:`TensorRef`. Admits what ``torch.load(weights_only=True)`` admits for plain state dicts.
    Used for ``torch.save`` files and for DCP's object records (each a ``torch.save`` archive).
    Imports torch only when a value holds one of torch's objects (a dtype, a device), and not then
    within ``safe_torch.values_as_read()`` (but for a device)."""
    unpickler = (_TorchSaveUnpickler if _c_may_read(data) else _TorchSavePyUnpickler)(data, source, _TORCH_REBUILDERS)
    value = _unpickle(unpickler, data, source, "the pickle", "the file is damaged or not written by torch.save")
    if unpickler.standins and (unpickler.devices or not safe_torch.keeps_standins()):
        value = safe_torch.to_torch(value, source)
    return value


def same_value(a: Any, b: Any) -> bool:
    """Whether two unpickled values are the same data: same types, same structure and order, floats
    bit for bit (a NaN equals itself), an ``io.BytesIO`` by its bytes and position (``==`` compares
    identity there)."""
    if type(a) is not type(b):
        return False
    numpy_same = safe_numpy.same_numpy(a, b)
    if numpy_same is not None:
        return numpy_same
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):  # a tensor inside an object: dtype, shape and bits
        from .compare import bits_differ

        return a.dtype == b.dtype and a.shape == b.shape and not bool(bits_differ(a.detach().cpu(), b.detach().cpu()).any())
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue() and a.tell() == b.tell() and same_value(vars(a), vars(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a) and same_value(
            getattr(a, "default_factory", None), getattr(b, "default_factory", None))
    if isinstance(a, (list, tuple, collections.deque)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b)) and getattr(a, "maxlen", None) == getattr(b, "maxlen", None)
    return bool(a == b)
