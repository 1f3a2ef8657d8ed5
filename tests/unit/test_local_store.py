"""The in-process backend runs the same shard and engine-store classes as Ray does; the
client behaves the same on both (puts, leases, reads, engine keys, accounting)."""

from __future__ import annotations

import numpy as np
import pytest

from routeplay.core import EngineKey, Routes, RouteSpec, canonicalize
from routeplay.errors import AlreadyConsumed, RoutesLost, RunMismatch
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.backend import LocalBackend

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


@pytest.fixture
def store() -> RouteStore:
    return RouteStore.local(StoreConfig(run="local-a", shards=2, block_rows=64))


def test_put_lease_read_release(store: RouteStore) -> None:
    routes = routing(100_000, seed=1)  # several blocks
    handle = store.put(routes, weight_version=3)
    assert store.stats().unleased_payloads == 1
    with store.acquire(handle, "buffer/g1") as lease:
        np.testing.assert_array_equal(lease.read(70_000, 90_000), routes.array[70_000:90_000])
        assert store.stats().leases_by_holder == (("buffer/g1", 1),)
    assert store.stats().live_payloads == 0
    assert store.leaks() == []
    with pytest.raises(RoutesLost):
        store.read(handle)


def test_engine_keys_are_adopted_lazily_and_consumed_once(store: RouteStore) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    full = routing(50, seed=2).array.astype(np.uint16)
    key = backend.engine_store().put(full)
    handle = store.adopt_key(EngineKey(key=key, rows=50), SPEC)
    with pytest.raises(AlreadyConsumed):
        store.adopt_key(EngineKey(key=key, rows=50), SPEC)
    with store.acquire(handle, "buffer/k"):
        np.testing.assert_array_equal(store.read(handle), full.astype(np.uint8))


def test_unread_keys_of_a_dropped_sample_are_freed(store: RouteStore) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    key = backend.engine_store().put(routing(10, seed=3).array)
    handle = EngineKey(key=key, rows=10)
    from routeplay.core import Handle, Segment

    dropped = Handle.of(Segment(source=handle, start=0, stop=10, spec=SPEC))
    assert store.free_engine_keys(dropped) == 1
    assert store.free_engine_keys(dropped) == 0
    assert backend.engine_store().stats().freed == 1


def test_runs_are_isolated(store: RouteStore) -> None:
    other = RouteStore.local(StoreConfig(run="local-b"))
    handle = store.put(routing(5, seed=4))
    with pytest.raises(RunMismatch):
        other.acquire(handle, "intruder")
    with pytest.raises(RunMismatch):
        other.read(handle)
