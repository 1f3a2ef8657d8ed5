"""routeplay.train: the learner side. Rank-local, bounded routing materialization
(``Materializer`` over a ``PackingPlan``) and router replay inside torch / HF
transformers MoE models (``replay``, ``record``)."""

from routeplay.train.hf import find_routers, model_spec, record, replay
from routeplay.train.materializer import (
    Materializer,
    MaterializerStats,
    MicroBatchRoutes,
    padding_rows,
)
from routeplay.train.packing import (
    Pack,
    PackedSample,
    PackingPlan,
    RankCoords,
    local_ranges,
    local_tokens,
    pack_samples,
)
from routeplay.train.replay import RecorderStats, ReplaySource, ReplayStats, RouteRecorder
from routeplay.train.routers import FAMILIES

__all__ = [
    "FAMILIES",
    "Materializer",
    "MaterializerStats",
    "MicroBatchRoutes",
    "Pack",
    "PackedSample",
    "PackingPlan",
    "RankCoords",
    "RecorderStats",
    "ReplaySource",
    "ReplayStats",
    "RouteRecorder",
    "find_routers",
    "local_ranges",
    "local_tokens",
    "model_spec",
    "pack_samples",
    "padding_rows",
    "record",
    "replay",
]
