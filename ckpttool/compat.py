"""The one place that touches torch names which are private, dunder or moved between releases.

Everything else in the package uses torch's public API; when a torch upgrade moves one of these
names, this module is where it breaks, and ``tests/unit/test_compat.py`` says which name and what
changed. The declared range is ``torch>=2.7`` (pyproject.toml); ``make test-matrix`` runs the
suite on its oldest, the pinned and the newest release.

What remains private, and why (docs/compat.md has the table):

- ``torch.distributed.checkpoint.filesystem._StorageInfo``: DCP's per-record storage entry. ckpttool
  writes ``.metadata`` itself (the collective-free save, offline convert/reshard), and torch's reader
  looks these objects up by this exact class; there is no public constructor.
- ``torch._utils._rebuild_tensor_v2`` and the legacy ``torch.<Type>Storage`` names: not calls but
  the names the ``torch.save`` format spells in its pickle; torch.load needs them to exist.
- ``torch.distributed.checkpoint._extension.ZStandard`` (torch >= 2.7): the only way to ask torch's
  own writer for zstd records; public ``_extensions=`` argument, private class.
- ``torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter``: exported as
  ``torch.distributed.checkpoint.FsspecWriter`` by recent releases (2.15 does, 2.13 does not); the
  private path on the others.
- ``DTensor.__create_chunk_list__``: the dunder DCP itself calls to learn a shard's box.
- ``torch.testing._internal.distributed.fake_pg.FakeStore`` (and the ``fake`` backend it registers):
  how ``reshard --to torch-ranks`` builds each target rank's device mesh in one process, so the
  per-rank files it writes hold DTensors pickled by torch itself.
- ``DTensor._local_tensor`` and ``DTensor._spec``: the local shard without ``to_local()``'s autograd
  function, and the spec object whose identity says a DTensor's layout is the one an async save
  planned for (its public parts, shape, placements and mesh, are each read from it); both read
  on every save for every tensor, where the public calls cost more than the copy of a small one.
- ``torch.utils._python_dispatch.TorchDispatchMode`` and ``torch._C._len_torch_dispatch_stack`` /
  ``_get_dispatch_stack_at``: the async save's write guard is a dispatch mode (the documented
  extension point of ``__torch_dispatch__``, in a private module), and it must know whether it is
  on this thread's stack, and on top, before it pushes or pops itself (torch has no public query);
  and whether a frame belongs to ``torch._dynamo`` (a compiled frame restores the dispatch state
  it entered with: the guard must not leave the stack from inside one).
- ``Tensor._version``: the in-place version counter, how an async save tells that a tensor was
  written during its copy (autograd's own check reads it; there is no public accessor).
- ``distributed_c10d._get_default_store``: the default group's key-value store, where the workers
  of an offline command publish their progress (optional: without it, worker 0 shows its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any

from .dtypes import LEGACY_STORAGE

if TYPE_CHECKING:
    import torch

from .layout import Box  # noqa: E402 - (layout imports nothing of torch)

#: The DCP format version torch >= 2.9 writes into ``Metadata.version`` (``CURRENT_DCP_VERSION``).
DCP_VERSION = "1.0.0"


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, read from the attribute ``to_local()`` returns without running its
    autograd function (one per tensor per save, tens of microseconds each), or a plain tensor itself."""
    local = getattr(value, "_local_tensor", None)
    if local is not None:
        return local
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def default_store() -> Any:
    """The default process group's key-value store (offline workers' shared progress), or None
    where a release moved torch's private accessor."""
    from torch.distributed import distributed_c10d

    getter = getattr(distributed_c10d, "_get_default_store", None)
    return getter() if getter is not None else None


def version_counter(t: torch.Tensor) -> int:
    """A tensor's in-place version counter (``Tensor._version``): what an async save compares to
    tell a write during its copy."""
    return t._version


def in_dynamo_frame(frame: Any) -> bool:
    """Whether a frame runs code of ``torch._dynamo`` (a compiled function being run or traced)."""
    return _DYNAMO in frame.f_code.co_filename


_DYNAMO = f"{os.sep}torch{os.sep}_dynamo{os.sep}"


def dtensor_spec(value: torch.Tensor) -> Any:
    """A DTensor's spec object (None for a plain tensor): the same object while its layout holds."""
    return getattr(value, "_spec", None)


def dispatch_mode_class() -> type:
    """torch's ``TorchDispatchMode``, the base of the async save's write guard."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def dispatch_stack() -> list[Any]:
    """The dispatch modes on this thread's stack, bottom first."""
    import torch

    return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]


def local_shard_box(value: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """(local tensor, its box in the global tensor) for a DTensor shard or a plain tensor.

    DTensor's ``__create_chunk_list__`` is the dunder DCP itself calls to learn a shard's box
    (public since torch 2.2, unlike ``torch.distributed.tensor._utils``).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        (chunk,) = value.__create_chunk_list__()
        return value.to_local(), (tuple(chunk.offsets), tuple(chunk.sizes))
    return value, (tuple(0 for _ in value.shape), tuple(value.shape))


@functools.cache
def storage_info_class() -> type:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo

@functools.cache
def has_record_transforms() -> bool:
    """Whether this torch's DCP reads and writes per-record transforms (zstd): torch >= 2.7."""
    return "transform_descriptors" in {f.name for f in dataclasses.fields(storage_info_class())}


def storage_info(file: str, offset: int, length: int, transforms: list[str] | None = None) -> Any:
    """DCP's storage entry of one record; the transform field only when set (torch's own
    ``__getstate__`` leaves it out of the pickle when it is None; compression is refused before
    anything is written where torch has no such field: ``transforms.check_compress``)."""
    cls = storage_info_class()
    if not transforms:
        return cls(file, offset, length)
    return cls(file, offset, length, transform_descriptors=list(transforms))


def dcp_metadata(**fields: Any) -> Any:
    """``Metadata(**fields)`` plus ``version`` where this torch's Metadata has that field (>= 2.9);
    an older torch reads a newer one's ``.metadata`` all the same (the extra attribute is ignored)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if "version" in {f.name for f in dataclasses.fields(Metadata)}:
        fields.setdefault("version", DCP_VERSION)
    return Metadata(**fields)


def zstd_extension() -> Any:
    """torch's ``ZStandard`` extension for ``FileSystemWriter(_extensions=[...])`` (torch >= 2.7;
    ``transforms.check_compress`` refuses compression before this is asked for on older torch)."""
    from torch.distributed.checkpoint._extension import ZStandard

    return ZStandard()


def fsspec_writer_class() -> type:
    """torch's fsspec StorageWriter: exported by recent releases, under ``_fsspec_filesystem`` always."""
    try:
        from torch.distributed.checkpoint import FsspecWriter
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    return FsspecWriter


def rebuild_tensor_v2() -> Any:
    """The function a ``torch.save`` pickle names to rebuild a tensor (``torch._utils._rebuild_tensor_v2``);
    the pickler writes its name, torch.load resolves it."""
    import torch._utils

    return torch._utils._rebuild_tensor_v2


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Any:
    """A process group of ``world_size`` in which this process is ``rank`` and no collective talks
    to anyone (torch's own ``fake`` backend, ``torch.testing._internal.distributed.fake_pg``): what
    lets one offline process build the device mesh each rank of a job would have, so DTensors it
    saves pickle exactly as that rank's would. Refused inside a job that already has a group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rebuild_tensor_v3() -> Any:
    """What a ``torch.save`` pickle names for a tensor whose dtype has no legacy storage class (float8,
    uint16/32/64): ``torch._utils._rebuild_tensor_v3`` over an ``UntypedStorage``, with the dtype
    given explicitly, as torch itself writes them."""
    import torch._utils

    return torch._utils._rebuild_tensor_v3


def __getattr__(name: str) -> Any:
    """``LEGACY_STORAGE_NAMES``: the legacy typed-storage class names ``torch.save`` writes into its
    pickle, per torch dtype (``dtypes.LEGACY_STORAGE`` keyed by torch's dtypes; made on first use,
    so importing this module does not import torch). A fixed part of the format (torch.load of a
    1.x file reads the same names), kept here rather than read from torch's private
    ``torch.storage._dtype_to_storage_type_map``."""
    if name == "LEGACY_STORAGE_NAMES":
        import torch

        table = {getattr(torch, dtype): storage for dtype, storage in LEGACY_STORAGE.items()}
        globals()[name] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- DCP's TensorProperties across releases ------------------------------------------------------
# torch 2.15 added ``strides`` and always pickles six fields; torch <= 2.14's ``__setstate__``
# unpacks exactly five, so plain torch <= 2.14 cannot load a DCP checkpoint torch 2.15 saved
# (docs/compat.md). ckpttool reads both, and writes five whenever there are no strides to record,
# which every release reads.


@functools.cache
def _tensor_properties_fields() -> set[str]:
    from torch.distributed.checkpoint.metadata import TensorProperties

    return {f.name for f in dataclasses.fields(TensorProperties)}


def check_properties_state(state: Any) -> tuple[int, ...] | None:
    """A pickled ``TensorProperties`` state: 5 fields, or 6 with strides (torch 2.15 writes them); returns
    the strides. Raises ``ValueError`` for anything else (the unpickler reports it as damage)."""
    if not isinstance(state, tuple) or len(state) not in (5, 6):
        raise ValueError(f"TensorProperties state of {type(state).__name__} "
                         f"{len(state) if isinstance(state, tuple) else ''} (5 or 6 fields expected)")
    strides = state[5] if len(state) == 6 else None
    if strides is not None and not (isinstance(strides, tuple) and all(type(s) is int for s in strides)):
        raise ValueError(f"TensorProperties strides {strides!r} are not a tuple of ints")
    return strides


@functools.cache
def tensor_properties_reader() -> type:
    """What the allow-listed unpickler uses for ``TensorProperties``: a subclass whose
    ``__setstate__`` takes the state of any release (5 or 6 fields), then turns the object into a
    plain ``TensorProperties`` of this torch."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    native_strides = "strides" in _tensor_properties_fields()

    class AnyReleaseTensorProperties(TensorProperties):
        def __setstate__(self, state: Any) -> None:
            strides = check_properties_state(state)
            TensorProperties.__setstate__(self, state if native_strides else state[:5])
            if not native_strides and strides is not None:
                self.strides = strides
            self.__class__ = TensorProperties

    return AnyReleaseTensorProperties


def dump_metadata(metadata: Any, protocol: int | None = None) -> bytes:
    """``pickle.dumps(metadata)`` as every release in the range reads it: a ``TensorProperties``
    with no strides is written as the five fields older torch expects (torch >= 2.15 reads five as
    strides=None), not the six torch 2.15 itself writes."""
    import copyreg
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import TensorProperties

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is TensorProperties and getattr(obj, "strides", None) is None:
                return copyreg.__newobj__, (TensorProperties,), tuple(obj.__getstate__()[:5])
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL if protocol is None else protocol).dump(metadata)
    return buf.getvalue()
