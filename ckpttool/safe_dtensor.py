"""DTensors in ``torch.save`` pickles, read as data: local tensor, placements, mesh shape and the
saving rank's coordinate, global shape and stride. No DTensor, DeviceMesh or process group is built.

``torch.save(model.state_dict())`` on an FSDP2 rank pickles each DTensor as
``torch._tensor._rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (dtype, size, stride,
...), {"_local_tensor": <tensor>, "_spec": DTensorSpec(...)})``; the spec holds a DeviceMesh,
placements (``Shard``, ``Replicate``, ``_StridedShard``, ``Partial``) and a ``TensorMeta``. Each of
those classes is replaced by a record that only keeps its constructor arguments and its state;
:func:`_rebuild_from_type_v2` then checks them and reduces them to a :class:`DTensorRef`. A record
left anywhere else in the value, a placement we cannot lay out, or a DTensor whose local shape
disagrees with its placements and global shape is refused by the folder's reader, which names the key.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .dtypes import DType
from .errors import UnsafePickleError
from .index import plausible_shape
from .refs import TensorRef

if TYPE_CHECKING:
    import torch

#: the most dimensions a device mesh may have (torch's meshes have a handful)
MAX_MESH_DIMS = 8
MAX_MESH_SIZE = 1 << 20

_WHAT = "a DTensor"


@dataclass(frozen=True)
class Placement:
    """How one mesh dimension lays a tensor out: ``shard`` (a tensor dim), or replicated (None).
    ``strided`` marks FSDP2's ``_StridedShard`` (sharded after the mesh dims that follow it)."""

    shard: int | None
    strided: bool = False

    def __str__(self) -> str:
        if self.shard is None:
            return "Replicate()"
        return f"{'_StridedShard' if self.strided else 'Shard'}({self.shard})"


@dataclass(frozen=True)
class DTensorRef:
    """A DTensor a pickle describes, not yet read: ``local`` is the saving rank's TensorRef."""

    local: TensorRef
    shape: tuple[int, ...]  # global
    element_type: DType
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None  # the saving rank's place in the mesh (None: unknown)
    rank: int | None  # the saving rank, as the mesh recorded it
    placements: tuple[Placement, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.element_type.torch

    def box(self, coordinate: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (offsets, sizes) of the part of the global tensor the rank at ``coordinate`` holds:
        each tensor dim is cut by its sharding mesh dims in turn, as ``torch.chunk`` cuts (pieces of
        ceil(n / parts); the last ones may be short or empty), ``_StridedShard`` dims last."""
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        order = sorted(range(len(self.placements)), key=lambda i: (self.placements[i].strided, i))
        for i in order:
            dim = self.placements[i].shard
            if dim is None:
                continue
            parts = self.mesh_shape[i]
            step = -(-sizes[dim] // parts) if sizes[dim] else 0
            start = min(sizes[dim], step * coordinate[i])
            offsets[dim] += start
            sizes[dim] = min(sizes[dim] - start, step)
        return tuple(offsets), tuple(sizes)


class _Record:
    """A torch.distributed class a DTensor pickle names: keeps its arguments and state, runs nothing."""

    kind = ""

    def __new__(cls, *args: Any) -> _Record:
        obj = super().__new__(cls)
        obj.args = args
        obj.state = {}
        return obj

    def __init__(self, *args: Any) -> None:  # (REDUCE calls the class; NEWOBJ only __new__)
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            merged = {}
            for part in state:
                if part is not None and not isinstance(part, dict):
                    raise UnsafePickleError(f"refused a {self.kind} whose state is not a dict")
                merged.update(part or {})
            state = merged
        if not isinstance(state, dict):
            raise UnsafePickleError(f"refused a {self.kind} whose state is a {type(state).__name__}, not a dict")
        self.state = state

    def __reduce__(self) -> Any:  # never written back: a record stands for a class we did not build
        raise UnsafePickleError(f"a {self.kind} outside a DTensor cannot be stored", hint="ckpttool reads DTensors as data")


_RECORD_NAMES = ("DTensorSpec", "TensorMeta", "ShardOrderEntry", "DeviceMesh", "_MeshLayout", "_FlatLayout", "Shard",
                 "Replicate", "Partial", "_Partial", "_StridedShard", "_NormPartial", "MaskPartial")
_RECORDS = {name: type(name, (_Record,), {"kind": name}) for name in _RECORD_NAMES}
_RECORD_MODULES = ("torch.distributed.tensor._dtensor_spec", "torch.distributed.tensor.placement_types",
                   "torch.distributed.device_mesh", "torch.distributed._mesh_layout",
                   "torch.distributed._tensor.placement_types", "torch.distributed.tensor._ops._embedding_ops",
                   "torch.distributed._tensor.ops.embedding_ops")


class _Token:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any) -> Any:
        raise UnsafePickleError(f"refused to call {self.name} from a pickle")


_WRAPPER = _Token("torch._utils._rebuild_wrapper_subclass")
_DTENSOR = _Token("DTensor")


def _int(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise UnsafePickleError(f"refused {_WHAT} whose {what} is {value!r}, not an integer") from None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise UnsafePickleError(f"refused {_WHAT} whose {what} is a {type(value).__name__}")
    return tuple(_int(v, what) for v in value)


def _record(value: Any, *kinds: str) -> _Record:
    if not isinstance(value, _Record) or value.kind not in kinds:
        raise UnsafePickleError(f"refused {_WHAT} whose spec holds a {type(value).__name__} where a {' or '.join(kinds)} belongs")
    return value


def _mesh_shape(mesh: _Record) -> tuple[int, ...]:
    """The mesh's shape: from its layout (torch >= 2.10: one flat layout per mesh dim), else from
    the shape of its rank tensor (older releases)."""
    state = mesh.state
    layout = state.get("_layout")
    if layout is not None:
        axes = _record(layout, "_MeshLayout").state.get("axes")
        if not isinstance(axes, (tuple, list)):
            raise UnsafePickleError(f"refused {_WHAT} whose mesh layout has no axes")
        return tuple(math.prod(_ints(_record(a, "_FlatLayout").state.get("shape"), "mesh shape")) for a in axes)
    ranks = state.get("mesh")
    shape = getattr(ranks, "shape", None)
    if shape is None:
        raise UnsafePickleError(f"refused {_WHAT} whose device mesh has neither a layout nor a rank tensor")
    return _ints(shape, "mesh shape")


def _placement(value: Any) -> Placement:
    rec = _record(value, "Shard", "Replicate", "_StridedShard", "Partial", "_Partial", "_NormPartial", "MaskPartial")
    if rec.kind == "Replicate":
        return Placement(None)
    if rec.kind in ("Shard", "_StridedShard"):
        dim = rec.state.get("dim", rec.args[0] if rec.args else None)
        return Placement(_int(dim, "shard dim"), rec.kind == "_StridedShard")
    raise UnsafePickleError(f"refused {_WHAT} with placement {rec.kind}: its ranks hold partial values that "
                            "are summed only when it is redistributed", hint="redistribute it to Shard or Replicate before saving")


def _tensor_ref(value: Any) -> TensorRef:
    if not isinstance(value, TensorRef):
        raise UnsafePickleError(f"refused {_WHAT} whose local tensor is a {type(value).__name__}")
    return value


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> DTensorRef:
    """A DTensor from its pickle: only DTensors rebuilt as wrapper subclasses are admitted; every
    field is checked against the others (the local shape against the box its placements give)."""
    if func is not _WRAPPER or new_type is not _DTENSOR:
        raise UnsafePickleError("refused torch._tensor._rebuild_from_type_v2 of anything but a DTensor")
    if not (isinstance(args, tuple) and len(args) >= 3 and args[0] is _DTENSOR and isinstance(args[1], DType)):
        raise UnsafePickleError(f"refused {_WHAT} whose arguments are not (DTensor, dtype, size, ...)")
    dtype, shape = args[1], _ints(args[2], "size")
    if isinstance(state, tuple) and len(state) == 2 and all(part is None or isinstance(part, dict) for part in state):
        state = {**(state[0] or {}), **(state[1] or {})}  # (__dict__, slots)
    if not isinstance(state, dict) or set(state) - {"_local_tensor", "_spec"} or "_spec" not in state:
        extra = sorted(set(state) - {"_local_tensor", "_spec"}) if isinstance(state, dict) else type(state).__name__
        raise UnsafePickleError(f"refused {_WHAT} carrying more than its local tensor and spec ({extra})")
    local = _tensor_ref(state.get("_local_tensor"))
    spec = _record(state["_spec"], "DTensorSpec")
    meta = spec.state.get("tensor_meta")
    if meta is not None:
        meta = _record(meta, "TensorMeta")
        if len(meta.args) < 3 or _ints(meta.args[0], "global shape") != shape or meta.args[2] != dtype:
            raise UnsafePickleError(f"refused {_WHAT} whose spec gives another global shape or dtype than the tensor")
    if not plausible_shape(list(shape)) or local.element_type != dtype:
        raise UnsafePickleError(f"refused {_WHAT} of shape {list(shape)} whose local tensor is {local.element_type}, not {dtype}")
    mesh = _record(spec.state.get("mesh"), "DeviceMesh")
    mesh_shape = _mesh_shape(mesh)
    placements = spec.state.get("placements")
    if not isinstance(placements, (tuple, list)):
        raise UnsafePickleError(f"refused {_WHAT} without placements")
    placed = tuple(_placement(p) for p in placements)
    if not (0 < len(mesh_shape) <= MAX_MESH_DIMS and len(placed) == len(mesh_shape) and all(n > 0 for n in mesh_shape)
            and math.prod(mesh_shape) <= MAX_MESH_SIZE):
        raise UnsafePickleError(f"refused {_WHAT} on a mesh of shape {list(mesh_shape)} with {len(placed)} placements")
    if any(p.shard is not None and not 0 <= p.shard < len(shape) for p in placed):
        raise UnsafePickleError(f"refused {_WHAT} of {len(shape)} dims sharded along dim "
                                f"{next(p.shard for p in placed if p.shard is not None and not 0 <= p.shard < len(shape))}")
    coord = mesh.state.get("_coordinate_on_dim")
    coordinate = _ints(coord, "mesh coordinate") if coord is not None else None
    if coordinate is not None and (len(coordinate) != len(mesh_shape) or any(not 0 <= c < n for c, n in zip(coordinate, mesh_shape))):
        raise UnsafePickleError(f"refused {_WHAT} at mesh coordinate {list(coordinate)} of a mesh of shape {list(mesh_shape)}")
    rank = mesh.state.get("_rank")
    # (whether the local shape is the box its placements give is checked where the key is known:
    # formats/torch_ranks.py, which has every rank's file)
    return DTensorRef(local, shape, dtype, mesh_shape, coordinate, None if rank is None else _int(rank, "rank"), placed)


GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_wrapper_subclass"): _WRAPPER,
    **{(module, "DTensor"): _DTENSOR for module in ("torch.distributed.tensor", "torch.distributed.tensor._api",
                                                      "torch.distributed._tensor.api", "torch.distributed._tensor")},
    **{(module, name): cls for module in _RECORD_MODULES for name, cls in _RECORDS.items()},
}


def stray_record(value: Any) -> _Record | None:
    """A record left outside a DTensor (a bare DeviceMesh or Shard in a value): refused by the caller."""
    return value if isinstance(value, _Record) else None
