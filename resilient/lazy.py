"""Package faces that re-export names without importing them up front.

Why: ``resilient-train`` checks a recipe before any worker starts, and an operator waits for that
answer. Importing torch, TensorStore and ml_dtypes costs ~4 s on a small machine; the config check
needs none of them. A package ``__init__`` therefore maps each public name to the module that
defines it, and the module is imported on first use of the name (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a dotted module) on
    first access to ``name`` and caches the value in the package's namespace."""

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
