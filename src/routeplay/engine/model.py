"""The reference engine's model: a tiny transformers MoE built from a config, never downloaded.

Invariant: the weights depend on ``EngineConfig.seed`` (and the geometry) only, never on the
precision. The model is always initialized in float32 under a private RNG stream and then
cast, so ``build_model(c, dtype="bfloat16")`` is exactly ``build_model(c, dtype="float32")``
rounded to bf16: the engine (bf16) and the trainer (float32) start from the same network,
and they still pick different experts for some tokens, as real engines and trainers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from routeplay.engine.wide_experts import use_wide_experts
from routeplay.errors import MisuseError

__all__ = ["DTYPES", "EngineConfig", "build_model", "torch_dtype"]

DTYPES: Final[dict[str, torch.dtype]] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""Precisions a model can be built in, by name."""

_HEAD_DIM: Final = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Geometry, seed and precision of the reference engine's model."""

    model_type: str = "qwen3_moe"
    """transformers model type; a family covered by ``routeplay.train.routers``."""
    hidden_size: int = 64
    """Width of the residual stream (attention uses heads of 16 dims)."""
    num_layers: int = 2
    """Decoder layers, all of them MoE for ``qwen3_moe``."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts chosen per token and layer."""
    vocab_size: int = 128
    """Token ids are ``0 .. vocab_size - 1``."""
    seed: int = 0
    """Seed of the weight initialization: same seed, same weights, in any precision."""
    dtype: str = "bfloat16"
    """Precision the engine runs in (a key of ``DTYPES``)."""
    max_positions: int = 2048
    """Longest prompt + completion the model accepts."""
    expert_init_scale: float = 1.0
    """Factor on every routed expert's weights after the random init (1.0: transformers'
    init). A freshly initialized MoE layer adds about 1% to the residual stream, so a
    flipped route barely moves the output; scaling the experts up makes each layer's
    choice of experts matter, as it does in a trained model."""
    lm_head_init_scale: float = 1.0
    """Factor on the LM head after the random init (1.0: transformers' init). A fresh head
    gives near-uniform next-token distributions whose log-probs hardly react to the hidden
    state; a larger head makes them as peaked and as sensitive as a trained model's, so a
    routing difference shows up in the log-probs (the gap replay is meant to close)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_experts", "top_k", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MisuseError(
                    f"EngineConfig.{name} must be a positive int", expected=">= 1", found=value
                )
        if self.top_k > self.num_experts:
            raise MisuseError(
                "EngineConfig.top_k cannot exceed num_experts",
                expected=f"top_k <= {self.num_experts}",
                found=self.top_k,
            )
        if self.max_positions < 2:
            raise MisuseError(
                "EngineConfig.max_positions is too small", expected=">= 2", found=self.max_positions
            )
        for name in ("expert_init_scale", "lm_head_init_scale"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise MisuseError(
                    f"EngineConfig.{name} must be a positive number", expected="> 0", found=value
                )
        torch_dtype(self.dtype)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``, ``"float32"``, ...)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise MisuseError(
            "unknown precision", expected=f"one of {sorted(DTYPES)}", found=name
        ) from None


def build_model(config: EngineConfig, *, dtype: str | None = None) -> PreTrainedModel:
    """A randomly initialized causal LM of ``config``, in eval mode, in ``dtype or config.dtype``.

    Initialized in float32 under ``torch.manual_seed(config.seed)`` on a forked RNG (the
    caller's global RNG state is left untouched), scaled by ``expert_init_scale`` and
    ``lm_head_init_scale``, then cast. In bf16 or fp16, its routed experts accumulate in
    float32, as an engine's MoE kernel does (``routeplay.engine.wide_experts``).
    """
    target = torch_dtype(dtype or config.dtype)
    hf_config = AutoConfig.for_model(config.model_type, **_hf_fields(config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        built = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model = cast(PreTrainedModel, built)
    _scale_init(model, config)
    torch.nn.Module.to(model, target)
    torch.nn.Module.train(model, False)  # eval mode
    if target in (torch.bfloat16, torch.float16):
        use_wide_experts(model)  # as an engine's MoE kernel: float32 accumulation, 2x faster
    return model


def _scale_init(model: PreTrainedModel, config: EngineConfig) -> None:
    """Scale the routed experts and the LM head in place (float32, before the cast)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name and config.expert_init_scale != 1.0:
                param.mul_(config.expert_init_scale)
            elif name == "lm_head.weight" and config.lm_head_init_scale != 1.0:
                param.mul_(config.lm_head_init_scale)


def _hf_fields(config: EngineConfig) -> dict[str, Any]:
    # Several spellings of the same field: each family's config reads its own and keeps the
    # rest as inert attributes, so one table serves Qwen-MoE, Mixtral, OLMoE and the like.
    heads = max(1, config.hidden_size // _HEAD_DIM)
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": 2 * config.hidden_size,
        "moe_intermediate_size": max(8, config.hidden_size // 2),
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": _HEAD_DIM,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_positions,
        "num_experts": config.num_experts,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "attn_implementation": "sdpa",
    }
