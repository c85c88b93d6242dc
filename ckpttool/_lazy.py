"""Names a package imports on first use (PEP 562), so importing it stays cheap: the CLI's
``--help`` and the offline readers do not import torch."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, where: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name in ``where`` is imported from the submodule
    it maps to at its first use, and kept in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(f".{where[name]}", package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
