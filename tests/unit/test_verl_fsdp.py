"""R3 for verl 0.9.1's FSDP engine, which has none: ``RouteplayHFReplay`` around verl's own
``FSDPEngineWithLMHead.forward_step`` (its ``prepare_model_inputs``, the padding-free
token stream, its log-prob head) on a tiny transformers MoE with gradient checkpointing.

The loss and every gradient equal those of the same forward and backward run inside
routeplay's own ``replay`` block over the expected rows (each sample's routes, then a
padding row for its last token), so the checkpointed recompute in the backward replayed
the same experts. Closing the block before the backward makes the recompute route
natively, which torch's checkpoint refuses: the comparison can fail. On CPU verl's device
helpers answer "cpu" (a fixture).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fsdp_impl = pytest.importorskip(
    "verl.workers.engine.fsdp.transformer_impl",
    reason="verl's FSDP engine does not import (make test installs its dependencies)",
)
from tiny_moe import qwen3_moe  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from routeplay.core import Routes  # noqa: E402
from routeplay.errors import MisuseError  # noqa: E402
from routeplay.integrations.verl import ROUTING_KEY  # noqa: E402
from routeplay.integrations.verl_fsdp import RouteplayHFReplay, VerlHFReplay  # noqa: E402
from routeplay.store import RouteStore, StoreConfig  # noqa: E402
from routeplay.train.hf import find_routers, replay  # noqa: E402

TOKENS = [5, 7, 4]


class Engine(RouteplayHFReplay, fsdp_impl.FSDPEngineWithLMHead):
    """verl's FSDP engine with routeplay's HF replay."""


@pytest.fixture(autouse=True)
def verl_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsdp_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(fsdp_impl, "get_device_name", lambda: "cpu")


def _model() -> Any:
    model = qwen3_moe()
    model.gradient_checkpointing_enable()
    model.train()
    return model


def _engine(cls: type, model: Any) -> Any:
    engine = object.__new__(cls)  # forward_step needs these attributes only
    engine.module = model
    engine.pad_to_length = None
    engine.use_ulysses_sp = False
    engine.ulysses_sequence_parallel_size = 1
    engine.ulysses_device_mesh = None
    engine.engine_config = types.SimpleNamespace(
        use_torch_compile=False, entropy_checkpointing=False
    )
    return engine


def _micro_batch(handles: list[Any] | None) -> Any:
    ids = [torch.randint(3, 64, (t,), generator=torch.Generator().manual_seed(t)) for t in TOKENS]
    tensors = {
        "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
        "position_ids": torch.nested.as_nested_tensor(
            [torch.arange(t) for t in TOKENS], layout=torch.jagged
        ),
        "temperature": torch.ones(len(TOKENS)),
    }
    if handles is not None:
        tensors[ROUTING_KEY] = handles
    return tu.get_tensordict(
        tensors, non_tensor_dict={"use_remove_padding": True, "calculate_entropy": False}
    )


def _loss(model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, dict]:
    return -model_output["log_probs"].values().sum(), {}


def _grads(model: Any) -> list[Any]:
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def _routes(spec: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    keys = [rng.random((t - 1, spec.num_layers, spec.num_experts)) for t in TOKENS]
    return [np.argsort(k, axis=-1)[..., : spec.top_k].astype(spec.dtype) for k in keys]


def test_verls_fsdp_step_replays_the_stores_rows_through_the_recompute() -> None:
    model = _model()
    spec = find_routers(model).spec
    routes = _routes(spec)
    store = RouteStore.local(StoreConfig(run="verl-fsdp"))
    batch = [store.put_leased(Routes(array=r, spec=spec), "verl/step") for r in routes]
    handles = [h for h, _ in batch]

    engine = _engine(Engine, model)
    engine.routeplay_replay = VerlHFReplay(store, model)
    loss, _ = engine.forward_step(_micro_batch(handles), _loss, forward_only=False)
    loss.backward()  # forward_backward_batch's backward: the block is still open
    engine.routeplay_replay.close()
    got = _grads(model)

    # The reference: verl's own forward_step inside routeplay's replay block, over the
    # expected rows (each sample's routes, then a padding row for its last token).
    pad = (np.arange(spec.top_k) % spec.num_experts).astype(spec.dtype)
    rows = np.concatenate(
        [np.concatenate([r, np.broadcast_to(pad, (1, *r.shape[1:]))]) for r in routes]
    )
    plain = _engine(fsdp_impl.FSDPEngineWithLMHead, model)
    with replay(model, rows):
        want_loss, _ = plain.forward_step(_micro_batch(None), _loss, forward_only=False)
        want_loss.backward()
    want = _grads(model)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    # Closed before the backward, the recompute routes natively: torch's checkpoint
    # finds a different forward (other experts ran) and refuses.
    with replay(model, rows):
        early_loss, _ = plain.forward_step(_micro_batch(None), _loss, forward_only=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        early_loss.backward()
    model.zero_grad(set_to_none=True)

    for _, lease in batch:
        lease.release()
    assert store.leaks() == []


def test_a_micro_batch_without_handles_runs_natively_and_ulysses_is_refused() -> None:
    model = _model()
    store = RouteStore.local(StoreConfig(run="verl-fsdp-2"))
    engine = _engine(Engine, model)
    engine.routeplay_replay = VerlHFReplay(store, model)
    with torch.no_grad():
        native, _ = _engine(fsdp_impl.FSDPEngineWithLMHead, model).forward_step(
            _micro_batch(None), _loss, forward_only=True
        )
        through, _ = engine.forward_step(_micro_batch(None), _loss, forward_only=True)
    torch.testing.assert_close(through, native, rtol=0, atol=0)
    engine.use_ulysses_sp = True
    with pytest.raises(MisuseError, match="Ulysses"):
        engine.forward_step(_micro_batch(None), _loss, forward_only=True)
