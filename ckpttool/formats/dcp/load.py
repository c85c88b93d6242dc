"""Loading a DCP checkpoint into live tensors: every rank reads only the boxes it holds (DTensor
shards or whole plain tensors), straight into them where the memory allows, and checks each record
it reads, once: torch's CRC-32 of the record's tensor data and, when the step has a manifest, the
manifest's hash of the whole record (and of ``.metadata``).

This replaces ``torch.distributed.checkpoint.load`` on the load path: DCP reads each record through
``torch.load`` into a temporary tensor and copies it (two copies per tensor, no checksum);
resharding is the same box arithmetic our offline reader already does.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ...checksums import new_hasher
from ...compat import local_shard_box
from ...errors import ChecksumError
from ...index import Chunk, ObjectEntry, TensorEntry, dtype_size
from ...layout import Box, intersect, relative
from ..base import SlabBuffers, tensor_buffer
from ..torchzip import check_ref
from .metadata import METADATA_FILE
from .source import DcpSource

#: (file, offset) -> (length, hex digest), from a step's manifest
Manifest = dict[tuple[str, int], tuple[int, str]]


class RecordChecks:
    """The checks of one load: which records were checked, and the manifest to check them against."""

    def __init__(self, source: DcpSource, manifest: dict[str, Any] | None, rank: int):
        self.source = source
        self.rank = rank
        self.rows: Manifest | None = None
        self._done: set[tuple[str, int]] = set()
        self._scratch = SlabBuffers(1)
        if manifest:
            self.rows = {(name, off): (length, digest) for name, rows in manifest.get("records", {}).items()
                         for off, length, digest in rows}
            expected = manifest.get("files", {}).get(METADATA_FILE)
            if expected is not None and list(expected) != [source.metadata_size, source.metadata_digest]:
                raise ChecksumError(f".metadata does not match the manifest written at commit (on rank {rank})",
                                    where=source.location.child(METADATA_FILE).url,
                                    hint="it changed after the save; the step cannot be trusted: load an earlier one")

    def done(self, info: Any) -> bool:
        return (info.relative_path, info.offset) in self._done

    def read_chunk(self, key: str, entry: TensorEntry, chunk: Chunk, part: Box, dst: torch.Tensor) -> None:
        """Read the whole record of ``chunk`` once, check it, and copy ``part`` of it into ``dst``."""
        source, info = self.source, chunk.location
        ref, storage = source.tensor_record(key, entry, chunk)
        where = f"{source.file(info.relative_path).url} (key {key!r}, chunk at {list(chunk.offsets)})"
        check_ref(ref, storage, where)
        reader = source.reader(info.relative_path)
        item = dtype_size(ref.dtype)
        straight = (part == (chunk.offsets, chunk.sizes) and dst.device.type == "cpu" and dst.dtype == ref.dtype
                    and dst.is_contiguous() and ref.is_contiguous() and ref.storage_offset == 0
                    and storage.nbytes == dst.numel() * item)
        if straight:  # the common case: a rank loads the very shard it saved
            data = tensor_buffer(dst)
            reader.readinto(storage.offset, data)
        else:
            raw = self._scratch.view((storage.nbytes,), torch.uint8, 0)
            data = tensor_buffer(raw)
            reader.readinto(storage.offset, data)
            full = raw[: storage.nbytes // item * item].view(ref.dtype).as_strided(ref.shape, ref.stride, ref.storage_offset)
            dst.copy_(full[relative(part, (chunk.offsets, chunk.sizes))])
        crc = zlib.crc32(data)
        if crc != storage.crc32:
            raise ChecksumError(f"tensor data of {key!r} (chunk at {list(chunk.offsets)}) does not match its CRC-32 "
                                f"(stored {storage.crc32:08x}, computed {crc:08x}) on rank {self.rank}",
                                where=source.file(info.relative_path).url,
                                hint="the bytes changed after they were written; restore the file or load another step")
        self._check_manifest(key, info, data, storage.offset, storage.nbytes)
        self._done.add((info.relative_path, info.offset))

    def check_object(self, key: str, info: Any) -> None:
        """The manifest's hash of an object's record (its pickle's CRC-32 is checked as it is read)."""
        if self.rows is not None and not self.done(info):
            self._check_manifest(key, info, memoryview(b""), info.offset + info.length, 0)
            self._done.add((info.relative_path, info.offset))

    def _check_manifest(self, key: str, info: Any, data: memoryview, data_start: int, data_len: int) -> None:
        """Hash the record as [its head][data, already in memory][its tail] against the manifest."""
        if self.rows is None:
            return
        url = self.source.file(info.relative_path).url
        row = self.rows.get((info.relative_path, info.offset))
        if row is None or row[0] != info.length:
            raise ChecksumError(f"record of {key!r} at byte {info.offset} is not in the manifest written at commit "
                                f"(on rank {self.rank})", where=url, hint="the .metadata changed after the save")
        reader = self.source.reader(info.relative_path)
        h = new_hasher()
        h.update(reader.read(info.offset, data_start - info.offset))
        h.update(data)
        end = info.offset + info.length
        h.update(reader.read(data_start + data_len, end - data_start - data_len))
        if h.hexdigest() != row[1]:
            raise ChecksumError(f"record of {key!r} at byte {info.offset} does not match the manifest's checksum "
                                f"(on rank {self.rank})", where=url,
                                hint="the bytes changed after the save committed; restore the file or load another step")


def load_into(source: DcpSource, flat: dict[str, Any], checks: RecordChecks | None) -> None:
    """Fill every tensor of the flat state ``flat`` in place with this rank's box of it, and
    replace every other value by the checkpoint's object under the same key."""
    scratch = SlabBuffers(1)
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            flat[key] = source.read_object(key)
            if checks is not None:
                checks.check_object(key, source.entry(key, ObjectEntry).location)
            continue
        entry = source.entry(key, TensorEntry)
        local, box = local_shard_box(value)
        if local.numel() == 0:
            continue
        entry.check_coverage(source.location.url)
        if checks is None:
            _read_plain(source, key, entry, local, box, scratch)
            continue
        for chunk in entry.chunks:
            part = intersect((chunk.offsets, chunk.sizes), box)
            if part is None:
                continue
            dst = local[relative(part, box)]
            if checks.done(chunk.location):
                _read_plain(source, key, entry, dst, part, scratch)
            else:
                checks.read_chunk(key, entry, chunk, part, dst)


def _read_plain(source: DcpSource, key: str, entry: TensorEntry, dst: torch.Tensor, box: Box, scratch: SlabBuffers) -> None:
    """``box`` of tensor ``key`` into ``dst``: straight into CPU memory of the stored dtype, else
    through a staging buffer (another dtype, another device)."""
    if dst.device.type == "cpu" and dst.dtype == entry.dtype:
        source.read_tensor(key, box, out=dst)
    else:
        dst.copy_(source.read_tensor(key, box, out=scratch.view(box[1], entry.dtype, 0)))


__all__ = ["RecordChecks", "load_into"]
