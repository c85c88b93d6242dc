"""Per-rank ``torch.save`` folders (format ``torch-ranks``): what FSDP2's "manual sharded
checkpointing" writes. Every rank saves ``model_rank_<R>.pt`` (``model.state_dict()``: DTensors)
and ``optim_rank_<R>.pt`` (``optimizer.state_dict()``: keyed by parameter index); rank 0 may add
``metadata.pt``. Any ``<prefix>_rank_<R>.pt`` group is read, each as the top-level key ``prefix``;
any other ``NAME.pt`` beside them as the top-level key ``NAME``.

Each DTensor is read as data (:mod:`ckpttool.safe_dtensor`): the box a rank holds follows from its
placements, the mesh's shape and the rank's coordinate, and the boxes of all ranks make the
tensor's chunks (a replicated box, as HSDP stores it, is read from the lowest rank holding it).
Plain tensors (buffers, AdamW's ``step``) and other values are taken from rank 0.

An optimizer's state is keyed by parameter index, and torch numbers the parameters group by group
(``optimizer.state_dict()``), in the order the optimizer was given them: nothing in the folder
says which parameter an index is unless torch recorded it. The indices become the model's
parameter names only where that is proven or stated: by the names torch records in each group
(``param_names``: an optimizer built from ``named_parameters()``); with a live optimizer
(``optimizer_names``: ``ckpttool.load``), through its own groups, position by position, exactly as
``optimizer.load_state_dict`` pairs them; or where the caller states the order
(``optimizer_order="model"``: the optimizer was given the model's parameters in the order the
model file lists them, ``model.parameters()``'s), which each param group of the result records
(``param_names_from``). Anywhere else the state is kept as torch wrote it, keyed by index with its
param groups (``optimizer.load_state_dict`` reads it), and one note says which of these happened.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CkptError, CorruptCheckpointError, FormatError, MismatchError, NotACheckpointError, UsageError
from ..index import Chunk, Index, ObjectEntry, TensorEntry, flatten
from ..index import unflatten
from ..layout import Box, FsdpLayout, rank_box, relative, unravel, whole
from ..report import Report
from ..safe_dtensor import DTensorRef
from ..safe_pickle import TensorRef, same_value
from ..storage import Location
from .base import Format, ObjectSpec, Probe, Progress, ReadFn, Sink, SinkOptions, Source, TensorSpec, stream_slabs
from .torch_save import TorchFile, check_tensor_records, int_keyed_optimizers

if TYPE_CHECKING:
    import torch

RANK_FILE = re.compile(r"^(?P<prefix>.+)_rank_(?P<rank>\d+)\.(pt|pth|bin)$")
#: the parameter order a caller may state for an optimizer that records no names: the model file's
STATED_ORDER = "model"
#: what each param group of an optimizer named by a stated order records about its names
STATED_NOTE = "stated: the order the model lists its parameters in (optimizer_order='model')"
SIDE_FILE = re.compile(r"^(?P<name>[^.].*)\.(pt|pth|bin)$")
#: the most rank files a folder may hold (one per rank)
MAX_RANKS = 1 << 16


def rank_groups(names: tuple[str, ...] | list[str]) -> dict[str, dict[int, list[str]]]:
    """prefix -> rank -> the file names claiming that rank (two names may claim one: refused later)."""
    groups: dict[str, dict[int, list[str]]] = {}
    for name in sorted(names):
        m = RANK_FILE.match(name)
        if m:
            groups.setdefault(m["prefix"], {}).setdefault(int(m["rank"]), []).append(name)
    return groups


def _is_ref(value: Any) -> bool:
    return isinstance(value, (TensorRef, DTensorRef))


def _is_optimizer(obj: Any) -> bool:
    return (isinstance(obj, Mapping) and set(obj) == {"state", "param_groups"} and isinstance(obj["state"], Mapping)
            and isinstance(obj["param_groups"], list)
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in obj["param_groups"]))


class RanksSource(Source):
    """A per-rank ``torch.save`` folder as one checkpoint with global shapes. Opening reads every
    file's pickle (no tensor data) and refuses a folder whose ranks are incomplete or disagree."""

    format = "torch-ranks"

    def __init__(self, location: Location, verify: bool = True, optimizer_names: list[list[str]] | None = None,
                 optimizer_order: str | None = None):
        """``optimizer_names``: the parameter names of a live optimizer's groups, in its order (for
        the folder's one optimizer group file); its indices are then paired through them.
        ``optimizer_order="model"``: the caller states that the optimizer numbered the model's
        parameters in the order the model file lists them (see the module's text)."""
        super().__init__(location)
        if optimizer_order not in (None, STATED_ORDER):
            raise UsageError(f"unknown optimizer order {optimizer_order!r}", hint=f"the order ckpttool takes: {STATED_ORDER!r}")
        self._verify = verify
        self._live_names = optimizer_names
        self._stated = optimizer_order
        self._files: dict[str, TorchFile] = {}
        self._placements: dict[str, str] = {}  # key -> how its DTensor was laid out (for inspect)
        # values every rank (or every replica) stores that are not the same on all of them:
        # (group, key, what, the ranks that differ from the first holder, that holder)
        self._differences: list[tuple[str, str, str, list[int], int]] = []
        self._unexpected: list[str] = []
        self._index_names_of: dict[str, dict[int, str]] = {}  # optimizer group -> index -> parameter name
        try:
            self._index = self._read()
        except BaseException:
            self.close()
            raise

    # --- opening -------------------------------------------------------------------------------
    def _open(self, name: str) -> TorchFile:
        part = self._files.get(name)
        if part is None:
            part = self._files[name] = TorchFile(self.location.child(name), self._verify)
        return part

    def _read(self) -> Index:
        names = list(self.location.listdir())
        groups = rank_groups(names)
        if not groups:
            raise NotACheckpointError("folder holds no <prefix>_rank_<R>.pt files", where=self.location.url)
        world = self._world_size(groups)
        self._world = world
        trees: dict[str, Any] = {}
        for prefix in sorted(groups, key=lambda p: (p != "model", p)):  # the model first: the optimizer maps onto it
            trees[prefix] = self._group(prefix, groups[prefix], world)
        grouped = {name for files in groups.values() for claim in files.values() for name in claim}
        for name in sorted(names):
            if name in grouped:
                continue
            m = SIDE_FILE.match(name)
            if m and m["name"] not in trees and self.location.child(name).isfile():
                part = self._open(name)
                obj = part.archive.obj
                obj = obj if isinstance(obj, Mapping) else {"value": obj}
                if any(isinstance(v, DTensorRef) for v in flatten(obj, is_tensor=_is_ref)[0].values()):
                    raise FormatError("holds DTensors but is no <prefix>_rank_<R>.pt file: which rank saved it cannot be told",
                                      where=part.location.url, hint="name it for its rank, or move it out of the folder")
                trees[m["name"]] = (obj, {}, name)
        self._map_optimizers(trees)
        self._say_differences(trees)
        idx = Index()
        for top, (obj, chunks, _) in trees.items():
            flat, paths = flatten({top: obj}, is_tensor=_is_ref)
            for key, value in flat.items():
                if isinstance(value, DTensorRef):
                    idx.add(TensorEntry(key, value.shape, value.element_type, chunks[id(value)]), paths[key])
                elif isinstance(value, TensorRef):
                    where = chunks.get(id(value), trees[top][2])
                    idx.add(TensorEntry(key, value.shape, value.element_type, (Chunk((0,) * len(value.shape), value.shape, (where, value)),)),
                            paths[key])
                else:
                    idx.add(ObjectEntry(key, value), paths[key])
        return idx

    def _world_size(self, groups: dict[str, dict[int, list[str]]]) -> int:
        world = 0
        for prefix, ranks in groups.items():
            for rank, claim in ranks.items():
                if len(claim) > 1:
                    raise CorruptCheckpointError(f"two files claim rank {rank} of {prefix!r}: {', '.join(claim)}",
                                                 where=self.location.url, hint="remove the stray copy")
            world = max(world, max(ranks) + 1)
        if world > MAX_RANKS:
            raise CorruptCheckpointError(f"rank files name rank {world - 1}, more than ckpttool reads ({MAX_RANKS})",
                                         where=self.location.url)
        for prefix, ranks in groups.items():
            missing = [r for r in range(world) if r not in ranks]
            if missing:
                raise CorruptCheckpointError(f"{prefix}_rank_{missing[0]}.pt is missing ({len(ranks)} of {world} ranks of "
                                             f"{prefix!r} present{'' if len(missing) == 1 else f'; also missing: {missing[1:6]}'})",
                                             where=self.location.url, hint="every rank's file is needed; restore it")
        return world

    def _group(self, prefix: str, ranks: dict[int, list[str]], world: int) -> tuple[Any, dict[int, tuple[Chunk, ...]], str]:
        """Rank 0's tree, with every DTensor's chunks gathered from all ranks (by ``id`` of rank
        0's reference), checked to agree rank by rank."""
        parts = [self._open(ranks[r][0]) for r in range(world)]
        trees = []
        for part in parts:
            obj = part.archive.obj
            if not isinstance(obj, Mapping):
                raise FormatError(f"top level of the file is a {type(obj).__name__}, not a dict", where=part.location.url,
                                  hint="ckpttool reads state dicts")
            trees.append(flatten(obj, is_tensor=_is_ref)[0])
        first = trees[0]
        chunks: dict[int, tuple[Chunk, ...]] = {}
        for rank, (part, flat) in enumerate(zip(parts, trees)):
            if list(flat) != list(first):
                extra, lacking = sorted(set(flat) - set(first)), sorted(set(first) - set(flat))
                raise CorruptCheckpointError(f"holds other keys than {parts[0].location.name} "
                                             f"({'only here: ' + repr(extra[:3]) if extra else 'missing here: ' + repr(lacking[:3])})",
                                             where=part.location.url, hint="the ranks' files come from different saves")
        for key, value in first.items():
            where = f"{prefix}.{key}"
            if isinstance(value, DTensorRef):
                chunks[id(value)] = self._chunks(where, [flat[key] for flat in trees], parts)
            elif isinstance(value, TensorRef):
                for rank, flat in enumerate(trees):
                    other = flat[key]
                    if not isinstance(other, TensorRef) or other.shape != value.shape or other.element_type != value.element_type:
                        raise CorruptCheckpointError(f"key {where!r} is a {value.element_type} tensor of shape {list(value.shape)} on rank 0 "
                                                     f"but not on rank {rank}", where=parts[rank].location.url)
                chunks[id(value)] = parts[0].location.name
                ranks = self._differing(where, [(r, flat[key], parts[r]) for r, flat in enumerate(trees)])
                if ranks:
                    self._differences.append((prefix, where, "a plain tensor", ranks, 0))
            else:
                ranks = [r for r, flat in enumerate(trees) if r and not same_value(value, flat[key])]
                if ranks:
                    self._differences.append((prefix, where, "a value", ranks, 0))
        tree = parts[0].archive.obj
        return tree, chunks, parts[0].location.name

    def _chunks(self, key: str, refs: list[Any], parts: list[TorchFile]) -> tuple[Chunk, ...]:
        """The stored boxes of one DTensor, one per distinct box over the ranks (replicas once)."""
        base = refs[0]
        seen: dict[tuple[int, ...], list[int]] = {}
        boxes: dict[Box, Chunk] = {}
        holders: dict[Box, list[tuple[int, Any, TorchFile]]] = {}
        for rank, (ref, part) in enumerate(zip(refs, parts)):
            where = f"{part.location.url} (key {key!r})"
            if not isinstance(ref, DTensorRef):
                raise CorruptCheckpointError(f"is a DTensor on rank 0 but a {type(ref).__name__} here", where=where)
            if (ref.shape, ref.element_type, ref.mesh_shape, ref.placements) != (base.shape, base.element_type, base.mesh_shape, base.placements):
                raise CorruptCheckpointError(f"DTensor of shape {list(ref.shape)} {ref.element_type} placed {[str(p) for p in ref.placements]} on a "
                                             f"{list(ref.mesh_shape)} mesh; rank 0's is {list(base.shape)} {base.element_type} placed "
                                             f"{[str(p) for p in base.placements]} on {list(base.mesh_shape)}", where=where,
                                             hint="the ranks' files come from different saves")
            size = math.prod(ref.mesh_shape)
            if len(parts) % size:
                raise CorruptCheckpointError(f"DTensor on a mesh of {size} ranks {list(ref.mesh_shape)}, but the folder holds "
                                             f"{len(parts)} rank files", where=where, hint="a rank's file is missing or extra")
            if ref.rank is not None and ref.rank != rank:
                raise CorruptCheckpointError(f"the file is named for rank {rank} but its DTensors were saved by rank {ref.rank}",
                                             where=where, hint="files were renamed or mixed up")
            if ref.coordinate is None and size != len(parts):
                raise CorruptCheckpointError(f"DTensor on a sub-mesh {list(ref.mesh_shape)} of the job's {len(parts)} ranks "
                                             "that does not record the rank's place in it", where=where)
            coord = ref.coordinate if ref.coordinate is not None else tuple(unravel(rank, ref.mesh_shape))
            # a mesh of fewer ranks than the job (FSDP's data-parallel part of an FSDP+TP mesh) holds
            # each coordinate on len(parts) / size ranks: more is two files claiming one rank
            seen.setdefault(coord, []).append(rank)
            if len(seen[coord]) > len(parts) // size:
                raise CorruptCheckpointError(f"ranks {', '.join(map(str, seen[coord]))} hold mesh coordinate {list(coord)} "
                                             f"of a {list(ref.mesh_shape)} mesh", where=where, hint="two files claim one rank")
            box = ref.box(coord)
            if tuple(ref.local.shape) != box[1]:
                raise CorruptCheckpointError(f"local shape {list(ref.local.shape)} disagrees with its placements "
                                             f"{[str(p) for p in ref.placements]} and global shape {list(ref.shape)}, which give "
                                             f"{list(box[1])} at mesh coordinate {list(coord)}", where=where)
            if box not in boxes:
                boxes[box] = Chunk(box[0], box[1], (part.location.name, ref.local))
            holders.setdefault(box, []).append((rank, ref.local, part))
        for box, held in holders.items():  # a replicated box: every replica must hold the same bytes
            ranks = self._differing(key, held) if len(held) > 1 else []
            if ranks:
                self._differences.append((key.split(".", 1)[0], key, f"the replicas of box {list(box[0])}+{list(box[1])}",
                                          ranks, held[0][0]))
        self._placements[key] = f"{', '.join(str(p) for p in base.placements)} on mesh {'x'.join(map(str, base.mesh_shape))}"
        return tuple(boxes.values())

    def _differing(self, key: str, held: list[tuple[int, Any, TorchFile]]) -> list[int]:
        """The ranks whose tensor data differs from the first holder's: equal when the stored
        records' CRC-32, size and the view on them are equal; otherwise the viewed bytes are read
        (each checked against its CRC-32) and compared."""
        import torch

        first_rank, first_ref, first_part = held[0]

        def view(ref: Any, part: TorchFile) -> tuple:
            storage = part.storage_of(ref, key)
            return (storage.crc32, storage.nbytes, ref.storage_offset, tuple(ref.shape), tuple(ref.stride), ref.element_type)

        def data(ref: Any, part: TorchFile) -> torch.Tensor:
            return part.read(ref, key, whole(tuple(ref.shape))).reshape(-1).view(torch.uint8)

        first, first_bytes, out = view(first_ref, first_part), None, []
        for rank, ref, part in held[1:]:
            if view(ref, part) == first:
                continue
            if first_bytes is None:
                first_bytes = data(first_ref, first_part)
            if not torch.equal(data(ref, part), first_bytes):
                out.append(rank)
        return out

    def _say_differences(self, trees: dict[str, Any]) -> None:
        """One note naming every value that is not the same on every rank holding it, and whether
        that is expected: in a group of plain values saved per rank (an RNG state, a data loader's
        position) it is; in a group holding DTensors (the model) or an optimizer it is not."""
        self._unexpected = []
        for group, key, what, ranks, holder in self._differences:
            names = self._index_names_of.get(group)
            if names:  # the key the checkpoint names it by (a mapped optimizer's state: by parameter name)
                index, _, rest = key[len(f"{group}.state."):].partition(".")
                if key.startswith(f"{group}.state.") and index.isdigit() and int(index) in names:
                    key = f"{group}.state.{names[int(index)]}.{rest}"
            obj = trees.get(group, (None,))[0]
            per_rank = not _is_optimizer(obj) and not any(isinstance(v, DTensorRef) for v in flatten(obj, is_tensor=_is_ref)[0].values())
            line = f"{key} ({what}): rank(s) {', '.join(map(str, ranks))} differ from rank {holder}"
            if per_rank:
                self.notes.append(f"differs between ranks, as a per-rank group's value may (rank {holder}'s is read): {line}")
            else:
                self._unexpected.append(line)
                self.notes.append(f"differs between ranks, which it must not (rank {holder}'s is read; the folder mixes "
                                  f"saves, or the ranks diverged): {line}")

    def rank_differences(self) -> list[str]:
        """The values of the model or optimizer groups that are not the same on every rank holding
        them (each with the ranks that differ): problems verify reports."""
        return list(self._unexpected)

    def _map_optimizers(self, trees: dict[str, Any]) -> None:
        """Key every optimizer group's state by parameter name where the mapping is proven or stated
        (see the module docstring)."""
        optims = [p for p, (obj, _, _) in trees.items() if _is_optimizer(obj)]
        if not optims:
            return
        models = [p for p, (obj, _, _) in trees.items() if p not in optims
                  and any(isinstance(v, DTensorRef) for v in flatten(obj, is_tensor=_is_ref)[0].values())]
        model = "model" if "model" in models else (models[0] if len(models) == 1 else None)
        if self._live_names is not None and len(optims) != 1:
            raise FormatError(f"the folder holds {len(optims)} optimizer groups ({', '.join(optims)}): which of them the "
                              "optimizer given to the load is cannot be told", where=self.location.url,
                              hint="load the model alone, then each optimizer with its own file")
        for prefix in optims:
            obj, chunks, name = trees[prefix]
            if model is None:
                self._kept(prefix, f"no single model group to name the parameters ({len(models)} groups hold DTensors)")
                continue
            params = {k: v for k, v in flatten(trees[model][0], is_tensor=_is_ref)[0].items() if isinstance(v, DTensorRef)}
            names, how, stated = self._index_names(prefix, obj, params, model)
            if names is None:
                self._kept(prefix, how)
                continue
            self._index_names_of[prefix] = names
            state = {names[i]: obj["state"][i] for i in sorted(obj["state"], key=lambda i: i)}
            groups = [{**g, "params": [names[i] for i in g["params"]], **({"param_names_from": STATED_NOTE} if stated else {})}
                      for g in obj["param_groups"]]
            trees[prefix] = ({"state": state, "param_groups": groups}, chunks, name)
            self.notes.append(f"{prefix}: parameter indices mapped to the names of {model}'s parameters {how}")

    def _kept(self, prefix: str, why: str) -> None:
        self.notes.append(f"the {prefix} state stays keyed by parameter index, with its param groups, as torch.optim wrote it "
                          f"(optimizer.load_state_dict reads it): {why}")

    def _index_names(self, prefix: str, optim: Mapping[str, Any], params: dict[str, Any],
                     model: str) -> tuple[dict[int, str] | None, str, bool]:
        """Index -> parameter name and how it is known (proven by ``param_names``, paired through a
        live optimizer, or stated by the caller: the third value), or None and why not."""
        groups = optim["param_groups"]
        ids = [i for g in groups for i in g["params"]]
        if not all(type(i) is int for i in ids) or len(set(ids)) != len(ids):
            return None, "its param_groups list indices that are not distinct integers", False
        live = self._live_names
        if live is not None and [len(g["params"]) for g in groups] != [len(g) for g in live]:
            raise MismatchError(
                f"the {prefix} state was saved by an optimizer with {len(groups)} param group(s) of "
                f"{[len(g['params']) for g in groups]} parameters; the optimizer given has {len(live)} of "
                f"{[len(g) for g in live]}", where=self.location.url,
                hint="build the optimizer with the param groups of the job that saved it (torch pairs them position by position)")
        stated = False
        recorded = {i: n for g in groups if isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g["params"])
                    for i, n in zip(g["params"], g["param_names"])}
        proven = (len(recorded) == len(ids) and len(set(recorded.values())) == len(ids)
                  and all(isinstance(n, str) and n in params for n in recorded.values()))
        if proven:
            names, how = recorded, "that torch recorded in its param groups (param_names)"
        elif live is not None:
            names = {i: n for g, names in zip(groups, live) for i, n in zip(g["params"], names)}
            how = "of the optimizer given, group by group, as optimizer.load_state_dict pairs them"
        elif recorded:
            return None, (f"the names its param groups record ({', '.join(map(repr, list(recorded.values())[:3]))}, ...) "
                          f"are not all distinct names of {model}'s parameters"), False
        elif self._stated == STATED_ORDER:
            if len(ids) != len(params):
                raise MismatchError(f"the {prefix} state numbers {len(ids)} parameters and {model} has {len(params)}: they "
                                    f"cannot be {model}'s parameters in the order its file lists them, as stated",
                                    where=self.location.url, hint="leave the optimizer order unstated: the state is then kept "
                                    "keyed by index")
            order = list(params)
            names = {i: order[n] for n, i in enumerate(ids)}
            how = (f"in the order {model}'s file lists them, as stated (--optimizer-order model): nothing in the folder "
                   "proves it; each param group records it (param_names_from)")
            stated = True
        else:
            return None, ("its param groups record no parameter names (an optimizer built from model.named_parameters() "
                          "records them), so which parameter an index is cannot be told from the folder; "
                          "--optimizer-order model (optimizer_order='model') names them in the order the model lists its "
                          "parameters, for an optimizer built from model.parameters(); ckpttool.load(FOLDER, model, optimizer) "
                          "pairs them through the live optimizer's groups, as optimizer.load_state_dict does"), False
        if not all(type(i) is int and i in names for i in optim["state"]):
            return None, "its state names indices that are no parameter of its groups", False
        why = self._misfit(optim, names, params, model)
        if why is None:
            return names, how, stated
        if live is not None and not proven:
            raise MismatchError(f"the {prefix} state does not fit the optimizer given: {why}", where=self.location.url,
                                hint="build the optimizer with the param groups of the job that saved it")
        if stated:
            raise MismatchError(f"the {prefix} state does not fit the order stated: {why}", where=self.location.url,
                                hint="leave the optimizer order unstated: the state is then kept keyed by index")
        return None, why, False

    def _misfit(self, optim: Mapping[str, Any], names: dict[int, str], params: dict[str, Any], model: str) -> str | None:
        """Why the optimizer's state does not fit the parameters ``names`` gives its indices (a state
        shape other than its parameter's), or None."""
        for i, entry in optim["state"].items():
            if names[i] not in params:
                raise MismatchError(f"the optimizer given holds parameter {names[i]!r}, which {model}'s files do not",
                                    where=self.location.url, hint="load with the model the folder was saved from")
            for key, value in (entry.items() if isinstance(entry, Mapping) else ()):
                if isinstance(value, DTensorRef) and value.shape != params[names[i]].shape:
                    return (f"index {i}'s state {key!r} has shape {list(value.shape)} but parameter {names[i]!r} has "
                            f"{list(params[names[i]].shape)}")
        return None

    # --- reading ---------------------------------------------------------------------------------
    def index(self) -> Index:
        return self._index

    @property
    def world_size(self) -> int:
        return self._world

    def files(self) -> list[str]:
        return sorted(self._files)

    def _chunk_file(self, entry: TensorEntry, chunk_index: int) -> str:
        return entry.chunks[chunk_index].location[0]

    def _placement(self, key: str) -> str | None:
        return self._placements.get(key)

    def part(self, name: str) -> TorchFile:
        """The open archive of one file of the folder."""
        return self._files[name]

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        entry, box, out = self._destination(key, box, out)
        for chunk, part in entry.chunks_in(box):
            name, ref = chunk.location
            local = tuple(s.start for s in relative(part, (chunk.offsets, chunk.sizes)))
            self._files[name].read(ref, key, (local, part[1]), out=out[relative(part, box)])
        return out

    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        spans = []
        for chunk in self.entry(key, TensorEntry).chunks:
            name, ref = chunk.location
            storage = self._files[name].storage_of(ref, key)
            spans.append((self.location.child(name), storage.offset, storage.offset + storage.nbytes))
        return spans

    def close(self) -> None:
        for part in self._files.values():
            part.close()


class RanksSink(Sink):
    """A per-rank folder for a job on ``layout.mesh`` (FSDP2's ``Shard(0)``; HSDP ``Replicate``,
    ``Shard(0)`` on a 2-D mesh), as that job's ranks would write it with the guide's manual code:
    ``<top>_rank_<R>.pt`` holding DTensors (each rank's box; buffers and 0-d tensors whole, as plain
    tensors) for every top-level key that holds a sharded tensor, and ``<top>.pt`` (rank 0's, once)
    for the others. An ``optim`` state keyed by parameter name goes back to
    ``optimizer.state_dict()``'s indices (the names' order in its param_groups). Each rank's file is
    built in turn, holding that rank's share in memory (the checkpoint / world size), and pickled by
    torch with the mesh that rank would have (a fake process group: ``compat.fake_rank``)."""

    format = "torch-ranks"

    def __init__(self, location: Location, layout: Any):
        super().__init__(location)
        if not isinstance(layout, FsdpLayout):
            raise FormatError("per-rank folders are written for FSDP2's Shard(0) layouts (--world-size, --mesh RxS)",
                              hint="write DCP for tensor-parallel or --like layouts")
        self.layout = layout
        self._entries: list[TensorSpec | ObjectSpec] = []
        self.bytes_per_rank: dict[int, int] = {}  # tensor bytes each rank's files hold

    def _begin(self, entries: list[TensorSpec | ObjectSpec]) -> None:
        self._entries = list(entries)
        self.tmp.makedirs()

    def _sharded(self, spec: TensorSpec) -> bool:
        return bool(spec.shape) and spec.key not in self.layout.replicated

    def _box(self, spec: TensorSpec, rank: int) -> Box:
        if not self._sharded(spec):
            return whole(spec.shape)
        box = rank_box(spec.shape, self.layout.mesh, rank)
        if box is None:  # an empty shard: no rows, at the end
            return (spec.shape[0], *([0] * (len(spec.shape) - 1))), (0, *spec.shape[1:])
        return box

    def _ranked_tops(self) -> list[str]:
        return sorted({str(s.path[0]) for s in self._entries if isinstance(s, TensorSpec) and self._sharded(s)})

    def read_order(self, tensors: list[TensorSpec]) -> list[tuple[TensorSpec, Box | None]]:
        ranked = set(self._ranked_tops())
        return [(spec, self._box(spec, r)) for r in range(self.layout.world_size) for spec in tensors
                if str(spec.path[0]) in ranked or r == 0]

    def _add_tensor(self, spec: TensorSpec, read: ReadFn, budget: int) -> None:  # (write() reads rank by rank)
        raise NotImplementedError

    def write(self, tensors: list[TensorSpec], reader_for: Any, done: Any) -> None:
        import torch

        from ..compat import fake_rank

        mesh = self.layout.mesh
        ranked = self._ranked_tops()
        tops = list(dict.fromkeys(str(s.path[0]) for s in self._entries))
        for rank in range(self.layout.world_size):
            flat: dict[str, Any] = {}
            paths: dict[str, Any] = {}
            for spec in self._entries:
                top = str(spec.path[0])
                if top not in ranked and rank != 0:
                    continue
                paths[spec.key] = spec.path
                if isinstance(spec, ObjectSpec):
                    flat[spec.key] = spec.value
                    continue
                box = self._box(spec, rank)
                local = torch.empty(box[1], dtype=spec.dtype)
                read, budget = reader_for(spec)
                for slab in stream_slabs(spec, budget, box):
                    local[relative(slab, box)] = read(slab)
                flat[spec.key] = _Shard(local) if self._sharded(spec) else local
                nbytes = local.numel() * local.element_size()
                self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + nbytes
                done(nbytes, spec.key)
            state = unflatten(flat, paths)
            with fake_rank(rank, mesh.world_size):
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor import DTensor, Replicate, Shard

                dmesh = (init_device_mesh("cpu", (mesh.replicate, mesh.shard), mesh_dim_names=("replicate", "shard"))
                         if mesh.replicate > 1 else init_device_mesh("cpu", (mesh.shard,)))  # (HSDP needs the names)
                placements = [Replicate(), Shard(0)] if mesh.replicate > 1 else [Shard(0)]
                shapes = {s.key: s.shape for s in self._entries if isinstance(s, TensorSpec)}

                def wrap(value: Any, key: str) -> Any:
                    if isinstance(value, _Shard):
                        full = torch.Size(shapes[key])
                        return DTensor.from_local(value.local, dmesh, placements, run_check=False, shape=full,
                                                  stride=torch.empty(full, device="meta").stride())
                    return value

                for top in tops:
                    if top not in state or (top not in ranked and rank != 0):
                        continue
                    tree = _wrap_tree(state[top], top, wrap)
                    if top in ranked:
                        tree = int_keyed_optimizers(_by_index(tree))
                    name = f"{top}_rank_{rank}.pt" if top in ranked else f"{top}.pt"
                    with self.tmp.child(name).open_write() as f:
                        torch.save(tree, f)

    def complete(self) -> None:
        pass


class _Shard:
    """A rank's local part of a sharded tensor, until it is made a DTensor."""

    __slots__ = ("local",)

    def __init__(self, local: torch.Tensor):
        self.local = local


def _wrap_tree(value: Any, key: str, wrap: Any) -> Any:
    """``value`` with every :class:`_Shard` leaf made a DTensor by ``wrap(leaf, its flat key)``."""
    if isinstance(value, dict):
        return type(value)((k, _wrap_tree(v, f"{key}.{k}", wrap)) for k, v in value.items())
    if isinstance(value, list):
        return [_wrap_tree(v, f"{key}.{i}", wrap) for i, v in enumerate(value)]
    return wrap(value, key)


def _by_index(tree: Any) -> Any:
    """An optimizer state keyed by parameter name (as ckpttool reads one) back to the indices of
    ``optimizer.state_dict()``: each name's position in the param_groups' lists."""
    if not (isinstance(tree, Mapping) and set(tree) == {"state", "param_groups"} and isinstance(tree["param_groups"], list)):
        return tree
    names = [p for g in tree["param_groups"] if isinstance(g, Mapping) for p in g.get("params", [])]
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        return tree  # (already by index, or not a state ckpttool can renumber)
    index = {n: i for i, n in enumerate(names)}
    if not set(tree["state"]) <= set(index):
        raise FormatError("the optimizer state names parameters its param_groups do not list",
                          hint="it cannot be numbered as optimizer.state_dict() numbers them")
    # (numbered again, the state no longer rests on the order a reader was told: that note goes)
    return {"state": {index[n]: v for n, v in tree["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "param_names_from"}, "params": [index[n] for n in g["params"]]}
                             for g in tree["param_groups"]]}


class RanksFormat(Format):
    name = "torch-ranks"
    checksums = True  # the zip's CRC-32 of every storage record
    ranked = True
    names_by_order = True

    def sniff(self, probe: Probe) -> bool:
        return probe.is_dir and bool(rank_groups(probe.names))

    def open_source(self, loc: Location, verify: bool = True, reading: Any = None) -> RanksSource:
        return RanksSource(loc, verify=verify, optimizer_names=reading.optimizer_names if reading is not None else None,
                           optimizer_order=reading.optimizer_order if reading is not None else None)

    sink_options = frozenset({"layout"})

    def make_sink(self, loc: Location, options: SinkOptions) -> RanksSink:
        if options.layout is None:
            raise FormatError("a per-rank folder is written for a job's ranks", hint="ckpttool reshard SRC DST --world-size M --to torch-ranks")
        return RanksSink(loc, options.layout)

    def check_integrity(self, source: RanksSource, report: Report, only: str | None, progress: Progress | None,
                        share: tuple[int, int] | None = None) -> None:
        """Every DTensor's boxes tile its global shape with no gap or overlap, and every record's
        bytes match their CRC-32 and hold the tensor (the ranks' agreement, the files present and
        every pickle were checked when the folder was opened)."""

        def tiling(key: str, entry: TensorEntry) -> None:
            try:
                entry.check_coverage(source.location.url)
            except CkptError as exc:
                report.add(exc.what, source.location.url, key, hint="shards overlap or leave a gap; the folder mixes saves")

        check_tensor_records(source.index(), report, only, progress,
                             lambda key, entry: [(source.part(c.location[0]), c.location[1]) for c in entry.chunks], tiling)
        for line in source.rank_differences():
            key = line.split(" ", 1)[0]
            if only is None or key.split(".", 1)[0] == only:
                report.add(f"differs between ranks: {line}", source.location.url, key,
                           hint="a value of the model or the optimizer must be the same on every rank that holds it: the folder "
                                "mixes files of different saves, or the ranks diverged")


FORMAT = RanksFormat()
