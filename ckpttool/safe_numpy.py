"""numpy values in a checkpoint's pickles, rebuilt from their bytes by us, never by numpy's pickle code.

Training states hold numpy data: Hugging Face Trainer's ``rng_state.pth`` keeps
``np.random.get_state()`` (a tuple with a ``uint32`` array), data-loader states keep numpy scalars
and small arrays. A pickle spells them as calls to ``numpy.dtype``, ``numpy...multiarray.scalar``
and ``numpy...multiarray._reconstruct`` followed by a state; the allow-listed unpickler maps those
names to the stand-ins below, which admit numeric dtypes only (bool, integers, floats, complex),
check that the bytes present are exactly shape x itemsize before anything is allocated, and build
the value with ``numpy.frombuffer``. Object arrays (whose elements are pickles of anything),
structured and string dtypes are refused in one line. numpy is imported only when a pickle holds a
numpy value (it is not a dependency of ckpttool; a missing numpy is a clear error).
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any

from .errors import UnsafePickleError

#: numeric dtype codes numpy pickles (``'<u4'`` is ``dtype('u4')`` then a byte order in its state)
_CODE = re.compile(r"^[biufc]\d{1,2}$")
_ORDERS = ("<", ">", "|", "=")
#: the most elements a pickled numpy array may declare (its bytes are in the pickle, so far less in practice)
_MAX_NUMEL = 1 << 40


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise UnsafePickleError("the file holds numpy values and numpy is not installed",
                                hint="pip install numpy, then run the command again") from None
    return numpy


class NumpyPlaceholder:
    """A numpy value being unpickled: replaced by the real value once the whole pickle is read."""

    __hash__ = None  # type: ignore[assignment]  # never a set member or dict key: it could not be replaced there

    def build(self) -> Any:
        raise NotImplementedError


class _Dtype(NumpyPlaceholder):
    """``numpy.dtype(code, align, copy)`` then BUILD with ``(version, byteorder, ...)``."""

    __slots__ = ("code", "order")

    def __init__(self, code: str):
        self.code = code
        self.order = "="

    def __setstate__(self, state: Any) -> None:
        # (3, '<', subdtype, names, fields, elsize, alignment, flags); structured dtypes carry names/fields
        if not (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4) and state[1] in _ORDERS
                and state[2] is None and state[3] is None and state[4] is None):
            raise UnsafePickleError("refused a numpy dtype with fields or sub-arrays (a structured dtype)",
                                    hint="ckpttool reads numeric numpy arrays and scalars")
        self.order = state[1]

    def build(self) -> Any:
        np = _numpy()
        return np.dtype(self.code).newbyteorder(self.order) if self.order in "<>" else np.dtype(self.code)


def _dtype(code: Any = None, align: Any = False, copy: Any = True, *rest: Any) -> _Dtype:
    if not isinstance(code, str) or rest:
        raise UnsafePickleError(f"refused numpy.dtype{(code, align, copy, *rest)!r}")
    if code in ("O8", "O4", "O"):
        raise UnsafePickleError("refused a numpy array or scalar of dtype object (its elements are arbitrary "
                                "pickled Python objects)", hint="store numeric arrays, or plain lists")
    if not _CODE.match(code):
        raise UnsafePickleError(f"refused a numpy value of dtype {code!r} (not a number or bool)",
                                hint="ckpttool reads numeric numpy arrays and scalars")
    return _Dtype(code)


def _resolved(dtype: Any) -> Any:
    if not isinstance(dtype, _Dtype):
        raise UnsafePickleError(f"refused a numpy value whose dtype is {type(dtype).__name__}, not a numpy dtype")
    return dtype.build()


def _scalar(dtype: Any, data: Any = None, *rest: Any) -> Any:
    """``numpy...multiarray.scalar(dtype, bytes)``: one element, exactly itemsize bytes."""
    np_dtype = _resolved(dtype)
    if rest or not isinstance(data, (bytes, bytearray)) or len(data) != np_dtype.itemsize:
        raise UnsafePickleError(f"refused a numpy {np_dtype} scalar whose data is not {np_dtype.itemsize} bytes")
    return _numpy().frombuffer(bytes(data), dtype=np_dtype)[0]


class _NdarrayClass:
    """What a pickle gets for ``numpy.ndarray``: a name ``_reconstruct`` accepts, not a class."""


_NDARRAY = _NdarrayClass()


class _Array(NumpyPlaceholder):
    """``_reconstruct(ndarray, (0,), b'b')`` then BUILD with ``(version, shape, dtype, fortran, bytes)``."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = None

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[0], int)
                and isinstance(state[1], tuple) and isinstance(state[3], bool)):
            raise UnsafePickleError("refused a numpy array whose state is not (version, shape, dtype, order, data)")
        _, shape, dtype, fortran, raw = state
        np_dtype = _resolved(dtype)
        try:
            shape = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise UnsafePickleError(f"refused a numpy array of shape {shape!r}") from None
        if any(d < 0 for d in shape) or math.prod(shape) > _MAX_NUMEL:
            raise UnsafePickleError(f"refused a numpy array of shape {list(shape)}")
        if not isinstance(raw, (bytes, bytearray)):
            raise UnsafePickleError(f"refused a numpy {np_dtype} array whose data is a {type(raw).__name__}, not bytes")
        need = math.prod(shape) * np_dtype.itemsize
        if len(raw) != need:  # checked before numpy sees it: no array is made from bytes that are not there
            raise UnsafePickleError(f"refused a numpy array of shape {list(shape)} and dtype {np_dtype}: it needs "
                                    f"{need} bytes and the pickle holds {len(raw)}", hint="the file is damaged or hostile")
        flat = _numpy().frombuffer(bytes(raw), dtype=np_dtype)
        if not np_dtype.isnative:  # numpy's own unpickling gives native byte order (the same values)
            flat = flat.astype(np_dtype.newbyteorder("="))
        self.value = flat.copy().reshape(shape, order="F" if fortran else "C")  # writable, owns its memory

    def build(self) -> Any:
        if self.value is None:
            raise UnsafePickleError("refused a numpy array that was never given its data")
        return self.value


def _reconstruct(cls: Any = None, shape: Any = None, typecode: Any = None, *rest: Any) -> _Array:
    if cls is not _NDARRAY or rest or shape != (0,) or typecode not in (b"b", "b"):
        raise UnsafePickleError("refused numpy _reconstruct of anything but a plain ndarray")
    return _Array()


GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy", "dtype"): _dtype,
    ("numpy", "ndarray"): _NDARRAY,
    **{(module, "scalar"): _scalar for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "_reconstruct"): _reconstruct for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
}
#: of those, the ones that give a placeholder (the unpickled tree is finished afterwards)
PLACEHOLDER_GLOBALS = frozenset({("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                                 ("numpy._core.multiarray", "_reconstruct")})


def same_numpy(a: Any, b: Any) -> bool | None:
    """Whether two numpy values are the same data (dtype, shape, bytes); None when ``a`` is none."""
    module = type(a).__module__
    if not module.startswith("numpy"):
        return None
    np = _numpy()
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes(order="A") == b.tobytes(order="A") and a.flags.f_contiguous == b.flags.f_contiguous)
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, np.dtype):
        return isinstance(b, np.dtype) and a == b
    return None
