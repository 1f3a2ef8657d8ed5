"""A reduced-precision model's routed experts accumulate in float32 (``wide_experts``):
each checked against the computation written out by hand, token by token, and against
what it must keep (gradients to the bf16 parameters, weights loaded later, a family
without an experts interface left alone)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from routeplay.engine import EngineConfig, build_model  # noqa: E402
from routeplay.engine.wide_experts import WIDE_EXPERTS, use_wide_experts  # noqa: E402

CONFIG = EngineConfig(hidden_size=64, num_layers=2, num_experts=16, top_k=4, seed=3)
TOKENS = 48
"""A prefill's tokens (4 x 48 pairs for 16 experts: all experts widened); a decode step
has 1 (4 pairs: only its experts' weights widened)."""


def _experts_and_inputs(
    dtype: str, tokens: int = TOKENS
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    model = build_model(CONFIG, dtype=dtype)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, CONFIG.hidden_size, generator=gen).to(model.dtype)
    logits = torch.randn(tokens, CONFIG.num_experts, generator=gen)
    weights, index = torch.softmax(logits, dim=-1).topk(CONFIG.top_k, dim=-1)
    return experts, hidden, index, (weights / weights.sum(-1, keepdim=True)).to(model.dtype)


def _by_hand(
    experts: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Per token and chosen expert: bf16 inputs and weights multiplied in float32, the
    first projection rounded to bf16 for the gate (silu(gate) * up, in bf16), the second
    in float32, weighted and summed in float32, rounded once."""
    half = experts.gate_up_proj.dtype
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for token in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            expert = int(index[token, slot])
            gate_up = (hidden[token].float() @ experts.gate_up_proj[expert].float().T).to(half)
            gate, up = gate_up.chunk(2)
            inner = torch.nn.functional.silu(gate) * up
            down = inner.float() @ experts.down_proj[expert].float().T
            out[token] += weights[token, slot].float() * down
    return out.to(half)


@pytest.mark.parametrize("tokens", [TOKENS, 1])
def test_a_bf16_models_experts_are_the_float32_accumulation_written_out(tokens: int) -> None:
    experts, hidden, index, weights = _experts_and_inputs("bfloat16", tokens)
    assert experts.config._experts_implementation == WIDE_EXPERTS
    with torch.no_grad():
        got = experts(hidden, index, weights)
        expected = _by_hand(experts, hidden, index, weights)
        experts.config._experts_implementation = "grouped_mm"  # torch's own bf16 kernels
        native = experts(hidden, index, weights)
    assert got.dtype == torch.bfloat16
    # Summation order aside (a last-bit rounding of a few values), the same numbers.
    same = (got == expected).float().mean().item()
    assert same > 0.99, same
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    # And not torch's bf16 kernels, which round every product's output: fewer agree.
    assert (native == expected).float().mean().item() < same


def test_weights_loaded_later_count_at_the_next_call() -> None:
    experts, hidden, index, weights = _experts_and_inputs("bfloat16")
    with torch.no_grad():
        before = experts(hidden, index, weights)
        experts.down_proj.mul_(2)  # as load_state_dict copies new weights in place
        after = experts(hidden, index, weights)
        expected = _by_hand(experts, hidden, index, weights)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.float(), expected.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("tokens", [TOKENS, 1])
def test_gradients_reach_the_bf16_parameters(tokens: int) -> None:
    experts, hidden, index, weights = _experts_and_inputs("bfloat16", tokens)
    hidden.requires_grad_(True)
    experts(hidden, index, weights).float().square().sum().backward()
    for param in (experts.gate_up_proj, experts.down_proj):
        assert param.grad is not None
        assert param.grad.dtype == torch.bfloat16
        assert torch.isfinite(param.grad.float()).all()
        assert param.grad.abs().sum() > 0
    assert hidden.grad is not None
    assert hidden.grad.abs().sum() > 0


def test_float32_models_keep_transformers_default_and_fp16_and_mixtral_take_it_too() -> None:
    assert build_model(CONFIG, dtype="float32").config._experts_implementation != WIDE_EXPERTS
    experts, hidden, index, weights = _experts_and_inputs("float16")
    assert experts.config._experts_implementation == WIDE_EXPERTS
    with torch.no_grad():
        got, expected = experts(hidden, index, weights), _by_hand(experts, hidden, index, weights)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-10, atol=1e-6)
    mixtral = build_model(EngineConfig(model_type="mixtral", hidden_size=32, vocab_size=64))
    assert mixtral.config._experts_implementation == WIDE_EXPERTS
    experts = mixtral.model.layers[0].mlp.experts
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    index = torch.tensor([[0, 1]] * 5)
    weights = torch.full((5, 2), 0.5, dtype=torch.bfloat16)
    with torch.no_grad():
        got, expected = experts(hidden, index, weights), _by_hand(experts, hidden, index, weights)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)


def test_a_dense_model_is_left_as_it_is() -> None:
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
    )
    assert not use_wide_experts(dense)
    assert dense.config._experts_implementation != WIDE_EXPERTS
