"""safetensors: one file, or an HF-sharded directory with ``model.safetensors.index.json``.

File layout (the format's spec): 8-byte little-endian header length N, N bytes of JSON (per tensor:
``dtype``, ``shape``, ``data_offsets`` relative to the data area; optional ``__metadata__`` of
string values), then the data. We parse and write it ourselves rather than through the
``safetensors`` package: its ``safe_open`` memory-maps a local file (no fsspec URLs, no ranged
reads of a remote object) and ``save_file`` needs every tensor in memory at once, while we read
byte ranges on any filesystem and write slab by slab. The package reads what we write (the tests
check it). Non-tensor entries ride in ``__metadata__`` as typed JSON when they can.
"""

from __future__ import annotations

import json
import math
import struct
from typing import TYPE_CHECKING, Any

from ..buffers import read_c_order_box
from ..dtypes import PLAIN, DType, dtype_of
from ..errors import CorruptCheckpointError, FormatError, NotACheckpointError
from ..index import Chunk, Index, ObjectEntry, TensorEntry, dtype_size, plausible_shape
from ..layout import Box, relative, tiles_exactly, whole
from ..report import Report
from ..storage import Location, RangeReader
from .hf_index import ShardedOutput, index_bytes, read_weight_map, shard_files
from .base import Format, ObjectSpec, Probe, Progress, ReadFn, Sink, SinkOptions, Source, TensorSpec, split, stream_tensor

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
#: torch's HuggingFaceStorageWriter(save_distributed=True): each rank's file holds its shards, and
#: this __metadata__ entry gives each one's offsets in the global tensor
SHARDING_INFO = "DCP_SHARDING_INFO"
META_OBJECTS = "ckpttool.objects"
META_PATHS = "ckpttool.paths"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit

#: safetensors' dtype codes -> the element types they name
CODES: dict[str, DType] = {code: PLAIN[name] for code, name in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"), ("I32", "int32"),
    ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"), ("U16", "uint16"),
    ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
)}
CODE_OF: dict[DType, str] = {v: k for k, v in CODES.items()}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (code -> torch dtype) and ``NAMES`` (torch dtype -> code): :data:`CODES` in
    torch's dtypes, made on first use (importing torch)."""
    if name in ("DTYPES", "NAMES"):
        import torch

        dtypes = {code: getattr(torch, dt.name) for code, dt in CODES.items() if hasattr(torch, dt.name)}
        globals().update(DTYPES=dtypes, NAMES={v: k for k, v in dtypes.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- typed JSON for objects (tuples stay tuples, floats stay exact) ------------------------------


class _NotJson(Exception):
    pass


def encode_object(value: Any) -> Any:
    """Typed JSON of a value made of exactly these types (a subclass such as OrderedDict or
    torch's TorchVersion would come back as its base type: it is not JSON-able here, and dropped)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode_object(v) for v in value]
    if kind is tuple:
        return {"__tuple__": [encode_object(v) for v in value]}
    if kind is dict:
        return {"__dict__": [[encode_object(k), encode_object(v)] for k, v in value.items()]}
    raise _NotJson(kind.__name__)


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
        header = _json(self.reader.read(8, n), loc.url, "header")
        if not isinstance(header, dict):
            raise CorruptCheckpointError("header is not a JSON object", where=loc.url)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        if not (isinstance(self.metadata, dict) and all(isinstance(v, str) for v in self.metadata.values())):
            raise CorruptCheckpointError("header's __metadata__ is not a map of strings", where=loc.url)
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self.tensors: dict[str, tuple[DType, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = CODES[info["dtype"]]
                shape = tuple(info["shape"])
                begin, end = info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CorruptCheckpointError(f"bad header entry for {key!r}: {info!r}", where=loc.url) from None
            if not plausible_shape(shape) or not all(_count(x) for x in (begin, end)) or begin > end or end > self.data_size \
                    or end - begin != math.prod(shape) * dtype_size(dtype):
                raise CorruptCheckpointError(
                    f"tensor {key!r}: data_offsets {begin}..{end} do not match {info['dtype']}{list(shape)} "
                    f"inside {self.data_size} data bytes",
                    where=loc.url,
                )
            self.tensors[key] = (dtype, shape, begin, end)
        # Two tensors on the same bytes would let a small file convert to an unbounded output
        spans = sorted((b, e, k) for k, (_, _, b, e) in self.tensors.items() if e > b)
        for (_, end0, k0), (begin1, _, k1) in zip(spans, spans[1:]):
            if begin1 < end0:
                raise CorruptCheckpointError(f"tensors {k0!r} and {k1!r} share bytes of the data area", where=loc.url,
                                             hint="the header is damaged or hostile; safetensors tensors never overlap")


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _json(raw: bytes, where: str, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON ({type(exc).__name__}: {exc})", where=where) from None


class SafetensorsSource(Source):
    format = "safetensors"

    def __init__(self, location: Location):
        super().__init__(location)
        self.parts: list[_File] = []  # the parsed files
        if location.isdir():
            if location.child(INDEX_FILE).exists():
                files = shard_files(location, INDEX_FILE)
            else:
                files = [location.inside(n, location.url) for n in location.listdir() if n.endswith(".safetensors")]
            if not files:
                raise NotACheckpointError("directory holds no .safetensors files", where=location.url)
            self.parts = [_File(loc) for loc in files]
        else:
            self.parts = [_File(location)]
        meta = self.parts[0].metadata
        where = self.parts[0].loc.url
        objects = _json(meta[META_OBJECTS], where, f"__metadata__ {META_OBJECTS}") if META_OBJECTS in meta else {}
        paths = _json(meta[META_PATHS], where, f"__metadata__ {META_PATHS}") if META_PATHS in meta else {}
        if not (isinstance(objects, dict) and isinstance(paths, dict) and all(isinstance(p, list) for p in paths.values())):
            raise CorruptCheckpointError("ckpttool's __metadata__ entries have the wrong shape", where=where)
        try:
            objects = {key: decode_object(value) for key, value in objects.items()}
        except (TypeError, ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(f"cannot decode ckpttool's __metadata__ ({type(exc).__name__}: {exc})",
                                         where=where) from None
        idx = Index()
        sharded = [SHARDING_INFO in f.metadata for f in self.parts]
        if any(sharded) and not location.isdir():
            raise FormatError(f"this file is one rank's part of a distributed checkpoint ({SHARDING_INFO}: written by torch's "
                              "HuggingFaceStorageWriter); its tensors are pieces of larger ones", where=location.url,
                              hint=f"open the directory that holds every rank's file: {location.parent.url}")
        if any(sharded) and not all(sharded):
            raise CorruptCheckpointError(f"some files carry {SHARDING_INFO} and some do not", where=location.url,
                                         hint="the directory mixes a sharded checkpoint with other files")
        chunks: dict[str, list[Chunk]] = {}
        dtypes: dict[str, DType] = {}
        for i, f in enumerate(self.parts):
            offsets = _sharding_info(f) if all(sharded) and sharded else {}
            for key, (dtype, shape, begin, end) in f.tensors.items():
                if dtypes.setdefault(key, dtype) != dtype:
                    raise CorruptCheckpointError(f"tensor {key!r} is {dtypes[key]} in one file and {dtype} in {f.loc.name}",
                                                 where=location.url)
                if key in chunks and not offsets:
                    raise CorruptCheckpointError(f"key {key!r} appears in two files", where=f.loc.url,
                                                 hint="the shards overlap; the set is damaged")
                chunks.setdefault(key, []).append(Chunk(offsets.get(key, tuple(0 for _ in shape)), shape, (i, begin, end)))
        for key, parts in chunks.items():
            shape = parts[0].sizes if len(parts) == 1 and not any(sharded) else _global_shape(key, parts, location.url)
            idx.add(TensorEntry(key, shape, dtypes[key], tuple(parts)), _path(paths, key))
        for key, value in objects.items():
            idx.add(ObjectEntry(key, value), _path(paths, key))
        self._index = _in_original_order(idx, paths)

    def index(self) -> Index:
        return self._index

    def files(self) -> list[str]:
        return [f.loc.name for f in self.parts]

    def aux_files(self) -> list[str]:
        return [INDEX_FILE]

    def _chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        return self.parts[entry.chunks[chunk_index].location[0]].loc.name

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        entry = self.entry(key, TensorEntry, checked=True)  # the ranks' shards must tile the tensor: no gap read as memory
        box = box if box is not None else whole(entry.shape)
        if len(entry.chunks) == 1 and not any(entry.chunks[0].offsets):
            i, begin, _ = entry.chunks[0].location
            return read_c_order_box(self.parts[i].reader, self.parts[i].data_start + begin, entry.shape, entry.dtype, box, out)
        if out is None:
            out = torch.empty(box[1], dtype=entry.dtype)
        for chunk, part in entry.chunks_in(box):
            i, begin, _ = chunk.location
            local = tuple(s.start for s in relative(part, (chunk.offsets, chunk.sizes)))
            read_c_order_box(self.parts[i].reader, self.parts[i].data_start + begin, chunk.sizes, entry.dtype, (local, part[1]),
                             out[relative(part, box)])
        return out

    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        entry = self.entry(key, TensorEntry)
        return [(self.parts[c.location[0]].loc, self.parts[c.location[0]].data_start + c.location[1],
                 self.parts[c.location[0]].data_start + c.location[2]) for c in entry.chunks]

    def close(self) -> None:
        for f in self.parts:
            f.reader.close()


def _sharding_info(f: _File) -> dict[str, tuple[int, ...]]:
    """Each tensor's offsets in its global tensor, from a HuggingFaceStorageWriter shard's header."""
    info = _json(f.metadata[SHARDING_INFO], f.loc.url, f"__metadata__ {SHARDING_INFO}")
    out: dict[str, tuple[int, ...]] = {}
    for key, (_, shape, _, _) in f.tensors.items():
        offsets = info.get(key, {}).get("saved_offsets") if isinstance(info, dict) and isinstance(info.get(key), dict) else None
        if not (isinstance(offsets, list) and len(offsets) == len(shape) and all(_count(o) for o in offsets)):
            raise CorruptCheckpointError(f"{SHARDING_INFO} gives no valid offsets for {key!r}", where=f.loc.url)
        out[key] = tuple(offsets)
    return out


def _global_shape(key: str, chunks: list[Chunk], where: str) -> tuple[int, ...]:
    """A sharded tensor's shape: how far its shards reach in each dimension (they must then tile it)."""
    if any(len(c.sizes) != len(chunks[0].sizes) for c in chunks):
        raise CorruptCheckpointError(f"the shards of {key!r} do not agree on its number of dimensions", where=where)
    shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].sizes)))
    if not plausible_shape(shape):
        raise CorruptCheckpointError(f"the shards of {key!r} do not agree on its rank or reach an implausible shape", where=where)
    return shape


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


class SafetensorsSink(ShardedOutput, Sink):
    """Write one file, or with ``max_shard_size`` an HF-sharded directory with its index (with
    ``shard_files``, a directory of those files, with an index unless it is one ``model.safetensors``)."""

    format = "safetensors"
    STEM, SUFFIX = "model", ".safetensors"

    def __init__(self, location: Location, max_shard_size: int | None = None,
                 shard_files: tuple[tuple[str, tuple[str, ...]], ...] | None = None):
        super().__init__(location)
        self.max_shard_size = max_shard_size
        self.shard_files = shard_files
        self.plan_shards([])
        self._metadata: dict[str, str] = {}
        self._open: tuple[int, Any] | None = None  # (shard index, open file)
        self._started: set[int] = set()

    def order(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        # Larger elements first: every tensor then starts at an offset aligned to its element size;
        # with files named up front, file by file (each is written whole before the next)
        if self.shard_files is not None:
            file_of = self.file_of()
            return sorted(specs, key=lambda s: (file_of.get(s.key, -1), -dtype_size(s.dtype)))
        return sorted(specs, key=lambda s: -dtype_size(s.dtype))

    def _begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        tensors, objects = split(entries)
        for spec in tensors:  # everything is checked before the first byte is written
            if dtype_of(spec.dtype) not in CODE_OF:
                raise FormatError(f"safetensors cannot hold dtype {spec.dtype} (key {spec.key!r})",
                                  hint="convert to dcp or torch, or cast it with --dtype")
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
        self.plan_shards(tensors)
        if self.sharded:
            self.tmp.makedirs()
        self.total_size = sum(s.nbytes for s in tensors)

    def _shard_loc(self, i: int) -> Location:
        return self.tmp.child(self.shard_file(i)) if self.sharded else self.tmp

    def _start_file(self, i: int) -> None:
        header: dict[str, Any] = {"__metadata__": self._metadata}
        offset = 0
        for spec in self._shards[i]:
            header[spec.key] = {"dtype": CODE_OF[dtype_of(spec.dtype)], "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)
        f = self._next_file(self._shard_loc(i))
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        self._open = (i, f)

    def _add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:
        i = self._shard_of[spec.key]
        if self._open is None or self._open[0] != i:
            self._started.add(i)
            self._start_file(i)  # shards are written in order: the previous one is complete
        stream_tensor(self._open[1].write, spec, read, budget)

    def finish_files(self) -> None:
        for i in range(len(self._shards)):  # files with no tensor written yet (empty checkpoint)
            if i not in self._started and self.share.mine(i, len(self._shards)):
                self._started.add(i)
                self._start_file(i)
        self._files.close()

    def complete(self) -> None:
        if self.indexed:  # the index, written last, is what makes a sharded output complete
            weight_map = {spec.key: self.shard_file(i) for i, shard in enumerate(self._shards) for spec in shard}
            self.tmp.child(INDEX_FILE).write_bytes(index_bytes(self.total_size, weight_map))


class SafetensorsFormat(Format):
    name = "safetensors"
    checksums = False  # the format stores none: a flipped bit in tensor data cannot be detected
    sink_options = frozenset({"max_shard_size", "shard_files"})

    def sniff(self, probe: Probe) -> bool:
        if probe.is_dir:
            return INDEX_FILE in probe.names or any(n.endswith(".safetensors") for n in probe.names)
        if len(probe.head) < 9:
            return False
        (n,) = struct.unpack("<Q", probe.head[:8])
        return probe.head[8:9] == b"{" and 8 + n <= probe.size

    def open_source(self, loc: Location, verify: bool = True, reading: Any = None) -> SafetensorsSource:
        return SafetensorsSource(loc)  # the format stores no checksums to verify

    def make_sink(self, loc: Location, options: SinkOptions) -> SafetensorsSink:
        return SafetensorsSink(loc, max_shard_size=options.max_shard_size, shard_files=options.shard_files)

    def check_integrity(self, source: SafetensorsSource, report: Report, only: str | None, progress: Progress | None) -> None:
        """Every file's data area tiled by its tensors (no hole, no overlap, nothing trailing) and
        the index's weight map agreeing with the files. There are no checksums to check."""
        for f in source.parts:
            spans = sorted((begin, end, key) for key, (_, _, begin, end) in f.tensors.items())
            pos = 0
            for begin, end, key in spans:
                if begin < pos:
                    report.add(f"data of {key!r} overlaps the tensor before it", f.loc.url, key)
                elif begin > pos:
                    report.add(f"{begin - pos} bytes before {key!r} belong to no tensor (a hole)", f.loc.url, key)
                pos = max(pos, end)
            if pos != f.data_size:
                report.add(f"header describes {pos} data bytes but the file holds {f.data_size}", f.loc.url,
                           hint="the file is truncated or has trailing bytes")
            report.bytes_checked += sum(end - begin for (_, _, begin, end) in f.tensors.values())
        for entry in source.index().tensors():  # the shards of a distributed set tile each tensor
            gap = tiles_exactly(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
            if gap:
                report.add(f"shards do not tile the shape {list(entry.shape)}: {gap}", source.location.url, entry.key,
                           hint="a rank's file is missing or damaged")
            report.tensors_checked += 1
        index_loc = source.location.child(INDEX_FILE) if source.location.isdir() else None
        if index_loc is not None and index_loc.exists():
            weight_map = read_weight_map(index_loc)
            where = {key: f.loc.name for f in source.parts for key in f.tensors}
            for key, fname in weight_map.items():
                if where.get(key) != fname:
                    report.add(f"index maps it to {fname} but it is in {where.get(key, 'no file')}", index_loc.url, key)
            for key in where.keys() - weight_map.keys():
                report.add(f"tensor in {where[key]} is missing from the index", index_loc.url, key)
        report.note("safetensors stores no checksums: a flipped bit in tensor data cannot be detected")
        report.objects_checked += sum(1 for _ in source.index().objects())


FORMAT = SafetensorsFormat()
