"""A real Megatron-Core training step on CPU, shared by the recompute and verl tests: a
seeded attention-free ``GPTModel`` with MoE layers (``build``), one step through
``get_forward_backward_func()`` over several micro-batches (``train_step``), every
``routing_map`` each router produced (``Calls``), and the checks on them.

The layers are attention-free (``IdentityOp`` in place of self-attention): Megatron's
``DotProductAttention`` forks the CUDA RNG tracker even with dropout 0, which needs a GPU;
routing does not depend on attention.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from helpers import cpu_patches, cpu_schedule, random_routing, routing_ids
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

from routeplay.core import RouteSpec
from routeplay.integrations.megatron import MegatronReplay
from routeplay.train.replay_core import in_backward

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=8)
SEQ, BATCH, MICRO_BATCHES, VOCAB = 6, 2, 3, 32
TOKENS = SEQ * BATCH

# Megatron's config fields per mode, and how many router calls each step recomputes.
MODES: dict[str, tuple[dict[str, Any], int]] = {
    "none": ({}, 0),
    "full-uniform-1": (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        3,
    ),
    "full-uniform-3": (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3},
        3,
    ),
    "full-block-1": (  # only the first layer of the chunk is recomputed
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
        1,
    ),
    "selective-moe": ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, 3),
    # "moe_act" checkpoints only the experts' activation (Megatron's output-discarding
    # CheckpointWithoutOutput): routers are not re-run. It needs moe_grouped_gemm in the
    # config; grouped experts (TE, or the grouped_gemm CUDA kernels, bf16) cannot be built
    # on CPU, so the experts stay local and only the config is the user's. (0.16.1's
    # CheckpointWithoutOutput itself needs Transformer Engine: ``fp8 is not None`` is True
    # for its default ``fp8=False``, so it reads TE's FP8GlobalStateManager.)
    "selective-moe_act": (
        {
            "recompute_granularity": "selective",
            "recompute_modules": ["moe_act"],
            "moe_grouped_gemm": True,
        },
        0,
    ),
}


def build(
    mtp: bool = False,
    spec: RouteSpec = SPEC,
    pre_process: bool = True,
    post_process: bool = True,
    **overrides: Any,
) -> GPTModel:
    """The same weights for every mode (seeded), attention-free MoE layers."""
    config = TransformerConfig(
        **{
            "num_layers": spec.num_layers,
            "hidden_size": 16,
            "ffn_hidden_size": 32,
            "num_attention_heads": 2,
            "num_moe_experts": SPEC.num_experts,
            "moe_router_topk": SPEC.top_k,
            "moe_enable_routing_replay": True,
            "use_cpu_initialization": True,
            "moe_router_load_balancing_type": "none",
            "add_bias_linear": False,
            "moe_token_dispatcher_type": "allgather",
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            **({"mtp_num_layers": 1} if mtp else {}),
            **overrides,
        }
    )
    layer = get_gpt_layer_local_spec(num_experts=SPEC.num_experts, moe_grouped_gemm=False)
    layer.submodules.input_layernorm = IdentityOp  # nothing to normalize for: no attention
    # A spec (not the bare class): the MTP layer reads the attention's mask type from it.
    layer.submodules.self_attention = ModuleSpec(
        module=IdentityOp, params={"attn_mask_type": AttnMaskType.causal}
    )
    layer.submodules.self_attn_bda = IdentityFuncOp
    torch.manual_seed(0)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
        mtp_block_spec=get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False)
        if mtp
        else None,
    )


def step_routes(seed: int = 7) -> list[np.ndarray]:
    """Per micro-batch ``[BATCH * SEQ, L, K]`` rows, batch-major (as a materializer gives)."""
    return [random_routing(SPEC, TOKENS, seed + i) for i in range(MICRO_BATCHES)]


def router_order(routes: np.ndarray) -> np.ndarray:
    """Batch-major rows in Megatron's sequence-major token order, experts sorted."""
    rows = routes.reshape(BATCH, SEQ, *routes.shape[1:]).transpose(1, 0, 2, 3)
    return np.sort(rows.reshape(TOKENS, *routes.shape[1:]), axis=-1)


class Calls:
    """Every routing map each decoder router produced, tagged (micro-batch, layer, backward)."""

    def __init__(self, model: GPTModel) -> None:
        self.micro_batch = -1  # the latest forward's micro-batch (no-pipelining: 1F1B)
        self.maps: dict[tuple[int, int, bool], list[Any]] = {}
        for layer, transformer_layer in enumerate(model.decoder.layers):
            transformer_layer.mlp.router.register_forward_hook(self._keep(layer))

    def _keep(self, layer: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            key = (self.micro_batch, layer, in_backward())
            self.maps.setdefault(key, []).append(out[1].detach().clone())

        return hook


def train_step(
    model: GPTModel,
    session: MegatronReplay | None,
    routes: list[np.ndarray],
    calls: Calls | None = None,
) -> list[Any]:
    """One step through Megatron's own schedule; returns each micro-batch's loss."""
    tokens = iter(
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(i))
        for i in range(MICRO_BATCHES)
    )
    count = iter(range(MICRO_BATCHES))

    def forward_step(data: Iterator[Any], model: Any) -> tuple[Any, Any]:
        batch, i = next(data), next(count)
        if calls is not None:
            calls.micro_batch = i
        position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
        if session is None:
            output = model(batch, position_ids, None, labels=batch)
        else:
            with session.replay(routes[i]):
                output = model(batch, position_ids, None, labels=batch)

        def loss_func(losses: Any) -> tuple[Any, dict[str, Any]]:
            loss = losses.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    with cpu_schedule():
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=tokens,
            model=[model],
            num_microbatches=MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=False,
        )
    return [o["loss"] for o in out]


def grads(model: GPTModel) -> dict[str, Any]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_routing(calls: Calls, routes: list[np.ndarray], recomputed: int) -> None:
    for i, mb in enumerate(routes):
        want = router_order(mb)
        for layer in range(SPEC.num_layers):
            [forward] = calls.maps[i, layer, False]
            np.testing.assert_array_equal(routing_ids(forward), want[:, layer])
            again = calls.maps.get((i, layer, True), [])
            assert len(again) == (1 if layer < recomputed else 0)
            for routing_map in again:
                assert torch.equal(routing_map, forward)


def reference_step() -> tuple[list[Any], dict[str, Any]]:
    """Losses and gradients of the step without recompute, replayed on megatron-core's
    own ``RouterReplay`` (what every recompute mode, and verl's routers, must equal)."""
    with cpu_patches(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build()
        try:
            with MegatronReplay(model, SPEC) as session:
                losses = train_step(model, session, step_routes())
        finally:
            RouterReplay.clear_global_router_replay_instances()
    return losses, grads(model)
