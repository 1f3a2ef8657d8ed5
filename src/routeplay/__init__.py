"""routeplay: the data plane for MoE routing replay (R3) between inference engines and trainers.

Engines return per-sample routing ``[T, L, K]``; routeplay decodes it into one compact,
validated form, passes small handles around instead of bytes, and (in later layers)
stores, leases and replays it. Public names are re-exported here.
"""

from routeplay import errors
from routeplay.core import (
    PRESETS,
    Engine,
    EngineKey,
    EngineRouting,
    Handle,
    InlineSource,
    Routes,
    RouteSpec,
    Segment,
    StoreRef,
    canonicalize,
    preset,
    read_response,
    read_responses,
    read_stream,
    spec_from_hf_config,
)

__all__ = [
    "PRESETS",
    "Engine",
    "EngineKey",
    "EngineRouting",
    "Handle",
    "InlineSource",
    "RouteSpec",
    "Routes",
    "Segment",
    "StoreRef",
    "canonicalize",
    "errors",
    "preset",
    "read_response",
    "read_responses",
    "read_stream",
    "spec_from_hf_config",
]

__version__ = "0.1.0"
