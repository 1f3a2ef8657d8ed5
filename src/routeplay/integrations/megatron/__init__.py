"""routeplay.integrations.megatron: routing replay (R3 and R2) for Megatron-Core MoE models.

``MegatronLayout`` maps a rank's TP/SP/CP/PP/VPP place to the materializer's
``RankCoords`` and to the layers each model chunk holds; ``MegatronReplay`` fills the
``RouterReplay`` of exactly the routers the rank holds, in the token order they see, and
clears Megatron's global replay state when it closes. See docs/megatron.md.

Importing this package needs torch but neither Ray nor megatron-core (Megatron is imported
when a session finds its routers), so a layout can be planned anywhere.
"""

from routeplay.integrations.megatron.layout import MegatronLayout, QkvFormat
from routeplay.integrations.megatron.routers import MegatronRouter, find_megatron_routers
from routeplay.integrations.megatron.session import MegatronReplay, MegatronReplayStats, Recording

__all__ = [
    "MegatronLayout",
    "MegatronReplay",
    "MegatronReplayStats",
    "MegatronRouter",
    "QkvFormat",
    "Recording",
    "find_megatron_routers",
]
