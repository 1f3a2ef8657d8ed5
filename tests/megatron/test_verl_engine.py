"""verl 0.9.1's Megatron engine reads each micro-batch's routes from routeplay's store.

The driver puts a handle column in verl's ``DataProto`` (``routing_column``); verl turns
the batch into a ``TensorDict`` (``get_tensordict``: a ``NonTensorStack``) and splits it
into dynamic micro-batches with its own ``prepare_micro_batches``. An engine class with
``StoreRoutedExperts`` before verl's ``MegatronEngineWithLMHead`` fills
``routed_experts`` in verl's own ``prepare_model_inputs``: each micro-batch gets exactly
its samples' rows, narrow, and verl's R3 path (``align_r3_router_replay_data``,
``build_r3_replay_mask``, ``set_router_replay_data``) hands every router of a CP2 x TP2
rank the same ids as when verl carried the routes itself (int64).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (make test)")
engine_impl = pytest.importorskip(
    "verl.workers.engine.megatron.transformer_impl",
    reason="verl's Megatron engine does not import (make test installs its dependencies)",
)
from verl.protocol import DataProto  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.megatron import router_replay_utils as rru  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl_rank import RecordingRouter, as_rank  # noqa: E402

from routeplay.core import Routes, RouteSpec  # noqa: E402
from routeplay.errors import HandleError, MisuseError  # noqa: E402
from routeplay.integrations.verl import (  # noqa: E402
    ROUTING_KEY,
    StoreRoutedExperts,
    handles_in,
    routing_column,
)
from routeplay.store import RouteStore, StoreConfig  # noqa: E402

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)
TOKENS = [9, 14, 5, 11, 7, 12, 6, 10]
RESPONSE = [4, 6, 2, 5, 3, 6, 2, 4]


class RouteplayEngine(StoreRoutedExperts, engine_impl.MegatronEngineWithLMHead):
    """verl's engine with its routes read from the store."""


@pytest.fixture
def rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's replay helpers as CP rank 1, TP rank 0 of CP2 x TP2 see them (one process)."""
    as_rank(rru, monkeypatch, tp=2, tp_rank=0, cp=2, cp_rank=1)


def _routes() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        np.argsort(rng.random((t - 1, SPEC.num_layers, SPEC.num_experts)), axis=-1)[
            ..., : SPEC.top_k
        ].astype(SPEC.dtype)
        for t in TOKENS
    ]


def _micro_batches(handles: list[Any]) -> list[Any]:
    """The driver's batch as verl's engine gets it: a DataProto column, a TensorDict,
    dynamic micro-batches of at most 24 tokens."""
    data = DataProto.from_dict(
        tensors={"uid": torch.arange(len(TOKENS))},
        non_tensors={ROUTING_KEY: routing_column(handles)},
    )
    uids = data.batch["uid"].tolist()
    batch = tu.get_tensordict(
        {
            "uid": data.batch["uid"],
            "input_ids": torch.nested.as_nested_tensor(
                [torch.arange(TOKENS[u]) for u in uids], layout=torch.jagged
            ),
            "loss_mask": torch.nested.as_nested_tensor(
                [torch.arange(TOKENS[u]) >= TOKENS[u] - RESPONSE[u] for u in uids],
                layout=torch.jagged,
            ),
            ROUTING_KEY: list(data.non_tensor_batch[ROUTING_KEY]),
        },
        non_tensor_dict={"use_dynamic_bsz": True, "max_token_len_per_gpu": 24},
    )
    micro_batches, _ = prepare_micro_batches(batch, same_micro_num_in_dp=False)
    return micro_batches


def _targets(routed: Any, micro_batch: Any) -> dict[int, tuple[Any, Any]]:
    """What verl's R3 path hands each of 4 layers' routers for this micro-batch."""
    input_ids = micro_batch["input_ids"]
    uids = micro_batch["uid"].tolist()
    response_mask = torch.zeros(len(uids), max(RESPONSE), dtype=torch.bool)
    for i, uid in enumerate(uids):
        response_mask[i, : RESPONSE[uid]] = True
    aligned = rru.align_r3_router_replay_data(routed, input_ids)
    mask = rru.build_r3_replay_mask(input_ids, response_mask)
    chunk = torch.nn.ModuleList([RecordingRouter(d + 1) for d in range(SPEC.num_layers)])
    config = types.SimpleNamespace(fp8=None, num_layers=SPEC.num_layers)
    rru.set_router_replay_data(aligned, None, config, 0, replay_mask=mask, model=chunk)
    return {r.layer_number: (r.router_replay.ids, r.router_replay.mask) for r in chunk}


@pytest.mark.usefixtures("rank")
def test_each_micro_batch_reads_its_own_rows_and_verls_r3_replays_them() -> None:
    routes = _routes()
    store = RouteStore.local(StoreConfig(run="verl-engine"))
    batch = [store.put_leased(Routes(array=r, spec=SPEC), "verl/step") for r in routes]
    engine = object.__new__(RouteplayEngine)  # prepare_model_inputs needs no engine state
    engine.routeplay_store = store
    micro_batches = _micro_batches([handle for handle, _ in batch])
    assert len(micro_batches) > 1  # verl split the step by tokens
    seen = []
    for micro_batch in micro_batches:
        inputs = engine.prepare_model_inputs(micro_batch)
        routed = inputs["routed_experts"]
        uids = micro_batch["uid"].tolist()
        seen += uids
        assert routed.dtype == torch.uint8  # 1 byte an id: verl's path carries int16
        for part, uid in zip(routed.unbind(), uids, strict=True):
            np.testing.assert_array_equal(part.numpy(), routes[uid])
        carried = torch.nested.as_nested_tensor(
            [torch.from_numpy(routes[u].astype(np.int64)) for u in uids], layout=torch.jagged
        )
        got, want = _targets(routed, micro_batch), _targets(carried, micro_batch)
        for layer, (ids, mask) in want.items():
            assert torch.equal(got[layer][1], mask)
            assert torch.equal(got[layer][0][mask.bool()], ids[mask.bool()])
    assert sorted(seen) == list(range(len(TOKENS)))
    for _, lease in batch:
        lease.release()
    assert store.leaks() == []


def test_a_batch_without_handles_is_left_to_verl_and_a_bad_column_is_refused() -> None:
    engine = object.__new__(RouteplayEngine)
    plain = tu.get_tensordict(
        {"input_ids": torch.zeros(2, 3), "loss_mask": torch.ones(2, 3)},
        non_tensor_dict={},
    )
    assert engine.prepare_model_inputs(plain)["routed_experts"] is None
    assert handles_in(plain) is None
    bad = DataProto.from_dict(
        tensors={"uid": torch.arange(2)}, non_tensors={ROUTING_KEY: ["a", "b"]}
    )
    with pytest.raises(HandleError, match="something else than routeplay handles"):
        handles_in(bad)
    store = RouteStore.local(StoreConfig(run="verl-engine-2"))
    handle = store.put(Routes(array=_routes()[0], spec=SPEC))
    carrying = tu.get_tensordict(
        {"input_ids": torch.zeros(1, 3), "loss_mask": torch.ones(1, 3), ROUTING_KEY: [handle]}
    )
    with pytest.raises(MisuseError, match="no store"):
        engine.prepare_model_inputs(carrying)
