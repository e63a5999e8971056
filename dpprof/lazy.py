"""Names a package exports, imported from their modules the first time one is used (PEP 562).

A package's ``__init__`` that imports its submodules makes every import of any one of them pay for all: a
process that reads trace files (``dpprof import``'s workers) would import pandas and the store's reader it never
uses. Packages list their names here instead.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, names: Mapping[str, str], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose ``names`` (name -> module) are imported on first
    use and kept in ``namespace`` (the package's globals) from then on."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:  # also how ``from package import submodule`` goes on to import the submodule
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
