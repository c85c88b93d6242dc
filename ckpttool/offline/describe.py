"""What ``ckpttool inspect`` reports: a JSON-able description of a checkpoint or a training root."""

from __future__ import annotations

import io

from typing import Any

from ..formats import Reading, check_optimizer_order, detect, open_source
from ..health import nonfinite_keys, problems
from ..index import TensorEntry
from ..safe_torch import values_as_read
from ..choices import human_bytes
from ..steps import is_training_root, list_root, read_commit_record, step_name
from ..storage import Location, resolve

_VALUE_CHARS = 80


def describe_checkpoint(loc: Location, reading: Reading | None = None) -> dict[str, Any]:
    with open_source(loc, reading=reading) as source:
        check_optimizer_order(reading.optimizer_order if reading is not None else None, loc.url, source.format)
        index = source.index()
        entries = []
        for key in index:
            entry = index[key]
            path = list(index.path(key))
            if isinstance(entry, TensorEntry):
                about = source.about(key)
                entries.append({
                    "key": key, "kind": "tensor", "shape": list(entry.shape), "dtype": entry.element_type.name,
                    "bytes": entry.nbytes, "chunks": len(entry.chunks), "files": sorted(set(about.files)), "path": path,
                    **({"placement": about.placement} if about.placement else {}),
                })
            else:
                value = source.read_object(key)
                text = _value_text(value)
                entries.append({
                    "key": key, "kind": "object", "type": type(value).__name__,
                    "value": text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "...", "path": path,
                })
        return {
            "path": loc.url,
            "kind": "checkpoint",
            "format": source.format,
            "files": source.files(),
            "tensors": sum(1 for e in entries if e["kind"] == "tensor"),
            "objects": sum(1 for e in entries if e["kind"] == "object"),
            "total_bytes": index.tensor_bytes,
            "entries": entries,
            "notes": source.not_read().lines(),
            **({"parts": parts} if (parts := source.describe_parts()) is not None else {}),
        }


def _value_text(value: Any) -> str:
    """What inspect shows of a value: its repr, but a buffer by its size (its repr is an address)."""
    if isinstance(value, io.BytesIO):
        return f"BytesIO({value.getbuffer().nbytes} bytes)"
    return repr(value)


def describe_root(loc: Location) -> dict[str, Any]:
    listing = list_root(loc)
    steps = []
    for step in listing.committed:
        record = read_commit_record(loc.child(step_name(step))) or {}
        row = {"step": step, "path": loc.child(step_name(step)).url, "world_size": record.get("world_size")}
        for field in ("bytes_written", "bytes_shared"):  # what the save wrote, and what it shared with the step before
            if isinstance(record.get(field), int) and not isinstance(record.get(field), bool):
                row[field] = record[field]
        found = record.get("health")
        if not isinstance(found, dict):
            row["health"] = {"state": "not recorded", "problems": []}
        else:
            said = problems(found)
            row["health"] = {"state": "unhealthy" if said else "healthy", "problems": said,
                             "nonfinite": nonfinite_keys(found), "unchanged": list(found.get("unchanged") or [])}
        slowest = slowest_rank(record.get("phases"))
        if slowest is not None:
            row["slowest_rank"] = slowest
        for field in ("per_rank", "per_rank_buffers"):  # extra's keys and the model's buffers kept per rank
            if isinstance(record.get(field), list) and record[field]:
                row[field] = [str(k) for k in record[field]]
        steps.append(row)
    damaged = [{"step": step, "path": loc.child(step_name(step)).url, "problem": what} for step, what in listing.damaged.items()]
    return {"path": loc.url, "kind": "training_root", "steps": steps, "damaged": damaged, "incomplete": listing.incomplete}


def slowest_rank(phases: Any) -> dict[str, Any] | None:
    """From a commit record's ``phases`` (rank -> seconds per phase of its save): the rank whose
    phases took longest, its seconds and its phases; None where the record has none (older
    steps) or they are not numbers."""
    if not isinstance(phases, dict):
        return None
    totals = {}
    for rank, spent in phases.items():
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(spent, dict)):
            return None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in spent.values()):
            return None
        totals[int(rank)] = (sum(spent.values()), {str(k): float(v) for k, v in spent.items()})
    if not totals:
        return None
    rank = max(totals, key=lambda r: (totals[r][0], -r))
    return {"rank": rank, "seconds": round(totals[rank][0], 3), "phases": {k: round(v, 3) for k, v in totals[rank][1].items()}}


def inspect_path(path: str, storage_options: dict[str, Any] | None = None, optimizer_order: str | None = None) -> dict[str, Any]:
    """What ``ckpttool inspect`` shows. Imports no torch for a safetensors or DCP checkpoint
    (values holding torch's objects are shown from their stand-ins, which print the same).
    ``optimizer_order``: as ``convert``'s, for a per-rank folder."""
    loc = resolve(path, storage_options)
    if loc.isdir() and is_training_root(loc) and not loc.child(".metadata").exists():
        return describe_root(loc)
    detect(loc)  # raises a clear error for anything that is not a checkpoint
    with values_as_read():
        return describe_checkpoint(loc, Reading(optimizer_order=optimizer_order))


def render_text(report: dict[str, Any]) -> str:
    lines = []
    if report["kind"] == "training_root":
        lines.append(f"training root {report['path']}")
        if report["steps"]:
            lines.append(f"committed steps ({len(report['steps'])}):")
            for s in report["steps"]:
                wrote = ""
                if "bytes_written" in s:
                    wrote = f"  wrote {human_bytes(s['bytes_written'])}, shared {human_bytes(s.get('bytes_shared', 0))}"
                lines.append(f"  step {s['step']:>8}  world size {s['world_size']}{wrote}  {s['health']['state']}  {s['path']}")
                if s.get("slowest_rank"):
                    slow = s["slowest_rank"]
                    spent = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(slow["phases"].items(), key=lambda kv: -kv[1]))
                    lines.append(f"      slowest rank {slow['rank']}: {slow['seconds']:.2f} s ({spent})")
                lines.extend(f"      {p}" for p in s["health"]["problems"])
                kept = [f"extra {', '.join(s['per_rank'])}"] if s.get("per_rank") else []
                kept += [f"buffers {', '.join(s['per_rank_buffers'])}"] if s.get("per_rank_buffers") else []
                if kept:
                    lines.append(f"      each rank's own (values differ between ranks): {'; '.join(kept)}")
        else:
            lines.append("no committed steps")
        for d in report["damaged"]:
            lines.append(f"damaged (never loaded): step {d['step']}: {d['problem']}")
        if report["incomplete"]:
            lines.append(f"incomplete (never committed; ignored by load, removed by `ckpttool clean`): {', '.join(report['incomplete'])}")
        return "\n".join(lines)
    lines.append(f"{report['format']} checkpoint {report['path']}")
    lines.append(f"files: {', '.join(report['files'])}")
    for part in report.get("parts", ()):
        if part.get("not_read"):
            lines.append(f"part: {part['file']}: not read ({part['not_read']})")
        else:
            lines.append(f"part: {part['file']} ({part['format']}) -> {part['key'] or 'its own keys'}")
    lines.append(f"{report['tensors']} tensors, {report['objects']} objects, {report['total_bytes']} bytes of tensor data")
    width = max((len(e["key"]) for e in report["entries"]), default=10)
    for e in report["entries"]:
        if e["kind"] == "tensor":
            shape = "x".join(str(s) for s in e["shape"]) or "scalar"
            placed = f"  [{e['placement']}]" if e.get("placement") else ""
            lines.append(f"  {e['key']:<{width}}  {e['dtype']:<9} {shape:<16} {e['bytes']:>12} B  {e['chunks']} chunk(s) in {', '.join(e['files'])}{placed}")
        else:
            lines.append(f"  {e['key']:<{width}}  {e['type']:<9} = {e['value']}")
    lines.extend(f"note: {n}" for n in report.get("notes", ()))
    return "\n".join(lines)
