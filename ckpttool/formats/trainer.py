"""Trainer checkpoint folders (format ``trainer``): the several files a training framework writes
for one step, read as one checkpoint whose top-level keys name the parts.

Hugging Face Trainer's ``checkpoint-N/`` and accelerate's ``save_state`` folders (its FSDP
``SHARDED_STATE_DICT`` DCP directories included) map onto these keys:

==========================================================  =====================================
part                                                        top-level key
==========================================================  =====================================
``model.safetensors``, ``model-0000k-of-0000n.safetensors``   ``model``
(+ ``model.safetensors.index.json``), ``pytorch_model.bin``,
``pytorch_model-0000k-of-0000n.bin`` (+ its index)
``optimizer.pt`` / ``optimizer.bin``                         ``optimizer`` (keyed by parameter index,
                                                            as the framework saved it)
``scheduler.pt`` / ``scheduler.bin``, ``scaler.pt``          ``scheduler``, ``scaler``
``rng_state.pth``, ``rng_state_<R>.pth``                    ``rng_state``, ``rng_state_<R>``
``random_states_<R>.pkl`` (accelerate)                       ``random_states_<R>``
``custom_checkpoint_<N>.pkl`` (accelerate)                   ``custom_checkpoint_<N>``
``adapter_model.safetensors`` / ``.bin`` (PEFT)              ``adapter``
``trainer_state.json``, ``adapter_config.json``              ``trainer_state``, ``adapter_config`` (JSON)
``pytorch_model_fsdp_<N>/``, ``optimizer_<N>/`` (DCP)        the DCP's own keys (``model.*``,
                                                            ``optimizer.*``)
==========================================================  =====================================

``training_args.bin`` (a pickled ``TrainingArguments``, which the allow-list refuses), any part
holding a value the allow-list refuses, and checkpoint data whose place in the state cannot be
told (a weights-shaped file of another name: ``ema.pt``, a second model file, a directory) are named
by :meth:`TrainerSource.not_read` with the reason (verify fails over them unless ``--only``
narrows the check; the other commands go on with the rest and say so); a damaged part is an
error, as in any checkpoint, and two files for one part (``optimizer.pt`` and ``optimizer.bin``) are
refused as ambiguous. Files that are no checkpoint state (``config.json``, tokenizer files) are
named in the notes. Nothing in the folder is passed over without a word.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpointError, FormatError, NotACheckpointError, UnsafePickleError
from ..index import Index, ObjectEntry, TensorEntry
from ..layout import Box
from ..report import Report
from ..storage import Location
from .base import About, Format, NotRead, Probe, Progress, Source

if TYPE_CHECKING:
    import torch

#: single files: name -> top-level key
_FILES = {"optimizer.pt": "optimizer", "optimizer.bin": "optimizer", "scheduler.pt": "scheduler", "scheduler.bin": "scheduler",
          "scaler.pt": "scaler", "rng_state.pth": "rng_state", "adapter_model.safetensors": "adapter",
          "adapter_model.bin": "adapter"}
_NUMBERED = re.compile(r"^(?P<stem>rng_state_\d+)\.pth$|^(?P<stem2>(random_states|custom_checkpoint)_\d+)\.pkl$")
_DCP_DIRS = re.compile(r"^(pytorch_model_fsdp|optimizer|model)_\d+$")
_MODEL_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
_STATE_JSON = {"trainer_state.json": "trainer_state", "adapter_config.json": "adapter_config"}
#: files that hold tensors or pickled state by their kind: one of another name is checkpoint data
#: whose place in the state cannot be told (never "not state")
_DATA = re.compile(r".*\.(pt|pth|bin|safetensors|pkl|pickle|ckpt|npy|npz|h5|msgpack|gguf|distcp)$")
#: what a trainer folder holds beside its state, never read: said so, by name
_NOT_STATE = re.compile(r".*\.(json|txt|model|md|py|jinja)$|^training_args\.bin$")
_MAX_JSON = 64 << 20


def is_trainer_folder(names: tuple[str, ...] | list[str]) -> bool:
    """A folder with the trainer's own files beside (or instead of) a model: its state, optimizer,
    scheduler or RNG states, or accelerate's per-process DCP directories."""
    return any(n in _FILES or n == "trainer_state.json" or _NUMBERED.match(n) or _DCP_DIRS.match(n) for n in names)


class TrainerSource(Source):
    """A trainer folder as one checkpoint: each part opened in its own format, its keys under the
    part's top-level key (see the module docstring)."""

    format = "trainer"

    def __init__(self, location: Location, verify: bool = True):
        super().__init__(location)
        self._parts: list[tuple[str | None, Source]] = []  # (top-level key or None: the part's own keys, source)
        self._owner: dict[str, tuple[Source, str]] = {}  # key -> (part, its key there)
        self._unreadable: list[tuple[str, str]] = []  # (file, why) of parts that could not be read
        self._objects: dict[str, Any] = {}
        self._json_parts: list[tuple[str, str]] = []  # (top-level key, file) of JSON parts
        self._idx = Index()
        try:
            self._open_parts(verify)
        except BaseException:
            self.close()
            raise

    def _open_parts(self, verify: bool) -> None:
        from . import detect, get

        plan, model_format, not_state = self._plan_parts(sorted(self.location.listdir()))
        added: set[str] = set()
        for top, name, loc in plan:
            if loc is None:
                self._add_json(top, name)
                continue
            try:
                fmt = get(model_format) if loc == self.location and model_format else detect(loc)
                if fmt.name == self.format:
                    raise FormatError("a trainer folder inside a trainer folder", where=loc.url)
                source = fmt.open_source(loc, verify)
            except UnsafePickleError as exc:  # a value the allow-list refuses: named, the rest read
                self._unreadable.append((name, exc.what))
                continue  # (a damaged part is an error: nothing goes on without it unannounced)
            self._add(top, name, source, added)
        if not self._parts and not self._objects:
            raise NotACheckpointError("trainer folder holds no part ckpttool can read", where=self.location.url,
                                      hint="; ".join(f"{n}: {why}" for n, why in self._unreadable) or None)
        if not_state:
            self.notes.append(f"not checkpoint state, not read: {', '.join(not_state)}")

    def _plan_parts(self, names: list[str]) -> tuple[list[tuple[str | None, str, Location | None]], str | None, list[str]]:
        """What each file of the folder is: (top-level key, file, where to read it; None for a JSON
        part) for every part read, the model's format when it is sharded (the folder itself), and
        the files that are not checkpoint state. Names what cannot be read (``_unreadable``)."""
        used: set[str] = set()
        not_state: list[str] = []
        model = next((n for n in _MODEL_FILES if n in names), None)
        plan: list[tuple[str | None, str, Location | None]] = []
        model_format: str | None = None  # a sharded model is the folder itself, read in its model's format
        if model is not None:
            sharded = model.endswith(".index.json")
            model_format = ("safetensors" if ".safetensors" in model else "torch") if sharded else None
            plan.append(("model", model, self.location if sharded else self.location.child(model)))
            if sharded:  # the index and its shard files
                stem = model.removesuffix(".index.json").rsplit(".", 1)
                used |= {n for n in names if n.startswith(stem[0] + "-") and n.endswith("." + stem[1])} | {model}
            else:
                used.add(model)
        tops: dict[str, list[str]] = {}
        for name in names:
            if name in _FILES and name not in used:
                tops.setdefault(_FILES[name], []).append(name)
        for top, claim in tops.items():
            if len(claim) > 1:
                raise FormatError(f"two files for one part: {' and '.join(claim)} are both the {top} (which one the trainer "
                                  "wrote last cannot be told)", where=self.location.url,
                                  hint="move the stale one out of the folder, or convert the file you want on its own")
        for name in names:
            if name in used:
                continue
            m = _NUMBERED.match(name)
            if name in _FILES:
                plan.append((_FILES[name], name, self.location.child(name)))
            elif m:
                plan.append((m["stem"] or m["stem2"], name, self.location.child(name)))
            elif _DCP_DIRS.match(name) and self.location.child(name).isdir():
                plan.append((None, name, self.location.child(name)))
            elif name in _STATE_JSON:
                plan.append((_STATE_JSON[name], name, None))  # (read after the other parts: the model first)
            elif name == "training_args.bin":
                self._unreadable.append((name, "a pickled TrainingArguments (the run's settings, not its state): the "
                                              "allow-list refuses it; nothing from it was run"))
                continue
            elif _DATA.match(name) or (not _NOT_STATE.match(name) and self.location.child(name).isdir()):
                self._unreadable.append((name, "checkpoint data ckpttool does not read: which part of the state it is "
                                               "cannot be told from its name"))
                continue
            else:
                not_state.append(name)
                continue
            used.add(name)
        return plan, model_format, not_state

    def _add(self, top: str | None, name: str, source: Source, tops: set[str]) -> None:
        index = source.index()
        for key in index:
            path = index.path(key)
            new_path = (top, *path) if top is not None else path
            new_key = ".".join(str(p) for p in new_path)
            if new_key in self._owner or new_key in self._objects:
                raise CorruptCheckpointError(f"{name} holds key {new_key!r}, which another part holds too", where=self.location.url)
            entry = index[key]
            if isinstance(entry, TensorEntry):
                self._idx.add(TensorEntry(new_key, entry.shape, entry.element_type, entry.chunks), new_path)
            else:
                self._idx.add(ObjectEntry(new_key, None), new_path)
            self._owner[new_key] = (source, key)
        self._parts.append((top, source))
        self.notes.extend(f"{name}: {n}" for n in source.notes)

    def _add_json(self, top: str, name: str) -> None:
        from ..index import flatten

        loc = self.location.child(name)
        size = loc.size()
        if size > _MAX_JSON:
            self._unreadable.append((name, f"{size} bytes of JSON, more than ckpttool reads ({_MAX_JSON})"))
            return
        try:
            value = json.loads(loc.read_bytes(0, size))
        except (ValueError, RecursionError) as exc:
            self._unreadable.append((name, f"not valid JSON ({type(exc).__name__})"))
            return
        self._json_parts.append((top, name))
        flat, paths = flatten({top: value})
        for key, v in flat.items():
            self._objects[key] = v
            self._idx.add(ObjectEntry(key, v), paths[key])

    def index(self) -> Index:
        return self._idx

    def parts(self) -> list[tuple[str | None, Source]]:
        """(top-level key, or None where the part brings its own keys; its source) of each part read."""
        return list(self._parts)

    def describe_parts(self) -> list[dict[str, Any]]:
        """What inspect lists: each part's file, what it is (its format) and the key it is read under."""
        out = []
        for top, source in self._parts:
            # a sharded model is the folder itself (its shards); a DCP part a directory; else one file
            name = ", ".join([*source.aux_files(), *source.files()]) if source.location == self.location else source.location.name
            out.append({"file": name, "format": source.format, "key": top})  # (key None: the part's own keys)
        out += [{"file": name, "format": "json", "key": top} for top, name in self._json_parts]
        out += [{"file": name, "format": None, "key": None, "not_read": why} for name, why in self._unreadable]
        return out

    def json_keys(self) -> list[str]:
        """The keys read from JSON parts (``trainer_state.json``)."""
        return list(self._objects)

    def _part(self, key: str) -> tuple[Source, str]:
        owner = self._owner.get(key)
        if owner is None:
            raise FormatError(f"{key!r} is not an entry of this checkpoint", where=self.location.url)
        return owner

    def read_tensor(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        source, own = self._part(key)
        return source.read_tensor(own, box, out)

    def read_object(self, key: str) -> Any:
        if key in self._objects:
            return self._objects[key]
        source, own = self._part(key)
        return source.read_object(own)

    def _check(self, key: str, entry: TensorEntry) -> None:
        source, own = self._part(key)
        source.entry(own, TensorEntry, checked=True)

    def data_spans(self, key: str) -> list[tuple[Location, int, int]]:
        source, own = self._part(key)
        return source.data_spans(own)

    def _prefix(self, source: Source) -> str:
        rel = source.location.path[len(self.location.path):].strip("/")
        return rel + "/" if source.location.isdir() and rel else ""

    def files(self) -> list[str]:
        names = []
        for _, source in self._parts:
            prefix = self._prefix(source)
            names += [prefix + n if prefix else n for n in source.files()]
        return names

    def about(self, key: str) -> About:
        self.entry(key, TensorEntry)  # (a key of this checkpoint's, and a tensor: said in its terms)
        source, own = self._part(key)
        about, prefix = source.about(own), self._prefix(source)
        return About(tuple(prefix + name for name in about.files), about.placement)

    def not_read(self) -> NotRead:
        # (the folder's other files are named in the notes, with what they are)
        return NotRead(tuple(self.notes), tuple(self._unreadable))

    @contextmanager
    def checked_in_parts(self) -> Iterator[None]:
        with ExitStack() as stack:
            for _, source in reversed(self._parts):  # (left in reverse: the parts settle in their order)
                stack.enter_context(source.checked_in_parts())
            yield

    def close(self) -> None:
        for _, source in self._parts:
            source.close()


class TrainerFormat(Format):
    name = "trainer"
    checksums = True  # each part checks its own (safetensors parts have none, and say so)

    def sniff(self, probe: Probe) -> bool:
        return probe.is_dir and ".metadata" not in probe.names and is_trainer_folder(probe.names)

    def open_source(self, loc: Location, verify: bool = True, reading: Any = None) -> TrainerSource:
        return TrainerSource(loc, verify=verify)

    def make_sink(self, loc: Location, options: Any) -> Any:
        raise FormatError("ckpttool reads trainer folders but does not write them",
                          hint="convert one to DCP or a torch.save file, which hold every part under its key")

    def check_integrity(self, source: TrainerSource, report: Report, only: str | None, progress: Progress | None,
                        share: tuple[int, int] | None = None) -> None:
        """Each part checked by its own format (only the parts under the top-level key ``only``,
        when given). (The parts that could not be read are verify's problems: ``Source.not_read``.)"""
        from . import get

        for top, part in source.parts():
            if only is not None and top is not None and top != only:
                continue
            if only is not None and top is None and only not in {str(part.index().path(k)[0]) for k in part.index()}:
                continue
            get(part.format).check_integrity(part, report, only if top is None else None, progress)
        report.objects_checked += sum(1 for k in source.json_keys() if only is None or k.split(".", 1)[0] == only)


FORMAT = TrainerFormat()
