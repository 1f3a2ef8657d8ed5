"""verl 0.9.1's FSDP engine on CPU for tests: its ``forward_step`` and
``forward_backward_batch`` need only a few attributes of an engine built without FSDP, a
padding-free batch as verl's trainer makes it, and its device helpers answering "cpu"."""

from __future__ import annotations

import types
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
import torch
from tiny_moe import qwen3_moe
from verl.utils import seqlen_balancing
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp import transformer_impl as fsdp_impl

from routeplay.integrations.verl import ROUTING_KEY


def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's device helpers answer "cpu" (they assert CUDA otherwise)."""
    monkeypatch.setattr(fsdp_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(fsdp_impl, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(seqlen_balancing, "get_device_name", lambda: "cpu")


def checkpointed_model() -> Any:
    """The tiny MoE in training mode with gradient checkpointing (recompute in backward)."""
    model = qwen3_moe()
    model.gradient_checkpointing_enable()
    model.train()
    return model


def engine(cls: type, model: Any) -> Any:
    """An engine of ``cls`` around ``model`` (unwrapped: one rank, no FSDP)."""
    out = object.__new__(cls)
    out.module = model
    out.pad_to_length = None
    out.use_ulysses_sp = False
    out.ulysses_sequence_parallel_size = 1
    out.ulysses_device_mesh = None
    out.scaler = None
    out.engine_config = types.SimpleNamespace(
        use_torch_compile=False,
        entropy_checkpointing=False,
        use_no_sync_for_gradient_accumulation=False,
    )
    out._gradient_sync_context = lambda **_: nullcontext()  # no FSDP wrapper here
    return out


def batch(tokens: list[int], handles: list[Any] | None, *, max_tokens: int = 12) -> Any:
    """A padding-free batch of samples ``tokens`` long (verl's ``TensorDict``), with the
    handle column when ``handles`` is given."""
    ids = [torch.randint(3, 64, (t,), generator=torch.Generator().manual_seed(t)) for t in tokens]
    tensors = {
        "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
        "position_ids": torch.nested.as_nested_tensor(
            [torch.arange(t) for t in tokens], layout=torch.jagged
        ),
        "loss_mask": torch.nested.as_nested_tensor(
            [torch.ones(t) for t in tokens], layout=torch.jagged
        ),
        "temperature": torch.ones(len(tokens)),
        "uid": torch.arange(len(tokens)),
    }
    if handles is not None:
        tensors[ROUTING_KEY] = handles
    return tu.get_tensordict(
        tensors,
        non_tensor_dict={
            "use_remove_padding": True,
            "calculate_entropy": False,
            "use_dynamic_bsz": True,
            "max_token_len_per_gpu": max_tokens,
        },
    )


def loss(model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, dict]:
    """A loss over every log-prob verl's head returns."""
    return -model_output["log_probs"].values().sum(), {}


def grads(model: Any) -> list[Any]:
    """The parameters' gradients, then cleared."""
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def routes(spec: Any, tokens: list[int], seed: int) -> list[np.ndarray]:
    """Each sample's routed rows (``tokens - 1``, distinct ids per row)."""
    rng = np.random.default_rng(seed)
    keys = [rng.random((t - 1, spec.num_layers, spec.num_experts)) for t in tokens]
    return [np.argsort(k, axis=-1)[..., : spec.top_k].astype(spec.dtype) for k in keys]


def expected_rows(spec: Any, rows: list[np.ndarray], samples: list[int]) -> np.ndarray:
    """What the model sees for ``samples`` back to back: each one's rows, then a
    padding row (distinct ids) for its last token."""
    pad = (np.arange(spec.top_k) % spec.num_experts).astype(spec.dtype)
    return np.concatenate(
        [np.concatenate([rows[s], np.broadcast_to(pad, (1, *rows[s].shape[1:]))]) for s in samples]
    )
