"""safetensors: one file, or an HF-sharded directory with ``model.safetensors.index.json``.

File layout (the format's spec): 8-byte little-endian header length N, N bytes of JSON (per tensor:
``dtype``, ``shape``, ``data_offsets`` relative to the data area; optional ``__metadata__`` of
string values), then the data. We parse and write it ourselves so reads are byte ranges on any
fsspec filesystem and writes stream slab by slab; the ``safetensors`` package reads what we write
(the tests check it). Non-tensor entries ride in ``__metadata__`` as typed JSON when they can.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from ..errors import CorruptCheckpointError, FormatError, NotACheckpointError
from ..index import Chunk, Index, ObjectEntry, TensorEntry, dtype_size
from ..layout import Box, whole
from ..storage import Location, RangeReader
from .base import ObjectSpec, ReadFn, Sink, Source, TensorSpec, read_c_order_box, split, stream_tensor
from .torchzip import tensor_buffer

INDEX_FILE = "model.safetensors.index.json"
META_OBJECTS = "ckpttool.objects"
META_PATHS = "ckpttool.paths"
_MAX_HEADER = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
NAMES = {v: k for k, v in DTYPES.items()}


# --- typed JSON for objects (tuples stay tuples, floats stay exact) ------------------------------


class _NotJson(Exception):
    pass


def encode_object(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode_object(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode_object(v) for v in value]}
    if isinstance(value, dict):
        return {"__dict__": [[encode_object(k), encode_object(v)] for k, v in value.items()]}
    raise _NotJson(type(value).__name__)


def decode_object(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_object(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode_object(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {decode_object(k): decode_object(v) for k, v in value["__dict__"]}
    return value


# --- reading -------------------------------------------------------------------------------------


class _File:
    """One parsed safetensors file."""

    def __init__(self, loc: Location):
        self.loc = loc
        self.reader: RangeReader = loc.open_reader()
        size = loc.size()
        if size < 8:
            raise CorruptCheckpointError("file is shorter than a safetensors header", where=loc.url)
        (n,) = struct.unpack("<Q", self.reader.read(0, 8))
        if n > _MAX_HEADER or 8 + n > size:
            raise CorruptCheckpointError(
                f"header length {n} does not fit the file size {size}", where=loc.url, hint="the file is truncated or not safetensors"
            )
        try:
            header = json.loads(self.reader.read(8, n))
        except ValueError as exc:
            raise CorruptCheckpointError(f"header is not valid JSON ({exc})", where=loc.url) from None
        if not isinstance(header, dict):
            raise CorruptCheckpointError("header is not a JSON object", where=loc.url)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CorruptCheckpointError(f"bad header entry for {key!r}: {info!r}", where=loc.url) from None
            if end - begin != math.prod(shape) * dtype_size(dtype) or begin < 0 or end > self.data_size:
                raise CorruptCheckpointError(
                    f"tensor {key!r}: data_offsets {begin}..{end} do not match {NAMES[dtype]}{list(shape)} "
                    f"inside {self.data_size} data bytes",
                    where=loc.url,
                )
            self.tensors[key] = (dtype, shape, begin, end)


class SafetensorsSource(Source):
    format = "safetensors"

    def __init__(self, location: Location):
        super().__init__(location)
        self._files: list[_File] = []
        if location.isdir():
            index_loc = location.child(INDEX_FILE)
            if index_loc.exists():
                try:
                    index = json.loads(index_loc.read_bytes())
                    names = sorted(set(index["weight_map"].values()))
                except (ValueError, KeyError, TypeError) as exc:
                    raise CorruptCheckpointError(f"bad index file ({exc})", where=index_loc.url) from None
            else:
                names = [n for n in location.listdir() if n.endswith(".safetensors")]
            if not names:
                raise NotACheckpointError("directory holds no .safetensors files", where=location.url)
            self._files = [_File(location.child(n)) for n in names]
        else:
            self._files = [_File(location)]
        meta = self._files[0].metadata
        try:
            objects = json.loads(meta[META_OBJECTS]) if META_OBJECTS in meta else {}
            paths = json.loads(meta[META_PATHS]) if META_PATHS in meta else {}
        except ValueError as exc:
            raise CorruptCheckpointError(f"bad ckpttool metadata ({exc})", where=self._files[0].loc.url) from None
        idx = Index()
        self._where: dict[str, _File] = {}
        for f in self._files:
            for key, (dtype, shape, begin, end) in f.tensors.items():
                self._where[key] = f
                idx.add(TensorEntry(key, shape, dtype, (Chunk(tuple(0 for _ in shape), shape, (f.loc.name, begin, end)),)), _path(paths, key))
        for key, value in objects.items():
            idx.add(ObjectEntry(key, decode_object(value)), _path(paths, key))
        self._index = _in_original_order(idx, paths)

    def index(self) -> Index:
        return self._index

    def files(self) -> list[str]:
        return [f.loc.name for f in self._files]

    def chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        return entry.chunks[0].location[0]

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        f = self._where.get(key)
        if f is None:
            raise FormatError(f"{key!r} is not a tensor of this checkpoint")
        dtype, shape, begin, _ = f.tensors[key]
        box = box if box is not None else whole(shape)
        return read_c_order_box(f.reader, f.data_start + begin, shape, dtype, box, out)

    def read_object(self, key: str) -> Any:
        entry = self._index[key]
        if not isinstance(entry, ObjectEntry):
            raise FormatError(f"{key!r} is a tensor, not an object")
        return entry.location

    def close(self) -> None:
        for f in self._files:
            f.reader.close()


def _path(paths: dict[str, list], key: str) -> tuple:
    p = paths.get(key)
    return tuple(p) if p else (key,)


def _in_original_order(idx: Index, paths: dict[str, Any]) -> Index:
    """Keys in the order they were written from (kept in the paths map), not the header's order."""
    order = {k: i for i, k in enumerate(paths)}
    out = Index()
    for key in sorted(idx.keys(), key=lambda k: (order.get(k, len(order)), k)):
        out.add(idx[key], idx.path(key))
    return out


# --- writing -------------------------------------------------------------------------------------


class SafetensorsSink(Sink):
    """Write one file, or with ``max_shard_size`` an HF-sharded directory with its index."""

    format = "safetensors"

    def __init__(self, location: Location, max_shard_size: int | None = None):
        super().__init__(location)
        self.max_shard_size = max_shard_size
        self._shards: list[list[TensorSpec]] = []
        self._metadata: dict[str, str] = {}
        self._open: tuple[Any, Any] | None = None
        self._file_of: dict[str, int] = {}

    @property
    def sharded(self) -> bool:
        return self.max_shard_size is not None

    def order(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        # Larger elements first: every tensor then starts at an offset aligned to its element size.
        return sorted(specs, key=lambda s: -dtype_size(s.dtype))

    def begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        tensors, objects = split(entries)
        tensors = self.order(tensors)
        encoded: dict[str, Any] = {}
        for spec in objects:
            try:
                encoded[spec.key] = encode_object(spec.value)
                json.dumps(encoded[spec.key], allow_nan=True)
            except (_NotJson, TypeError, ValueError):
                encoded.pop(spec.key, None)
                self.dropped.append(spec.key)
        kept = [o.key for o in objects if o.key in encoded]
        paths = {s.key: list(s.path) for s in entries if s.key in encoded or isinstance(s, TensorSpec)}
        self._metadata = {"format": "pt"}
        if encoded:
            self._metadata[META_OBJECTS] = json.dumps({k: encoded[k] for k in kept})
        if any(tuple(p) != (k,) for k, p in paths.items()) or encoded:
            self._metadata[META_PATHS] = json.dumps(paths)
        self._shards = [[]]
        size = 0
        for spec in tensors:
            if self.sharded and self._shards[-1] and size + spec.nbytes > self.max_shard_size:
                self._shards.append([])
                size = 0
            self._shards[-1].append(spec)
            size += spec.nbytes
        for i, shard in enumerate(self._shards):
            for spec in shard:
                self._file_of[spec.key] = i
        if self.sharded:
            self.tmp.makedirs()
        self.total_size = sum(s.nbytes for s in tensors)

    def _shard_name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{len(self._shards):05d}.safetensors"

    def _shard_loc(self, i: int) -> Location:
        return self.tmp.child(self._shard_name(i)) if self.sharded else self.tmp

    def _start_file(self, i: int) -> None:
        header: dict[str, Any] = {"__metadata__": self._metadata}
        offset = 0
        for spec in self._shards[i]:
            header[spec.key] = {"dtype": NAMES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)
        cm = self._shard_loc(i).open_write()
        f = cm.__enter__()
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        self._open = (i, cm, f)

    def add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        if spec.dtype not in NAMES:
            raise FormatError(f"safetensors cannot hold dtype {spec.dtype} (key {spec.key!r})")
        i = self._file_of[spec.key]
        if self._open is None or self._open[0] != i:
            self._close()
            self._start_file(i)
        f = self._open[2]
        stream_tensor(lambda t: f.write(tensor_buffer(t.contiguous())), spec, read, budget)

    def _close(self) -> None:
        if self._open is not None:
            _, cm, _ = self._open
            self._open = None
            cm.__exit__(None, None, None)

    def finalize(self) -> None:
        self._close()
        for i, shard in enumerate(self._shards):  # files with no tensor written yet (empty checkpoint)
            if not self._shard_loc(i).exists():
                self._start_file(i)
                self._close()
        if self.sharded:
            weight_map = {spec.key: self._shard_name(i) for i, shard in enumerate(self._shards) for spec in shard}
            index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            self.tmp.child(INDEX_FILE).write_bytes(json.dumps(index, indent=2).encode())
        super().finalize()
