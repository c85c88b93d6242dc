"""Integrity of a checkpoint (files, byte ranges, chunk tiling, decoding, checksums) and equality of
two checkpoints in any formats, region by region under a memory budget -> a :class:`Report`.

Nothing here raises for a problem it was asked to find: each becomes a :class:`Problem` with the
file, the key and what to do, and the check goes on. Only input that cannot be read at all (a
missing path, something that is no checkpoint, an unsafe ``.metadata``) raises.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .errors import CkptError, UnsafePickleError
from .formats import Source, detect, open_source
from .formats.base import SlabBuffers
from .index import TensorEntry, dtype_size
from .layout import slabs, tiles_exactly, whole
from .pipeline import DEFAULT_BUDGET, Progress, plan_entries
from .steps import is_training_root, list_root, step_name
from .storage import Location, resolve

_CRC_BLOCK = 8 << 20


@dataclass
class Problem:
    what: str
    file: str | None = None
    key: str | None = None
    hint: str | None = None

    def line(self) -> str:
        where = ", ".join(p for p in (self.file, f"key {self.key!r}" if self.key else None) if p)
        text = f"{where}: {self.what}" if where else self.what
        return f"{text} ({self.hint})" if self.hint else text


@dataclass
class Report:
    path: str
    kind: str  # "integrity" or "equality"
    problems: list[Problem] = field(default_factory=list)
    tensors_checked: int = 0
    bytes_checked: int = 0
    objects_checked: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, what: str, file: str | None = None, key: str | None = None, hint: str | None = None) -> None:
        self.problems.append(Problem(what, file, key, hint))

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        return doc


# --- integrity -----------------------------------------------------------------------------------


def verify_path(path: str | Location, *, only: str | None = None, storage_options: dict[str, Any] | None = None,
                progress: Progress | None = None) -> Report:
    """Check every committed step of a training root, or one checkpoint in any format."""
    loc = resolve(path, storage_options)
    if loc.isdir() and is_training_root(loc) and not loc.child(".metadata").exists():
        report = Report(loc.url, "integrity")
        listing = list_root(loc)
        if listing.incomplete:
            report.notes.append(f"incomplete steps (ignored by load): {', '.join(listing.incomplete)}")
        for step in listing.committed:
            sub = verify_path(loc.child(step_name(step)), only=only, progress=progress)
            report.problems += sub.problems
            report.notes += [n for n in sub.notes if n not in report.notes]
            report.tensors_checked += sub.tensors_checked
            report.bytes_checked += sub.bytes_checked
            report.objects_checked += sub.objects_checked
        if not listing.committed:
            report.notes.append("no committed steps")
        return report
    fmt = detect(loc)
    report = Report(loc.url, "integrity")
    try:
        source = open_source(loc, fmt)
    except UnsafePickleError:
        raise
    except CkptError as exc:
        report.add(exc.what, exc.where, hint=exc.hint or "restore the checkpoint from a good copy")
        return report
    with source:
        check = {"dcp": _verify_dcp, "torch": _verify_torch, "safetensors": _verify_safetensors}[fmt]
        try:
            check(source, report, only, progress)
        except CkptError as exc:
            report.add(exc.what, exc.where, hint=exc.hint)
        except Exception as exc:  # noqa: BLE001 - damaged input must end as a reported problem, not a crash
            report.add(f"cannot be read: {type(exc).__name__}: {exc}", loc.url, hint="the checkpoint is damaged")
    return report


def _selected(source: Source, only: str | None) -> list[str]:
    index = source.index()
    if only is None:
        return list(index)
    return [k for k in index if str(index.path(k)[0]) == only]


def _scan(reader, offset: int, length: int, buf: memoryview, crc_span: tuple[int, int] | None = None,
          hasher: Any = None) -> int:
    """Read ``length`` bytes at ``offset`` once, feeding every block to ``hasher`` (if any) and the
    part inside the absolute byte span ``crc_span`` (default: all of it) to CRC-32; returns the CRC.

    One pass serves both checks of a DCP record (torch's CRC-32 of the tensor data, ckpttool's
    manifest hash of the whole record), so a cold verify reads each byte from disk once.
    """
    lo, hi = crc_span if crc_span is not None else (offset, offset + length)
    crc = 0
    done = 0
    while done < length:
        n = min(len(buf), length - done)
        block = buf[:n]
        start = offset + done
        reader.readinto(start, block)
        if hasher is not None:
            hasher.update(block)
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            crc = zlib.crc32(block[a - start:b - start], crc)
        done += n
    return crc


def _verify_dcp(source: Source, report: Report, only: str | None, progress: Progress | None) -> None:
    index = source.index()
    sizes: dict[str, int | None] = {}
    for name in source.files():
        loc = source.location.child(name)
        sizes[name] = loc.size() if loc.exists() else None
        if sizes[name] is None:
            keys = sorted(k for k in index if name in _files_of(index[k]))
            report.add("data file is missing", loc.url, keys[0] if keys else None,
                       hint=f"{len(keys)} entries lose their data; restore the file")
    buf = memoryview(bytearray(_CRC_BLOCK))
    manifest = _load_manifest(source, report)
    keys = _selected(source, only)
    total = sum(index[k].nbytes for k in keys if isinstance(index[k], TensorEntry))
    done = 0
    for key in keys:
        entry = index[key]
        infos = [c.location for c in entry.chunks] if isinstance(entry, TensorEntry) else [entry.location]
        broken = False
        for info in infos:
            size = sizes.get(info.relative_path)
            url = source.location.child(info.relative_path).url
            if size is None:
                broken = True
            elif info.offset < 0 or info.offset + info.length > size:
                report.add(f"record at bytes {info.offset}..{info.offset + info.length} lies past the end of the file ({size} bytes)",
                           url, key, hint="the file is truncated; restore it from a good copy")
                broken = True
        if broken:
            continue
        if isinstance(entry, TensorEntry):
            gap = tiles_exactly(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
            if gap:
                report.add(f"chunks do not tile the shape {list(entry.shape)}: {gap}", source.location.child(".metadata").url, key,
                           hint="the .metadata is inconsistent; the checkpoint cannot be trusted")
            for chunk in entry.chunks:
                _check_dcp_chunk(source, key, entry, chunk, manifest, report, buf)
            report.tensors_checked += 1
            report.bytes_checked += entry.nbytes
            done += entry.nbytes
            if progress:
                progress(done, total, key)
        else:
            _check_manifest_only(source, manifest, entry.location, key, report, buf)
            try:
                source.read_object(key)
                report.objects_checked += 1
            except CkptError as exc:
                report.add(exc.what, exc.where or source.location.child(entry.location.relative_path).url, key, exc.hint)


def _load_manifest(source, report: Report) -> dict[tuple[str, int], tuple[int, str]] | None:
    """(file, offset) -> (length, hash) from the step's commit record, when ckpttool wrote one."""
    from .manifest import ALGORITHM
    from .steps import read_commit_record

    record = read_commit_record(source.location)
    manifest = (record or {}).get("manifest")
    if not manifest:
        return None
    if manifest.get("algorithm") != ALGORITHM:
        report.notes.append(f"manifest uses {manifest.get('algorithm')}, this install hashes with {ALGORITHM}: not checked")
        return None
    report.notes.append(f"checked against the manifest ({ALGORITHM}) of the commit record")
    return {(name, off): (length, digest) for name, rows in manifest.get("records", {}).items() for off, length, digest in rows}


def _manifest_row(manifest, info, url: str, key: str, report: Report) -> tuple[int, str] | None:
    """The manifest's (length, hash) of this record; reports a record the manifest does not know."""
    if manifest is None:
        return None
    row = manifest.get((info.relative_path, info.offset))
    if row is None or row[0] != info.length:
        report.add("record is not in the manifest written at commit", url, key, hint="the .metadata changed after the save")
        return None
    return row


def _compare_digest(row: tuple[int, str] | None, digest: str, info, url: str, key: str, report: Report) -> None:
    if row is not None and digest != row[1]:
        report.add(f"record at byte {info.offset} does not match the manifest's checksum", url, key,
                   hint="the bytes changed after the save committed; restore the file")


def _check_manifest_only(source, manifest, info, key: str, report: Report, buf: memoryview) -> None:
    from .manifest import hash_range

    url = source.location.child(info.relative_path).url
    row = _manifest_row(manifest, info, url, key, report)
    if row is None:
        return
    try:
        digest = hash_range(source._reader(info.relative_path), info.offset, info.length, buf)
    except CkptError as exc:
        report.add(exc.what, exc.where or url, key, exc.hint)
        return
    _compare_digest(row, digest, info, url, key, report)


def _files_of(entry) -> set[str]:
    if isinstance(entry, TensorEntry):
        return {c.location.relative_path for c in entry.chunks}
    return {entry.location.relative_path}


def _check_dcp_chunk(source, key: str, entry: TensorEntry, chunk, manifest, report: Report, buf: memoryview) -> None:
    """Decode the chunk's record header, then read the record once for its CRC-32 and manifest hash."""
    from .manifest import new_hasher

    info = chunk.location
    url = source.location.child(info.relative_path).url
    row = _manifest_row(manifest, info, url, key, report)
    reader = source._reader(info.relative_path)
    hasher = new_hasher() if row is not None else None
    try:
        arch = source.archive(info, key)
        ref = arch.obj
        if not hasattr(ref, "shape") or tuple(ref.shape) != tuple(chunk.sizes) or ref.dtype != entry.dtype:
            report.add(f"record at byte {info.offset} holds {getattr(ref, 'dtype', type(ref).__name__)}"
                       f"{list(getattr(ref, 'shape', []))}, .metadata says {entry.dtype}{list(chunk.sizes)}", url, key)
            return
        storage = arch.storages.get(ref.storage.key)
        need = (ref.storage_offset + math.prod(ref.shape)) * dtype_size(ref.dtype) if ref.shape else dtype_size(ref.dtype)
        if storage is None or storage.nbytes < need:
            report.add("record's data is shorter than its tensor", url, key)
            return
        span = (storage.offset, storage.offset + storage.nbytes)
        if hasher is not None:
            crc = _scan(reader, info.offset, info.length, buf, crc_span=span, hasher=hasher)
        else:
            crc = _scan(reader, storage.offset, storage.nbytes, buf)
        if crc != storage.crc32:
            report.add(f"tensor data of the chunk at {list(chunk.offsets)} does not match its CRC-32 "
                       f"(stored {storage.crc32:08x}, computed {crc:08x})", url, key,
                       hint="the bytes changed after they were written (bit rot, a bad copy); restore the file")
        if hasher is not None:
            _compare_digest(row, hasher.hexdigest(), info, url, key, report)
    except CkptError as exc:
        report.add(exc.what, exc.where or url, key, exc.hint)
    except Exception as exc:  # noqa: BLE001 - a corrupt record must be reported, never crash the check
        report.add(f"cannot decode the record at byte {info.offset}: {type(exc).__name__}: {exc}", url, key)


def _verify_torch(source: Source, report: Report, only: str | None, progress: Progress | None) -> None:
    buf = memoryview(bytearray(_CRC_BLOCK))
    checked: set[str] = set()
    index = source.index()
    keys = _selected(source, only)
    total = sum(index[k].nbytes for k in keys if isinstance(index[k], TensorEntry))
    done = 0
    for key in keys:
        entry = index[key]
        if not isinstance(entry, TensorEntry):
            report.objects_checked += 1
            continue
        ref = entry.chunks[0].location
        try:
            storage = source.storage_of(ref)
        except KeyError:
            report.add("tensor's storage record is missing from the archive", source.location.url, key)
            continue
        if storage.name not in checked:
            checked.add(storage.name)
            crc = _scan(source._reader, storage.offset, storage.nbytes, buf)
            if crc != storage.crc32:
                report.add(f"data of {storage.name} does not match its CRC-32 (stored {storage.crc32:08x}, computed {crc:08x})",
                           source.location.url, key, hint="the file changed after it was written; restore it")
        item = dtype_size(ref.dtype)
        span = 0 if 0 in ref.shape else (1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride))) * item
        if (ref.storage_offset * item + span) > storage.nbytes:
            report.add("tensor extends past its storage record", source.location.url, key)
        report.tensors_checked += 1
        report.bytes_checked += entry.nbytes
        done += entry.nbytes
        if progress:
            progress(done, total, key)


def _verify_safetensors(source: Source, report: Report, only: str | None, progress: Progress | None) -> None:
    from .formats.safetensors import INDEX_FILE
    for f in source._files:
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
        report.tensors_checked += len(f.tensors)
        report.bytes_checked += sum(end - begin for (_, _, begin, end) in f.tensors.values())
    index_loc = source.location.child(INDEX_FILE) if source.location.isdir() else None
    if index_loc is not None and index_loc.exists():
        try:
            weight_map = json.loads(index_loc.read_bytes())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            report.add(f"index file is not valid ({exc})", index_loc.url)
            return
        where = {key: f.loc.name for f in source._files for key in f.tensors}
        for key, fname in weight_map.items():
            if where.get(key) != fname:
                report.add(f"index maps it to {fname} but it is in {where.get(key, 'no file')}", index_loc.url, key)
        for key in where.keys() - weight_map.keys():
            report.add(f"tensor in {where[key]} is missing from the index", index_loc.url, key)
    report.notes.append("safetensors stores no checksums: a flipped bit in tensor data cannot be detected")
    report.objects_checked += sum(1 for _ in source.index().objects())


# --- equality ------------------------------------------------------------------------------------


def _int_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if flat.numel() else flat


def verify_against(path: str | Location, other: str | Location, *, only: str | None = None, rtol: float = 0.0, atol: float = 0.0,
                   cast: bool = False, memory_budget: int = DEFAULT_BUDGET, storage_options: dict[str, Any] | None = None,
                   progress: Progress | None = None) -> Report:
    """Compare ``path`` (optionally one top-level key of it, prefix dropped) with ``other`` entry by
    entry: keys on either side, dtypes and shapes, values bitwise or within rtol/atol."""
    a_loc, b_loc = resolve(path, storage_options), resolve(other, storage_options)
    report = Report(a_loc.url, "equality")
    with open_source(a_loc) as a, open_source(b_loc) as b:
        plan = plan_entries(a, only, None)
        b_index = b.index()
        a_keys = plan.source_key
        for key in sorted(b_index.keys() - a_keys.keys()):
            report.add(f"only in {b_loc.url}", a_loc.url, key)
        tensors = plan.tensors
        total = sum(t.nbytes for t in tensors)
        done = 0
        for spec in plan.entries:
            a_key = a_keys[spec.key]
            if spec.key not in b_index:
                report.add(f"only in {a_loc.url}, missing from {b_loc.url}", b_loc.url, spec.key)
                continue
            b_entry = b_index[spec.key]
            if not hasattr(spec, "shape"):
                if isinstance(b_entry, TensorEntry):
                    report.add("an object here, a tensor in the other", b_loc.url, spec.key)
                    continue
                if a.read_object(a_key) != b.read_object(spec.key):
                    report.add(f"objects differ: {a.read_object(a_key)!r} vs {b.read_object(spec.key)!r}", b_loc.url, spec.key)
                report.objects_checked += 1
                continue
            if not isinstance(b_entry, TensorEntry):
                report.add("a tensor here, an object in the other", b_loc.url, spec.key)
                continue
            if tuple(spec.shape) != tuple(b_entry.shape):
                report.add(f"shapes differ: {list(spec.shape)} vs {list(b_entry.shape)}", b_loc.url, spec.key)
                continue
            if spec.dtype != b_entry.dtype and not cast:
                report.add(f"dtypes differ: {spec.dtype} vs {b_entry.dtype}", b_loc.url, spec.key,
                           hint="pass --cast to compare an export made with --dtype after casting")
                continue
            _compare_tensor(a, a_key, b, spec.key, spec.shape, spec.dtype, b_entry.dtype, rtol, atol, memory_budget, report, b_loc.url)
            report.tensors_checked += 1
            report.bytes_checked += spec.nbytes
            done += spec.nbytes
            if progress:
                progress(done, total, spec.key)
    return report


def _compare_tensor(a: Source, a_key: str, b: Source, b_key: str, shape, a_dtype, b_dtype, rtol, atol, budget, report, where):
    item = max(dtype_size(a_dtype), dtype_size(b_dtype))
    first = None
    max_abs = 0.0
    max_rel = 0.0
    count = 0
    buffers = SlabBuffers(2)
    for box in slabs(shape, item * 4, budget, whole(shape)):
        x = a.read_tensor(a_key, box, out=buffers.view(box[1], a_dtype, 0))
        y = b.read_tensor(b_key, box, out=buffers.view(box[1], b_dtype, 1))
        if a_dtype != b_dtype:  # OTHER is an export made with --dtype: cast PATH's values the same way
            x = x.to(b_dtype)
        if rtol == 0 and atol == 0:
            bad = _int_view(x) != _int_view(y)
        else:
            xd, yd = x.double().reshape(-1), y.double().reshape(-1)
            diff = (xd - yd).abs()
            both_nan = xd.isnan() & yd.isnan()
            bad = ~((diff <= atol + rtol * yd.abs()) | (xd == yd) | both_nan)
            finite = torch.isfinite(diff)
            if finite.any():
                max_abs = max(max_abs, diff[finite].max().item())
                rel = diff[finite] / yd.abs()[finite].clamp_min(1e-300)
                max_rel = max(max_rel, rel.max().item())
        n = int(bad.sum().item()) if bad.numel() else 0
        if n:
            count += n
            if first is None:
                flat = int(bad.nonzero()[0].item())
                local = _unravel(flat, box[1])
                first = [o + i for o, i in zip(box[0], local)]
                first_vals = (x.reshape(-1)[flat].item(), y.reshape(-1)[flat].item())
    if count:
        detail = f"{count} element(s) differ; first at index {first}: {first_vals[0]!r} vs {first_vals[1]!r}"
        if rtol or atol:
            detail += f"; max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}"
        report.add(detail, where, b_key)


def _unravel(flat: int, sizes) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(flat % s if s else 0)
        flat //= s if s else 1
    return list(reversed(out))



# --- live check after a load ---------------------------------------------------------------------


@dataclass
class Mismatch:
    key: str
    rank: int
    first_index: list[int]
    max_abs_diff: float
    elements: int


@dataclass
class LoadedReport:
    """What :func:`verify_loaded` found; the same object on every rank."""

    path: str
    tensors_checked: int = 0
    bytes_checked: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _local_box(value: torch.Tensor):
    """(local tensor, its box in the global tensor) for a DTensor shard or a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return value.to_local(), (tuple(offset), tuple(shape))
    return value, whole(tuple(value.shape))


def verify_loaded(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Location, *,
                  storage_options: dict[str, Any] | None = None) -> LoadedReport:
    """Compare this rank's shards of ``model`` (and ``optimizer``) with the checkpoint's bytes for
    exactly the same boxes, reading only those boxes (no all-gather); every rank returns the same
    report. Call it on every rank after a load."""
    from . import dist
    from .checkpointer import _training_state
    from .index import flatten

    loc = resolve(path, storage_options)
    report = LoadedReport(loc.url)
    rank = dist.rank()
    state, _ = flatten(_training_state(model, optimizer, None))
    mine: list[Mismatch] = []
    checked = [0, 0]
    error: BaseException | None = None
    try:
        with open_source(loc, "dcp") as source:
            index = source.index()
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                local, box = _local_box(value)
                if local.numel() == 0:
                    continue
                if key not in index:
                    mine.append(Mismatch(key, rank, [], float("nan"), local.numel()))
                    continue
                stored = source.read_tensor(key, box)
                local = local.detach().cpu()
                if stored.dtype != local.dtype or tuple(stored.shape) != tuple(local.shape):
                    mine.append(Mismatch(key, rank, [], float("nan"), local.numel()))
                    continue
                bad = _int_view(stored) != _int_view(local)
                n = int(bad.sum().item())
                if n:
                    flat = int(bad.nonzero()[0].item())
                    first = [o + i for o, i in zip(box[0], _unravel(flat, box[1]))]
                    diff = (stored.double() - local.double()).abs()
                    max_abs = float(diff[torch.isfinite(diff)].max().item()) if torch.isfinite(diff).any() else float("nan")
                    mine.append(Mismatch(key, rank, first, max_abs, n))
                checked[0] += 1
                checked[1] += local.numel() * local.element_size()
    except CkptError as exc:
        error = exc
    error = dist.first_error(error)
    if error is not None:
        raise error
    for r, (found, counts) in enumerate(dist.all_gather((mine, checked))):
        report.mismatches += found
        report.tensors_checked += counts[0]
        report.bytes_checked += counts[1]
    report.mismatches.sort(key=lambda m: (m.key, m.rank))
    return report
