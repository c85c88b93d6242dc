"""What every offline command that writes a checkpoint shares: the checks of its output before
anything is written, and the report of what it wrote (``convert``, ``reshard``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import formats
from ..engine import Plan
from ..errors import OutputExistsError, UsageError
from ..formats.base import Sink, SinkOptions, Source
from ..steps import is_training_root, list_root
from ..storage import Location


@dataclass
class WriteReport:
    """What an offline command wrote (the CLI renders it; ``--json`` prints its fields)."""

    src: str
    dst: str
    tensors: int
    objects: int
    bytes: int
    notes: list[str] = field(default_factory=list)  # what the source said it did not read, or read from one rank

    @classmethod
    def of(cls, src: Location, dst: Location, plan: Plan, sink: Sink, source: Source, **more: Any):
        return cls(src=src.url, dst=dst.url, tensors=len(plan.tensors), objects=len(plan.objects) - len(sink.dropped),
                   bytes=sum(s.nbytes for s in plan.tensors), notes=source.not_read().lines(), **more)


_OPTION_FLAGS = {"max_shard_size": "--max-shard-size", "layout": "--world-size", "compress": "--compress"}


def check_options(fmt: formats.Format, options: SinkOptions) -> None:
    """An option the output format cannot honour is a usage error naming the formats that can."""
    for name in sorted(options.given() - fmt.sink_options):
        able = [f.name for f in formats.all_formats() if name in f.sink_options]
        raise UsageError(f"{_OPTION_FLAGS.get(name, name)} applies to {' or '.join(able)} output only",
                         hint=f"the output format here is {fmt.name}")


def check_output(src: Location, dst: Location, force: bool) -> None:
    """Refuse an output that would destroy more than DST: one that contains SRC or lies inside it,
    or a training root holding committed steps (even with ``force``); an existing DST without
    ``force``."""
    if src.url == dst.url:
        raise UsageError("source and destination are the same path", where=dst.url)
    if dst.contains(src):
        raise UsageError("the destination contains the source", where=dst.url,
                         hint="write the output beside the checkpoint, not around it; --force never replaces a source")
    if src.contains(dst):
        raise UsageError("the destination lies inside the source checkpoint", where=dst.url,
                         hint="write the output beside the checkpoint, not into it")
    if not dst.exists():
        return
    if dst.isdir() and is_training_root(dst) and list_root(dst).committed:
        raise UsageError("the destination is a training root holding committed steps", where=dst.url,
                         hint="--force replaces one output, never a training run; choose another destination")
    if not force:
        raise OutputExistsError("output already exists", where=dst.url, hint="pass --force to replace it")
