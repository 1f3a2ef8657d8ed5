"""Routed experts of a bf16 (or fp16) model computed the way a GPU engine's MoE kernel
computes them: inputs and weights in the model's precision, products accumulated in
float32, the first projection's output rounded to the model's precision before the
gate, the expert outputs weighted and summed in float32 and rounded once.

Why: a CPU without native bf16 (no AVX512-BF16 or AMX, as here) runs torch's bf16
matmul on a reference kernel; on the experts' small matrices (a few dozen tokens each)
that is about 15x slower than float32, and it was most of the reference engine's time
(the default demo recipe's 640-token prefill: 0.97 s, 0.49 s with these experts; the
demo's rollouts 54 s -> 32 s over its three steps). The numbers stay a reduced-precision
engine's: the routers, attention and every other layer still run in bf16, and against
a float32 trainer about as many routes differ (12% on that prefill, either way).

It goes through transformers' own experts interface (``ExpertsInterface``, the hook
for custom expert kernels): registered once under ``WIDE_EXPERTS``, it runs
transformers' ``grouped_mm_experts_forward`` on float32 views of the expert weights.
A family whose experts do not take an implementation keeps its own.

Example:
    >>> model = build_model(EngineConfig(), dtype="bfloat16")  # calls use_wide_experts
    >>> model.config._experts_implementation
    'routeplay_wide'
"""

from __future__ import annotations

import threading
from typing import Any, Final, cast

import torch
from transformers import PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

__all__ = ["WIDE_EXPERTS", "use_wide_experts"]

WIDE_EXPERTS: Final = "routeplay_wide"
"""The name of the implementation in transformers' ``ExpertsInterface``."""

_WEIGHTS: Final = ("gate_up_proj", "up_proj", "down_proj")
"""The expert weight tensors (their layouts differ by family; transformers reads them)."""

_registered = threading.Lock()


def use_wide_experts(model: PreTrainedModel) -> bool:
    """Have ``model``'s routed experts accumulate in float32 (see the module); returns
    whether they do (False: a family without an experts interface, left as it is)."""
    with _registered:
        if WIDE_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(WIDE_EXPERTS, _wide_experts_forward)
    try:
        model.set_experts_implementation(WIDE_EXPERTS)
    except (ValueError, AttributeError):  # the family's experts are plain modules
        return False
    return True


def _wide_experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    out: torch.Tensor = grouped_mm_experts_forward(
        _Float32Experts(experts), hidden_states.float(), top_k_index, top_k_weights.float()
    )
    return out.to(hidden_states.dtype)


class _Float32Experts:
    """``experts`` as transformers' forward reads it, with float32 copies of the weights
    (taken per call: autograd reaches the real parameters, and loaded weights count at
    once) and a gate that sees the first projection rounded to the model's precision."""

    def __init__(self, experts: torch.nn.Module) -> None:
        self._experts = experts
        self._dtype = next(experts.parameters()).dtype
        for name in _WEIGHTS:
            weight = getattr(experts, name, None)
            if isinstance(weight, torch.Tensor):
                setattr(self, name, weight.float())

    def __getattr__(self, name: str) -> Any:  # everything not overridden: the module's
        return getattr(self._experts, name)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate: Any = self._experts._apply_gate  # set by transformers' experts decorator
        return cast(torch.Tensor, gate(gate_up.to(self._dtype))).float()
