"""routeplay.train: the learner side. Rank-local, bounded routing materialization
(``Materializer`` over a ``PackingPlan``) and router replay inside torch / HF
transformers MoE models (``replay``, ``record``), and the live routing drift of a replay
(``DriftMeter``).

Trainers that decide for themselves fit too (``docs/replay.md``, XTuner's flow): their own
packs (``PackingPlan.from_packs``, whole padding packs for DP included), their SP split
(``RankCoords(sp_split="pad_to_multiple")``: XTuner's zero-padding to a multiple of
``sp``), several passes over one step with the leases ended once after the last
(``Materializer(passes=3)`` and ``next_pass()``), and routers they own, indexed by decoder
layer (``ReplaySource.decoder_ids``: layer map, int64 on the device, replay's checks; an
MTP layer of the spec gets None, as XTuner's guard leaves it to its router), their own
padding rows replayed as laid out (``ReplaySource(mask=...)``: XTuner's zero and random
rows, refused only where they are routing).

Names are resolved on first use (PEP 562), so ``import routeplay.train.packing`` or the
materializer loads neither torch nor Ray: a trainer process pays only for what it uses.
The torch primitives of replay live in ``routeplay.train.replay_core``; ``replay`` here is
the HF entry point (``routeplay.train.hf.replay``), not a module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from routeplay.core.lazy import LazyExports

if TYPE_CHECKING:
    from routeplay.train.drift import DRIFT_BY_DEFAULT, DriftMeter, logprob_gaps
    from routeplay.train.drift_figures import LayerDrift, RoutingDrift
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
        seq_alignment,
    )
    from routeplay.train.replay_core import (
        RecorderStats,
        ReplaySource,
        ReplayStats,
        RouteRecorder,
    )
    from routeplay.train.routers import FAMILIES

_HOME = {
    "DRIFT_BY_DEFAULT": "drift",
    "DriftMeter": "drift",
    "LayerDrift": "drift_figures",
    "RoutingDrift": "drift_figures",
    "logprob_gaps": "drift",
    "FAMILIES": "routers",
    "Materializer": "materializer",
    "MaterializerStats": "materializer",
    "MicroBatchRoutes": "materializer",
    "Pack": "packing",
    "PackedSample": "packing",
    "PackingPlan": "packing",
    "RankCoords": "packing",
    "RecorderStats": "replay_core",
    "ReplaySource": "replay_core",
    "ReplayStats": "replay_core",
    "RouteRecorder": "replay_core",
    "find_routers": "hf",
    "local_ranges": "packing",
    "local_tokens": "packing",
    "model_spec": "hf",
    "pack_samples": "packing",
    "padding_rows": "materializer",
    "record": "hf",
    "replay": "hf",
    "seq_alignment": "packing",
}

__all__ = [
    "DRIFT_BY_DEFAULT",
    "FAMILIES",
    "DriftMeter",
    "LayerDrift",
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
    "RoutingDrift",
    "find_routers",
    "local_ranges",
    "local_tokens",
    "logprob_gaps",
    "model_spec",
    "pack_samples",
    "padding_rows",
    "record",
    "replay",
    "seq_alignment",
]


_LAZY = LazyExports(__name__, _HOME)


def __getattr__(name: str) -> Any:
    return _LAZY.resolve(name)


def __dir__() -> list[str]:
    return _LAZY.names(__all__)
