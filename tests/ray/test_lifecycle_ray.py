"""The rollout lifecycle on real Ray: a rollout worker actor (one-write puts), the trace
store actor, partial resumes, multi-turn exports, stale retries, a training step that
raises, a checkpoint round trip; at the end no lease is left and the object store is
back to its baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import used_bytes, wait_until

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.errors import RoutesLost
from routeplay.rollout import (
    ADAPTERS,
    BufferConfig,
    Origin,
    RolloutState,
    Status,
    TraceStoreActor,
    TrainingBatch,
    load_buffer,
    save_buffer,
)
from routeplay.rollout.adapters import ProducerWriter
from routeplay.rollout.fake_engines import FakeSglang
from routeplay.store import Lease, RoutesProducer, RouteStore, StoreConfig, producer_actor
from routeplay.store.shard.api import ShardApi, shard_call
from routeplay.store.shard.shard import shard_of

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=48, top_k=8, num_experts=128)  # 384 B a row: real blocks


def truth(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = np.argsort(rng.random((256, SPEC.num_experts)), axis=1)[:, : SPEC.top_k]
    return table[rng.integers(0, 256, size=(rows, SPEC.num_layers))].astype(np.uint8)


class _RolloutWorker(RoutesProducer):
    def __init__(self, store: RouteStore) -> None:
        self.store = store

    def generate(
        self,
        full: np.ndarray,
        prompt: int,
        completion: int,
        version: int,
        history: Handle | None = None,
    ) -> Handle:
        start = history.rows if history is not None else 0
        body = FakeSglang(spec=SPEC).respond(
            full, prompt_tokens=prompt, completion_tokens=completion, start_row=start
        )
        writer = ProducerWriter(producer=self, store=self.store)
        return ADAPTERS["sglang"].ingest(
            body, spec=SPEC, writer=writer, weight_version=version, history=history, start_row=start
        )


RolloutWorker = producer_actor(_RolloutWorker, num_cpus=0)


def _state(
    sid: str, group: str, tokens: int, prompt: int, version: int, **extra: Any
) -> RolloutState:
    response = tuple(range(100, 100 + tokens - prompt))
    state = RolloutState(sample_id=sid, group_id=group, prompt_ids=tuple(range(prompt)), **extra)
    return state.extend(response, (0.0,) * len(response), version).with_status(Status.COMPLETED)


def _attached(state: RolloutState, handle: Handle, lease: Lease, origin: Origin) -> RolloutState:
    """``state`` holding ``handle`` under ``lease`` (its routing's ``attach`` step)."""
    return state.with_sample_routing(state.routing.attach(handle, lease, origin))


def test_a_full_lifecycle_leaves_nothing_behind(tmp_path: Path) -> None:
    baseline = used_bytes()
    store = StoreConfig(run="run-lifecycle", block_rows=700, timeout_s=30).build()
    worker, trace = RolloutWorker.remote(store), TraceStoreActor.remote(store)
    turn1, sample_b = truth(1600, seed=1), truth(2200, seed=2)

    # multi-turn session, turn 1: stored once, leased by the trace session and the sample
    h1 = ray.get(worker.generate.remote(turn1, 1000, 601, 0))
    tokens1 = list(range(1601))
    ray.get(trace.insert.remote("s1", tokens1, h1))
    a = _state("a", "g1", 1601, 1000, 0, session_id="s1")
    a = _attached(a, h1, store.acquire(h1, "rollout/a"), Origin.PRODUCED)

    # partial rollout: interrupted, resumed from a start row; the input's lease released
    first = ray.get(worker.generate.remote(sample_b, 1200, 300, 0))
    first_lease = store.acquire(first, "rollout/b-partial")
    resumed = ray.get(worker.generate.remote(sample_b, 1200, 1000, 1, first))
    b_lease = store.acquire(resumed, "rollout/b")
    b = _attached(_state("b", "g1", 2200, 1200, 1), resumed, b_lease, Origin.PRODUCED)
    first_lease.release()
    np.testing.assert_array_equal(store.read(resumed), sample_b[:2199])

    # turn 2 borrows turn 1's rows from the trace (its own lease), appends the new ones
    turn2 = np.concatenate([turn1[:1600], truth(400, seed=3)])
    exported = ray.get(trace.export.remote("s1", [*tokens1, *range(5000, 5400)], "rollout/c"))
    c_handle = ray.get(worker.generate.remote(turn2, 1700, 301, 2, exported.handle))
    c = _state("c", "g2", 2001, 1700, 2, session_id="s1")
    c = _attached(c, c_handle, store.acquire(c_handle, "rollout/c"), Origin.BORROWED)
    exported.lease.release()
    np.testing.assert_array_equal(store.read(c_handle), turn2[:2000])

    # the buffer takes over; g1 goes stale and is retried (only the buffer's leases end)
    # (c joins after the refresh: its prompt rows were routed at version 0, so at
    # version 3 it is 3 versions stale as well, although its response is from version 2)
    assert c.staleness(3) == 3
    assert c.oldest_version() == 0
    buffer = BufferConfig(max_staleness=1).build(store)
    buffer.add("g1", [a, b])
    retried, _ = buffer.refresh(current_version=3)
    assert sorted(retried) == ["a", "b"]
    buffer.add("g2", [c])
    again = ray.get(trace.export.remote("s1", tokens1, "rollout/a-retry"))
    np.testing.assert_array_equal(store.read(again.handle), turn1[:1600])  # borrowed data lives
    again.lease.release()

    # a checkpoint round trip, then a training step that raises
    save_buffer(buffer, tmp_path, SPEC)
    buffer.close()
    restored = load_buffer(tmp_path, store, BufferConfig(max_staleness=5))

    def failing_step() -> None:
        release = lambda session: ray.get(trace.release_session.remote(session))  # noqa: E731
        with TrainingBatch(
            1, restored.sample(1, current_version=3), release_session=release
        ) as batch:
            np.testing.assert_array_equal(store.read(batch.states[0].routing.handle), turn2[:2000])  # type: ignore[arg-type]
            raise RuntimeError("optimizer step failed")

    with pytest.raises(RuntimeError, match="optimizer"):
        failing_step()
    restored.close()
    ray.get(trace.release_all.remote())

    assert store.leaks() == []
    assert store.stats().live_payloads == 0
    assert wait_until(lambda: used_bytes() <= baseline), (used_bytes(), baseline)
    store.shutdown()


def _on_shard(store: RouteStore, shard: int, sid: str, group: str, seed: int) -> RolloutState:
    """A completed sample whose routing the store put on ``shard``."""
    while True:
        handle = store.put(canonicalize(truth(300, seed), SPEC))
        [source] = handle.sources()
        if shard_of(source.payload_id) == shard:  # type: ignore[union-attr]
            break
        store.acquire(handle, "probe").release()  # the other shard's: dropped again
    state = _state(sid, group, 301, 200, 0)
    return _attached(state, handle, store.acquire(handle, f"rollout/{sid}"), Origin.PRODUCED)


def _holders_on(store: RouteStore, shard: int) -> dict[str, int]:
    [stats] = store.backend.call([shard_call(shard, ShardApi.stats)], "stats")
    return dict(stats.leases_by_holder)


def test_b_a_dead_shard_loses_no_lease_of_the_live_one() -> None:
    """One of two shards is killed: the buffer's close releases every lease on the live
    shard, keeps the dead shard's samples as release-failed, and a training batch that
    cannot clone on the dead shard moves nothing."""
    store = StoreConfig(run="run-dead-shard", shards=2, timeout_s=30).build()
    buffer = BufferConfig().build(store)
    buffer.add("g1", [_on_shard(store, 0, "a", "g1", 1), _on_shard(store, 1, "b", "g1", 2)])
    buffer.add("g2", [_on_shard(store, 0, "c", "g2", 3), _on_shard(store, 1, "d", "g2", 4)])
    assert _holders_on(store, 0) == _holders_on(store, 1) == {"buffer/g1": 1, "buffer/g2": 1}
    doomed = ray.get_actor("routeplay.store.run-dead-shard.1", namespace="routeplay")
    ray.kill(doomed)
    assert wait_until(lambda: _dead(store, 1))

    [g1] = buffer.sample(1, current_version=0)
    with pytest.raises(RoutesLost):
        TrainingBatch(1, [g1])  # b's clone fails on the dead shard: a's is rolled back
    assert _holders_on(store, 0) == {"buffer/g1": 1, "buffer/g2": 1}  # nothing moved

    with pytest.raises(RoutesLost) as failed:
        buffer.close()  # g2: c released, d's release fails
    assert "run-dead-shard" in str(failed.value)
    assert _holders_on(store, 0) == {"buffer/g1": 1}  # only a: the caller holds g1
    assert [s.sample_id for s in buffer.release_failed()] == ["d"]
    assert buffer.stats().release_failed == 1
    for state in g1.states:  # the caller ends g1 as the buffer would have
        after, _ = state.try_release()
        assert after.routing.stuck == (state.sample_id == "b")
    assert _holders_on(store, 0) == {}
    store.shutdown()


def _dead(store: RouteStore, shard: int) -> bool:
    try:
        _holders_on(store, shard)
    except RoutesLost:
        return True
    return False
