"""A tiny random transformers Qwen3-MoE (3 MoE layers, 8 experts, top-2), built locally
with a fixed seed: no download."""

from __future__ import annotations

from typing import Any

import pytest


def qwen3_moe() -> Any:
    """The model in float32 (training mode as built; callers choose)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).float()
