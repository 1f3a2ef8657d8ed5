"""Package names resolved on first use (PEP 562), so that importing a package loads only
the submodules a caller touches: ``routeplay.train`` without torch until a replay is made,
``routeplay.store`` and ``routeplay.rollout`` without Ray until an actor is needed.

Example:
    _LAZY = LazyExports(__name__, {"RouteStore": "client"})

    def __getattr__(name: str) -> Any:
        return _LAZY.resolve(name)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LazyExports"]


class LazyExports:
    """The public names of one package and the submodule each lives in."""

    __slots__ = ("_homes", "_package")

    def __init__(self, package: str, homes: Mapping[str, str]) -> None:
        self._package = package
        self._homes = dict(homes)

    def resolve(self, name: str) -> Any:
        """The value of ``name``, imported from its home once and then cached in the package."""
        home = self._homes.get(name)
        if home is None:
            raise AttributeError(f"module {self._package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self._package}.{home}"), name)
        setattr(sys.modules[self._package], name, value)  # resolve once
        return value

    def names(self, exported: Iterable[str]) -> list[str]:
        """What ``dir(package)`` lists: what it holds now plus every exported name."""
        return sorted(set(vars(sys.modules[self._package])) | set(exported))
