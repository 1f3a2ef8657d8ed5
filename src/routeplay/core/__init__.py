"""routeplay.core: numpy-only types and codecs. No Ray, no torch (a test pins this).

Owns the canonical routing form (``Routes``), the model geometry (``RouteSpec``), the
wire formats of every engine, validation, and the metadata a sample carries instead of
data (``Segment``, ``Handle``).
"""

from routeplay.core.degenerate import DegenerateCheck
from routeplay.core.handle import EngineKey, Handle, InlineSource, Piece, Segment, Source, StoreRef
from routeplay.core.hf_config import spec_from_hf_config
from routeplay.core.presets import PRESETS, preset
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec, canonical_dtype
from routeplay.core.validate import canonicalize, expected_rows
from routeplay.core.wires import Engine, EngineRouting, read_response, read_responses, read_stream

__all__ = [
    "PRESETS",
    "DegenerateCheck",
    "Engine",
    "EngineKey",
    "EngineRouting",
    "Handle",
    "InlineSource",
    "Piece",
    "RouteSpec",
    "Routes",
    "Segment",
    "Source",
    "StoreRef",
    "canonical_dtype",
    "canonicalize",
    "expected_rows",
    "preset",
    "read_response",
    "read_responses",
    "read_stream",
    "spec_from_hf_config",
]
