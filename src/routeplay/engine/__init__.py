"""routeplay.engine: the reference engine, a real tiny HF MoE model that generates while
recording routing, served in process and over HTTP in each real engine's wire format.

- ``model``: ``EngineConfig`` and ``build_model`` (same seed, same weights, any precision);
- ``generator``: ``ReferenceEngine.generate`` -> ``Generation`` (tokens, log-probs, routing);
- ``server``: ``WireHandler`` (one wire format in process) and ``EngineServer`` (HTTP,
  under ``ServerLimits``: body size and per-request deadline).

The server names load on first use, so the model and generator need no web stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from routeplay.engine.generator import FINISH_REASONS, EngineStats, Generation, ReferenceEngine
from routeplay.engine.model import DTYPES, EngineConfig, build_model

if TYPE_CHECKING:
    from routeplay.engine.server import (
        WIRES,
        EngineServer,
        ServerLimits,
        ServerStats,
        WireHandler,
    )

__all__ = [
    "DTYPES",
    "FINISH_REASONS",
    "WIRES",
    "EngineConfig",
    "EngineServer",
    "EngineStats",
    "Generation",
    "ReferenceEngine",
    "ServerLimits",
    "ServerStats",
    "WireHandler",
    "build_model",
]

_SERVER_NAMES = frozenset({"WIRES", "EngineServer", "ServerLimits", "ServerStats", "WireHandler"})


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        from routeplay.engine import server

        return getattr(server, name)
    raise AttributeError(f"module 'routeplay.engine' has no attribute {name!r}")
