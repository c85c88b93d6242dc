"""DCP's ``.metadata`` written opcode by opcode, straight from what a step describes.

A step of thousands of ranks has millions of chunks. Building a ``Metadata`` object graph (four
objects and two ``Size`` tuples a chunk) and pickling it cost rank 0 most of its commit, in object
construction, the pickler's memo of every object and the garbage collector walking them all. This
writer emits the same pickle stream a chunk at a time from precomputed pieces, and memoizes only
what is referred to again (torch's classes, field names, keys, file names, a tensor's common
chunk size): a chunk costs a handful of byte joins and no objects, and the file is smaller.

What torch unpickles from it equals, field for field, what :func:`metadata_pickle.metadata_bytes`
pickles from the stand-ins (the same globals: torch's own classes and values, protocol 3, which
every torch release in the range reads); tests hold the two to that.

At thousands of ranks even that is millions of joins on rank 0. So each rank spells its own
sharded tensors' chunks and storage entries as it writes (:func:`fragment`): a pickle may append to
a list or a dict built earlier, fetched from the memo (``BINGET``, then ``APPENDS``/``SETITEMS``
and a ``POP``). Rank 0's stream builds every sharded tensor's chunk list (empty) and the storage
dict at memo slots that every rank computes alike from the number of sharded keys (:class:`Slots`),
and copies the ranks' fragments in after its own storage entries: rank 0 no longer touches a
sharded chunk. A fragment's own strings (its file names) go to scratch slots, which the next
fragment overwrites (a ``PUT`` to a slot in use replaces its value, in every unpickler).
"""

from __future__ import annotations

import struct
from typing import Any

from ...dtypes import PLAIN

_METADATA = b"torch.distributed.checkpoint.metadata"
_FILESYSTEM = b"torch.distributed.checkpoint.filesystem"
_BATCH = 1000  # items between a MARK and its APPENDS/SETITEMS, as the pickler batches them

_pack_i, _pack_I, _pack_H = struct.Struct("<i").pack, struct.Struct("<I").pack, struct.Struct("<H").pack


def _int(value: int) -> bytes:
    """An int as the pickler writes it at protocol 3 (the shortest of BININT1/2, BININT, LONG1)."""
    if 0 <= value <= 0xFF:
        return b"K" + bytes((value,))
    if 0 <= value <= 0xFFFF:
        return b"M" + _pack_H(value)
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return b"J" + _pack_i(value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    if len(raw) > 255:
        raise ValueError("an integer too large for .metadata")
    return b"\x8a" + bytes((len(raw),)) + raw


def _get(slot: int) -> bytes:
    return b"h" + bytes((slot,)) if slot < 256 else b"j" + _pack_I(slot)


def _put(slot: int) -> bytes:
    return b"q" + bytes((slot,)) if slot < 256 else b"r" + _pack_I(slot)


def _str(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + _pack_I(len(raw)) + raw


_TUPLE = {0: b")", 1: b"\x85", 2: b"\x86", 3: b"\x87"}


def _tuple(items: list[bytes]) -> bytes:
    if len(items) in _TUPLE:
        return b"".join(items) + _TUPLE[len(items)]
    return b"(" + b"".join(items) + b"t"


class _Memo:
    """The memo: each value put once (its first use), a back-reference after."""

    def __init__(self) -> None:
        self.n = 0
        self.got: dict[Any, bytes] = {}

    def put(self, key: Any, first: bytes) -> bytes:
        """``first`` (the opcodes that push the value) and a PUT, the first time; a GET after."""
        got = self.got.get(key)
        if got is not None:
            return got
        i = self.n
        self.n += 1
        self.got[key] = _get(i)
        return first + _put(i)

    def glob(self, module: bytes, name: str) -> bytes:
        return self.put(("global", module, name), b"c" + module + b"\n" + name.encode() + b"\n")

    def string(self, text: str) -> bytes:
        got = self.got.get(("str", text))
        return got if got is not None else self.put(("str", text), _str(text))


class _Spell:
    """The prelude's back-references, and the spelling of instances and ``torch.Size`` values."""

    def __init__(self, memo: _Memo) -> None:
        self.memo = memo
        self.prelude, self.new, self.size_cls, self.fields = _prelude(memo)
        self.ints: dict[int, bytes] = {}  # the ints of sizes and offsets in a tensor (a few per rank), encoded once
        self.sizes: dict[tuple[int, ...], bytes] = {}  # each distinct Size value (chunks repeat a few), spelled once

    def obj(self, cls: str) -> bytes:
        """An instance made as copyreg.__newobj__ makes it."""
        return self.new[cls] + b")\x81"

    def small(self, value: int) -> bytes:
        got = self.ints.get(value)
        if got is None:
            got = self.ints[value] = _int(value)
        return got

    def size(self, values: Any) -> bytes:
        values = tuple(values)
        got = self.sizes.get(values)
        if got is None:
            got = self.sizes[values] = self.size_cls + _tuple([self.small(v) for v in values]) + b"\x85R"
        return got


class Slots:
    """The memo slots that a stream with ranks' fragments keeps for them, which every rank computes
    alike from the number of sharded keys: after the prelude's, the storage dict, then each sharded
    key's name and chunk list, then two scratch slots for a fragment's file names."""

    FIXED = 0  # the prelude's slots (set below)

    def __init__(self, keys: int) -> None:
        self.keys = keys
        self.storage = self.FIXED

    def name(self, i: int) -> int:
        return self.FIXED + 1 + 2 * i

    def chunks(self, i: int) -> int:
        return self.FIXED + 2 + 2 * i

    def scratch(self, j: int) -> int:
        return self.FIXED + 1 + 2 * self.keys + j

    def free(self) -> int:
        """The first slot the stream may memoize anything else in."""
        return self.FIXED + 3 + 2 * self.keys


def streamable(described: Any) -> bool:
    """Whether this writer spells ``described`` (a ``metadata_pickle.Described``): every dtype has a
    name in torch's namespace, every planner path component is a str or an int."""
    return (all(str(dtype).removeprefix("torch.") in PLAIN for _, dtype, _ in described.tensors.values())
            and all(type(p) in (str, int) for k in described.order for p in described.paths.get(k, ())))


def metadata_stream(described: Any, save_id: str, dcp_version: str,
                    shared: tuple[list[str], list[bytes]] | None = None) -> bytes | None:
    """The ``.metadata`` pickle of ``described`` (a ``metadata_pickle.Described``), or None when it
    holds something this writer does not spell (:func:`streamable`); the caller then pickles the
    object graph. ``shared``: the sharded keys, in the ranks' order, whose chunks and storage
    entries the ranks' fragments hold (``described`` lists none of them), and those fragments."""
    ends = metadata_ends(described, save_id, dcp_version, shared[0] if shared else None)
    return None if ends is None else b"".join([ends[0], *(shared[1] if shared else ()), ends[1]])


def metadata_ends(described: Any, save_id: str, dcp_version: str, keys: list[str] | None = None) -> tuple[bytes, bytes] | None:
    """:func:`metadata_stream` as the bytes before the ranks' fragments and the bytes after them
    (a writer puts the fragments between, rank after rank, as it reads them); None where the
    stream writer does not spell ``described``."""
    if not streamable(described):
        return None
    shared = (keys, None) if keys else None
    paths = {k: described.paths[k] for k in described.order if k in described.paths}
    memo = _Memo()
    spell = _Spell(memo)
    out, obj, size, fields = spell.prelude, spell.obj, spell.size, spell.fields
    slots = Slots(len(shared[0]) if shared else 0)
    own = {key: i for i, key in enumerate(shared[0])} if shared else {}
    if shared:
        memo.n = slots.free()
    out.append(obj("Metadata") + b"}(" + memo.string("state_dict_metadata") + b"}")
    items = [(k, described.tensors.get(k)) for k in described.order if k in described.tensors or k in described.objects]
    for batch in range(0, len(items), _BATCH):
        out.append(b"(")
        for key, tensor in items[batch:batch + _BATCH]:
            i = own.get(key)
            if i is None:
                out.append(memo.string(key))
            else:  # (at its slot whatever else memoized the same string: the fragments refer to the slot)
                out.append(_str(key) + _put(slots.name(i)))
                memo.got.setdefault(("str", key), _get(slots.name(i)))
            if tensor is None:
                out.append(obj("BytesStorageMetadata"))
                continue
            shape, dtype, chunks = tensor
            out.append(obj("TensorStorageMetadata") + b"}(" + fields["properties"]
                       + _properties(memo, obj, str(dtype).removeprefix("torch."))
                       + fields["size"] + size(shape) + fields["chunks"] + b"]")
            if i is not None:  # (filled by the fragments)
                out.append(_put(slots.chunks(i)))
            _chunk_list(out, memo, obj, size, fields, key, chunks)
            out.append(b"ub")
        out.append(b"u")
    out.append(memo.string("planner_data") + b"}")
    path_items = list(paths.items())
    for batch in range(0, len(path_items), _BATCH):
        out.append(b"(")
        for key, path in path_items[batch:batch + _BATCH]:
            out.append(memo.string(key) + _tuple([memo.string(p) if type(p) is str else _int(p) for p in path]))
        out.append(b"u")
    out.append(memo.string("storage_data") + b"}" + (_put(slots.storage) if shared else b""))
    _storage(out, memo, obj, size, fields, described)
    return b"".join(out), (memo.string("storage_meta") + obj("StorageMeta") + b"}(" + memo.string("checkpoint_id") + b"N"
                           + memo.string("save_id") + _str(save_id) + memo.string("load_id") + b"N" + memo.string("modules")
                           + b"]ub" + memo.string("version") + _str(dcp_version) + b"ub.")


def fragment(keys: int, chunks: list[tuple[int, list[list[Any]]]], file: str, transforms: tuple[str, ...]) -> bytes:
    """One rank's fragment of a ``.metadata`` stream (see the module's text): ``chunks`` holds, for
    each sharded key this rank stores a part of (its number ``i`` of ``keys``), its chunks as a
    rank's index has them, ``[offsets, sizes, start, length]`` in ``file`` or with a fifth element
    the file they lie in; every record of the rank stored through ``transforms``. Its chunks are
    appended to each key's list and its storage entries set in the storage dict, in that order;
    storage entries carry no chunk index (``MetadataIndex.index``: a hint, left out of its equality
    and hash; a rank does not know where its chunks fall in the merged list)."""
    slots = Slots(keys)
    spell = _Spell(_Memo())
    obj, size, fields = spell.obj, spell.size, spell.fields
    out: list[bytes] = []
    head = obj("ChunkStorageMetadata") + b"}(" + fields["offsets"]
    sizes_key = fields["sizes"]
    for i, rows in chunks:
        got = _get(slots.chunks(i))
        for batch in range(0, len(rows), _BATCH):
            out.append(got + b"(")
            out.extend(head + size(c[0]) + sizes_key + size(c[1]) + b"ub" for c in rows[batch:batch + _BATCH])
            out.append(b"e0")
    names: dict[str, bytes] = {}

    def name(f: str) -> bytes:
        got = names.get(f)
        if got is None:
            if len(names) == 2:
                raise ValueError("a rank's chunks lie in more than two files")
            slot = slots.scratch(len(names))
            names[f] = _get(slot)
            return _str(f) + _put(slot)
        return got

    index_head = obj("MetadataIndex") + b"}(" + fields["fqn"]
    info_head = obj("_StorageInfo") + b"}(" + fields["relative_path"]
    at, length_key, index_key = fields["offset"], fields["length"], fields["index"]
    tail = (fields["transform_descriptors"] + b"](" + b"".join(_str(t) for t in transforms) + b"eub") if transforms else b"ub"
    entries = [(i, c) for i, rows in chunks for c in rows]
    for batch in range(0, len(entries), _BATCH):
        out.append(_get(slots.storage) + b"(")
        for i, c in entries[batch:batch + _BATCH]:
            out.append(index_head + _get(slots.name(i)) + index_key + b"N" + at + size(c[0]) + b"ub"
                       + info_head + name(c[4] if len(c) > 4 else file) + at + _int(c[2]) + length_key + _int(c[3]) + tail)
        out.append(b"u0")
    return b"".join(out)


def _prelude(memo: _Memo) -> tuple[list[bytes], dict[str, bytes], bytes, dict[str, bytes]]:
    """The stream's start (its protocol) with torch's classes and the field names memoized, most
    used first so their back-references are two bytes; returns it and the back-references."""
    out: list[bytes] = []
    # the classes and field names first: the most used, so their back-references are two bytes
    new = {name: memo.glob(_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                                       "BytesStorageMetadata", "MetadataIndex", "TensorProperties",
                                                       "StorageMeta")}
    new["_StorageInfo"] = memo.glob(_FILESYSTEM, "_StorageInfo")
    size_cls = memo.glob(b"torch", "Size")
    fields = {name: memo.string(name) for name in ("offsets", "sizes", "fqn", "index", "offset", "relative_path",
                                                   "length", "properties", "size", "chunks", "transform_descriptors")}
    # (each first use above pushed and memoized a value: pop them; later uses are back-references)
    out.append(b"\x80\x03" + b"".join(v + b"0" for v in (*new.values(), size_cls, *fields.values())))
    new = {name: memo.got[("global", _FILESYSTEM if name == "_StorageInfo" else _METADATA, name)] for name in new}
    size_cls = memo.got[("global", b"torch", "Size")]
    fields = {name: memo.got[("str", name)] for name in fields}
    return out, new, size_cls, fields


def _properties(memo: _Memo, obj: Any, dtype: str) -> bytes:
    """TensorProperties as torch pickles it: its five-field state (dtype, layout, requires_grad,
    memory format encoding, pin_memory)."""
    layout = memo.put("layout", memo.glob(b"torch.serialization", "_get_layout") + _str("torch.strided") + b"\x85R")
    contiguous = memo.put("contiguous", memo.glob(_METADATA, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R")
    return (obj("TensorProperties") + b"(" + memo.glob(b"torch", dtype) + layout + b"\x89" + contiguous + b"\x89tb")


def _chunk_list(out: list[bytes], memo: _Memo, obj: Any, size: Any, fields: dict[str, bytes], key: str,
                chunks: list[tuple[tuple, tuple, tuple]]) -> None:
    """A tensor's chunks: ChunkStorageMetadata(offsets, sizes), the chunks' common sizes memoized."""
    head = obj("ChunkStorageMetadata") + b"}(" + fields["offsets"]
    sizes_key = fields["sizes"]
    for batch in range(0, len(chunks), _BATCH):
        out.append(b"(")
        for offsets, sizes, _record in chunks[batch:batch + _BATCH]:
            out.append(head + size(offsets) + sizes_key + memo.put(("size", key, tuple(sizes)), size(sizes)) + b"ub")
        out.append(b"e")


def _storage(out: list[bytes], memo: _Memo, obj: Any, size: Any, fields: dict[str, bytes], described: Any) -> None:
    """storage_data: {MetadataIndex(fqn, offset, index): _StorageInfo(file, offset, length[, transforms])},
    objects first, then every tensor's chunks in order (as metadata_pickle.metadata_bytes builds it)."""
    index_head = obj("MetadataIndex") + b"}(" + fields["fqn"]
    info_head = obj("_StorageInfo") + b"}(" + fields["relative_path"]
    at, length_key, index_key = fields["offset"], fields["length"], fields["index"]
    pending = 0
    out.append(b"(")

    def info(file: str, offset: int, length: int, transforms: Any) -> bytes:
        tail = b"ub"
        if transforms:
            tail = memo.string("transform_descriptors") + b"](" + b"".join(_str(t) for t in transforms) + b"eub"
        return info_head + memo.string(file) + at + _int(offset) + length_key + _int(length) + tail

    for key, (file, offset, length, transforms) in described.objects.items():
        out.append(index_head + memo.string(key) + index_key + b"Nub" + info(file, offset, length, transforms))
        pending += 1
        if pending == _BATCH:
            out.append(b"u(")
            pending = 0
    for key, (_shape, _dtype, chunks) in described.tensors.items():
        head = index_head + memo.string(key) + index_key
        for i, (offsets, _sizes, (file, offset, length, transforms)) in enumerate(chunks):
            if transforms:
                value = info(file, offset, length, transforms)
            else:
                value = info_head + memo.string(file) + at + _int(offset) + length_key + _int(length) + b"ub"
            out.append(head + _int(i) + at + size(offsets) + b"ub" + value)
            pending += 1
            if pending == _BATCH:
                out.append(b"u(")
                pending = 0
    out.append(b"u")


def _fixed_slots() -> int:
    memo = _Memo()
    _prelude(memo)
    return memo.n


Slots.FIXED = _fixed_slots()
