"""A verl agent loop's turns, as verl 0.9.1's rollout server returns them (its own
``TokenOutput``), written through routeplay: each turn keeps the rows of the turn that
sampled them.

verl's tool agent loop replaces its routes with each turn's ``routed_experts``
(``agent_data.routed_experts = output.routed_experts``, verl#6054): after two turns, the
first turn's response rows are the second turn's prefill routing, not what was sampled.
Through ``TOKEN_OUTPUT`` and the sample's ``SampleRouting`` steps, turn 2 stores only the
rows turn 1 lacked; the step's batch column and the trainer's read give turn 1's rows,
then turn 2's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
replica = pytest.importorskip("verl.workers.rollout.replica", reason="verl is not installed")
protocol = pytest.importorskip("verl.protocol")

from routeplay.core import RouteSpec  # noqa: E402
from routeplay.errors import ExpertOutOfRange, MalformedPayload, RowCountMismatch  # noqa: E402
from routeplay.integrations.verl import (  # noqa: E402
    ROUTING_KEY,
    TOKEN_OUTPUT,
    VerlTurn,
    handles_in,
    routed_experts,
    routing_column,
)
from routeplay.rollout import SampleRouting  # noqa: E402
from routeplay.rollout.routing_groups import discard_all, take_over_all  # noqa: E402
from routeplay.store import RouteStore, StoreConfig  # noqa: E402

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=16)


def _rows(count: int, seed: int) -> np.ndarray:
    keys = np.random.default_rng(seed).random((count, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.int16)  # verl's dtype


def _turn(
    store: RouteStore, routing: SampleRouting, prompt: list[int], output: Any, version: int
) -> SampleRouting:
    with routing.continuation() as cont:
        handle = cont.ingest(
            TOKEN_OUTPUT,
            VerlTurn(prompt, output),
            spec=SPEC,
            writer=store,
            weight_version=version,
        )
        return cont.finish(store, handle)


def test_each_turn_keeps_the_rows_it_sampled() -> None:
    store = RouteStore.local(StoreConfig(run="verl-rollout"))
    prompt = list(range(6))
    first = replica.TokenOutput(token_ids=[7, 8, 9, 10], routed_experts=_rows(9, seed=1))
    routing = _turn(store, SampleRouting(sample_id="s0"), prompt, first, version=1)
    assert routing.rows == 9
    # Turn 2: the tool's answer (3 tokens), then 5 generated tokens. The server's routes
    # cover the whole conversation, turn 1's rows re-routed by the new prefill.
    conversation = prompt + first.token_ids + [11, 12, 13]
    second_rows = _rows(len(conversation) + 5 - 1, seed=2)
    second = replica.TokenOutput(token_ids=[20, 21, 22, 23, 24], routed_experts=second_rows)
    routing = _turn(store, routing, conversation, second, version=2)
    want = np.concatenate([_rows(9, seed=1), second_rows[9:]]).astype(SPEC.dtype)
    assert routing.handle is not None
    np.testing.assert_array_equal(store.read(routing.handle), want)
    assert [s.weight_version for s in routing.handle.segments] == [1, 2]
    # verl's loop would carry the last turn's routes: turn 1's rows from the prefill.
    assert not np.array_equal(second_rows[:9], _rows(9, seed=1))

    # The driver's column and the trainer's read of it.
    data = protocol.DataProto.from_dict(
        tensors={"uid": torch.arange(1)},
        non_tensors={ROUTING_KEY: routing_column([routing.handle])},
    )
    [read] = routed_experts(store, handles_in(data)).unbind()
    np.testing.assert_array_equal(read.numpy(), want)
    routing.release()
    assert store.leaks() == []


@pytest.mark.parametrize(
    ("output", "error"),
    [
        (replica.TokenOutput(token_ids=[7, 8], routed_experts=None), MalformedPayload),
        (replica.TokenOutput(token_ids=[7, 8], routed_experts=_rows(4, seed=3)), RowCountMismatch),
        (
            replica.TokenOutput(token_ids=[7, 8], routed_experts=_rows(5, seed=3) + 16),
            ExpertOutOfRange,
        ),
    ],
    ids=["no-routes", "rows", "range"],
)
def test_a_bad_turn_is_refused_typed_and_writes_nothing(output: Any, error: type) -> None:
    store = RouteStore.local(StoreConfig(run="verl-rollout-bad"))
    routing = SampleRouting(sample_id="s1")
    with pytest.raises(error), routing.continuation() as cont:
        cont.ingest(
            TOKEN_OUTPUT, VerlTurn([1, 2, 3, 4], output), spec=SPEC, writer=store, weight_version=1
        )
    assert store.stats().live_bytes == 0
    assert store.leaks() == []


def _internal_output(routing: SampleRouting, prompt: int, response: int) -> Any:
    """What verl's ``_agent_loop_postprocess`` hands ``_postprocess`` for one sample:
    padded tensors, no ``routed_experts``, the sample's routing in ``extra_fields``."""
    agent_loop = pytest.importorskip("verl.experimental.agent_loop.agent_loop")
    width = prompt + response
    return agent_loop._InternalAgentLoopOutput(
        prompt_ids=torch.zeros(1, prompt, dtype=torch.long),
        response_ids=torch.zeros(1, response, dtype=torch.long),
        response_mask=torch.ones(1, response, dtype=torch.long),
        input_ids=torch.zeros(1, width, dtype=torch.long),
        position_ids=torch.arange(width)[None],
        attention_mask=torch.ones(1, width, dtype=torch.long),
        num_turns=2,
        metrics=agent_loop.AgentLoopMetrics(),
        extra_fields={ROUTING_KEY: routing},
    )


def test_verls_agent_loop_batch_carries_each_samples_routing_to_the_driver() -> None:
    """verl's own ``AgentLoopWorker._postprocess`` turns each output's ``extra_fields``
    into a ``non_tensor_batch`` column: the samples' routings (handle and lease) reach the
    driver, which takes their leases over (one call per shard) and puts the handles in
    the batch."""
    agent_loop = pytest.importorskip("verl.experimental.agent_loop.agent_loop")
    store = RouteStore.local(StoreConfig(run="verl-agent-loop"))
    routings, prompt = [], list(range(6))
    for sample in range(3):
        output = replica.TokenOutput(token_ids=[7, 8, 9], routed_experts=_rows(8, seed=sample))
        routings.append(_turn(store, SampleRouting(sample_id=f"s{sample}"), prompt, output, 1))
    worker = object.__new__(agent_loop.AgentLoopWorker)
    worker.reward_loop_worker_handles = None
    data = worker._postprocess([_internal_output(r, 6, 3) for r in routings])
    column = data.non_tensor_batch[ROUTING_KEY]
    assert [r.sample_id for r in column] == ["s0", "s1", "s2"]
    batch = take_over_all(list(column), "train/step-1", store)
    data.non_tensor_batch[ROUTING_KEY] = routing_column([r.handle for r in batch])
    for sample, part in enumerate(routed_experts(store, handles_in(data)).unbind()):
        np.testing.assert_array_equal(part.numpy(), _rows(8, seed=sample).astype(SPEC.dtype))
    assert all(error is None for _, error in discard_all(batch))
    assert store.leaks() == []
