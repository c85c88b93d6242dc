"""The save path for placements ckpttool's own writer does not lay out (``_StridedShard``, as
FSDP2 + TP makes): torch's own DCP writer, whose planning and commit are collectives over a
process group. What ckpttool's writer does rank by rank without a collective is done here over
that group: each rank's differing values of ``extra`` kept per rank, the NaN/Inf count, and the
records' manifest for the commit record.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from .. import compat, health, rendezvous
from ..checksums import ALGORITHM, hash_bytes, hash_range, new_block
from ..compat import local_tensor
from ..formats.dcp.metadata import METADATA_FILE, PER_RANK, PER_RANK_BUFFERS, file_rank, read_metadata, read_metadata_bytes
from ..storage import Location, save_error
from .state import holds_dtensor
from .staging import frozen
from .step_writer import Whole

# DCP raises CheckpointException, a BaseException, for failures on any rank.
_DCP_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def write(state: dict[str, Any], step_dir: Location, storage_options: dict[str, Any], compress: str | None, group: Any,
          count_health: bool, buffers: frozenset[str] = frozenset()) -> tuple[dict[str, Any], list[str], list[str], dict[str, Any] | None]:
    """Write ``state`` into ``step_dir`` with DCP's writer (collective over ``group``); returns the
    manifest of every rank's records, the keys of ``extra`` and the model's plain-tensor buffers
    (``buffers``: their state keys) kept per rank, and the health counts."""
    state, per_rank = _with_per_rank(state, group)
    state, own_buffers = _with_own_buffers(state, group, buffers)
    found = _health(state, group) if count_health else None
    try:
        with _single_process_quiet():
            dcp.save(state, storage_writer=dcp_writer(step_dir, storage_options, compress), process_group=group)
    except _DCP_ERRORS as exc:
        raise save_error(exc, step_dir) from None
    rendezvous.pause_point("after-write")
    return _manifest_of_own_file(step_dir, group), per_rank, own_buffers, found


def stage(state: Any, previous: Any = None) -> Any:
    """A copy of every tensor (DTensors stay DTensors), so the caller may change the originals.

    ``previous`` is the last save's copy, no longer in use once that save committed: tensors of
    the same shape, dtype and layout are copied into it, so async saves keep one copy of the
    rank's state in host memory and do not fault in fresh pages every time.
    """
    if isinstance(state, torch.Tensor):
        if _same_layout(state, previous):
            local_tensor(previous).copy_(local_tensor(state))
            return previous
        return state.detach().clone()
    if isinstance(state, dict):
        prev = previous if isinstance(previous, dict) else {}
        return {k: stage(v, prev.get(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        prev = previous if isinstance(previous, (list, tuple)) and len(previous) == len(state) else [None] * len(state)
        staged = [stage(v, p) for v, p in zip(state, prev)]
        return staged if isinstance(state, list) else tuple(staged)
    return frozen(state)


def _same_layout(t: torch.Tensor, other: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if not isinstance(other, torch.Tensor) or type(other) is not type(t) or other.dtype != t.dtype or other.shape != t.shape:
        return False
    if isinstance(t, DTensor):
        return (other.placements == t.placements and other.device_mesh == t.device_mesh
                and local_tensor(other).shape == local_tensor(t).shape)
    return other.device == t.device


def _with_per_rank(state: dict[str, Any], group: Any) -> tuple[dict[str, Any], list[str]]:
    """DCP's writer keeps rank 0's value of every plain value of ``extra``: here (its path is
    collective anyway) every top-level value of ``extra`` without a DTensor is gathered, and each
    that differs between ranks is added whole under ``per_rank.<rank>.<key>``, as ckpttool's own
    writer lays them out. DCP's writer traverses every value: one kept whole (:class:`Whole`) is
    handed to it as it is (its non-string keys come back as strings, as from plain ``dcp.save``)."""
    extra = state.get("extra")
    if not extra:
        return state, []
    extra = {k: v.value if isinstance(v, Whole) else v for k, v in extra.items()}
    state = {**state, "extra": extra}
    if not rendezvous.active():
        return state, []
    everyone, differing = _differing({top: value for top, value in extra.items() if not holds_dtensor(value)}, group)
    if not differing:
        return state, []
    # DCP's planner lets any rank write a tensor every rank holds: ``extra.<key>`` is made rank 0's here
    shared = {**extra, **{top: everyone[0][top] for top in differing if top in everyone[0]}}
    return {**state, "extra": shared, PER_RANK: {str(r): {top: values[top] for top in differing if top in values}
                                                 for r, values in enumerate(everyone)}}, differing


def _with_own_buffers(state: dict[str, Any], group: Any, buffers: frozenset[str]) -> tuple[dict[str, Any], list[str]]:
    """The same for the model's plain-tensor buffers (``buffers``: their state keys): each that
    differs between ranks is added under ``per_rank_buffers.<rank>.<name>``."""
    model = state.get("model") or {}
    keys = sorted(k[len("model."):] for k in buffers if k[len("model."):] in model)
    if not keys or not rendezvous.active():
        return state, []
    everyone, differing = _differing({k: model[k].detach().cpu() for k in keys}, group)
    if not differing:
        return state, []
    # DCP's planner lets any rank write a tensor every rank holds: ``model.<name>`` is made rank 0's here
    return ({**state, "model": {**model, **{k: everyone[0][k] for k in differing}},
             PER_RANK_BUFFERS: {str(r): {k: values[k] for k in differing} for r, values in enumerate(everyone)}},
            [f"model.{k}" for k in differing])


def _differing(values: dict[str, Any], group: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Every rank's ``values`` (gathered over ``group``: DCP's planner has rank 0 alone write
    objects, so every rank gets them all) and the keys whose values differ between ranks (by a
    digest of their ``torch.save`` bytes), or that some rank lacks."""
    def digests() -> dict[str, tuple[str, Any]]:
        mine = {}
        for key, value in values.items():
            buf = io.BytesIO()
            torch.save(value, buf)
            mine[key] = (hash_bytes(buf.getvalue()), value)
        return mine

    everyone = rendezvous.agreed_gather("digesting its own values", digests, group)
    differing = sorted({key for held in everyone for key in held if any(key not in other or other[key][0] != held[key][0]
                                                                        for other in everyone)})
    return [{key: value for key, (_, value) in held.items()} for held in everyone], differing


def _health(state: dict[str, Any], group: Any) -> dict[str, Any]:
    """DCP's writer passes no bytes through ckpttool: each rank counts NaN and Inf in the local
    shards it holds (each box once: a replicated one on its first holder; a ``Partial`` sum, which
    is no value yet, not at all), and rank 0 adds them up. No stale check on this path."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from ..index import flatten

    def count() -> dict[str, list[int]]:
        flat, _ = flatten(state)
        tally = health.Tally()
        rank = rendezvous.rank()
        for key, value in flat.items():
            if isinstance(value, DTensor):
                coordinate = value.device_mesh.get_coordinate()
                if coordinate is None or any(isinstance(p, Partial) or (isinstance(p, Replicate) and c != 0)
                                             for p, c in zip(value.placements, coordinate)):
                    continue
                tally.count(key, local_tensor(value).detach())
            elif isinstance(value, torch.Tensor) and rank == 0:
                tally.count(key, value.detach())
            elif rank == 0:  # an object (a Python float, a numpy value), as rank 0 writes it
                tally.count_object(key, value.value if isinstance(value, Whole) else value)
        return tally.nonfinite

    parts = [{"nonfinite": counts} for counts in rendezvous.agreed_gather("counting NaN and Inf", count, group)]
    return health.merge(parts, None, set())


def _manifest_of_own_file(step_dir: Location, group: Any) -> dict[str, Any]:
    """Each rank hashes the records of its own data file (read back while the page cache still
    holds them); rank 0 gets them all for the commit record. Documented in docs/format.md."""
    records: dict[str, Any] = {}
    for part in rendezvous.agreed_gather("hashing its records", lambda: hash_records(step_dir, rendezvous.rank()), group):
        records.update(part["records"])
    return {"algorithm": ALGORITHM, "records": records}


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns on every call that it assumes one process; that is our intent."""
    with warnings.catch_warnings():
        if not rendezvous.active():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- torch's own DCP writer, and the manifest of what it wrote --------------------------------------


def dcp_writer(loc: Location, storage_options: dict[str, Any] | None = None, compress: str | None = None):
    """A DCP StorageWriter for ``loc`` (a single file per rank, fsync'ed; with ``compress``,
    torch's own zstd extension on every record)."""
    extra: dict[str, Any] = {}
    if compress is not None:
        extra["_extensions"] = [compat.zstd_extension()]
    if loc.local_path is not None:
        return FileSystemWriter(loc.local_path, single_file_per_rank=True, sync_files=True, **extra)
    FsspecWriter = compat.fsspec_writer_class()
    return FsspecWriter(loc.url, single_file_per_rank=True, sync_files=True, **extra, **(storage_options or {}))


def hash_records(step_dir: Location, rank: int | None = None) -> dict[str, Any]:
    """The manifest rows of a step's data files (only those ``rank`` wrote, when given):
    ``{"algorithm": ..., "records": {FILE: [[offset, length, hexdigest], ...]}}``."""
    metadata = read_metadata(step_dir)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        if rank is None or file_rank(info.relative_path) == rank:
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    buf = new_block()
    records: dict[str, list[list[Any]]] = {}
    for name, spans in sorted(by_file.items()):
        reader = step_dir.child(name).open_reader()
        try:
            records[name] = [[off, length, hash_range(reader, off, length, buf)] for off, length in sorted(spans)]
        finally:
            reader.close()
    return {"algorithm": ALGORITHM, "records": records}


def metadata_row(step_dir: Location) -> dict[str, list[Any]]:
    """The manifest's entry for ``.metadata`` itself: ``{".metadata": [length, hexdigest]}``."""
    raw = read_metadata_bytes(step_dir)
    return {METADATA_FILE: [len(raw), hash_bytes(raw)]}
