"""Reading a checkpoint of any format into live tensors: every rank reads only the boxes it holds
(DTensor shards or whole plain tensors), straight into them where the memory allows, and checks
each record it reads, once: for a DCP step, torch's CRC-32 of the record's tensor data and, when
the step has a manifest, the manifest's hash of the whole record (and of ``.metadata``), as it reads.

This replaces ``torch.distributed.checkpoint.load`` on the load path: DCP reads each record through
``torch.load`` into a temporary tensor and copies it (two copies per tensor, no checksum);
resharding is the same box arithmetic our offline reader already does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..buffers import SlabBuffers
from ..bulk import no_gc
from ..checksums import HASH_BLOCK
from ..compat import local_shard_box
from ..index import TensorEntry
from ..layout import Box, relative
from ..formats.base import Source


def load_into(source: Source, flat: dict[str, Any]) -> None:
    """Fill every tensor of the flat state ``flat`` in place with this rank's box of it, and
    replace every other value by the checkpoint's object under the same key; every record read is
    checked when ``source`` was opened with ``verify``. A checksum that fails raises after that
    record's bytes reached the tensor: a load that raises leaves the state partly filled. A DCP
    source checks each record as it reads it into the tensor; any other ranked source (a per-rank
    torch.save folder) checks a record before its first read."""
    with no_gc():  # (as a convert's records: engine.py)
        _load_into(source, flat)


def _load_into(source: Source, flat: dict[str, Any]) -> None:
    checks = source.checks
    scratch = SlabBuffers(1)
    # Everything that can be checked without the tensor data is checked before the first tensor
    # is written: each tensor's chunks (coverage, records inside their files) and every object.
    tensors = {key: source.entry(key, TensorEntry, checked=True) for key, value in flat.items() if isinstance(value, torch.Tensor)}
    # the records this rank reads: a format may fetch adjacent small ones together
    index = source.index()
    source.will_read([*(chunk.location for key, entry in tensors.items() for chunk, _ in entry.chunks_in(local_shard_box(flat[key])[1])),
                      *(getattr(index[key], "location", None) for key in flat if key not in tensors and key in index)])
    objects = {key: source.read_object(key) for key in flat if key not in tensors}
    flat.update(objects)
    small: list[tuple[str, torch.Tensor]] = []  # whole small tensors, read together (Source.read_tensors)
    for key, entry in tensors.items():
        local, box = local_shard_box(flat[key])
        if local.numel() == 0:
            continue
        if (box[1] == tuple(entry.shape) and local.numel() * local.element_size() <= HASH_BLOCK and local.device.type == "cpu"
                and local.dtype == entry.dtype and local.is_contiguous()):
            small.append((key, local))
            continue
        if small:
            source.read_tensors(small)  # (in the order of the state: the records a file holds back to back)
            small = []
        if checks is None:
            _read_plain(source, key, entry, local, box, scratch)
            continue
        for chunk, part in entry.chunks_in(box):
            dst = local[relative(part, box)]
            if checks.done(chunk.location):
                _read_plain(source, key, entry, dst, part, scratch)
            else:
                checks.read_chunk(key, entry, chunk, part, dst)
    source.read_tensors(small)


def _read_plain(source: Source, key: str, entry: TensorEntry, dst: torch.Tensor, box: Box, scratch: SlabBuffers) -> None:
    """``box`` of tensor ``key`` into ``dst``: straight into CPU memory of the stored dtype, else
    through a staging buffer (another dtype, another device)."""
    if dst.device.type == "cpu" and dst.dtype == entry.dtype:
        source.read_tensor(key, box, out=dst)
    else:
        dst.copy_(source.read_tensor(key, box, out=scratch.view(box[1], entry.dtype, 0)))


__all__ = ["load_into"]
