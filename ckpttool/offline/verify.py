"""Integrity of a checkpoint (each format checks its own files: ``Format.check_integrity``) and
equality of two checkpoints in any formats, region by region under a memory budget -> a :class:`Report`.

Nothing here raises for a problem it was asked to find: each becomes a :class:`Problem` with the
file, the key and what to do, and the check goes on. Only input that cannot be read at all (a
missing path, something that is no checkpoint, an unsafe ``.metadata``) raises.
"""

from __future__ import annotations

from typing import Any

from .. import formats, rendezvous
from ..bulk import no_gc
from ..choices import DEFAULT_BUDGET
from ..errors import CkptError, FormatError, UnsafePickleError, UsageError
from ..buffers import SlabBuffers
from ..formats.base import Progress, Source
from ..index import TensorEntry, dtype_size, strip_prefix
from ..layout import slabs, whole
from ..report import Problem, Report
from ..safe_torch import values_as_read
from ..safe_pickle import same_value
from ..steps import is_training_root, list_root, step_name
from ..storage import Location, resolve

__all__ = ["Problem", "Report", "verify_against", "verify_path"]


# --- integrity -----------------------------------------------------------------------------------


@no_gc()  # (the collector held off: bulk.py, docs/benchmarks.md)
def verify_path(path: str | Location, *, only: str | None = None, storage_options: dict[str, Any] | None = None,
                progress: Progress | None = None, parallel: bool = False, optimizer_order: str | None = None) -> Report:
    """Check every committed step of a training root, or one checkpoint in any format.

    With ``parallel``, every process of the torch.distributed group runs this together and the
    checks of a DCP checkpoint are split between them (the entries of each in runs of about equal
    bytes); every worker returns the report one process would (other formats: worker 0 checks).
    Imports no torch for a safetensors or DCP checkpoint (values are only checked to decode).
    ``optimizer_order``: as ``convert``'s, for a per-rank folder."""
    with values_as_read():
        return _verify_path(path, only, storage_options, progress, parallel, formats.Reading(optimizer_order=optimizer_order))


def _verify_path(path: str | Location, only: str | None, storage_options: dict[str, Any] | None, progress: Progress | None,
                 parallel: bool, reading: formats.Reading) -> Report:
    loc = resolve(path, storage_options)
    if loc.isdir() and is_training_root(loc) and not loc.child(".metadata").exists():
        report = Report(loc.url, "integrity")
        listing = list_root(loc)
        if listing.incomplete:
            report.note(f"incomplete steps (ignored by load): {', '.join(listing.incomplete)}")
        for step, what in listing.damaged.items():
            report.add(what, loc.child(step_name(step)).url, hint="load never takes this step; it cannot be trusted")
        for step in listing.committed:
            report.merge(_verify_path(loc.child(step_name(step)), only, None, progress, parallel, reading))
        if not listing.committed and not listing.damaged:
            report.note("no committed steps")
        return report
    fmt = formats.detect(loc)
    formats.check_optimizer_order(reading.optimizer_order, loc.url, fmt.name)
    report = Report(loc.url, "integrity")
    workers = rendezvous.world_size() if parallel else 1
    try:
        source = fmt.open_source(loc, verify=False, reading=reading)  # check_integrity reports what it finds instead
    except (UnsafePickleError, FormatError):  # input ckpttool cannot read as asked (exit 2): no difference found
        raise
    except CkptError as exc:
        report.add(exc.what, exc.where, hint=exc.hint or "restore the checkpoint from a good copy")
        # (the other workers, which may have opened it, gather the reports: this worker's too)
        return _merged(report, rendezvous.all_gather((report, []))) if workers > 1 else report
    share = (rendezvous.rank(), workers) if workers > 1 and fmt.splits_integrity else None
    segments = None
    shared = None
    if share is not None:
        from ..parallel import SharedProgress

        # every worker's progress counts against the bytes of all the entries checked
        shared = progress = SharedProgress(progress, None, loc.url)
    with source:
        try:
            if share is not None:
                segments = fmt.check_integrity(source, report, only, progress, share)
            elif rendezvous.rank() == 0 or workers == 1:
                fmt.check_integrity(source, report, only, progress)
        except UnsafePickleError as exc:  # unreadable input (exit 2), not a difference found
            report.add(exc.what, exc.where, hint=exc.hint, unreadable=True)
        except CkptError as exc:
            report.add(exc.what, exc.where, hint=exc.hint)
        except Exception as exc:  # noqa: BLE001 - damaged input must end as a reported problem, not a crash
            report.add(f"cannot be read: {type(exc).__name__}: {exc}", loc.url, hint="the checkpoint is damaged")
        not_read = source.not_read()
        for text in not_read.notes:
            report.note(text)
        if only is None:  # a part that cannot be read fails the check: verify never passes over it
            for name, why in not_read.unreadable:
                report.add(f"cannot be read: {why}", source.location.child(name).url, unreadable=True,
                           hint="check the other parts with --only KEY (e.g. --only model)")
    if shared is not None:
        shared.close(finished=False)
    if workers > 1:
        report = _merged(report, rendezvous.all_gather((report, segments or [])))
    return report


def _merged(mine: Report, parts: list[tuple[Report, list[tuple[int, Report]]]]) -> Report:
    """The workers' reports as one process makes it: worker 0's checks of the whole checkpoint,
    then what each entry's check found in the entries' order, then anything a worker found
    outside both (an error that stopped its share)."""
    report = Report(mine.path, mine.kind)
    segments = sorted((seg for _, segs in parts for seg in segs), key=lambda s: s[0])
    for part in [parts[0][0], *(seg for _, seg in segments), *(p for p, _ in parts[1:])]:
        report.merge(part)
    return report


# --- equality ------------------------------------------------------------------------------------


@no_gc()  # (the collector held off: bulk.py, docs/benchmarks.md)
def verify_against(path: str | Location, other: str | Location, *, only: str | None = None, against_only: str | None = None,
                   rtol: float = 0.0, atol: float = 0.0, cast: bool = False, memory_budget: int = DEFAULT_BUDGET,
                   storage_options: dict[str, Any] | None = None, progress: Progress | None = None,
                   optimizer_order: str | None = None) -> Report:
    """Compare ``path`` with ``other`` entry by entry: keys on either side, dtypes and shapes,
    values bitwise or within rtol/atol. ``only`` / ``against_only`` compare one top-level key of
    that side, prefix dropped (an HF export's flat keys against the ``model`` of a DCP step, either
    way round). A difference is reported under both files (and keys), a missing key under the file
    that has it; what either side says of how it was read is noted (``optimizer_order``: convert's)."""
    from ..engine import plan_entries

    a_loc, b_loc = resolve(path, storage_options), resolve(other, storage_options)
    report = Report(a_loc.url, "equality")
    reading = formats.Reading(optimizer_order=optimizer_order)
    with formats.open_source(a_loc, reading=reading) as a, formats.open_source(b_loc, reading=reading) as b:
        formats.check_optimizer_order(optimizer_order, a_loc.url, a.format, b.format)
        for text in (f"{s.location.url}: {note}" for s in (a, b) for note in s.not_read().notes):
            report.note(text)
        plan = plan_entries(a, only, None)
        b_index = b.index()
        b_keys = _keys_compared(b_index, against_only, b_loc)
        a_keys = plan.source_key
        for key in sorted(b_keys.keys() - a_keys.keys()):
            report.add(f"only in {b_loc.url}, missing from {a_loc.url}", b_loc.url, b_keys[key])
        total = sum(t.nbytes for t in plan.tensors)
        done = 0
        for spec in plan.entries:
            a_key = a_keys[spec.key]
            if spec.key not in b_keys:
                report.add(f"only in {a_loc.url}, missing from {b_loc.url}", a_loc.url, a_key)
                continue
            b_key = b_keys[spec.key]
            b_entry = b_index[b_key]
            both = f"{a_loc.url} vs {b_loc.url}" + (f" (key {b_key!r} there)" if b_key != a_key else "")
            if not hasattr(spec, "shape"):
                if isinstance(b_entry, TensorEntry):
                    report.add("an object here, a tensor in the other", both, a_key)
                    continue
                a_value, b_value = a.read_object(a_key), b.read_object(b_key)
                if not same_value(a_value, b_value):
                    report.add(f"objects differ: {a_value!r} vs {b_value!r}", both, a_key)
                report.objects_checked += 1
                continue
            if not isinstance(b_entry, TensorEntry):
                report.add("a tensor here, an object in the other", both, a_key)
                continue
            if tuple(spec.shape) != tuple(b_entry.shape):
                report.add(f"shapes differ: {list(spec.shape)} vs {list(b_entry.shape)}", both, a_key)
                continue
            if spec.dtype != b_entry.dtype and not cast:
                report.add(f"dtypes differ: {spec.dtype} vs {b_entry.dtype}", both, a_key,
                           hint="pass --cast to compare an export made with --dtype after casting")
                continue
            _compare_tensor(a, a_key, b, b_key, spec.shape, spec.dtype, b_entry.dtype, rtol, atol, memory_budget, report, both)
            report.tensors_checked += 1
            report.bytes_checked += spec.nbytes
            done += spec.nbytes
            if progress:
                progress(done, total, spec.key)
    return report


def _keys_compared(index: Any, only: str | None, loc: Location) -> dict[str, str]:
    """The keys of one side as compared (the prefix ``only.`` dropped) -> its own keys."""
    if only is None:
        return {k: k for k in index}
    keys = {out: key for key, (out, _) in strip_prefix(index.paths, only).items()}
    if not keys:
        tops = sorted({str(index.path(k)[0]) for k in index})
        raise UsageError(f"no entries under the top-level key {only!r} in {loc.url}",
                         hint=f"top-level keys there are: {', '.join(tops)}")
    return keys


def _compare_tensor(a: Source, a_key: str, b: Source, b_key: str, shape, a_dtype, b_dtype, rtol, atol, budget, report, where):
    import torch

    from ..compare import bits_differ
    from ..layout import unravel

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
            bad = bits_differ(x, y)
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
                local = unravel(flat, box[1])
                first = [o + i for o, i in zip(box[0], local)]
                first_vals = (x.reshape(-1)[flat].item(), y.reshape(-1)[flat].item())
    if count:
        detail = f"{count} element(s) differ; first at index {first}: {first_vals[0]!r} vs {first_vals[1]!r}"
        if rtol or atol:
            detail += f"; max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}"
        report.add(detail, where, a_key)
