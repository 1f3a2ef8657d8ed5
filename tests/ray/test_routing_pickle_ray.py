"""A leased ``SampleRouting`` pickled as a rollout worker hands it to the driver
(``routeplay.rollout.routing_pickle``): it arrives with its lease over the same handle
object, its stuck leases kept, the rows still readable and every lease releasable."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from routeplay.core import RouteSpec, canonicalize
from routeplay.rollout import SampleRouting
from routeplay.store import RouteStore, StoreConfig

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


@pytest.fixture
def store() -> Iterator[RouteStore]:
    built = StoreConfig(run=f"pickle-{uuid.uuid4().hex[:6]}", timeout_s=30).build()
    yield built
    built.shutdown()


def _routes(rows: int) -> np.ndarray:
    keys = np.random.default_rng(rows).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


def test_a_leased_routing_arrives_with_its_lease_over_the_same_handle(store: RouteStore) -> None:
    handle = store.put(canonicalize(_routes(9), SPEC))
    lease = store.acquire(handle, "rollout/1", pin=False)
    other = store.acquire(handle, "rollout/stuck", pin=False)
    routing = SampleRouting(sample_id="1", handle=handle, lease=lease, unreleased=(other,))
    restored = pickle.loads(pickle.dumps(routing, protocol=5))
    assert restored == routing
    assert restored.lease is not None
    assert restored.lease.handle is restored.handle
    assert restored.lease.holder == "rollout/1"
    assert not restored.lease.released
    assert [u.holder for u in restored.unreleased] == ["rollout/stuck"]
    np.testing.assert_array_equal(restored.lease.read(), _routes(9))
    restored.lease.release()
    restored.unreleased[0].release()
    store.flush()
    assert store.stats().leases == 0


def test_a_lease_over_another_handle_keeps_that_handle(store: RouteStore) -> None:
    handle = store.put(canonicalize(_routes(9), SPEC))
    lease = store.acquire(handle, "rollout/2", pin=False)
    routing = SampleRouting(sample_id="2", handle=handle[0:4], lease=lease)
    restored = pickle.loads(pickle.dumps(routing))
    assert restored.handle == handle[0:4]
    assert restored.lease is not None
    assert restored.lease.handle == handle
    restored.lease.release()
    store.flush()
    assert store.stats().leases == 0


def test_a_lease_named_twice_in_one_payload_arrives_as_one_lease(store: RouteStore) -> None:
    """The pickler's memo keeps shared objects shared: releasing the lease through the
    sample is seen by every other name of it in the same payload."""
    handle = store.put(canonicalize(_routes(5), SPEC))
    lease = store.acquire(handle, "rollout/5", pin=False)
    first = SampleRouting(sample_id="5", handle=handle, lease=lease)
    twin = SampleRouting(sample_id="5b", handle=handle, lease=lease)
    a, b, leases = pickle.loads(pickle.dumps((first, twin, [lease]), protocol=5))
    assert a.lease is b.lease
    assert a.lease is leases[0]
    assert a.handle is b.handle
    assert a.lease.handle is a.handle
    a.lease.release()
    assert not b.holds_lease
    store.flush()
    assert store.stats().leases == 0
