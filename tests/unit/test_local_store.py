"""The in-process backend runs the same shard and engine-store classes as Ray does; the
client behaves the same on both (puts, leases, reads, engine keys, accounting)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from routeplay.core import EngineKey, Handle, Routes, RouteSpec, Segment, canonicalize
from routeplay.errors import (
    AlreadyConsumed,
    MalformedPayload,
    MisuseError,
    RoutesLost,
    RowCountMismatch,
    RunMismatch,
    StoreTimeout,
)
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend
from routeplay.store.shard.shard import shard_of

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
    lease = store.acquire(handle, "owner")
    with pytest.raises(RunMismatch):  # refused before the lease is marked released
        other.release_many([lease])
    assert not lease.released
    lease.release()
    assert store.leaks() == []


def _on_two_shards(store: RouteStore) -> tuple[Any, Any]:
    """Two payloads that landed on different shards."""
    first = store.put(routing(3, seed=10))
    for seed in range(11, 60):
        other = store.put(routing(3, seed=seed))
        if shard_of(other.segments[0].source.payload_id) != shard_of(  # type: ignore[union-attr]
            first.segments[0].source.payload_id  # type: ignore[union-attr]
        ):
            return first, other
    raise AssertionError("hash never picked the second shard")


def test_a_half_failed_multi_shard_acquire_leaves_no_lease(store: RouteStore) -> None:
    alive, doomed = _on_two_shards(store)
    store.acquire(doomed, "gone").release()  # doomed's payload is dropped
    unleased = store.stats().unleased_payloads
    with pytest.raises(RoutesLost):
        store.acquire(alive + doomed, "train/step-1")
    assert store.leaks() == []  # the shard that granted its part was rolled back
    assert store.stats().unleased_payloads == unleased  # alive is unleased again, TTL applies
    with store.acquire(alive, "train/step-2"):
        np.testing.assert_array_equal(store.read(alive), routing(3, seed=10).array)


def test_a_failed_release_can_be_retried(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = store.acquire(store.put(routing(4, seed=5)), "buffer/retry")
    real_release = store.release_lease
    calls = {"n": 0}

    def flaky(parts: dict[int, str]) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise StoreTimeout("release timed out")
        real_release(parts)

    monkeypatch.setattr(store, "release_lease", flaky)
    with pytest.raises(StoreTimeout):
        lease.release()
    assert not lease.released
    lease.release()
    assert lease.released
    assert store.leaks() == []


def test_an_engine_key_handle_reads_in_slices_within_one_call(store: RouteStore) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    full = routing(40, seed=6).array
    key = backend.engine_store().put(full.astype(np.uint16))
    handle = Handle.of(Segment(source=EngineKey(key=key, rows=40), start=0, stop=40, spec=SPEC))
    first, second = store.read_many([(handle, 0, 20), (handle, 20, 40)])
    np.testing.assert_array_equal(np.concatenate([first, second]), full)
    with pytest.raises(AlreadyConsumed):  # single-use across calls: adopt_key to share
        store.read(handle)


def test_a_key_whose_payload_disagrees_with_its_row_count_is_refused_and_freed(
    store: RouteStore,
) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    key = backend.engine_store().put(routing(12, seed=7).array)
    with pytest.raises(RowCountMismatch, match="12 rows"):
        store.adopt_key(EngineKey(key=key, rows=10), SPEC)
    assert backend.engine_store().stats().freed == 1  # set aside, not leaked


@pytest.mark.parametrize(
    "kwargs", [{"shards": 0}, {"ttl_s": 0}, {"ttl_s": -1.0}, {"block_rows": -1}, {"timeout_s": 0}]
)
def test_invalid_store_configs_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(MisuseError):
        StoreConfig(run="bad", **kwargs)


def test_a_lazy_key_claiming_more_rows_than_its_payload_is_refused_before_allocating(
    store: RouteStore,
) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    key = backend.engine_store().put(routing(12, seed=8).array.astype(np.uint16))
    claimed = 10**12  # the response's counts say so; the output would need 7 TB
    handle = Handle.of(
        Segment(source=EngineKey(key=key, rows=claimed), start=0, stop=claimed, spec=SPEC)
    )
    with pytest.raises(RowCountMismatch, match="12 rows"):
        store.read(handle)


def test_a_lazy_key_whose_payload_is_not_an_array_is_a_typed_refusal(store: RouteStore) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    key = backend.engine_store().put({"not": "routing"})
    handle = Handle.of(Segment(source=EngineKey(key=key, rows=3), start=0, stop=3, spec=SPEC))
    with pytest.raises(MalformedPayload, match="not an array"):
        store.read(handle)


def test_adopting_a_key_whose_payload_is_not_an_array_is_a_typed_refusal(
    store: RouteStore,
) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    key = backend.engine_store().put("not routing")
    with pytest.raises(MalformedPayload, match="not an array"):
        store.read(store.adopt_key(EngineKey(key=key, rows=3), SPEC))
