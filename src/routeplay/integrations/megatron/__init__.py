"""routeplay.integrations.megatron: routing replay (R3 and R2) for Megatron-Core MoE models.

``MegatronLayout`` maps a rank's TP/SP/CP/PP/VPP place to the materializer's
``RankCoords`` and to the layers each model chunk holds; ``MegatronReplay`` fills the
``RouterReplay`` of exactly the routers the rank holds, in the token order they see, and
clears Megatron's global replay state when it closes. See docs/megatron.md.

Names resolve on first use (PEP 562): the layout plans without torch, the session needs
torch, and megatron-core is imported only when a session looks for routers. Nothing here
imports Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from routeplay.core.lazy import LazyExports

if TYPE_CHECKING:
    from routeplay.integrations.megatron.layout import MegatronLayout, QkvFormat
    from routeplay.integrations.megatron.routers import MegatronRouter, find_megatron_routers
    from routeplay.integrations.megatron.session import (
        MegatronReplay,
        MegatronReplayStats,
        Recording,
    )

_HOME = {
    "MegatronLayout": "layout",
    "MegatronReplay": "session",
    "MegatronReplayStats": "session",
    "MegatronRouter": "routers",
    "QkvFormat": "layout",
    "Recording": "session",
    "find_megatron_routers": "routers",
}

__all__ = [
    "MegatronLayout",
    "MegatronReplay",
    "MegatronReplayStats",
    "MegatronRouter",
    "QkvFormat",
    "Recording",
    "find_megatron_routers",
]


_LAZY = LazyExports(__name__, _HOME)


def __getattr__(name: str) -> Any:
    return _LAZY.resolve(name)


def __dir__() -> list[str]:
    return _LAZY.names(__all__)
