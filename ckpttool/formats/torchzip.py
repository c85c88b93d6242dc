"""The ``torch.save`` zip archive, read and written in place, one storage record at a time.

``torch.save`` writes an uncompressed zip: ``<name>/data.pkl`` (the pickled structure, tensors as
persistent ids) and one ``<name>/data/<key>`` record per storage holding the raw bytes. A whole
``.pt`` file is one archive; a DCP ``.distcp`` file is many archives back to back, one per chunk.
Reading the zip directory lets us fetch any byte range of a tensor without loading the rest, and
writing it ourselves lets a tensor stream into the archive slab by slab.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from ..buffers import read_c_order_box, tensor_buffer
from ..checksums import crc32
from ..dtypes import LEGACY_STORAGE, dtype_of, torch_dtype
from ..errors import ChecksumError, CkptError, CorruptCheckpointError, FormatError
from ..index import dtype_size, plausible_shape
from ..safe_dtensor import DTensorRef
from ..safe_pickle import StorageRef, TensorRef, load_torch_pickle
from ..storage import RangeReader
from .zipwrite import ZipOut

if TYPE_CHECKING:
    import torch

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature .. extra length (30 bytes)
_SMALL_ARCHIVE = 1 << 20  # read archives up to this size in one request
REMOTE_RECORD = 16 << 20  # on an object store, DCP records up to this size are fetched whole (one request)
REMOTE_SPAN = 32 << 20  # ... together with the records that follow them in the file, up to this many bytes
_TAIL = 64 * 1024  # the zip directory of a torch archive is a few hundred bytes per record
_SMALL_LOCAL = 8 * 1024  # the same two, for a file on a local disk
_TAIL_LOCAL = 4 * 1024
ALIGN = 64  # torch aligns storage records to 64 bytes so they can be mmap'ed
PAGE = 4096  # a record's data aligned in its file (ArchiveWriter's ``at``): written from memory by O_DIRECT


@dataclass(frozen=True)
class StoredStorage:
    """Where one storage's raw bytes lie in the file, with the zip's CRC-32 of them."""

    offset: int  # absolute offset in the file
    nbytes: int
    crc32: int
    name: str


@dataclass(frozen=True)
class Archive:
    """A parsed ``torch.save`` archive: the unpickled structure (tensors as TensorRef) and storages."""

    obj: Any
    storages: dict[str, StoredStorage]
    byteorder: str


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``[start, start+length)`` of a file, for ``zipfile``: served
    from the spans it holds (given, or fetched here: its head and its tail once each), else read."""

    def __init__(self, reader: RangeReader, start: int, length: int, spans: list[tuple[int, bytes]] = (), tail: int = _TAIL):
        self._r = reader
        self._start = start
        self._len = length
        self._pos = 0
        # (offset in the window, bytes): the spans of the file given that lie inside the window
        self._held = [(off - start, data) for off, data in spans if start <= off and off + len(data) <= start + length]
        self._head = self._tail = False  # whether the head / the tail was fetched here
        self._span = tail
        self.reads: list[tuple[int, int]] | None = None  # [pos, end) of every read, where a caller asks (read_archive)
        # (with reads) where the directory's CRC-32 fields lie: of each entry, in order (_plain_entries);
        # of the entries whose CRC-32 the parse's answer does not use (not the pickle's, not the byte
        # order's); of each storage's (its answer's, taken from each record anew)
        self.entry_crcs: list[int] = []
        self.unused_crcs: list[int] = []
        self.storage_crcs: dict[str, int] = {}

    def fetched(self) -> list[tuple[int, bytes]]:
        """The (file offset, bytes) spans held: those given and those read here (head, tail)."""
        return [(self._start + off, data) for off, data in self._held]

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def _from_held(self, end: int) -> bytes | None:
        for off, data in self._held:
            if off <= self._pos and end <= off + len(data):
                return data[self._pos - off : end - off]
        return None

    def read(self, n: int = -1) -> bytes:
        end = self._len if n is None or n < 0 else min(self._len, self._pos + n)
        if end <= self._pos:
            return b""
        if self.reads is not None:
            self.reads.append((self._pos, end))
        data = self._from_held(end)
        if data is None:
            fetch = None
            if not self._head and end <= self._span and self._len > 2 * self._span:
                # torch writes data.pkl and the small records first: fetch the head once as well
                self._head, fetch = True, (0, self._span)
            elif not self._tail and self._pos >= self._len - self._span:
                # zipfile reads the end record and the directory in many small reads: fetch the tail
                # once (one request on an object store instead of dozens; a syscall less locally)
                self._tail, fetch = True, (max(0, self._len - self._span), min(self._span, self._len))
            if fetch is not None:
                self._held.append((fetch[0], self._r.read(self._start + fetch[0], fetch[1])))
                data = self._from_held(end)
            if data is None:
                data = self._r.read(self._start + self._pos, end - self._pos)
        self._pos = end
        return data


def read_archive(reader: RangeReader, start: int = 0, length: int | None = None, where: str = "",
                 whole_up_to: int = 0, fetched: list[tuple[int, bytes]] | None = None,
                 spans: list[tuple[int, bytes]] | None = None) -> Archive:
    """Parse the archive at ``[start, start+length)``: its pickle (allow-listed) and its storages.

    An archive up to ``whole_up_to`` bytes is fetched in one read and kept by the reader for the
    data reads that follow (DCP records on an object store: one request per record, not three).
    ``fetched``, if given, receives the (offset, bytes) spans the parse read, for a caller that
    needs those bytes again (a record's hash) without reading them twice; ``spans``, (offset, bytes)
    of the file read before (a record's head and tail, read around its data), are not read again.
    """
    where = where or reader.where
    if length is None:
        length = reader.size() - start
    reader.check_range(start, length)
    # On a local disk a read costs a syscall, not a round trip: read the few KiB zipfile needs, so a
    # load that wants part of a record does not read the rest of it (or 128 KiB around it) anyway.
    loc = getattr(reader, "loc", None)
    local = loc is not None and not loc.batch_reads
    small, tail = (_SMALL_LOCAL, _TAIL_LOCAL) if local else (_SMALL_ARCHIVE, _TAIL)
    prefetched = reader.read(start, length) if length <= max(small, whole_up_to) else None
    if prefetched is not None and whole_up_to and not reader.holds(start, length):  # (a held span of records: kept)
        reader.hold(start, prefetched)  # the tensor data read that follows needs no request of its own
    whole = prefetched is not None and len(prefetched) == length  # (the record read whole: its parse may be kept)
    if whole:
        known = known_record(prefetched)
        if known is not None:
            if fetched is not None:
                fetched.append((start, prefetched))
            layout, crc = known
            return Archive(layout.obj, {layout.key: StoredStorage(start + layout.data, layout.nbytes, crc, layout.name)}, "little")
    window = _Window(reader, start, length, [(start, prefetched)] if prefetched is not None else spans or [], tail)
    if whole:
        window.reads = []
    parses["parsed"] += 1
    try:
        pkl, byteorder, storages = _parse_zip(window, start, length, where)
    except CkptError:
        raise
    except Exception as exc:  # noqa: BLE001 - zipfile parses untrusted bytes: any failure means a damaged archive
        raise CorruptCheckpointError(f"not a readable torch.save archive ({type(exc).__name__}: {exc})", where=where,
                                     hint="the file is damaged or in another format") from None
    if byteorder != "little":
        raise FormatError(f"byte order {byteorder!r}", where=where, hint="only little-endian checkpoints are supported")
    if fetched is not None:
        fetched.extend(window.fetched())
    obj = _REFS.get(pkl)
    if obj is None:
        obj = load_torch_pickle(pkl, where)
        if type(obj) is TensorRef and len(pkl) <= 4096:  # (frozen: the same bytes, the same reference)
            if len(_REFS) >= 1024:
                _REFS.clear()
            _REFS[pkl] = obj
    if window.reads is not None and window.storage_crcs and type(obj) is TensorRef and len(storages) == 1:
        _remember_layout(prefetched, start, obj, storages, window)
    return Archive(obj, storages, byteorder)


def known_record(record: bytes | memoryview) -> tuple[_Layout, int] | None:
    """A whole small record's parse without parsing it: where every byte its parse would read and
    use is the same as in the last record of its length parsed (:data:`_LAYOUTS`), the same answer
    but for the data's CRC-32 (its own, from its directory entry): (that layout, the CRC-32); else
    None (the caller parses it)."""
    known = _LAYOUTS.get(len(record))
    if known is None or b"".join([record[a:b] for a, b in known.ranges]) != known.read:
        return None
    parses["reused"] += 1
    return known, int.from_bytes(record[known.crc_at:known.crc_at + 4], "little")


@dataclass(frozen=True)
class _Layout:
    """A small record as parsed: the ranges of it its parse read and used, their bytes, and what
    the parse made of them (offsets relative to the record)."""

    ranges: list[tuple[int, int]]
    read: bytes
    obj: Any
    key: str
    data: int
    nbytes: int
    crc_at: int  # its storage's CRC-32 in its directory entry
    name: str


#: a record's length -> the layout of the last record of that length parsed: a DCP file of many
#: small records of one dtype and shape repeats the same zip headers and pickle around different
#: data, and a record whose bytes around its data are those of the layout parses as it did
_LAYOUTS: OrderedDict[int, _Layout] = OrderedDict()


def _remember_layout(record: bytes, start: int, obj: Any, storages: dict[str, StoredStorage], window: _Window) -> None:
    """Keep the layout of a parsed record: the bytes its parse read (a pickle or a directory inside
    the data included: another record must hold the same bytes there), less the directory's CRC-32
    fields its answer does not take as they are (torch's records of one dtype and shape differ
    there: their data's CRC-32, and that of a serialization id no parse reads). Not kept where
    another read of the parse (a local header, a pickle) overlaps such a field: its bytes would
    then shape the answer without being compared."""
    (key, storage), = storages.items()
    reads = sorted(window.reads or ())
    cuts = sorted(set(window.unused_crcs) | {window.storage_crcs[key]})
    if any(sum(a < cut + 4 and cut < b for a, b in reads) != 1 for cut in cuts):  # (the directory's read alone)
        return
    ranges: list[tuple[int, int]] = []
    for a, b in reads:  # merged, then the CRC-32 fields cut out
        if ranges and a <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], b))
        else:
            ranges.append((a, b))
    for cut in cuts:
        ranges = [piece for a, b in ranges for piece in ((a, min(b, cut)), (max(a, cut + 4), b)) if piece[0] < piece[1]]
    read = b"".join([record[a:b] for a, b in ranges])
    _LAYOUTS.pop(len(record), None)
    _LAYOUTS[len(record)] = _Layout(ranges, read, obj, key, storage.offset - start, storage.nbytes, window.storage_crcs[key],
                                    storage.name)
    if len(_LAYOUTS) > 64:
        _LAYOUTS.popitem(last=False)


#: archives parsed ("parsed") and records given a kept parse ("reused") in this process: a
#: benchmark's or a test's view of what the layout cache saved
parses: collections.Counter[str] = collections.Counter()

#: a DCP tensor record's pickle -> the TensorRef it unpickles to: the records of a dtype and shape
#: all hold the same pickle (a reshard unpickles thousands of them, one by one, for the same answer)
_REFS: dict[bytes, TensorRef] = {}


def _parse_zip(window: _Window, start: int, length: int, where: str) -> tuple[bytes, str, dict[str, StoredStorage]]:
    """(data.pkl, byte order, storages) of the archive in ``window``; the CRC-32 of every entry read
    whole (the pickle, the byte order) is checked. An archive laid out as torch and ckpttool write
    them is read from its directory here (a few struct reads, where zipfile builds objects for every
    entry of every record: a DCP file of many small records spends its time there); anything else,
    by zipfile."""
    entries, zf = _plain_entries(window, length), None
    if entries is None:
        zf = zipfile.ZipFile(window)
        entries = [(i.filename, i.header_offset, i.file_size, i.CRC, i.compress_type) for i in zf.infolist()]
    names = [e[0] for e in entries]
    pkl_name = next((n for n in names if n.endswith("data.pkl")), None)
    if pkl_name is None:
        raise CorruptCheckpointError("archive has no data.pkl", where=where)
    prefix = pkl_name[: -len("data.pkl")]
    storages: dict[str, StoredStorage] = {}
    pkl, byteorder = None, b"little"
    for i, (name, offset, size, crc, method) in enumerate(entries):
        if window.reads is not None and zf is None:
            if name.startswith(prefix + "data/"):
                window.storage_crcs[name[len(prefix + "data/"):]] = window.entry_crcs[i]
            elif name not in (pkl_name, prefix + "byteorder"):
                window.unused_crcs.append(window.entry_crcs[i])
        if method != zipfile.ZIP_STORED:
            raise FormatError(f"compressed record {name!r}", where=where, hint="ckpttool reads uncompressed torch.save archives only")
        if name.startswith(prefix + "data/"):
            storages[name[len(prefix + "data/") :]] = StoredStorage(start + _data_start(window, name, offset, size, length, where),
                                                                  size, crc, name)
        elif name in (pkl_name, prefix + "byteorder"):
            if zf is not None:
                data = zf.read(name)  # (zipfile checks its CRC-32)
            else:
                window.seek(_data_start(window, name, offset, size, length, where, check_name=True))
                data = window.read(size)
                if len(data) != size or crc32(data) != crc:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {name!r}")
            if name == pkl_name:
                pkl = data
            else:
                byteorder = data
    return pkl, byteorder.decode(), storages


_END = struct.Struct("<4s4H2LH")  # the end of central directory record (22 bytes)
_END64 = struct.Struct("<4sQ2H2L4Q")  # the zip64 end record (56 bytes) ...
_LOCATOR = struct.Struct("<4sLQL")  # ... and its locator (20 bytes), which torch always writes
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # a central directory entry (46 bytes, then name, extra, comment)


def _plain_entries(window: _Window, length: int) -> list[tuple[str, int, int, int, int]] | None:
    """(name, local header offset, size, CRC-32, method) of each entry of an archive as torch and
    ckpttool write them: the directory right before the end records (zip64's included), no
    comment, no entry over 4 GiB or past 4 GiB, no encryption, ASCII names, each once. None for
    any other archive (zipfile reads it then, with its own checks)."""
    if length < _END.size:
        return None
    window.seek(length - _END.size)
    sig, disk, cd_disk, here, count, cd_size, cd_offset, comment = _END.unpack(window.read(_END.size))
    if sig != b"PK\x05\x06" or disk or cd_disk or here != count or comment:
        return None
    end = length - _END.size
    if end >= _LOCATOR.size + _END64.size:
        window.seek(end - _LOCATOR.size)
        lsig, _disk, at64, _disks = _LOCATOR.unpack(window.read(_LOCATOR.size))
        if lsig == b"PK\x06\x07":
            if at64 != end - _LOCATOR.size - _END64.size:
                return None
            window.seek(at64)
            sig64, _size, _made, _needed, disk, cd_disk, here, count, cd_size, cd_offset = _END64.unpack(window.read(_END64.size))
            if sig64 != b"PK\x06\x06" or disk or cd_disk or here != count:
                return None
            end = at64
    if cd_offset + cd_size != end or count > cd_size // _CENTRAL.size:
        return None
    window.seek(cd_offset)
    cd = window.read(cd_size)
    if len(cd) != cd_size:
        return None
    entries, seen, at = [], set(), 0
    for _ in range(count):
        if at + _CENTRAL.size > cd_size:
            return None
        (sig, _made, _needed, flags, method, _time, _date, crc, csize, size, nlen, elen, clen, disk, _iattr, _eattr,
         offset) = _CENTRAL.unpack_from(cd, at)
        at += _CENTRAL.size
        raw = cd[at : at + nlen]
        at += nlen + elen + clen
        if (sig != b"PK\x01\x02" or flags & 0x1 or csize != size or disk or 0xFFFFFFFF in (size, offset)
                or at > cd_size or not raw.isascii() or raw in seen):
            return None
        seen.add(raw)
        entries.append((raw.decode("ascii"), offset, size, crc, method))
        if window.reads is not None:
            window.entry_crcs.append(cd_offset + at - nlen - elen - clen - _CENTRAL.size + 16)
    return entries if at == cd_size else None


def _data_start(window: _Window, name: str, offset: int, size: int, length: int, where: str, check_name: bool = False) -> int:
    """Where the data of entry ``name`` starts (its local header at ``offset`` read and checked),
    within the archive's ``length`` bytes with its ``size`` bytes."""
    window.seek(offset)
    header = window.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"bad zip local header for {name!r}", where=where)
    fields = _LOCAL_HEADER.unpack(header)
    if check_name and window.read(fields[-2]) != name.encode("ascii"):
        raise zipfile.BadZipFile(f"File name in directory {name!r} and header differ")
    data_start = offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    if offset < 0 or data_start + size > length:
        raise CorruptCheckpointError(f"record {name!r} runs past the end of its archive", where=where)
    return data_start


def read_tensor_box(reader: RangeReader, ref: TensorRef, storage: StoredStorage, box, where: str,
                    out: torch.Tensor | None = None, expanded: bool = False) -> torch.Tensor:
    """``box`` of the tensor ``ref`` describes, reading only the rows it touches (into ``out``);
    ``expanded``: the caller admitted ``ref`` as a view that repeats its record's bytes
    (:func:`check_ref`)."""
    import torch

    check_ref(ref, storage, where, expanded)
    item = dtype_size(ref.element_type)
    if ref.is_contiguous():
        return read_c_order_box(reader, storage.offset + ref.storage_offset * item, ref.shape, ref.dtype, box, out)
    # Rare: a strided tensor (saved from a view, an expanded one included). Read its whole storage
    # (no more than the record holds), then view it.
    raw = torch.empty(storage.nbytes, dtype=torch.uint8)
    reader.readinto(storage.offset, tensor_buffer(raw))
    full = raw.view(ref.dtype).as_strided(ref.shape, ref.stride, ref.storage_offset)
    piece = full[tuple(slice(o, o + n) for o, n in zip(*box))]
    if out is None:
        return piece.contiguous()
    out.copy_(piece)
    return out


#: the most bytes the views of one checkpoint that repeat their records' bytes (an expanded tensor,
#: stride 0) may add up to: more would let a small file declare terabytes for a convert to write
MAX_EXPANDED = 256 << 20


def expanded_bytes(ref: TensorRef, storage: StoredStorage) -> int:
    """The bytes of a view with more elements than its record has bytes for (one that repeats them:
    ``torch.ones(3, 1).expand(3, 4)``); 0 for any other tensor."""
    nbytes = math.prod(ref.shape) * dtype_size(ref.element_type)
    return nbytes if nbytes > storage.nbytes else 0


def check_ref(ref: TensorRef, storage: StoredStorage, where: str, expanded: bool = False) -> None:
    """A tensor a pickle describes must lie inside its storage record: no negative size, stride or
    offset, and no more elements than the record has bytes for (an overlapping view such as
    stride 0 would let a 1 KB file declare terabytes) unless ``expanded``: the caller admitted it
    within a budget (:data:`MAX_EXPANDED`)."""
    if (len(ref.stride) != len(ref.shape) or ref.storage_offset < 0 or not plausible_shape(ref.shape)
            or any(st < 0 for st in ref.stride)):
        raise CorruptCheckpointError(
            f"tensor has a negative or inconsistent size, stride or offset (shape {list(ref.shape)}, "
            f"stride {list(ref.stride)}, storage offset {ref.storage_offset})", where=where)
    item = dtype_size(ref.element_type)
    numel = math.prod(ref.shape)
    if numel == 0:
        return
    if ref.storage_offset * item + span_bytes(ref) > storage.nbytes:
        raise CorruptCheckpointError(f"tensor needs more bytes than its record holds ({storage.nbytes})", where=where)
    if numel * item > storage.nbytes and not expanded:
        raise CorruptCheckpointError(
            f"tensor of shape {list(ref.shape)} (stride {list(ref.stride)}) repeats the {storage.nbytes} bytes of its "
            "record (an overlapping view)", where=where, hint="ckpttool reads tensors whose elements are stored; "
            "save it with .contiguous()")


def span_bytes(ref: TensorRef) -> int:
    """Bytes from a tensor's first element to its last, as its strides lay them out."""
    if any(s == 0 for s in ref.shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride))) * dtype_size(ref.element_type)


def load_object_record(reader: RangeReader, start: int, length: int, where: str) -> Any:
    """The value a ``torch.save`` archive holds (a DCP object record), through the allow-list;
    tensors inside it (a tuple of tensors is one object to DCP) are read from the record."""
    arch = read_archive(reader, start, length, where)

    def read(ref: TensorRef) -> Any:
        storage = arch.storages.get(ref.storage.key)
        if storage is None:
            raise CorruptCheckpointError("object record lacks the data of a tensor it holds", where=where)
        check_ref(ref, storage, where)
        crc = crc32(reader.read(storage.offset, storage.nbytes))
        if crc != storage.crc32:  # like tensor records: an object's data is checked as it is read
            raise ChecksumError(f"a tensor inside the object does not match its CRC-32 (stored {storage.crc32:08x}, "
                                f"computed {crc:08x})", where=where, hint="the bytes changed after they were written")
        return read_tensor_box(reader, ref, storage, (tuple(0 for _ in ref.shape), ref.shape), where)

    return materialise(arch.obj, read, where)


def materialise(value: Any, read: Any, where: str) -> Any:
    """An object's value with each tensor inside it (a ``TensorRef``) read by ``read(ref)``, which
    checks it against its record; a DTensor inside an object is refused."""
    if isinstance(value, TensorRef):
        return read(value)
    if isinstance(value, DTensorRef):
        raise FormatError("an object holds a DTensor (one rank's shard)", where=where,
                          hint="save DTensors as state dict entries, not inside objects")
    if isinstance(value, dict):
        return type(value)((k, materialise(v, read, where)) for k, v in value.items())
    if isinstance(value, list):
        return [materialise(v, read, where) for v in value]
    if isinstance(value, tuple):
        items = [materialise(v, read, where) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


# --- writing -------------------------------------------------------------------------------------


class _Placeholder:
    """Stands for a tensor in the pickle written by :class:`ArchiveWriter`."""

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]):
        self.key, self.dtype, self.shape = key, dtype, tuple(shape)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


class _ArchivePickler(pickle.Pickler):
    """Spells each tensor as torch.save does: a legacy typed storage and ``_rebuild_tensor_v2`` where
    the dtype has one, else an ``UntypedStorage`` (its size in bytes) and ``_rebuild_tensor_v3``
    with the dtype (float8, uint16/32/64)."""

    inline: Any = None  # tensor -> its _Placeholder, with a record of its own (ArchiveWriter.finish)

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and self.inline is not None:
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided or obj.is_quantized:
                raise FormatError(f"an object holds a {type(obj).__name__} ({obj.layout}) that a torch file cannot store "
                                  "as plain data", hint="save such values as state dict entries of their own")
            return self.reducer_override(self.inline(obj))
        if isinstance(obj, _Placeholder):
            import torch

            from ..compat import rebuild_tensor_v2, rebuild_tensor_v3

            numel = math.prod(obj.shape)
            stride = contiguous_stride(obj.shape)
            name = dtype_of(obj.dtype).name
            if name in LEGACY_STORAGE:
                storage = _StorageToken(obj.key, LEGACY_STORAGE[name], numel)
                return rebuild_tensor_v2(), (storage, 0, torch.Size(obj.shape), stride, False, OrderedDict())
            storage = _StorageToken(obj.key, None, numel * dtype_size(obj.dtype))
            return rebuild_tensor_v3(), (storage, 0, torch.Size(obj.shape), stride, False, OrderedDict(), torch_dtype(obj.dtype))
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageToken):
            import torch

            storage_type = torch.UntypedStorage if obj.storage is None else getattr(torch, obj.storage)
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class _StorageToken:
    def __init__(self, key: str, storage: str | None, numel: int):
        self.key, self.storage, self.numel = key, storage, numel  # storage class None: untyped, numel in bytes


class ArchiveWriter:
    """Write one ``torch.save``-compatible archive into ``stream``, storages first, pickle last.

    The archive starts at the stream's current position (DCP packs many into one file). Storage
    records are 64-byte aligned from the archive start, as torch writes them, so torch's loader can
    memory-map our files (``mmap=True``).
    """

    def __init__(self, stream: IO[bytes], name: str = "archive", at: int | None = None):
        """``at``: the archive's offset in its file; given, each tensor's data (:meth:`new_tensor`)
        starts at a multiple of ``PAGE`` in the file instead of 64 bytes into the archive, so the
        file's writer can send it to disk straight from page-aligned memory (``LocalFile``)."""
        self._at = at
        self._stream = stream
        self._start = stream.tell() if stream.seekable() else 0
        self._out = _Tell(stream, self._start)
        self._zip = ZipOut(self._out)
        self._name = name
        self._next_key = 0

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass  # (an archive that raised is garbage: its output is discarded whole)

    def new_tensor(self, dtype: torch.dtype, shape: tuple[int, ...], crc: bool = True) -> tuple[_Placeholder, IO[bytes]]:
        """Open the record for a new tensor; write its C-order bytes into the returned stream, close it,
        and put the placeholder where the tensor goes in the object passed to :meth:`finish`
        (``crc=False``: no CRC-32 computed for its data, see ``ZipOut.open``)."""
        key = str(self._next_key)
        self._next_key += 1
        p = _Placeholder(key, dtype, shape)
        nbytes = dtype_size(dtype)
        for size in shape:
            nbytes *= size
        return p, self._open_record(f"data/{key}", nbytes, crc, self._at)

    def put_tensor(self, dtype: torch.dtype, shape: tuple[int, ...], data: Any) -> _Placeholder:
        """:meth:`new_tensor` for data already in memory (``data``: its C-order bytes, all of them),
        written in one step; the same bytes."""
        key = str(self._next_key)
        self._next_key += 1
        self._zip.put(*self._record_info(f"data/{key}", len(memoryview(data).cast("B")), self._at), data)
        return _Placeholder(key, dtype, shape)

    def _open_record(self, name: str, nbytes: int, crc: bool = True, at: int | None = None) -> IO[bytes]:
        return self._zip.open(*self._record_info(name, nbytes, at), crc)

    def _record_info(self, name: str, nbytes: int, at: int | None) -> tuple[zipfile.ZipInfo, bool]:
        """A record's entry (its padding puts the data at ``ALIGN`` in the archive, or at ``PAGE`` in
        the file when ``at`` is the archive's offset there) and whether it needs zip64 fields."""
        info = zipfile.ZipInfo(f"{self._name}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.file_size = nbytes
        zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT
        pos = self._out.tell()
        header = 30 + len(info.filename.encode()) + (20 if zip64 else 0)
        pad = (-(pos + header + 4)) % ALIGN if at is None else (-(at + pos + header + 4)) % PAGE
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # 'FB': torch's own padding id
        return info, zip64

    def write_bytes_record(self, name: str, data: bytes) -> None:
        with self._open_record(name, len(data)) as f:
            f.write(data)

    def finish(self, obj: Any) -> int:
        """Write the pickle of ``obj`` and the zip directory; returns the archive's length in bytes.
        A tensor inside ``obj`` itself (an object's value: a tuple holding a tensor, an RNG state
        kept whole) gets a record of its own, as ``torch.save`` gives it, before the pickle."""
        buf = io.BytesIO()
        inline: list[tuple[_Placeholder, Any]] = []

        def placeholder(t: Any) -> _Placeholder:
            key = str(self._next_key)
            self._next_key += 1
            inline.append((_Placeholder(key, t.dtype, tuple(t.shape)), t.detach().cpu().contiguous()))
            return inline[-1][0]

        pickler = _ArchivePickler(buf, protocol=2)
        pickler.inline = placeholder
        pickler.dump(obj)
        for p, t in inline:
            with self._open_record(f"data/{p.key}", t.numel() * t.element_size()) as f:
                if t.numel():
                    f.write(tensor_buffer(t))
        self.write_bytes_record("data.pkl", buf.getvalue())
        self.write_bytes_record("byteorder", b"little")
        self.write_bytes_record("version", b"3\n")
        self._zip.close()
        return self._out.tell()


class _Tell(io.RawIOBase):
    """Positions relative to the archive's start, so archives can follow each other in one file."""

    def __init__(self, stream: IO[bytes], start: int):
        self._s = stream
        self._start = start
        self._pos = 0
        self._seekable = stream.seekable()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def write(self, b) -> int:
        n = self._s.write(b)
        n = len(b) if n is None else n
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if not self._seekable:
            raise io.UnsupportedOperation("seek")
        if whence == 0:
            self._s.seek(self._start + pos)
            self._pos = pos
        elif whence == 1:
            return self.seek(self._pos + pos)
        else:
            end = self._s.seek(0, 2)
            self._pos = end - self._start + pos
            self._s.seek(self._start + self._pos)
        return self._pos

    def flush(self) -> None:
        self._s.flush()


__all__ = [
    "Archive",
    "ArchiveWriter",
    "StorageRef",
    "StoredStorage",
    "TensorRef",
    "load_object_record",
    "read_archive",
    "read_tensor_box",
    "span_bytes",
]
