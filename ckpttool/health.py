"""A step's health, kept in its commit record: non-finite values per tensor, and trainable tensors
that did not change since the previous step while their optimizer state did (a stale copy).

Both are found where the bytes pass anyway: each rank counts NaN and Inf in the records it writes
(on the host, slab by slab, beside the hashing; in an object record, every float, numpy value and
tensor inside it), and compares the block digests of its records with those of its previous
committed save (kept in memory; no read, no collective). Rank 0 merges
the ranks' findings into the commit record:

    "health": {"nonfinite": {key: {"nan": n, "inf": m}, ...},
               "unchanged": [key, ...], "compared_with": previous step or null}

``nonfinite`` lists only the keys (tensors and objects) with non-finite values; ``unchanged`` the trainable parameters
whose every stored box is bitwise what the previous committed step held while some of their
optimizer state changed (a parameter group with learning rate 0 is not listed: it is meant to stay).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (inspect reads a step's health without importing torch)
    import torch


def count_nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN, Inf) in a host tensor. One pass in the common case: a finite sum proves there are none
    (a NaN or an Inf makes the sum NaN or infinite). Summing in the tensor's own dtype runs at
    memory speed (asking for a float64 or float32 sum converts each element and runs many times
    slower: docs/benchmarks.md). A sum that overflows is told from a real Inf by summing ``t * 0``
    (0 for every finite value, NaN for the others); only then are they counted."""
    import torch

    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return 0, 0
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128):
        t = t.float()  # float8 and friends: no arithmetic of their own on the CPU
    if torch.isfinite(t.sum()).item() or torch.isfinite((t * 0).sum()).item():
        return 0, 0
    return int(torch.isnan(t).sum().item()), int(torch.isinf(t).sum().item())


def count_nonfinite_value(value: Any) -> tuple[int, int]:
    """(NaN, Inf) in a value stored as an object: Python floats and complex numbers, numpy scalars
    and arrays, tensors, and those inside lists, tuples, sets and dicts (a diverged ``loss`` kept
    as ``float("inf")``, a numpy metric, a tensor inside a tuple)."""
    import math
    import sys

    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")  # (no value is a numpy one in a process that never imported it)
    nan = inf = 0
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, float):
            nan, inf = nan + math.isnan(v), inf + math.isinf(v)
        elif isinstance(v, complex):
            nan, inf = nan + (math.isnan(v.real) or math.isnan(v.imag)), inf + (math.isinf(v.real) or math.isinf(v.imag))
        elif torch is not None and isinstance(v, torch.Tensor):
            from .compat import local_tensor

            # (a DTensor's own local part: its sum would be a collective, and one rank counts objects)
            n, i = count_nonfinite(local_tensor(v).detach().cpu())
            nan, inf = nan + n, inf + i
        elif numpy is not None and isinstance(v, (numpy.ndarray, numpy.generic)):
            if v.dtype.kind in "fc":
                a = numpy.asarray(v)
                nan, inf = nan + int(numpy.isnan(a).sum()), inf + int(numpy.isinf(a).sum())
        elif isinstance(v, (list, tuple, set, frozenset, dict)) and id(v) not in seen:
            seen.add(id(v))
            stack.extend(v.values() if isinstance(v, dict) else v)
    return nan, inf


class Tally:
    """One rank's findings while it writes a step: counts per key, and per record its data digest
    (for the next save's comparison)."""

    def __init__(self) -> None:
        self.nonfinite: dict[str, list[int]] = {}
        self.digests: dict[str, dict[str, str]] = {}  # key -> {box offsets as text: data digest}

    def count(self, key: str, part: torch.Tensor) -> None:
        self._add(key, *count_nonfinite(part))

    def count_object(self, key: str, value: Any) -> None:
        """The NaN and Inf of a value stored as an object (:func:`count_nonfinite_value`)."""
        self._add(key, *count_nonfinite_value(value))

    def _add(self, key: str, nan: int, inf: int) -> None:
        if nan or inf:
            found = self.nonfinite.setdefault(key, [0, 0])
            found[0] += nan
            found[1] += inf

    def digest(self, key: str, offsets: Any, row: list[Any]) -> None:
        """The data digest of a record just written (its block digests, or the record's own hash)."""
        data = row[3]["blocks"] if len(row) > 3 else row[2]
        self.digests.setdefault(key, {})[",".join(map(str, offsets))] = data


class Check:
    """What a rank's write needs for the health of the step: its tally, the trainable parameters'
    keys, and its records' digests at its previous committed save (None after a start or resume)."""

    def __init__(self, trainable: set[str], before: dict[str, dict[str, str]] | None, since: int | None):
        self.tally = Tally()
        self.trainable = trainable
        self.before = before
        self.since = since if before is not None else None

    def findings(self, flat: dict[str, Any], rank: int) -> dict[str, Any]:
        """This rank's part of the commit record's health (rank 0 also names the parameters of
        groups with learning rate 0)."""
        out: dict[str, Any] = {"nonfinite": self.tally.nonfinite, "since": self.since}
        if self.before is not None:
            out["stale"] = compare(self.tally.digests, self.before, self.trainable)
        if rank == 0:
            out["zero_lr"] = sorted(zero_lr_params(flat))
        return out


def merge_ranks(parts: list[dict[str, Any] | None], names: list[list[str] | None] | None = None) -> dict[str, Any] | None:
    """Rank 0: the commit record's ``health`` from every rank's findings (None when a rank did not
    check, as a Checkpointer with ``health=False``); ``names``: each rank's numbered keys
    (:func:`numbered`)."""
    if not parts or any(p is None for p in parts):
        return None
    since = parts[0].get("since")
    if any(p.get("since") != since or "stale" not in p for p in parts) or since is None:
        since = None
    return merge(parts, since, set(parts[0].get("zero_lr", ())), names)


def numbered(found: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """A rank's findings with the keys of its stale check that are among ``keys`` (its DTensor
    keys, in the order its index numbers them) given as bit sets of their numbers, in hex
    (``stale.numbered``: stored, same, moved), the others by name: a few hundred bytes a rank
    instead of tens of KB of names for rank 0 to read from every rank."""
    stale = found.get("stale")
    if stale is None or not keys:
        return found
    number = {k: i for i, k in enumerate(keys)}
    out: dict[str, Any] = {}
    bits = []
    for field in ("stored", "same", "moved"):
        b, rest = 0, []
        for key in stale[field]:
            i = number.get(key)
            if i is None:
                rest.append(key)
            else:
                b |= 1 << i
        out[field] = rest
        bits.append(format(b, "x"))
    out["numbered"] = bits
    return {**found, "stale": out}


def _bits(x: Any, count: int) -> int:
    if not (isinstance(x, str) and 0 < len(x) <= count // 4 + 1):
        raise ValueError(f"not a bit set of {count} keys")
    b = int(x, 16)
    if b >> count:
        raise ValueError(f"a key number past the {count} keys")
    return b


def compare(now: dict[str, dict[str, str]], before: dict[str, dict[str, str]], trainable: set[str]) -> dict[str, list[str]]:
    """This rank's part of the stale check: of the trainable parameters it stores (``model.<name>``),
    those whose records are all as ``before``, and those whose optimizer state
    (``optim.state.<name>.*``) changed since ``before``."""
    same = [k for k in now if k in trainable and before.get(k) == now[k]]
    moved = sorted({k[len("optim.state."):].rsplit(".", 1)[0] for k in now
                    if k.startswith("optim.state.") and k in before and before[k] != now[k]})
    return {"stored": sorted(k for k in now if k in trainable), "same": same, "moved": [f"model.{n}" for n in moved]}


def merge(parts: list[dict[str, Any]], compared_with: int | None, frozen_lr: set[str],
          names: list[list[str] | None] | None = None) -> dict[str, Any]:
    """Rank 0: the commit record's ``health`` from every rank's findings. A key is unchanged when
    some rank stores it, every rank that stores it found it the same, some rank's optimizer state
    for it moved, and its learning rate is not 0. Ranks whose keys are numbered alike (the same
    ``names`` list) are folded as bit sets, then named once; a bit set that is not one of its
    rank's keys raises ValueError."""
    nonfinite: dict[str, list[int]] = {}
    for part in parts:
        for key, (nan, inf) in part.get("nonfinite", {}).items():
            found = nonfinite.setdefault(key, [0, 0])
            found[0] += nan
            found[1] += inf
    unchanged: list[str] = []
    if compared_with is not None:
        # the keys some rank stores, those some rank stores but found changed, those whose optimizer state moved
        held: set[str] = set()
        changed: set[str] = set()
        moved: set[str] = set()
        folded: dict[int, tuple[list[str], list[int]]] = {}  # id(names) -> (names, [stored, changed, moved] bits)
        for i, part in enumerate(parts):
            stale = part["stale"]
            stored = set(stale["stored"])
            held |= stored
            changed |= stored.difference(stale["same"])
            moved.update(stale["moved"])
            if "numbered" in stale:
                keys = names[i] if names is not None else None
                if keys is None or not (isinstance(stale["numbered"], list) and len(stale["numbered"]) == 3):
                    raise ValueError("numbered keys without the rank's names")
                st, sa, mv = (_bits(x, len(keys)) for x in stale["numbered"])
                acc = folded.setdefault(id(keys), (keys, [0, 0, 0]))[1]
                acc[0] |= st
                acc[1] |= st & ~sa
                acc[2] |= mv
        for keys, (st, ch, mv) in folded.values():
            for into, b in ((held, st), (changed, ch), (moved, mv)):
                into.update(keys[j] for j in range(len(keys)) if b >> j & 1)
        unchanged = [key for key in sorted(held - changed) if key in moved and key not in frozen_lr]
    return {"nonfinite": {k: {"nan": v[0], "inf": v[1]} for k, v in sorted(nonfinite.items())},
            "unchanged": unchanged, "compared_with": compared_with}


def zero_lr_params(flat: dict[str, Any]) -> set[str]:
    """``model.<name>`` of every parameter in an optimizer group whose learning rate is 0 (from the
    saved ``optim.param_groups.<i>.lr`` and ``.params``)."""
    import torch

    out: set[str] = set()
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("optim.param_groups."):
            group, _, field = key[len("optim.param_groups."):].partition(".")
            groups.setdefault(group, {})[field] = value
    for group in groups.values():
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            lr = lr.item() if lr.numel() == 1 else None
        if lr == 0 and isinstance(group.get("params"), list):
            out |= {f"model.{p}" for p in group["params"] if isinstance(p, str)}
    return out


def problems(health: Any) -> list[str]:
    """What a step's ``health`` says is wrong, one phrase per tensor (empty: healthy)."""
    if not isinstance(health, dict):
        return []
    out = []
    for key, counts in sorted((health.get("nonfinite") or {}).items()):
        if isinstance(counts, dict):
            parts = [f"{counts.get(kind)} {label}" for kind, label in (("nan", "NaN"), ("inf", "Inf")) if counts.get(kind)]
            out.append(f"{key}: {', '.join(parts) or 'non-finite values'}")
    since = health.get("compared_with")
    for key in health.get("unchanged") or ():
        out.append(f"{key}: unchanged since step {since} while its optimizer state moved")
    return out


def nonfinite_keys(health: Any) -> list[str]:
    return sorted((health or {}).get("nonfinite") or {}) if isinstance(health, dict) else []
