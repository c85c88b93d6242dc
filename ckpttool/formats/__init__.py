"""Formats (dcp, torch, safetensors) as Sources and Sinks, and detection of a path's format.

Detection looks at content first (a ``.metadata`` file, a zip signature, a safetensors header) and
falls back to the suffix only for outputs that do not exist yet.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import FormatError, NotACheckpointError, NotFoundError
from ..storage import Location, resolve
from .base import ObjectSpec, Sink, Source, TensorSpec

FORMATS = ("dcp", "torch", "safetensors")
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def detect(loc: Location) -> str:
    """The format of an existing checkpoint path; raises when it is none we know."""
    if not loc.exists():
        raise NotFoundError("path does not exist", where=loc.url, hint="check the path or URL")
    if loc.isdir():
        names = set(loc.listdir())
        if ".metadata" in names:
            return "dcp"
        if "model.safetensors.index.json" in names or any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        from ..steps import is_training_root

        if is_training_root(loc):
            raise NotACheckpointError(
                "this is a training root (it holds step-<N> directories), not one checkpoint",
                where=loc.url,
                hint="name one step, e.g. PATH/step-100; `ckpttool inspect` lists them",
            )
        if any(n.endswith(".distcp") for n in names):
            raise NotACheckpointError(
                "DCP directory without .metadata (an interrupted save?)", where=loc.url, hint="use a complete checkpoint"
            )
        raise NotACheckpointError(
            "directory holds no checkpoint ckpttool knows", where=loc.url, hint="expected DCP (.metadata) or safetensors files"
        )
    head = loc.read_bytes(0, 16)
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if head[8:9] == b"{" and 8 + n <= loc.size():
            return "safetensors"
    if head[:2] == b"\x80\x02" or head[:1] == b"\x80":
        raise FormatError(
            "legacy (pre-1.6, non-zip) torch.save file", where=loc.url, hint="load and re-save it with a current torch"
        )
    raise NotACheckpointError("not a checkpoint in any format ckpttool knows", where=loc.url, hint="expected DCP, torch.save or safetensors")


def format_from_name(loc: Location) -> str:
    """The format an output path implies by its suffix (``--to`` overrides)."""
    name = loc.name.lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(TORCH_SUFFIXES):
        return "torch"
    return "dcp"


def open_source(path: str | Location, fmt: str | None = None, storage_options: dict[str, Any] | None = None) -> Source:
    loc = resolve(path, storage_options)
    fmt = fmt or detect(loc)
    if fmt == "dcp":
        from .dcp import DcpSource

        return DcpSource(loc)
    if fmt == "torch":
        from .torch_save import TorchSaveSource

        return TorchSaveSource(loc)
    if fmt == "safetensors":
        from .safetensors import SafetensorsSource

        return SafetensorsSource(loc)
    raise FormatError(f"unknown format {fmt!r}", hint=f"choose one of {', '.join(FORMATS)}")


def make_sink(loc: Location, fmt: str, *, max_shard_size: int | None = None) -> Sink:
    if fmt == "dcp":
        from .dcp import DcpSink

        return DcpSink(loc)
    if fmt == "torch":
        from .torch_save import TorchSaveSink

        return TorchSaveSink(loc)
    if fmt == "safetensors":
        from .safetensors import SafetensorsSink

        return SafetensorsSink(loc, max_shard_size=max_shard_size)
    raise FormatError(f"unknown format {fmt!r}", hint=f"choose one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "ObjectSpec", "Sink", "Source", "TensorSpec", "detect", "format_from_name", "make_sink", "open_source"]
