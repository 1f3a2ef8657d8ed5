"""Routing geometry of well-known MoE models.

Each number comes from the model's published config.json; the ones whose config is
also transformers' default config class are checked against it in
``tests/unit/test_presets.py``. L counts MoE layers; ``total_layers`` adds dense ones.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from routeplay.core.spec import RouteSpec
from routeplay.errors import SpecMismatch

__all__ = ["PRESETS", "preset"]


def _spec(
    name: str, total: int, top_k: int, experts: int, first_dense: int = 0, mtp: int = 0
) -> RouteSpec:
    layer_map = tuple(range(first_dense, total)) if first_dense else None
    return RouteSpec(
        num_layers=total - first_dense,
        top_k=top_k,
        num_experts=experts,
        layer_map=layer_map,
        total_layers=total,
        mtp_layers=mtp,  # num_nextn_predict_layers in the model's config.json
        name=name,
    )


PRESETS: Final = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            _spec("qwen3-30b-a3b", 48, 8, 128),
            _spec("qwen3-235b-a22b", 94, 8, 128),
            _spec("qwen3-next-80b-a3b", 48, 10, 512),
            _spec("qwen1.5-moe-a2.7b", 24, 4, 60),
            _spec("qwen2-57b-a14b", 28, 8, 64),
            _spec("intern-s1", 94, 8, 128),
            _spec("deepseek-v3", 61, 8, 256, first_dense=3, mtp=1),
            _spec("kimi-k2", 61, 8, 384, first_dense=1),
            _spec("glm-4.5", 92, 8, 160, first_dense=3, mtp=1),
            _spec("glm-4.5-air", 46, 8, 128, first_dense=1, mtp=1),
            _spec("gpt-oss-120b", 36, 4, 128),
            _spec("gpt-oss-20b", 24, 4, 32),
            _spec("mixtral-8x7b", 32, 2, 8),
            _spec("mixtral-8x22b", 56, 2, 8),
            _spec("olmoe-1b-7b", 16, 8, 64),
            _spec("minimax-m2", 62, 8, 256),
            _spec("llama-4-scout", 48, 1, 16),
        )
    }
)


def preset(name: str) -> RouteSpec:
    """The spec of a known model, by preset name (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise SpecMismatch(
            "unknown model preset",
            expected=f"one of {', '.join(sorted(PRESETS))}",
            found=name,
        )
    return PRESETS[key]
