"""Work that waits for a module to be imported: patch it, or tell it of dpprof, only once a script loads it."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["WhenImported", "when_imported"]


class WhenImported(importlib.abc.MetaPathFinder):
    """Calls ``then()`` once module ``name`` is imported (its body run), in whichever import first loads it."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        self.remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then(module: Any) -> None:
            if getattr(module, "__name__", None) != self.name:  # a loader shared by several modules: theirs as ever
                exec_module(module)
                return
            loader.exec_module = exec_module  # type: ignore[method-assign]  # once: the loader as it was
            exec_module(module)
            self.then()  # raises nothing: what it cannot patch stays torch's

        loader.exec_module = exec_then  # type: ignore[method-assign]  # this spec's loader, until it runs
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def when_imported(name: str, then: Callable[[], None]) -> None:
    """``then()`` now if module ``name`` is imported, else once it is (a WhenImported first on sys.meta_path)."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, WhenImported(name, then))
