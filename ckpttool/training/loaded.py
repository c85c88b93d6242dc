"""The check after a load, in the training loop: every rank compares its live shards with the
checkpoint's bytes for the same boxes (no all-gather) and all ranks agree on the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import formats, rendezvous
from .load import own_buffer_keys
from .state import training_state
from ..compare import bits_differ
from ..layout import unravel
from ..compat import local_shard_box
from ..errors import CkptError
from ..index import flatten
from ..storage import Location, resolve

__all__ = ["LoadedReport", "Mismatch", "verify_loaded"]


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


def verify_loaded(model: torch.nn.Module, optimizer: Any, path: str | Location, *,
                  storage_options: dict[str, Any] | None = None) -> LoadedReport:
    """Compare this rank's shards of ``model`` (and ``optimizer``: one or a list) with the checkpoint's bytes for
    exactly the same boxes, reading only those boxes (no all-gather); every rank returns the same
    report. Call it on every rank after a load."""
    loc = resolve(path, storage_options)
    report = LoadedReport(loc.url)
    rank = rendezvous.rank()
    state, _ = flatten(training_state(model, optimizer, None))
    mine: list[Mismatch] = []
    checked = [0, 0]
    error: BaseException | None = None
    try:
        with formats.open_source(loc, verify=False) as source:  # compares the bytes themselves
            index = source.index()
            own = own_buffer_keys(index, source.commit_record(), loc, warn=False)  # buffers saved per rank: this rank's own
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                local, box = local_shard_box(value)
                if local.numel() == 0:
                    continue
                if key not in index:
                    mine.append(Mismatch(key, rank, [], float("nan"), local.numel()))
                    continue
                stored = source.read_tensor(own.get(key, key), box)
                local = local.detach().cpu()
                if stored.dtype != local.dtype or tuple(stored.shape) != tuple(local.shape):
                    mine.append(Mismatch(key, rank, [], float("nan"), local.numel()))
                    continue
                bad = bits_differ(stored, local)
                n = int(bad.sum().item())
                if n:
                    flat = int(bad.nonzero()[0].item())
                    first = [o + i for o, i in zip(box[0], unravel(flat, box[1]))]
                    diff = (stored.double() - local.double()).abs()
                    max_abs = float(diff[torch.isfinite(diff)].max().item()) if torch.isfinite(diff).any() else float("nan")
                    mine.append(Mismatch(key, rank, first, max_abs, n))
                checked[0] += 1
                checked[1] += local.numel() * local.element_size()
    except CkptError as exc:
        error = exc
    error = rendezvous.agreed_failure("comparing its shards with the checkpoint's bytes", error)
    if error is not None:
        raise error
    for r, (found, counts) in enumerate(rendezvous.all_gather((mine, checked))):
        report.mismatches += found
        report.tensors_checked += counts[0]
        report.bytes_checked += counts[1]
    report.mismatches.sort(key=lambda m: (m.key, m.rank))
    return report
