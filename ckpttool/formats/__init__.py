"""The format registry: every checkpoint format is one module defining ``FORMAT`` (a
:class:`~ckpttool.formats.base.Format`) plus one registration line below.

A registration names the format, its module and the output suffixes that imply it, so the CLI can
list formats and choose an output format without importing torch; the module is imported on first
use. ``detect``, ``convert``, ``inspect``, ``verify`` and ``reshard``, the conformance suite and
the fuzz tests all iterate the registry.

To add a format: write ``formats/NAME.py`` with a Source, a Sink and a Format subclass (``sniff``,
``open_source``, ``make_sink``, ``check_integrity``), end it with ``FORMAT = NameFormat()``, and
add one ``register(...)`` line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import FormatError, NotACheckpointError, NotFoundError, UsageError

if TYPE_CHECKING:
    from ..storage import Location
    from .base import Format, Source


@dataclass(frozen=True)
class Registration:
    name: str
    module: str  # defines FORMAT
    suffixes: tuple[str, ...]  # output names ending so are written in this format
    summary: str
    default: bool  # the output format for a name with no known suffix (a directory)
    sharded_default: bool  # ... when the output is to be sharded (--max-shard-size)
    writes: tuple[str, ...] = ("convert",)  # the commands that write it (convert: any checkpoint; reshard: a job's ranks)

    @property
    def writable(self) -> bool:
        """Whether ``convert`` writes it (a ``--to`` choice of convert)."""
        return "convert" in self.writes


@dataclass(frozen=True)
class Reading:
    """Who opens a checkpoint, for what: ``rank``, named in its errors; ``optimizer_names`` (a load
    into a live job), the live optimizers' parameter names group by group, which pair a per-rank
    folder's optimizer indices with names as ``optimizer.load_state_dict`` pairs them; and
    ``optimizer_order``, the order the caller states a per-rank folder's optimizer numbered the
    model's parameters in (``"model"``: as the model file lists them) where torch recorded no names."""

    rank: int | None = None
    optimizer_names: list[list[str]] | None = None
    optimizer_order: str | None = None


_REGISTRY: dict[str, Registration] = {}


def register(name: str, module: str, *, suffixes: tuple[str, ...] = (), summary: str = "", default: bool = False,
             sharded_default: bool = False, writes: tuple[str, ...] = ("convert",)) -> None:
    if name in _REGISTRY:
        raise ValueError(f"format {name!r} is registered twice")
    _REGISTRY[name] = Registration(name, module, suffixes, summary, default, sharded_default, writes)


register("dcp", "ckpttool.formats.dcp", summary="torch.distributed.checkpoint directory", default=True,
         writes=("convert", "reshard"))
# (before torch and safetensors: a trainer folder holds their files among its parts)
register("trainer", "ckpttool.formats.trainer", writes=(),
         summary="a trainer's checkpoint folder (Hugging Face Trainer checkpoint-N/, accelerate save_state), one key per part")
register("torch", "ckpttool.formats.torch_save", suffixes=(".pt", ".pth", ".bin"),
         summary="one torch.save file, or an HF-sharded directory of .bin files")
register("safetensors", "ckpttool.formats.safetensors", suffixes=(".safetensors",),
         summary="one .safetensors file, or an HF-sharded directory", sharded_default=True)
register("torch-ranks", "ckpttool.formats.torch_ranks",
         summary="a folder of per-rank torch.save files (<prefix>_rank_<R>.pt, FSDP2's manual sharded checkpoints)",
         writes=("reshard",))


def names() -> tuple[str, ...]:
    """Registered format names, in registration (and detection) order. Imports no torch."""
    return tuple(_REGISTRY)


def output_names() -> tuple[str, ...]:
    """The formats ckpttool writes (``--to`` choices), in registration order. Imports no torch."""
    return tuple(name for name, reg in _REGISTRY.items() if reg.writable)


def reshard_outputs() -> tuple[str, ...]:
    """The formats ``reshard`` writes (its ``--to`` choices): a job's ranks' files. Imports no torch."""
    return tuple(name for name, reg in _REGISTRY.items() if "reshard" in reg.writes)


def registrations() -> tuple[Registration, ...]:
    return tuple(_REGISTRY.values())


def get(name: str) -> Format:
    """The format called ``name``; :class:`FormatError` naming the choices when there is none."""
    reg = _REGISTRY.get(name)
    if reg is None:
        raise FormatError(f"unknown format {name!r}", hint=f"choose one of {', '.join(_REGISTRY)}")
    fmt = importlib.import_module(reg.module).FORMAT
    if fmt.name != name:
        raise RuntimeError(f"{reg.module}.FORMAT is named {fmt.name!r}, registered as {name!r}")
    return fmt


def all_formats() -> list[Format]:
    return [get(name) for name in _REGISTRY]


def output_format(name: str, to: str | None = None, sharded: bool = False) -> str:
    """The format an output path implies by its suffix (``to`` overrides); a name with no known
    suffix is a directory of the default format, or of the sharded default when the output is to
    be sharded. Imports no torch."""
    if to is not None:
        get(to)  # a clear error for an unknown name
        if not _REGISTRY[to].writable:
            raise FormatError(f"ckpttool reads {to} but does not write it", hint=f"write one of {', '.join(output_names())}")
        return to
    lowered = name.lower()
    for reg in _REGISTRY.values():
        if reg.suffixes and lowered.endswith(reg.suffixes):
            return reg.name
    return next(reg.name for reg in _REGISTRY.values() if (reg.sharded_default if sharded else reg.default))


def detect(loc: Location) -> Format:
    """The format of an existing checkpoint, by content; a clear error when it is none we know."""
    from ..steps import is_training_root
    from .base import Probe

    if not loc.exists():
        raise NotFoundError("path does not exist", where=loc.url, hint="check the path or URL")
    if loc.isdir():
        probe = Probe(loc, True, names=tuple(loc.listdir()))
    else:
        size = loc.size()
        probe = Probe(loc, False, head=loc.read_bytes(0, min(16, size)), size=size)
    formats = all_formats()
    for fmt in formats:
        if fmt.sniff(probe):
            return fmt
    if probe.is_dir and is_training_root(loc):
        raise NotACheckpointError(
            "this is a training root (it holds step-<N> directories), not one checkpoint",
            where=loc.url,
            hint="name one step, e.g. PATH/step-100; `ckpttool inspect` lists them",
        )
    for fmt in formats:
        error = fmt.diagnose(probe)
        if error is not None:
            raise error
    known = ", ".join(_REGISTRY)
    if probe.is_dir:
        raise NotACheckpointError("directory holds no checkpoint ckpttool knows", where=loc.url, hint=f"expected one of: {known}")
    raise NotACheckpointError("not a checkpoint in any format ckpttool knows", where=loc.url, hint=f"expected one of: {known}")


def check_optimizer_order(order: str | None, where: str, *names: str) -> None:
    """A stated optimizer order applies to formats whose optimizers it names (per-rank folders): a
    :class:`UsageError` when none of the formats ``names`` is one (it would be ignored)."""
    if order is not None and not any(get(name).names_by_order for name in names):
        raise UsageError(f"--optimizer-order applies to per-rank torch.save folders; this is {' and '.join(names)}",
                         where=where, hint="leave it out: this checkpoint's optimizer state is read as stored")


def open_source(path: str | Location, fmt: str | None = None, storage_options: dict[str, Any] | None = None,
                verify: bool = True, reading: Reading | None = None) -> Source:
    """Open a checkpoint for reading, in the format ``fmt`` or the one its content shows; with
    ``verify``, stored checksums are checked as data is read; ``reading``: who reads it, for what."""
    from ..storage import resolve

    loc = resolve(path, storage_options)
    return (get(fmt) if fmt else detect(loc)).open_source(loc, verify, reading)


__all__ = ["Reading", "Registration", "all_formats", "check_optimizer_order", "detect", "get", "names", "open_source", "output_format", "output_names",
           "register", "registrations", "reshard_outputs"]
