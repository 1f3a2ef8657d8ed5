"""verl's pieces across Ray processes: an asyncio rollout worker actor (a coroutine per
sample) writes each sample through ``TOKEN_OUTPUT`` (verl's own ``TokenOutput``) and its
``ProducerWriter``, the driver puts the handles in
verl's ``DataProto`` and ships each DP chunk to a trainer actor, which reads its
micro-batch's routes from the store (``routed_experts``: the store pickled into it, no
lease of its own, the driver's batch holding them). Every rank gets exactly its samples'
rows; after the step no lease and no payload is left.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import ray

torch = pytest.importorskip("torch")
replica = pytest.importorskip("verl.workers.rollout.replica", reason="verl is not installed")
protocol = pytest.importorskip("verl.protocol")

from routeplay.core import Handle, RouteSpec  # noqa: E402
from routeplay.integrations.verl import (  # noqa: E402
    ROUTING_KEY,
    TOKEN_OUTPUT,
    VerlTurn,
    handles_in,
    routed_experts,
    routing_column,
)
from routeplay.rollout import ProducerWriter, SampleRouting  # noqa: E402
from routeplay.rollout.routing_groups import discard_all, take_over_all  # noqa: E402
from routeplay.store import (  # noqa: E402
    AsyncRoutesProducer,
    RouteStore,
    StoreConfig,
    producer_actor,
)

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.long]

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=16)
PROMPT, RESPONSE, SAMPLES = 12, 7, 8


def _rows(sample: int) -> np.ndarray:
    keys = np.random.default_rng(sample).random((PROMPT + RESPONSE - 1, 3, 16))
    return np.argsort(keys, axis=-1)[..., :2].astype(np.int16)


class _Rollout(AsyncRoutesProducer):
    """A rollout worker: an asyncio actor with a coroutine per sample, each generation as
    verl's server returns it; writes go through the worker (owned by the store)."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self.writer = ProducerWriter(producer=self, store=store)

    async def generate(self, samples: list[int]) -> list[SampleRouting]:
        return list(await asyncio.gather(*(self._one(s) for s in samples)))

    async def _one(self, sample: int) -> SampleRouting:
        output = replica.TokenOutput(token_ids=list(range(RESPONSE)), routed_experts=_rows(sample))
        routing = SampleRouting(sample_id=f"s{sample}")
        with await routing.acontinuation() as cont:
            handle = await cont.aingest(
                TOKEN_OUTPUT,
                VerlTurn(list(range(PROMPT)), output),
                spec=SPEC,
                writer=self.writer,
                weight_version=1,
            )
            return await cont.afinish(self.store, handle)


Rollout: Any = producer_actor(_Rollout, num_cpus=0)


@ray.remote(num_cpus=0)
class Trainer:
    """A trainer rank: its DP chunk's micro-batch routes, read from the store."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store

    def read(self, chunk: Any) -> list[tuple[int, np.ndarray]]:
        handles = handles_in(chunk)
        assert handles is not None
        parts = routed_experts(self.store, handles, holder="verl/rank").unbind()
        return list(zip(chunk.batch["uid"].tolist(), [p.numpy() for p in parts], strict=True))


def test_a_verl_step_reads_each_ranks_rows_across_processes() -> None:
    store = StoreConfig(run="verl-ray", timeout_s=30).build()
    rollout, trainers = Rollout.remote(store), [Trainer.remote(store) for _ in range(2)]
    routings: list[SampleRouting] = ray.get(
        rollout.generate.remote(list(range(SAMPLES))), timeout=60
    )
    # The driver's batch takes the samples' leases over (one call per shard); the
    # workers' copies hold none.
    batch = take_over_all(routings, "train/step-1", store)
    handles: list[Handle] = [r.handle for r in batch if r.handle is not None]
    data = protocol.DataProto.from_dict(
        tensors={"uid": torch.arange(SAMPLES)},
        non_tensors={ROUTING_KEY: routing_column(handles)},
    )
    try:
        reads = ray.get(
            [t.read.remote(c) for t, c in zip(trainers, data.chunk(2), strict=True)], timeout=60
        )
        got = dict(pair for rank in reads for pair in rank)
        assert sorted(got) == list(range(SAMPLES))
        for uid, rows in got.items():
            np.testing.assert_array_equal(rows, _rows(uid).astype(SPEC.dtype))
    finally:
        assert all(error is None for _, error in discard_all(batch))
    assert store.leaks() == []


def test_samples_from_separate_calls_are_taken_over_in_one_call_per_shard() -> None:
    """A driver gets its samples from many calls (workers, agent loops): each unpickles
    its own copy of the store client. Their leases still move together."""
    store = StoreConfig(run="verl-ray-takeover", timeout_s=30).build()
    rollout = Rollout.remote(store)
    routings = [ray.get(rollout.generate.remote([i]), timeout=60)[0] for i in range(SAMPLES)]
    assert len({id(r.lease._store) for r in routings if r.lease}) == SAMPLES  # 8 clients
    before = dict(store.stats().calls_by_op)
    batch = take_over_all(routings, "train/step-1", store)
    calls = {op: n - before.get(op, 0) for op, n in store.stats().calls_by_op}
    assert sum(calls.values()) == 1, calls  # one transfer_many (one shard), not 8 + 8
    assert all(error is None for _, error in discard_all(batch))
    assert store.leaks() == []
