"""Loading one checkpoint into live training state: a model (and its optimizers) on any mesh,
and the saved ``extra`` given back to each rank as its own, Stateful values restored in place.

Any format ckpttool reads: a ckpttool step or DCP, a per-rank folder, a trainer folder's model, a
``torch.save`` state dict, a safetensors file or a ``save_pretrained`` folder (``keys.py`` matches
the model's keys to the file's). Every rank reads only its own boxes (``read_into.py``);
keys and shapes are checked first; values of ``extra`` saved per rank (``per_rank.<rank>.*``) go
back to their own rank on the world size that saved them and to none on another.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

from .. import formats, health, rendezvous
from . import keys
from ..bulk import no_gc
from ..errors import CkptError, CorruptCheckpointError, MismatchError, NotFoundError, UsageError
from .read_into import load_into
from ..formats.dcp.metadata import PER_RANK, PER_RANK_BUFFERS
from ..formats.torch_save import CrcCheck, TorchSaveSource
from ..index import Index, TensorEntry, unflatten
from .state import Optimizers, optimizers_of, training_state
from ..steps import list_root, parse_step, step_health, step_name
from ..storage import Location, resolve

log = logging.getLogger("ckpttool")


@dataclass(frozen=True)
class LoadResult:
    """What a load restored. ``extra``: this rank's values of the saved ``extra`` (a Stateful
    value as its state dict). ``extra_by_rank``: every saved rank's own value of each key of
    ``extra`` whose values differed between the ranks that saved it (rank -> the same nesting as
    ``extra``), for a loader that re-partitions them on another world size (where ``extra`` leaves
    those keys out)."""

    step: int | None
    extra: dict[str, Any]
    path: str
    extra_by_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: with ``strict=False``: the model's keys not in the checkpoint, and the checkpoint's model keys
    #: the model does not have (as torch's ``load_state_dict`` returns them)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


@no_gc()  # (the collector held off: bulk.py, docs/benchmarks.md)
def load(path: str | os.PathLike | Location, model: torch.nn.Module, optimizer: Optimizers = None, *,
         verify: bool = True, storage_options: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
         key_map: dict[str, str] | None = None, strict: bool = True) -> LoadResult:
    """Load one checkpoint into ``model``/``optimizer`` on the current mesh: a ckpttool step or DCP
    directory, a per-rank ``torch.save`` folder (FSDP2's manual sharded checkpointing), a trainer
    folder (its model), a ``torch.save`` state dict, a safetensors file or a ``save_pretrained``
    folder (sharded, with its ``model.safetensors.index.json``).

    The model's keys are found in the checkpoint under ``model.`` (a step) or as they are (a state
    dict); a prefix every key of the model carries and the checkpoint's do not (a wrapper's ``llm.``,
    ``_orig_mod.``) is found by itself and said; ``key_map`` (``{regex: replacement}``, applied with
    ``re.sub`` to the model's keys) renames anything else; tied weights missing from the file are
    tied as ``from_pretrained`` ties them. ``strict=False`` loads the keys that match and returns the
    others in ``LoadResult.missing_keys``/``unexpected_keys``; an optimizer loads only from a step
    whose keys are the model's own.

    Every rank reads only its own boxes (any world size, any mesh). Checks keys and shapes first (a
    :class:`MismatchError` names the key and both shapes), reads ``.metadata`` and every object
    through the allow-listed unpickler, refuses a tensor whose chunks leave a gap, and with
    ``verify`` (the default) checks every record it reads: torch's CRC-32 of its tensor data, and
    the manifest of a ckpttool step (:class:`ChecksumError` names the key, the file and the rank).
    Every rank raises the same error when any rank fails.

    ``extra``: objects with ``load_state_dict`` (an LR scheduler, a stateful data loader) to
    restore in place from the saved ``extra`` values of the same names. Values saved per rank come
    back to their own rank on the same world size; on another world size no rank gets another
    rank's value: those keys are left out of ``extra`` (and their objects not restored), said in
    one line, and every saved rank's value is in ``LoadResult.extra_by_rank``.
    """
    loc = resolve(path, storage_options)
    optimizers = optimizers_of(optimizer)
    state = training_state(model, optimizers, None)
    record, matched, state, saved_leaves = _read_agreed(loc, model, optimizers, state, verify, key_map, strict)
    if optimizers:
        set_state_dict(model, optimizers if len(optimizers) > 1 else optimizers[0], model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not matched.missing))
    values, unmatched, by_rank = _extra_values(state, saved_leaves, record, loc)
    _restore_in_place(extra, values, unmatched, loc)
    return LoadResult(step=record["step"] if record is not None else parse_step(loc.name), extra=values, path=loc.url,
                      extra_by_rank=by_rank, missing_keys=matched.missing, unexpected_keys=matched.unexpected)


def _read_agreed(loc: Location, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], state: dict[str, Any],
                 verify: bool, key_map: dict[str, str] | None, strict: bool) -> tuple[dict | None, keys.KeyMatch, dict[str, Any], list[tuple]]:
    """The commit record, the keys matched, ``state`` filled and the per-rank paths saved
    (:func:`_read_state`); every rank raises the same error when any rank fails."""
    record: dict | None = None
    saved_leaves: list[tuple] = []
    matched = keys.KeyMatch()
    error: BaseException | None = None
    source: Any = None
    together = False
    try:
        source = _open(loc, model, optimizers, verify)
        record = source.commit_record()
        if rendezvous.rank() == 0:  # what the reader noted (a per-rank folder's optimizer indices: how they were paired)
            for note in source.notes:
                log.info("%s: %s", loc.url, note)
        # a torch.save file: each rank reads its rows; the records' CRC-32s are checked together below
        together = isinstance(source, TorchSaveSource) and source.check_together()
        matched = _match(source.index(), state, loc, key_map, strict, bool(optimizers))
        state, saved_leaves = _read_state(source, state, loc, matched, record)
    except CkptError as exc:
        error = exc
    try:
        error = rendezvous.agreed_failure("loading its shards", error)
        if error is None and together:  # from the pieces every rank read (the same verdict on every rank)
            error = rendezvous.checked_together("checking the CRC-32 of the records read", source.pieces_read(),
                                                lambda everyone: CrcCheck(source, everyone))
    finally:
        if source is not None:
            source.close()
    if error is not None:
        raise error
    return record, matched, state, saved_leaves


def _extra_values(state: dict[str, Any], saved_leaves: list[tuple], record: dict | None,
                  loc: Location) -> tuple[dict[str, Any], set[str], dict[int, dict[str, Any]]]:
    """This rank's values of the saved ``extra`` and the keys it could not be given
    (:func:`_own_values`), and every saved rank's own values."""
    by_rank = {int(r): v for r, v in state.get(PER_RANK, {}).items() if _rank_name(r)}
    leaves: dict[int, list[tuple]] = {}  # per saved rank: the paths in extra of its own values
    for rank_key, *sub in saved_leaves:
        if _rank_name(rank_key):
            leaves.setdefault(int(rank_key), []).append(tuple(sub))
    saved_world = record.get("world_size") if record is not None else None
    values, unmatched = _own_values(state.get("extra", {}), by_rank, leaves, saved_world, loc)
    return values, unmatched, by_rank


def _open(loc: Location, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], verify: bool) -> Any:
    """The checkpoint at ``loc`` opened for this rank's load (any format ckpttool reads)."""
    fmt = formats.detect(loc)
    # a per-rank folder's optimizer state is keyed by index: paired through the live optimizers' own groups
    fqn = {id(p): n for n, p in model.named_parameters()}
    names = [[fqn.get(id(p), "?") for p in g["params"]] for o in optimizers for g in o.param_groups] if optimizers else None
    return fmt.open_source(loc, verify, formats.Reading(rank=rendezvous.rank(), optimizer_names=names))


def _match(index: Index, state: dict[str, Any], loc: Location, key_map: dict[str, str] | None, strict: bool,
           optimizers: bool) -> keys.KeyMatch:
    """The checkpoint's key of each of the model's, checked: every key found (or ``strict`` off),
    nothing unexpected (idem), the same shapes; an optimizer only from a step with the model's own keys."""
    model = state["model"]
    matched = keys.match(model, _ties(model), index, key_map)
    shown = (lambda n: f"model.{n}") if matched.layout == "step" else (lambda n: n)
    if matched.renamed and rendezvous.rank() == 0:
        log.warning("%s: the model's keys matched %s", loc.url, matched.renamed)
    if strict and matched.missing:
        more = f" ({len(matched.missing)} keys of the model are not)" if len(matched.missing) > 1 else ""
        raise MismatchError(f"key {shown(matched.missing[0])!r} of the model is not in the checkpoint{more}", where=loc.url,
                            hint="was the checkpoint saved from a different model? `ckpttool inspect` lists its keys; "
                                 "key_map={regex: replacement} renames, strict=False loads the keys that match")
    if strict and matched.unexpected:
        raise MismatchError(f"the checkpoint holds {len(matched.unexpected)} model key(s) the model does not have, e.g. "
                            f"{shown(matched.unexpected[0])!r}", where=loc.url,
                            hint="strict=False loads the keys that match and returns the others")
    for name, key in matched.pairs.items():
        _check_one(key, model[name], index, loc)
    if optimizers and (matched.layout != "step" or matched.renamed):
        raise UsageError("an optimizer loads only from a ckpttool step (or DCP) saved with the model's own keys",
                         where=loc.url, hint="load the model alone (optimizer=None)")
    if optimizers:
        _check_fits({"optim": state["optim"]}, index, loc)
    return matched


def _ties(model: dict[str, Any]) -> dict[str, str]:
    """A key -> the first key whose tensor's memory it is (tied weights: ``lm_head.weight`` ->
    ``model.embed_tokens.weight``), told by the local data's address, shape and strides (a DTensor
    state dict may wrap one parameter's local tensor in two DTensor objects)."""
    from ..compat import local_tensor

    first: dict[tuple, str] = {}
    ties: dict[str, str] = {}
    for name, value in model.items():
        if isinstance(value, torch.Tensor):
            local = local_tensor(value)
            if local.numel() == 0:
                continue
            twin = first.setdefault((local.data_ptr(), tuple(local.shape), local.stride(), local.dtype), name)
            if twin != name:
                ties[name] = twin
    return ties


def _read_state(source: Any, state: dict[str, Any], loc: Location, matched: keys.KeyMatch,
                record: dict | None) -> tuple[dict[str, Any], list[tuple]]:
    """``state`` (the live model's and optimizers' state dicts) filled from ``source``, with the
    saved ``extra`` and per-rank values beside it (each buffer saved per rank from this rank's own
    value, on the world size that saved it); and the paths of the per-rank values saved."""
    from ..index import flatten

    model = state.pop("model")
    own = own_buffer_keys(source.index(), record, loc) if matched.layout == "step" else {}
    pairs = {name: own.get(key, key) for name, key in matched.pairs.items()}  # the model's key -> the key read
    for name, key in pairs.items():
        if key != matched.pairs[name]:
            _check_one(key, model[name], source.index(), loc)
    # tied weights the file holds under two keys: one is read into the tensor, the other compared with it
    twins = {name: (twin, pairs[twin], pairs[name]) for name, twin in _ties(model).items()
             if name in pairs and twin in pairs and pairs[name] != pairs[twin]}
    by_key: dict[str, Any] = {}
    for name, key in pairs.items():
        if name in twins:
            continue
        if key in by_key and by_key[key] is not model[name]:
            raise MismatchError(f"two keys of the model are matched to {key!r}", where=loc.url,
                                hint="a key_map that renames two keys to one: make it name each key's own")
        by_key[key] = model[name]
    if matched.layout == "step":
        for top in ("extra", PER_RANK):  # shaped like what was saved: a template built from the index
            template = _template(source, top)
            if template:
                state[top] = template
    flat, paths = flatten(state)
    flat.update(by_key)
    load_into(source, flat)
    _check_ties(source, model, twins, loc)
    state = unflatten({k: v for k, v in flat.items() if k in paths}, paths)
    state["model"] = {name: model[name] if name in twins else flat[key] for name, key in pairs.items()}
    state["model"].update({n: model[n] for n in model if n not in matched.pairs and n not in matched.missing})
    return state, [tuple(p[1:]) for p in paths.values() if p[0] == PER_RANK and len(p) > 2]


def own_buffer_keys(index: Index, record: dict | None, loc: Location, warn: bool = True) -> dict[str, str]:
    """The model's buffers saved per rank (``per_rank_buffers.<rank>.<name>``: their values differed
    between the ranks that saved them) -> this rank's own key, on the world size that saved them.
    On another world size none (every rank gets rank 0's value, ``model.<name>``) and, with
    ``warn``, one warning (rank 0) names them."""
    saved: dict[int, dict[str, str]] = {}
    for key in index:
        path = index.path(key)
        if len(path) > 2 and path[0] == PER_RANK_BUFFERS and _rank_name(path[1]):
            saved.setdefault(int(path[1]), {})["model." + ".".join(map(str, path[2:]))] = key
    if not saved:
        return {}
    world = record.get("world_size") if record is not None else None
    world = world if isinstance(world, int) and world > 0 else max(saved) + 1
    if world == rendezvous.world_size():
        return saved.get(rendezvous.rank(), {})
    if warn and rendezvous.rank() == 0:
        names = sorted({k for keys in saved.values() for k in keys})
        log.warning("%s: buffers saved per rank on %d ranks (their values differed between ranks) cannot be matched to %d "
                    "ranks: every rank gets rank 0's value of %s", loc.url, world, rendezvous.world_size(), ", ".join(names))
    return {}


#: bytes of a tied weight's second key read at a time to compare it with the first (loaded)
_TIE_SLAB = 64 << 20


def _check_ties(source: Any, model: dict[str, Any], twins: dict[str, tuple[str, str, str]], loc: Location) -> None:
    """Refuse a load that would put two different tensors of the checkpoint into one tensor of the
    model: weights the model ties (``lm_head.weight`` to ``model.embed_tokens.weight``) that the
    file holds under two keys whose values differ (a model trained untied, loaded into one
    configured tied). ``twins``: the tied key -> (its twin, the key loaded, its own key). This rank
    compares its own box of the tied key's values, slab by slab, with what the load put into the
    tensor; the load's agreement raises it on every rank (after the load: the tensor holds the
    first key's values)."""
    from ..compare import bits_differ
    from ..compat import local_shard_box
    from ..layout import relative, slabs

    for name, (twin, loaded, other) in twins.items():
        local, box = local_shard_box(model[name])
        for slab in slabs(tuple(model[name].shape), local.element_size(), _TIE_SLAB, box) if local.numel() else ():
            held = local[relative(slab, box)].detach().cpu()
            if bool(bits_differ(source.read_tensor(other, slab).to(held.dtype), held).any()):
                raise MismatchError(f"the model ties {name!r} to {twin!r}, but the checkpoint holds different values under "
                                    f"{other!r} and {loaded!r}: one tensor cannot take both", where=loc.url,
                                    hint="the checkpoint was saved untied: build the model untied (e.g. "
                                         "tie_word_embeddings=False in its config) to load both")


def _rank_name(name: Any) -> bool:
    """Whether a key under ``per_rank`` (from the checkpoint's ``.metadata``) names a rank: a few
    decimal digits, never a number too long to convert (``int()`` refuses 4,300 digits)."""
    return str(name).isdigit() and len(str(name)) <= 9


def _check_fits(state: dict[str, Any], index: Index, loc: Location) -> None:
    from ..index import flatten

    flat, _ = flatten(state)
    for key, value in flat.items():
        if key not in index:
            raise MismatchError(
                f"key {key!r} of the model is not in the checkpoint",
                where=loc.url,
                hint="was the checkpoint saved from a different model? `ckpttool inspect` lists its keys",
            )
        _check_one(key, value, index, loc)


def _check_one(key: str, value: Any, index: Index, loc: Location) -> None:
    """A tensor of the model against the checkpoint's entry ``key``: a tensor of the same shape."""
    if isinstance(value, torch.Tensor):
        entry = index[key]
        if not isinstance(entry, TensorEntry):
            raise MismatchError(f"key {key!r} is a tensor in the model but an object in the checkpoint", where=loc.url)
        if tuple(entry.shape) != tuple(value.shape):
            raise MismatchError(
                f"shape mismatch for {key!r}: checkpoint has {tuple(entry.shape)}, model has {tuple(value.shape)}",
                where=loc.url,
                hint="build the model with the configuration it was saved with",
            )


def _template(source: Any, top: str) -> dict[str, Any]:
    """A dict shaped like the saved top-level ``top`` (the load fills a template), built from the
    index; its tensors are allocated only once the checkpoint's bytes are known to back their size."""
    index = source.index()
    flat: dict[str, Any] = {}
    sub_paths = {}
    for key in index:
        path = index.path(key)
        if path[0] != top:
            continue
        entry = index[key]
        if isinstance(entry, TensorEntry):
            source.entry(key, TensorEntry, checked=True)
            flat[key] = torch.empty(entry.shape, dtype=entry.dtype)
        else:
            flat[key] = None
        sub_paths[key] = path
    return unflatten(flat, sub_paths).get(top, {})


def _own_values(extra: dict[str, Any], by_rank: dict[int, dict[str, Any]], leaves: dict[int, list[tuple]],
                saved_world: int | None, loc: Location) -> tuple[dict[str, Any], set[str]]:
    """This rank's values of ``extra``, and the top-level keys of those it could not be given. A
    value saved per rank is a whole top-level key (each rank's own tree, as that rank saved it): on
    the world size that saved it this rank's own replaces the shared one (a key some ranks saved
    and this one did not is left out); on another, every key saved per rank is left out (said in
    one line): no rank gets another rank's value."""
    tops = {rank: {path[0] for path in paths if path} for rank, paths in leaves.items()}
    everyone = set().union(*tops.values()) if tops else set()
    if not everyone:
        return extra, set()
    saved = saved_world if isinstance(saved_world, int) and saved_world > 0 else max(leaves) + 1
    rank, world = rendezvous.rank(), rendezvous.world_size()
    own = tops.get(rank, set()) if saved == world else set()
    for top in everyone:
        extra.pop(top, None)
    for top in own:
        extra[top] = by_rank[rank][top]
    if saved != world and rank == 0:
        log.warning("%s: extra values saved per rank on %d ranks cannot be matched to %d ranks, left out of "
                    "LoadResult.extra: %s (every saved rank's value is in LoadResult.extra_by_rank)",
                    loc.url, saved, world, ", ".join(sorted(map(str, everyone))))
    return extra, {str(top) for top in everyone - own}


def _restore_in_place(objects: dict[str, Any] | None, values: dict[str, Any], unmatched: set[str], loc: Location) -> None:
    """``obj.load_state_dict(saved value)`` for every object given to the load (a Stateful value of
    ``extra``, saved through its state dict); one whose saved state is not wholly this rank's (saved
    per rank on another world size) is not restored: the warning above names it."""
    for key, obj in (objects or {}).items():
        if not callable(getattr(obj, "load_state_dict", None)):
            raise UsageError(f"extra[{key!r}] has no load_state_dict(): only such objects are restored in place",
                             hint="the saved values are in LoadResult.extra")
        if key in unmatched:
            continue
        if key not in values:
            raise MismatchError(f"extra key {key!r} is not in the checkpoint", where=loc.url,
                                hint=f"saved extra keys: {sorted(values) or 'none'}")
        obj.load_state_dict(values[key])


@no_gc()  # (the collector held off: bulk.py, docs/benchmarks.md)
def load_committed(root: Location, model: torch.nn.Module, optimizer: Optimizers, step: int | None, *, verify: bool,
                   storage_options: dict[str, Any] | None, extra: dict[str, Any] | None) -> LoadResult | None:
    """``Checkpointer.load``: the newest (or the given) committed step under ``root``, loaded; None
    when ``step`` is None and nothing was committed yet."""
    listing = list_root(root)
    committed = listing.committed
    if step is None:
        newer_damaged = [s for s in listing.damaged if not committed or s > committed[-1]]
        if newer_damaged and rendezvous.rank() == 0:
            log.warning("not loading step(s) %s under %s: commit record damaged (%s)", newer_damaged, root.url,
                        listing.damaged[newer_damaged[-1]])
        if not committed:
            return None
        step = committed[-1]
    elif step in listing.damaged:
        raise CorruptCheckpointError(f"step {step} cannot be loaded: {listing.damaged[step]}",
                                     where=root.child(step_name(step)).url, hint=f"committed steps: {committed or 'none'}")
    elif step not in committed:
        raise NotFoundError(f"step {step} is not a committed checkpoint", where=root.url,
                            hint=f"committed steps: {committed or 'none'}")
    _warn_if_unhealthy(root, step, committed)
    result = load(root.child(step_name(step)), model, optimizer, verify=verify, storage_options=storage_options, extra=extra)
    return LoadResult(step=step, extra=result.extra, path=result.path, extra_by_rank=result.extra_by_rank)


def _warn_if_unhealthy(root: Location, step: int, committed: list[int]) -> None:
    """One line (rank 0) when the step to load holds non-finite values, naming the newest
    committed step that does not (from the commit records' health)."""
    if rendezvous.rank() != 0:
        return
    found = step_health(root.child(step_name(step)))
    bad = health.nonfinite_keys(found)
    if not bad:
        return
    older = next((s for s in reversed(committed) if s < step and step_health(root.child(step_name(s))) is not None
                  and not health.nonfinite_keys(step_health(root.child(step_name(s))))), None)
    log.warning("ckpttool: loading step %d, which holds non-finite values (%s%s); %s", step,
                "; ".join(health.problems(found)[:2]), f" and {len(bad) - 2} more" if len(bad) > 2 else "",
                f"the newest step without any is step {older}" if older is not None else "no earlier step is known to be without any")
