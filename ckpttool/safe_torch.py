"""torch's small values in a checkpoint's pickles, read without importing torch.

Pickles name ``torch.float32``, ``torch.Size``, ``torch.serialization._get_layout``,
``torch.device`` and ``torch.torch_version.TorchVersion``: in DCP's ``.metadata``, in every record's
``data.pkl`` (a tensor's size and dtype) and in values. The allow-listed unpickler maps those names
here: dtypes to :class:`~ckpttool.dtypes.DType`, the others to the stand-ins below, each checked
as torch checks it. A name not in these tables is decided by torch itself (imported then), so the
allow-list admits exactly what it admits with torch's own objects.

A tensor's size and dtype are consumed as the pickle is read (they become a ``TensorRef``); a
stand-in left in a value (a dtype in an optimizer's config, ``torch.__version__`` in extra state)
is replaced by torch's own object once the pickle is read (:func:`to_torch`), importing torch
only then: callers get the values torch.load would give. Inside :func:`values_as_read` (what
``inspect`` and ``verify`` do with values: show them, check that they decode) stand-ins stay,
each checked as torch would (a device is still handed to torch, whose list of device types ours
does not repeat); their repr and type name are torch's.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import operator
import re
from collections.abc import Iterator
from typing import Any

from .dtypes import DType, dtype_of, named
from .errors import CorruptCheckpointError, UnsafePickleError

_INT64 = (-(1 << 63), (1 << 63) - 1)
_PLAIN_INT = frozenset((int,))


class Size(tuple):
    """``torch.Size(items)``: a tuple of ints (torch's checks: each an integer of int64's range)."""

    __slots__ = ()

    def __new__(cls, items: Any = ()) -> Size:
        # (what a pickle holds: a tuple of plain ints, checked at C speed; one item, the most common, more directly)
        if type(items) is tuple:
            if len(items) == 1:
                if type(items[0]) is int and _INT64[0] <= items[0] <= _INT64[1]:
                    return tuple.__new__(cls, items)
            elif not items or (_PLAIN_INT.issuperset(map(type, items)) and _INT64[0] <= min(items) and max(items) <= _INT64[1]):
                return tuple.__new__(cls, items)
        values = []
        for i, item in enumerate(items):
            try:
                value = operator.index(item)
            except TypeError:
                raise TypeError(f"torch.Size() takes an iterable of 'int' (item {i} is '{type(item).__name__}')") from None
            if not _INT64[0] <= value <= _INT64[1]:
                raise ValueError("Overflow when unpacking long long")
            values.append(value)
        return super().__new__(cls, values)

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


class _Named:
    """A torch constant known by its name: a layout (``torch.strided``) or a memory format."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


LAYOUTS = {name: _Named("layout", name) for name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                                       "sparse_bsc", "_mkldnn", "jagged")}
MEMORY_FORMATS = {name: _Named("memory_format", name) for name in ("contiguous_format", "channels_last",
                                                                    "channels_last_3d", "preserve_format")}

_DEVICE = re.compile(r"^[a-z_]{1,32}(:\d{1,6})?$")


class Device:
    """``torch.device(type)`` or ``torch.device(type, index)``, torch's check of the type deferred to
    :func:`to_torch`."""

    __slots__ = ("args",)

    def __init__(self, *args: Any):
        self.args = args

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.args == self.args

    def __hash__(self) -> int:
        return hash(self.args)

    def __repr__(self) -> str:
        kind, _, index = self.args[0].partition(":")
        index = index or (self.args[1] if len(self.args) == 2 and self.args[1] is not None else "")
        return f"device(type={kind!r}{f', index={index}' if index != '' else ''})"


def device(*args: Any) -> Any:
    """``torch.device(...)`` from a pickle: a :class:`Device` for the usual spellings (a type, an
    optional index), torch's own answer for any other (imported then)."""
    if len(args) in (1, 2) and isinstance(args[0], str) and _DEVICE.match(args[0]) \
            and (len(args) == 1 or args[1] is None or (type(args[1]) is int and 0 <= args[1] and ":" not in args[0])):
        return Device(*args)
    import torch

    return torch.device(*args)


class TorchVersion(str):
    """``torch.__version__`` (a ``str`` subclass) that training code stores in its extra state:
    one short string."""

    __slots__ = ()

    def __new__(cls, *args: Any) -> TorchVersion:
        if len(args) != 1 or type(args[0]) is not str or len(args[0]) > 64:
            raise UnsafePickleError("refused a TorchVersion that is not one short string")
        return super().__new__(cls, args[0])


def get_layout(name: Any) -> _Named:
    """``torch.serialization._get_layout("torch.strided")``."""
    layout = LAYOUTS.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if layout is None:
        real_layout(name)  # torch's answer for a name not in our table (raises for a non-layout)
        layout = _Named("layout", name.removeprefix("torch."))
    return layout


def real_layout(name: Any) -> Any:
    import torch

    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise UnsafePickleError(f"unknown tensor layout {name!r}")
    return value


def torch_global(name: str, real: bool) -> Any | None:
    """What the pickle global ``torch.<name>`` is when it is a dtype, layout or memory format
    (torch's own object with ``real``, else a stand-in); None for anything else (refused)."""
    if not real:
        standin = named(name) or LAYOUTS.get(name) or MEMORY_FORMATS.get(name)
        if standin is not None:
            return standin
    import torch  # a name our tables do not know (or torch's own objects asked for): torch decides

    value = getattr(torch, name, None)
    if real or value is None:
        return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None
    if isinstance(value, torch.dtype):
        return dtype_of(value)
    if isinstance(value, torch.layout):
        return _Named("layout", name)
    if isinstance(value, torch.memory_format):
        return _Named("memory_format", name)
    return None


#: the stand-ins for the pickle globals naming torch callables (not module attributes: torch_global)
GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): Size,
    ("torch.serialization", "_get_layout"): get_layout,
    ("torch", "device"): device,
    ("torch.torch_version", "TorchVersion"): TorchVersion,
}

_STANDINS = (DType, Size, _Named, Device, TorchVersion)


def _real(value: Any) -> Any:
    """torch's object for one stand-in (imports torch)."""
    import torch

    if isinstance(value, DType):
        real = getattr(torch, value.name, None)
        if not isinstance(real, torch.dtype):
            raise UnsafePickleError(f"refused to unpickle global 'torch.{value.name}': not a dtype of this torch")
        return real
    if isinstance(value, Size):
        return torch.Size(tuple(value))
    if isinstance(value, _Named):
        return getattr(torch, value.name)
    if isinstance(value, Device):
        return torch.device(*value.args)
    if isinstance(value, TorchVersion):
        from torch.torch_version import TorchVersion as Real

        return Real(str(value))
    return value


_AS_READ = contextvars.ContextVar("ckpttool_values_as_read", default=False)


@contextlib.contextmanager
def values_as_read() -> Iterator[None]:
    """Within: values read from pickles keep the stand-ins of torch's values (no torch imported
    for them); for callers that only show or check values, never write or compare them."""
    token = _AS_READ.set(True)
    try:
        yield
    finally:
        _AS_READ.reset(token)


def keeps_standins() -> bool:
    return _AS_READ.get()


def to_torch(value: Any, source: str) -> Any:
    """``value`` with every stand-in in it replaced by torch's own object (lists, dicts, sets and
    deques changed in place, tuples rebuilt); a stand-in torch refuses (a device type it does not
    know) makes the file unreadable, as it would with torch's objects."""
    try:
        return _walk(value)
    except (UnsafePickleError, CorruptCheckpointError) as exc:
        raise type(exc)(exc.what, where=exc.where or source, hint=exc.hint) from None
    except Exception as exc:  # noqa: BLE001 - torch refused a value the file holds
        raise CorruptCheckpointError(f"cannot read the pickle ({type(exc).__name__}: {exc})", where=source,
                                     hint="the file is damaged or not written by torch.save") from None


def _walk(value: Any) -> Any:
    if isinstance(value, _STANDINS):
        return _real(value)
    if isinstance(value, (list, collections.deque)):
        items = [_walk(v) for v in value]
        value.clear()
        value.extend(items)
    elif type(value) is tuple:
        return tuple(_walk(v) for v in value)
    elif isinstance(value, dict):
        if any(isinstance(k, _STANDINS) or type(k) is tuple for k in value):
            items = [(_walk(k), _walk(v)) for k, v in value.items()]
            value.clear()
            for k, v in items:
                value[k] = v
        else:
            for k in list(value):
                value[k] = _walk(value[k])
    elif isinstance(value, (set, frozenset)):
        items = [_walk(v) for v in value]
        if isinstance(value, frozenset):
            return frozenset(items)
        value.clear()
        value.update(items)
    elif isinstance(value, slice):
        return slice(_walk(value.start), _walk(value.stop), _walk(value.step))
    return value
