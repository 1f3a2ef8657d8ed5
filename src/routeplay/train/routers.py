"""Per-family router rules for transformers MoE models (v5 modeling code).

A ``RouterFamily`` says which module to hook (matched by class name, so no transformers
import is needed and FSDP2's ``FSDP<Class>`` subclasses still match), which method of it,
how that method's output is laid out, and the family's own weighting rule: the function
that turns the live logits and the replayed expert ids into the weights the experts get.

Every rule below was read off the installed transformers source (5.24) and is pinned by a
test that replays each router's own choice and gets its native weights back. A family is
listed only once a tiny random model of it passes the replay tests; routers with the same
source in other families are named in ``docs/replay.md`` as candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch

from routeplay.train.replay_core import (
    dense_sigmoid_scores,
    sigmoid_topk_weights,
    softmax_topk_weights,
    topk_softmax_weights,
)

__all__ = [
    "FAMILIES",
    "Layout",
    "RouterFamily",
    "WeightFn",
    "family_of",
]

WeightFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(hooked module, logits ``[tokens, E]``, ids int64 ``[tokens, K]``) -> weights."""


class Layout(Protocol):
    """Where a hooked method's output keeps its logits, weights and ids."""

    @property
    def name(self) -> str:
        """A one-line picture of the output, for docs."""
        ...

    def source(self, out: Any, args: Sequence[Any]) -> torch.Tensor:
        """The tensor the weights are computed from (logits, or probabilities)."""
        ...

    def chosen(self, module: torch.nn.Module, out: Any, args: Sequence[Any]) -> torch.Tensor:
        """The expert ids the module chose itself ``[tokens, K]`` (for recording)."""
        ...

    def replace(self, out: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        """``out`` with the replayed weights (cast like the native ones) and ids."""
        ...


@dataclass(frozen=True, slots=True)
class _Triple:
    """``router.forward -> (logits, weights [T, K], ids [T, K], *extra)``: the v5 norm."""

    name: str = "(logits, weights, ids)"

    def source(self, out: Any, args: Sequence[Any]) -> torch.Tensor:
        return out[0]  # type: ignore[no-any-return]

    def chosen(self, module: torch.nn.Module, out: Any, args: Sequence[Any]) -> torch.Tensor:
        return out[2]  # type: ignore[no-any-return]

    def replace(self, out: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        return (out[0], weights.to(out[1].dtype), ids, *out[3:])


@dataclass(frozen=True, slots=True)
class _DenseScores:
    """Llama-4: ``router.forward -> (scores [T, E], logits)``; unchosen experts score 0."""

    name: str = "(scores [T, E], logits)"

    def source(self, out: Any, args: Sequence[Any]) -> torch.Tensor:
        return out[1]  # type: ignore[no-any-return]

    def chosen(self, module: torch.nn.Module, out: Any, args: Sequence[Any]) -> torch.Tensor:
        # Chosen experts score sigmoid(logit) > 0, the rest exactly 0; sigmoid is monotonic,
        # so natively this is the router's own top-k order, and under replay the given set.
        return torch.topk(out[0], int(_attr(module, "top_k")), dim=1).indices

    def replace(self, out: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        return (weights.to(out[0].dtype), out[1])


@dataclass(frozen=True, slots=True)
class _RouteMethod:
    """``block.route_tokens_to_experts(logits) -> (weights, ids)`` (DBRX)."""

    name: str = "route_tokens_to_experts(logits) -> (weights, ids)"

    def source(self, out: Any, args: Sequence[Any]) -> torch.Tensor:
        return args[0]  # type: ignore[no-any-return]

    def chosen(self, module: torch.nn.Module, out: Any, args: Sequence[Any]) -> torch.Tensor:
        return out[1]  # type: ignore[no-any-return]

    def replace(self, out: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        return (weights.to(out[0].dtype), ids)


TRIPLE: Final[Layout] = _Triple()
DENSE_SCORES: Final[Layout] = _DenseScores()
ROUTE_METHOD: Final[Layout] = _RouteMethod()


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterFamily:
    """How to replay one transformers MoE family's router."""

    name: str
    """transformers model type(s), e.g. ``"qwen3_moe"``."""
    classes: tuple[str, ...]
    """Class names of the hooked module (a subclass whose MRO names one matches too)."""
    rule: str
    """The weighting rule, in one line (for docs and errors)."""
    weights: WeightFn
    """The rule itself: (module, logits, ids) -> weights."""
    hook: str
    """Where the hook sits in the model, e.g. ``"mlp.gate -> Qwen3MoeTopKRouter.forward"``."""
    method: str = "forward"
    """The method replaced on the module instance."""
    layout: Layout = TRIPLE
    """How that method's output is laid out."""


# --------------------------------------------------------------------------- rules


def _attr(module: torch.nn.Module, name: str) -> Any:
    # Plain attributes copied from the config: nn.Module's __getattr__ types hide them.
    return getattr(module, name)


def _float(module: torch.nn.Module, name: str) -> float:
    return float(_attr(module, name))


def _flag(module: torch.nn.Module, name: str) -> bool:
    return bool(_attr(module, name))


def _softmax_renorm_if_configured(
    m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    return softmax_topk_weights(x, ids, renormalize=_flag(m, "norm_topk_prob"))


def _softmax_renorm(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return softmax_topk_weights(x, ids, renormalize=True)


def _softmax_plain(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return softmax_topk_weights(x, ids)


def _ernie(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return softmax_topk_weights(x, ids, renormalize=True, min_sum=_float(m, "norm_min"))


def _deepseek_v2(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return softmax_topk_weights(x, ids, scale=_float(m, "routed_scaling_factor"))


def _mistral4(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return softmax_topk_weights(
        x,
        ids,
        renormalize=_flag(m, "norm_topk_prob"),
        eps=1e-20,
        scale=_float(m, "routed_scaling_factor"),
        dtype=None,
    )


def _gemma4(m: torch.nn.Module, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # Gemma-4's router hands out probabilities, not logits; a learned per-expert scale follows.
    scale: torch.Tensor = _attr(m, "per_expert_scale")
    picked = probs.gather(-1, ids)
    return picked / picked.sum(dim=-1, keepdim=True) * scale[ids]


def _dbrx(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(x, dim=1, dtype=x.dtype).gather(-1, ids)
    p: float | None = _attr(m, "moe_normalize_expert_weights")
    if p is None:
        return weights
    norm: torch.Tensor = torch.norm(weights, p=p, dim=-1, keepdim=True)
    return weights / norm


def _topk_softmax(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return topk_softmax_weights(x, ids)


def _cohere2(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if _attr(m, "expert_selection_fn") == "softmax":
        return topk_softmax_weights(x, ids, dtype=torch.float32)
    scores = torch.sigmoid(x.gather(-1, ids))
    return scores / scores.sum(dim=-1, keepdim=True) if _flag(m, "norm_topk_prob") else scores


def _deepseek_v3(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return sigmoid_topk_weights(
        x,
        ids,
        renormalize=_flag(m, "norm_topk_prob"),
        eps=1e-20,
        scale=_float(m, "routed_scaling_factor"),
    )


def _sigmoid_renorm_upcast(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return sigmoid_topk_weights(x, ids, renormalize=True, upcast=True)


def _sigmoid_renorm(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return sigmoid_topk_weights(x, ids, renormalize=True)


def _afmoe(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return sigmoid_topk_weights(x, ids, renormalize=True, eps=1e-20, scale=_float(m, "route_scale"))


def _hy_v3(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    scale = _float(m, "router_scaling_factor")
    return sigmoid_topk_weights(x, ids, renormalize=True, eps=1e-20, scale=scale)


def _lfm2(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    scale = _float(m, "routed_scaling_factor")
    return sigmoid_topk_weights(
        x, ids, renormalize=_flag(m, "norm_topk_prob"), eps=1e-6, scale=scale
    )


def _llama4(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return dense_sigmoid_scores(x, ids)


# --------------------------------------------------------------------------- families

_SOFTMAX = "softmax over E (fp32), probabilities at the ids"
_SIGMOID = "sigmoid of the logits at the ids (selection bias ignored)"

FAMILIES: Final[tuple[RouterFamily, ...]] = (
    RouterFamily(
        name="qwen2_moe, qwen3_moe, qwen3_next, olmoe, flex_olmo",
        classes=(
            "Qwen2MoeTopKRouter",
            "Qwen3MoeTopKRouter",
            "Qwen3NextTopKRouter",
            "OlmoeTopKRouter",
            "FlexOlmoTopKRouter",
        ),
        rule=f"{_SOFTMAX}; renormalized if norm_topk_prob; cast to the logits' dtype",
        weights=_softmax_renorm_if_configured,
        hook="mlp.gate -> <X>TopKRouter.forward",
    ),
    RouterFamily(
        name="qwen3_vl_moe, qwen3_5_moe (text)",
        classes=("Qwen3VLMoeTextTopKRouter", "Qwen3_5MoeTopKRouter"),
        rule=f"{_SOFTMAX}; always renormalized; cast to the logits' dtype",
        weights=_softmax_renorm,
        hook="mlp.gate -> <X>TopKRouter.forward",
    ),
    RouterFamily(
        name="mixtral, minimax",
        classes=("MixtralTopKRouter", "MiniMaxTopKRouter"),
        rule=f"{_SOFTMAX}; always renormalized; weights stay fp32",
        weights=_softmax_renorm,
        hook="mlp.gate -> <X>TopKRouter.forward",
    ),
    RouterFamily(
        name="hunyuan_v1_moe",
        classes=("HunYuanMoEV1Gate",),
        rule=f"{_SOFTMAX}; always renormalized; cast to the logits' dtype",
        weights=_softmax_renorm,
        hook="mlp.gate -> HunYuanMoEV1Gate.forward",
    ),
    RouterFamily(
        name="jamba",
        classes=("JambaTopKRouter",),
        rule=f"{_SOFTMAX}; never renormalized",
        weights=_softmax_plain,
        hook="feed_forward.router -> JambaTopKRouter.forward",
    ),
    RouterFamily(
        name="ernie4_5_moe",
        classes=("Ernie4_5_MoeTopKRouter",),
        rule=f"{_SOFTMAX} (moe_statics bias only selects); / max(sum, moe_norm_min)",
        weights=_ernie,
        hook="mlp.gate -> Ernie4_5_MoeTopKRouter.forward",
    ),
    RouterFamily(
        name="deepseek_v2",
        classes=("DeepseekV2TopkRouter",),
        rule=f"{_SOFTMAX}; no renormalization; x routed_scaling_factor",
        weights=_deepseek_v2,
        hook="mlp.gate -> DeepseekV2TopkRouter.forward",
    ),
    RouterFamily(
        name="mistral4",
        classes=("Mistral4TopkRouter",),
        rule=(
            "softmax over E in the logits' dtype, probabilities at the ids; renormalized "
            "(+1e-20) if norm_topk_prob; x routed_scaling_factor"
        ),
        weights=_mistral4,
        hook="mlp.gate -> Mistral4TopkRouter.forward",
    ),
    RouterFamily(
        name="gemma4 (text)",
        classes=("Gemma4TextRouter",),
        rule="router's own softmax probabilities at the ids, renormalized, x per_expert_scale",
        weights=_gemma4,
        hook="router -> Gemma4TextRouter.forward (a decoder-layer child)",
    ),
    RouterFamily(
        name="dbrx",
        classes=("DbrxFFN",),
        rule=(
            "softmax over E in the logits' dtype, probabilities at the ids; divided by their "
            "p-norm (p = moe_normalize_expert_weights)"
        ),
        weights=_dbrx,
        hook="ffn -> DbrxFFN.route_tokens_to_experts",
        method="route_tokens_to_experts",
        layout=ROUTE_METHOD,
    ),
    RouterFamily(
        name="gpt_oss",
        classes=("GptOssTopKRouter",),
        rule="softmax over the K logits at the ids (router bias included in the logits)",
        weights=_topk_softmax,
        hook="mlp.router -> GptOssTopKRouter.forward",
    ),
    RouterFamily(
        name="granitemoe, granitemoeshared",
        classes=("GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter"),
        rule="softmax over the K fp32 logits at the ids; cast to the hidden dtype",
        weights=_topk_softmax,
        hook="block_sparse_moe.router -> <X>TopKRouter.forward",
    ),
    RouterFamily(
        name="cohere2_moe",
        classes=("Cohere2MoeTopKRouter",),
        rule=(
            "expert_selection_fn 'softmax': softmax over the K logits at the ids; 'sigmoid': "
            "sigmoid of them, renormalized if norm_topk_prob"
        ),
        weights=_cohere2,
        hook="mlp.gate -> Cohere2MoeTopKRouter.forward",
    ),
    RouterFamily(
        name="deepseek_v3, glm4_moe, glm4_moe_lite, dots1, solar_open, exaone_moe, mimo_v2_flash",
        classes=(
            "DeepseekV3TopkRouter",
            "Glm4MoeTopkRouter",
            "Glm4MoeLiteTopkRouter",
            "Dots1TopkRouter",
            "SolarOpenTopkRouter",
            "ExaoneMoeTopkRouter",
            "MiMoV2FlashTopkRouter",
        ),
        rule=(
            f"{_SIGMOID}; renormalized (+1e-20) if norm_topk_prob; x routed_scaling_factor "
            "(group-limited selection only selects)"
        ),
        weights=_deepseek_v3,
        hook="mlp.gate -> <X>TopkRouter.forward",
    ),
    RouterFamily(
        name="minimax_m2",
        classes=("MiniMaxM2TopKRouter",),
        rule=f"{_SIGMOID}, in fp32; always renormalized",
        weights=_sigmoid_renorm_upcast,
        hook="mlp.gate -> MiniMaxM2TopKRouter.forward",
    ),
    RouterFamily(
        name="laguna",
        classes=("LagunaTopKRouter",),
        rule=f"{_SIGMOID} (after the optional tanh soft-cap); always renormalized",
        weights=_sigmoid_renorm,
        hook="mlp.gate -> LagunaTopKRouter.forward",
    ),
    RouterFamily(
        name="afmoe",
        classes=("AfmoeTokenChoiceRouter",),
        rule=f"{_SIGMOID}; renormalized (+1e-20); x route_scale",
        weights=_afmoe,
        hook="mlp.router -> AfmoeTokenChoiceRouter.forward",
    ),
    RouterFamily(
        name="hy_v3",
        classes=("HYV3TopKRouter",),
        rule=f"{_SIGMOID}; renormalized (+1e-20); x router_scaling_factor",
        weights=_hy_v3,
        hook="mlp.gate -> HYV3TopKRouter.forward",
    ),
    RouterFamily(
        name="lfm2_moe",
        classes=("Lfm2MoeTopKRouter",),
        rule=f"{_SIGMOID}; renormalized (+1e-6) if norm_topk_prob; x routed_scaling_factor",
        weights=_lfm2,
        hook="feed_forward.gate -> Lfm2MoeTopKRouter.forward",
    ),
    RouterFamily(
        name="llama4 (text)",
        classes=("Llama4Router",),
        rule="dense [T, E] scores: sigmoid of the logit at the ids, 0 elsewhere (top-1 by default)",
        weights=_llama4,
        hook="feed_forward.router -> Llama4Router.forward",
        layout=DENSE_SCORES,
    ),
)

_BY_CLASS: Final[dict[str, RouterFamily]] = {
    name: family for family in FAMILIES for name in family.classes
}


def family_of(module: torch.nn.Module) -> RouterFamily | None:
    """The family whose router (or block) ``module`` is, looking through its MRO."""
    for cls in type(module).__mro__:
        family = _BY_CLASS.get(cls.__name__)
        if family is not None:
            return family
    return None
