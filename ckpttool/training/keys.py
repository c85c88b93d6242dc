"""Which checkpoint key holds each of a model's state-dict keys, whatever wrote the checkpoint.

A ckpttool step (and DCP, a per-rank folder, a trainer folder) keeps the model under the top-level
key ``model`` (``model.<fqn>``); a ``save_pretrained`` folder, a safetensors file or a
``torch.save(model.state_dict())`` file is the model's state dict itself (``<fqn>``). The model may
carry a prefix the file does not (a wrapper's ``llm.``, torch.compile's ``_orig_mod.``, FSDP1's
``_fsdp_wrapped_module.``): found by itself when removing it makes every key match, and said.
``key_map`` renames anything else (``re.sub`` of each pattern, in order, on the model's keys). A
key whose tensor is another key's (tied weights: ``lm_head.weight`` is ``embed_tokens.weight``) is
not missing when the other one is found, as ``from_pretrained`` ties them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..index import Index, key_of

#: wrapper modules that put a component into every key below them (torch.compile, FSDP1,
#: activation checkpointing): removed wherever they appear when that makes every key match
WRAPPERS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@dataclass
class KeyMatch:
    """``pairs``: the model's key -> the checkpoint's key; ``missing``: the model's keys found nowhere
    (tied ones whose twin was found are not); ``unexpected``: the checkpoint's model keys nothing
    asked for; ``layout``: ``step`` (under ``model.``) or ``bare`` (the state dict itself);
    ``renamed``: how the keys were matched, in words (None: as they are)."""

    pairs: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    layout: str = "step"
    renamed: str | None = None


def model_keys(index: Index) -> tuple[dict[str, str], str]:
    """The checkpoint's model keys (the model's own names) -> the checkpoint's keys, and the layout:
    ``step`` when the checkpoint nests the model under the top-level key ``model``, else ``bare``."""
    paths = index.paths
    under = {key_of(path[1:]): key for key, path in paths.items() if len(path) >= 2 and str(path[0]) == "model"}
    if under:
        return under, "step"
    return {key: key for key in paths}, "bare"


def match(model: Iterable[str], ties: Mapping[str, str], index: Index, key_map: Mapping[str, str] | None = None) -> KeyMatch:
    """Match the model's state-dict keys ``model`` to the checkpoint's (see the module's doc);
    ``ties``: a key -> the key whose tensor it shares (the first of each group)."""
    names = list(model)
    found, layout = model_keys(index)
    rules = [(re.compile(pattern), repl) for pattern, repl in (key_map or {}).items()]

    def mapped(name: str) -> str:
        for pattern, repl in rules:
            name = pattern.sub(repl, name)
        return name

    base = {name: mapped(name) for name in names}
    how = f"key_map {dict(key_map)}" if key_map else None
    best = _pairs(base, found, ties)
    if len(best) < len(names):  # not every key: try without a prefix the checkpoint does not have
        for stripped, said in _without_prefixes(base):
            pairs = _pairs(stripped, found, ties)
            if _complete(pairs, names, ties) and len(pairs) > len(best):
                best, how = pairs, said + (f", after key_map {dict(key_map)}" if key_map else "")
                break
    used = set(best.values())
    missing = [n for n in names if n not in best and not (n in ties and ties[n] in best)]
    unexpected = [name for name, key in found.items() if key not in used]
    return KeyMatch(best, missing, unexpected, layout, how)


def _pairs(names: Mapping[str, str], found: Mapping[str, str], ties: Mapping[str, str]) -> dict[str, str]:
    return {name: found[target] for name, target in names.items() if target in found}


def _complete(pairs: Mapping[str, str], names: list[str], ties: Mapping[str, str]) -> bool:
    return all(n in pairs or (n in ties and ties[n] in pairs) for n in names)


def _without_prefixes(names: Mapping[str, str]) -> Iterable[tuple[dict[str, str], str]]:
    """The model's keys without the wrappers' components, then without each leading part all of
    them share (``llm.``, then ``llm.model.``), each with the sentence that says so."""
    present = [w for w in WRAPPERS if any(w in v for v in names.values())]
    if present:
        yield ({k: _drop(v, present) for k, v in names.items()},
               f"without the wrappers' {', '.join(repr(w) for w in present)} in the model's keys")
    parts = [v.split(".") for v in names.values()]
    common = 0
    while parts and all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    for n in range(1, common + 1):
        prefix = ".".join(parts[0][:n]) + "."
        yield ({k: v[len(prefix):] for k, v in names.items()},
               f"without the prefix {prefix!r} every key of the model carries and the checkpoint's do not")


def _drop(name: str, wrappers: list[str]) -> str:
    for w in wrappers:
        name = name.replace(w, "")
    return name
