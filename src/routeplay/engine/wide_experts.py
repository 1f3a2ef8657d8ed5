"""Routed experts of a bf16 (or fp16) model computed the way a GPU engine's MoE kernel
computes them: inputs and weights in the model's precision, products accumulated in
float32, the first projection's output rounded to the model's precision before the
gate, the expert outputs weighted and summed in float32 and rounded once.

Why: a CPU without native bf16 (no AVX512-BF16 or AMX, as here) runs torch's bf16
matmul on a reference kernel; on the experts' small matrices (a few dozen tokens each)
that is about 15x slower than float32, and it was most of the reference engine's time
(``benchmarks/engine_experts.py``, the default demo recipe's model: a 640-token prefill
2.0x faster with these experts than with torch's bf16 ones, 1.42 s -> 0.70 s, 0.34 s all
in float32, on a busy day of this machine; a decode step 1.1x). The numbers
stay a reduced-precision engine's: the routers, attention and every other layer still
run in bf16, and against a float32 trainer about as many routes differ (12.1% and 11.9%
on that prefill).

It goes through transformers' own experts interface (``ExpertsInterface``, the hook
for custom expert kernels): registered once under ``WIDE_EXPERTS``, it runs
transformers' ``grouped_mm_experts_forward`` on float32 copies of the expert weights, or
for a decode step (no more (token, expert) pairs than experts) its
``batched_mm_experts_forward`` on float32 copies of only the chosen experts' weights.
A family whose experts do not take an implementation keeps its own. A bf16 trainer gets
them too (its experts then compute as the engine's do); autograd keeps each layer's
float32 copies until the backward: 3 MiB a layer at the demo's sizes, 72 MiB over its 24.

Example:
    >>> model = build_model(EngineConfig(), dtype="bfloat16")  # calls use_wide_experts
    >>> model.config._experts_implementation
    'routeplay_wide'
"""

from __future__ import annotations

from typing import Any, Final, cast

import torch
from transformers import PreTrainedModel
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
)

__all__ = ["WIDE_EXPERTS", "use_wide_experts"]

WIDE_EXPERTS: Final = "routeplay_wide"
"""The name of the implementation in transformers' ``ExpertsInterface``."""

_WEIGHTS: Final = ("gate_up_proj", "up_proj", "down_proj")
"""The expert weight tensors (their layouts differ by family; transformers reads them)."""


def use_wide_experts(model: PreTrainedModel) -> bool:
    """Have ``model``'s routed experts accumulate in float32 (see the module); returns
    whether they do (False: a family whose experts take no implementation, or a dense
    model, left as it is)."""
    model.set_experts_implementation(WIDE_EXPERTS)  # ignored where there are no experts
    return bool(model.config._experts_implementation == WIDE_EXPERTS)


def _wide_experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    # A decode step routes a token to K experts: widening every expert's weights would
    # cost more than its products (16 ms of a 48 ms step here), so it widens only the
    # weights of its (token, expert) pairs, one batched product each.
    experts_count: Any = experts.num_experts  # set by the family's experts class
    few = top_k_index.numel() <= int(experts_count)
    forward = batched_mm_experts_forward if few else grouped_mm_experts_forward
    out: torch.Tensor = forward(
        _Float32Experts(experts, only_selected=few),
        hidden_states.float(),
        top_k_index,
        top_k_weights.float(),
    )
    return out.to(hidden_states.dtype)


class _Float32Experts:
    """``experts`` as transformers' forward reads it, with its weights in float32 (widened
    per call: autograd reaches the real parameters, and loaded weights count at once;
    ``only_selected``: as indexed by the forward, so only the selected experts are) and
    a gate that sees the first projection rounded to the model's precision."""

    def __init__(self, experts: torch.nn.Module, *, only_selected: bool) -> None:
        self._experts = experts
        self._dtype = next(experts.parameters()).dtype
        for name in _WEIGHTS:
            weight = getattr(experts, name, None)
            if isinstance(weight, torch.Tensor):
                setattr(self, name, _WidenedOnIndex(weight) if only_selected else weight.float())

    def __getattr__(self, name: str) -> Any:  # everything not overridden: the module's
        return getattr(object.__getattribute__(self, "_experts"), name)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate: Any = self._experts._apply_gate  # set by transformers' experts decorator
        return cast(torch.Tensor, gate(gate_up.to(self._dtype))).float()


class _WidenedOnIndex:
    """A weight whose rows, once indexed, are float32 (what a batched forward reads)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._weight = weight

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return self._weight[index].float()


# Registered once, at import: a name-to-function entry in transformers' interface.
ALL_EXPERTS_FUNCTIONS.register(WIDE_EXPERTS, _wide_experts_forward)
