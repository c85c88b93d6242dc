"""Hugging Face's sharded layout, shared by the formats that use it: a directory of numbered shard
files (``model-00001-of-00003.safetensors``, ``pytorch_model-00001-of-00003.bin``) and an index
``<prefix>.index.json`` whose ``weight_map`` names the shard of every tensor. The index is written
last: it is what makes a sharded output complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from ..errors import CorruptCheckpointError, FormatError
from ..storage import Location

MAX_INDEX_BYTES = 64 << 20

T = TypeVar("T")


def read_weight_map(index_loc: Location) -> dict[str, str]:
    """``weight_map`` of an HF index file (tensor key -> shard file name), checked for shape."""
    if index_loc.size() > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"index file is larger than {MAX_INDEX_BYTES >> 20} MiB", where=index_loc.url)
    try:
        index = json.loads(index_loc.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"index file is not valid JSON ({type(exc).__name__}: {exc})", where=index_loc.url) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise CorruptCheckpointError("index file has no weight_map of file names", where=index_loc.url)
    return weight_map


def shard_files(dir_loc: Location, index_name: str) -> list[Location]:
    """The shard files an index names, each confined to the directory (refused otherwise)."""
    index_loc = dir_loc.child(index_name)
    names = sorted(set(read_weight_map(index_loc).values()))
    return [dir_loc.inside(n, f"{index_loc.url} (weight_map)") for n in names]


def group(items: Sequence[T], size_of: Any, max_size: int | None) -> list[list[T]]:
    """Consecutive items in groups of at most ``max_size`` bytes (an item larger than that alone);
    one group when ``max_size`` is None."""
    groups: list[list[T]] = [[]]
    total = 0
    for item in items:
        n = size_of(item)
        if max_size is not None and groups[-1] and total + n > max_size:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += n
    return groups


def shard_name(stem: str, suffix: str, i: int, count: int) -> str:
    return f"{stem}-{i + 1:05d}-of-{count:05d}{suffix}"


class ShardedOutput:
    """The HF-sharded side of a sink (mixed into the safetensors and torch sinks, before ``Sink``):
    with ``max_shard_size``, tensors go in consecutive shard files of at most that many bytes
    (``<STEM>-0000k-of-0000n<SUFFIX>``); with ``shard_files``, in the files it names, each holding
    the keys it lists. Workers can write the files apart; planned at ``begin``."""

    STEM = ""
    SUFFIX = ""
    max_shard_size: int | None = None
    shard_files: tuple[tuple[str, tuple[str, ...]], ...] | None = None

    def plan_shards(self, tensors: Sequence[Any]) -> None:
        """Group ``tensors`` (TensorSpecs, in write order) into the output's shard files."""
        if self.shard_files is None:
            self._shards: list[list[Any]] = group(tensors, lambda spec: spec.nbytes, self.max_shard_size)
        else:
            file_of = self.file_of()
            self._shards = [[] for _ in self.shard_files]
            for spec in tensors:
                if spec.key not in file_of:
                    raise FormatError(f"tensor {spec.key!r} is in none of the output's files", hint="name a file for every tensor")
                self._shards[file_of[spec.key]].append(spec)
        self._shard_of: dict[str, int] = {spec.key: i for i, shard in enumerate(self._shards) for spec in shard}

    def file_of(self) -> dict[str, int]:
        """With ``shard_files``: each key -> the position of its file."""
        return {key: i for i, (_, keys) in enumerate(self.shard_files or ()) for key in keys}

    @property
    def sharded(self) -> bool:
        """Whether the output is a directory of files (else one file)."""
        return self.max_shard_size is not None or self.shard_files is not None

    @property
    def indexed(self) -> bool:
        """Whether the output's index is written: for shards, not for one file named as
        save_pretrained names an unsharded one (``model.safetensors``)."""
        return self.sharded and not (self.shard_files is not None and len(self.shard_files) == 1
                                     and self.shard_files[0][0] == self.STEM + self.SUFFIX)

    @property
    def splittable(self) -> bool:
        return self.sharded

    def _writes(self, spec: Any) -> bool:
        return self.share.workers == 1 or self.share.mine(self._shard_of[spec.key], len(self._shards))  # type: ignore[attr-defined]

    def shard_file(self, i: int) -> str:
        if self.shard_files is not None:
            return self.shard_files[i][0]
        return shard_name(self.STEM, self.SUFFIX, i, len(self._shards))


def index_bytes(total_size: int, weight_map: dict[str, str]) -> bytes:
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2).encode()
