"""Issue 12 on a local Ray instance: no silent loss (a producer that dies before the
hand-over, a dead engine store, a dead shard) and two runs sharing one engine store."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import kill_and_wait

from routeplay.core import EngineKey, Handle, Routes, RouteSpec, Segment, canonicalize
from routeplay.errors import LifetimeError, RoutesLost, RunMismatch
from routeplay.store import (
    RoutesProducer,
    RouteStore,
    StoreConfig,
    leave_engine_store,
    producer_actor,
    start_engine_store,
)
from routeplay.store.remote.producer import TAKE_GROUP

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


class _DyingProducer(RoutesProducer):
    """A rollout worker that dies while the store is taking its staged payload."""

    @ray.method(concurrency_group=TAKE_GROUP)
    def take_staged(self, token: str) -> Any:
        os._exit(1)


DyingProducer = producer_actor(_DyingProducer, num_cpus=0)


def test_a_producer_dead_before_the_hand_over_fails_the_put_naming_it() -> None:
    """At once, not at the deadline: the refusal is the producer's death as Ray reports
    it (``ActorDiedError``), where a wait that ran out would be a ``StoreTimeout`` (raised
    as it is by the client, or as the ``found`` of the shard's ``RoutesLost``)."""
    store = StoreConfig(run="dying-producer", timeout_s=20).build()
    try:
        producer = DyingProducer.remote()
        routes = routing(64, 1)
        token, blocks = ray.get(
            producer.stage_routes.remote(routes.array, block_rows=0), timeout=20
        )
        with pytest.raises(RoutesLost, match=f"staged payload {token}") as refused:
            store.put_staged(producer, token, blocks, routes)
        assert refused.value.found == "ActorDiedError"  # the death, not a deadline
        assert store.stats().live_payloads == 0  # no handle to bytes never written
    finally:
        store.shutdown()


def test_a_dead_engine_store_is_a_typed_lifetime_error() -> None:
    engine = start_engine_store(name="dying_store", namespace="lmdeploy")
    key = ray.get(engine.put.remote(routing(8, 2).array), timeout=20)
    kill_and_wait(engine)
    store = StoreConfig(run="dead-engine", timeout_s=20).build()
    try:
        lazy = EngineKey(key=key, rows=8, actor="dying_store")
        handle = Handle.of(Segment(source=lazy, start=0, stop=8, spec=SPEC))
        for attempt in (
            lambda: store.adopt_keys([lazy], SPEC),
            lambda: store.free_key(lazy),
            lambda: store.read(handle),
        ):
            with pytest.raises(LifetimeError, match="lmdeploy/dying_store"):
                attempt()
    finally:
        store.shutdown()


def test_stats_and_leaks_report_live_shards_and_name_the_dead_one() -> None:
    store = StoreConfig(run="dead-shard", shards=2, timeout_s=20).build()
    try:
        handle = store.put(routing(16, 3))
        store.acquire(handle, "buffer/g-1")
        kill_and_wait(ray.get_actor("routeplay.store.dead-shard.1", namespace="routeplay"))
        stats = store.stats()
        assert stats.shards == 1
        assert len(stats.dead_shards) == 1
        assert stats.dead_shards[0].startswith("shard 1 (")
        live_leases = store.leaks()
        assert all(leak.lease_id.startswith("dead-shard/0/") for leak in live_leases)
        assert len(live_leases) == stats.leases
    finally:
        ray.kill(ray.get_actor("routeplay.store.dead-shard.0", namespace="routeplay"))


def _adopt(store: RouteStore, engine: Any, seed: int) -> tuple[Handle, Routes]:
    routes = routing(32, seed)
    key = ray.get(engine.put.remote(routes.array), timeout=20)
    [handle] = store.adopt_keys([EngineKey(key=key, rows=32)], SPEC)
    return handle, routes


def test_two_runs_share_the_engine_store_and_cannot_touch_each_others_data() -> None:
    engine = start_engine_store(user="run-a")
    start_engine_store(user="run-b")  # the second run joins the same actor
    a = StoreConfig(run="run-a", shards=2, timeout_s=20).build()
    b = StoreConfig(run="run-b", timeout_s=20).build()
    handle_a, routes_a = _adopt(a, engine, 10)
    handle_b, _ = _adopt(b, engine, 11)
    lease_a = a.acquire(handle_a, "train/a-0")
    lease_b = b.acquire(handle_b, "train/b-0")
    pending = a.scoped(EngineKey(key=ray.get(engine.put.remote(routing(4, 12).array)), rows=4))
    # Run b tries everything on run a's data: each attempt is a typed refusal.
    for attempt in (
        lambda: b.read(handle_a),
        lambda: b.acquire(handle_a, "train/b-1"),
        lambda: b.adopt_keys([pending], SPEC),
        lambda: b.free_key(pending),
        lambda: b.revoke([next(iter(lease_a.parts.values()))]),
    ):
        with pytest.raises(RunMismatch):
            attempt()
    assert ray.get(engine.keys.remote("run-b"), timeout=20) == []
    # Run b stops early: its teardown leaves the shared engine store to run a.
    lease_b.release()
    b.shutdown()
    assert leave_engine_store(engine, "run-b", end_if_last=True) is False
    np.testing.assert_array_equal(lease_a.read(0, 32), routes_a.array)
    with pytest.raises(RunMismatch):
        a.read(handle_b)
    [late] = a.adopt_keys([pending], SPEC)  # run a's unread key survived run b
    with a.acquire(late, "train/a-1"):
        np.testing.assert_array_equal(a.read(late), routing(4, 12).array)
    lease_a.release()
    assert a.stats().live_payloads == 0
    a.shutdown()
    assert leave_engine_store(engine, "run-a", end_if_last=True) is True  # the last user
