"""DCP's ``.metadata``: read through the allow-list and checked, and the data files' naming.

Layout (FileSystemWriter): ``.metadata`` (a pickle of ``Metadata``: per key the global shape, dtype
and chunks; per chunk the file, offset and length of its record) and ``__<rank>_<i>.distcp`` files,
each a run of ``torch.save`` archives, one per chunk or object.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ...dtypes import DType
from ...errors import CorruptCheckpointError, NotACheckpointError, NotFoundError
from ...index import plausible_shape
from ...safe_pickle import load_dcp_metadata
from ...storage import Location
from . import metadata_types

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

METADATA_FILE = ".metadata"
#: the top-level key of the values of a training step's ``extra`` that differ between the ranks
#: that saved it, each rank's own: ``per_rank.<rank>.<key in extra>`` (``extra.<key>`` is rank 0's)
PER_RANK = "per_rank"
#: the same for the model's plain-tensor buffers (not DTensors: every rank holds its own, such as a
#: BatchNorm's running statistics without SyncBatchNorm): ``per_rank_buffers.<rank>.<buffer's name>``
#: (``model.<name>`` is rank 0's)
PER_RANK_BUFFERS = "per_rank_buffers"
MAX_METADATA_BYTES = 1 << 30
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def data_file_name(rank: int) -> str:
    """The file a rank writes (one per rank, as ``FileSystemWriter(single_file_per_rank=True)``)."""
    return f"__{rank}_0.distcp"


def file_rank(name: str) -> int | None:
    """The rank that wrote a ``__<rank>_<i>.distcp`` file (None for another name)."""
    m = _DATA_FILE.match(name)
    return int(m.group(1)) if m else None


def writer_world_size(file_names: list[str]) -> int:
    """How many ranks wrote a DCP checkpoint, from its ``__<rank>_<i>.distcp`` file names."""
    ranks = {r for r in map(file_rank, file_names) if r is not None}
    return max(ranks) + 1 if ranks else 1


def read_metadata(loc: Location) -> Metadata:
    """``.metadata`` of a DCP directory, unpickled through the allow-list into torch's classes."""
    return parse_metadata(read_metadata_bytes(loc), loc)


def parse_metadata(data: bytes, loc: Location, plain: bool = False) -> Any:
    """``.metadata`` unpickled through the allow-list into torch's classes, or with ``plain`` into
    ours (``metadata_types.py``: no torch imported), and checked to be DCP metadata."""
    md_loc = loc.child(METADATA_FILE)
    if plain:
        metadata = load_dcp_metadata(data, md_loc.url, metadata_types.CLASSES)
        expected: type = metadata_types.Metadata
    else:
        from torch.distributed.checkpoint.metadata import Metadata

        metadata = load_dcp_metadata(data, md_loc.url)
        expected = Metadata
    if not isinstance(metadata, expected) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(metadata, "storage_data", None), dict) \
            or not isinstance(getattr(metadata, "planner_data", None), (dict, type(None))):
        raise CorruptCheckpointError("the .metadata file does not hold DCP metadata", where=md_loc.url,
                                     hint="the .metadata file is damaged; restore it")
    return metadata


def read_metadata_bytes(loc: Location) -> bytes:
    """The bytes of ``.metadata`` (bounded: a DCP's metadata is small beside its data)."""
    md_loc = loc.child(METADATA_FILE)
    if not loc.exists():
        raise NotFoundError("checkpoint does not exist", where=loc.url, hint="check the path")
    if not md_loc.exists():
        raise NotACheckpointError(
            "directory has no .metadata, so it is not a complete DCP checkpoint",
            where=loc.url,
            hint="the save may have been interrupted; use an earlier step or `ckpttool inspect` the root",
        )
    if md_loc.size() > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f".metadata is larger than {MAX_METADATA_BYTES >> 30} GiB", where=md_loc.url,
                                     hint="the file is damaged or not DCP metadata")
    return md_loc.read_bytes()


def storage_index(metadata: Metadata, loc: Location) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """(key, chunk offsets or None for an object) -> the storage entry saying where its record is.

    Every entry is checked here, before anything is read: a file name that stays inside the
    checkpoint (``Location.inside``), a non-negative integer offset and length.
    """
    where = loc.child(METADATA_FILE).url
    out: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    checked: set[str] = set()
    for mi, info in storage.items():
        fqn, offset = getattr(mi, "fqn", None), getattr(mi, "offset", None)
        name, start, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not (isinstance(fqn, str) and _ints_or_none(offset) and _nonneg_int(start) and _nonneg_int(length)):
            raise CorruptCheckpointError(f"storage entry of {fqn!r} in .metadata is malformed", where=where,
                                         hint="the .metadata file is damaged; restore it")
        if name not in checked:
            loc.inside(name, f"{where} (storage entry of {fqn!r})")
            checked.add(name)
        out[(fqn, None if offset is None else tuple(offset))] = info
    return out


_PLAIN_INT = frozenset((int,))


def _nonneg_int(x: Any) -> bool:
    """A plain int (not a bool, nor any other subclass), at least 0."""
    return type(x) is int and x >= 0


def _nonneg_ints(x: Any) -> bool:
    """Every item of the tuple or list ``x`` a :func:`_nonneg_int` (checked at C speed: a
    .metadata's offsets, one a chunk)."""
    return not x or (_PLAIN_INT.issuperset(map(type, x)) and min(x) >= 0)


def _ints_or_none(x: Any) -> bool:
    return x is None or (isinstance(x, (tuple, list)) and _nonneg_ints(x))


def check_tensor_metadata(key: str, md: Any, where: str) -> None:
    """Types and ranks of one entry (read by ``parse_metadata(plain=True)``), so a damaged
    .metadata is a clear error, not a crash later."""
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    size = getattr(md, "size", None)
    chunks = getattr(md, "chunks", None)
    ok = isinstance(dtype, DType) and plausible_shape(size) and isinstance(chunks, (tuple, list))
    if ok:
        for c in chunks:
            offs, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if not (isinstance(offs, (tuple, list)) and plausible_shape(sizes) and len(offs) == len(sizes) == len(size)
                    and _nonneg_ints(offs)):
                ok = False
                break
    if not ok:
        raise CorruptCheckpointError(
            f"entry {key!r} in .metadata is malformed", where=where, hint="the .metadata file is damaged; restore it"
        )
