"""The engine-side store as LMDeploy uses it, and lazy key resolution through the route
store. ``FakeLMDeployEngine`` does exactly what LMDeploy's engine does: look the actor
up by name and namespace, ``put`` the uint16 array, return the key."""

from __future__ import annotations

import numpy as np
import pytest
import ray
from store_probe import wait_until

from routeplay.bench.transfer_paths import FakeLMDeployEngine, make_routing
from routeplay.core import EngineKey, Handle, InlineSource, RouteSpec, Segment, preset
from routeplay.core.formats import lmdeploy
from routeplay.errors import AlreadyConsumed, DuplicateExperts, RoutesExpired
from routeplay.store import RouteStore, StoreConfig, start_engine_store

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = preset("glm-4.5-air")  # 46 decoder layers, the first dense: LMDeploy sends all 46
ROWS = 300


@pytest.fixture(scope="module")
def engine_store() -> object:
    return start_engine_store(ttl_s=30)


@pytest.fixture(scope="module")
def store() -> RouteStore:
    return StoreConfig(run="run-engine", timeout_s=20).build()


@pytest.fixture(scope="module")
def engine(engine_store: object) -> object:
    return FakeLMDeployEngine.remote(SPEC)


def _expected(seed: int) -> np.ndarray:
    raw = make_routing(SPEC, ROWS, all_layers=True, seed=seed)
    return raw[:, list(SPEC.moe_layer_indices()), :].astype(SPEC.dtype)


def test_lmdeploy_engine_finds_our_store_and_gets_are_destructive(
    engine_store: object, engine: object
) -> None:
    key = ray.get(engine.generate_lmdeploy.remote(ROWS, seed=1))  # type: ignore[attr-defined]
    assert lmdeploy.is_key(key)
    assert ray.get_actor("shared_store", namespace="lmdeploy")._actor_id == engine_store._actor_id  # type: ignore[attr-defined]
    peeked = ray.get(engine_store.peek.remote(key))  # type: ignore[attr-defined]
    data = ray.get(engine_store.get.remote(key))  # type: ignore[attr-defined]
    np.testing.assert_array_equal(data, peeked)
    assert data.dtype == np.uint16
    assert data.shape == (ROWS, SPEC.decoder_layers, SPEC.top_k)
    with pytest.raises(KeyError) as info:  # what LMDeploy clients catch
        ray.get(engine_store.get.remote(key))  # type: ignore[attr-defined]
    assert isinstance(info.value, AlreadyConsumed)
    assert "consumed" in str(info.value)


def test_free_clear_get_ref_and_stats(engine_store: object, engine: object) -> None:
    before = ray.get(engine_store.stats.remote())  # type: ignore[attr-defined]
    keys = [ray.get(engine.generate_lmdeploy.remote(ROWS, seed=s)) for s in range(3)]  # type: ignore[attr-defined]
    assert ray.get(engine_store.free.remote(keys[0])) is True  # type: ignore[attr-defined]
    assert ray.get(engine_store.free.remote(keys[0])) is False  # type: ignore[attr-defined]
    [ref] = ray.get(engine_store.get_ref.remote(keys[1]))  # type: ignore[attr-defined]
    np.testing.assert_array_equal(ray.get(ref), make_routing(SPEC, ROWS, all_layers=True, seed=1))
    ray.get(engine_store.clear.remote())  # type: ignore[attr-defined]
    after = ray.get(engine_store.stats.remote())  # type: ignore[attr-defined]
    assert after.live_keys == 0
    assert after.puts - before.puts == 3
    assert after.freed - before.freed == 2  # one free, one cleared
    assert after.consumed - before.consumed == 1


def test_unconsumed_keys_expire() -> None:
    short = start_engine_store(name="shared_store_ttl", namespace="lmdeploy", ttl_s=0.3)
    key = ray.get(short.put.remote(np.zeros((4, 2, 2), np.uint16)))  # type: ignore[attr-defined]
    np.testing.assert_array_equal(ray.get(short.peek.remote(key)), 0)  # type: ignore[attr-defined]
    assert wait_until(lambda: ray.get(short.stats.remote()).expired == 1)  # type: ignore[attr-defined]
    with pytest.raises(RoutesExpired, match="expired"):
        ray.get(short.get.remote(key))  # type: ignore[attr-defined]
    ray.kill(short)


def test_sglang_namespace_gets_its_own_store() -> None:
    sglang_store = start_engine_store(namespace="sglang")
    key = ray.get(sglang_store.put.remote(np.arange(8, dtype=np.int32)))  # type: ignore[attr-defined]
    assert ray.get_actor("shared_store", namespace="sglang")._actor_id == sglang_store._actor_id  # type: ignore[attr-defined]
    np.testing.assert_array_equal(ray.get(sglang_store.get.remote(key)), np.arange(8))  # type: ignore[attr-defined]
    ray.kill(sglang_store)


def test_adopted_keys_are_consumed_once_and_read_canonical(
    store: RouteStore, engine: object
) -> None:
    key = ray.get(engine.generate_lmdeploy.remote(ROWS, seed=5))  # type: ignore[attr-defined]
    handle = store.adopt_key(EngineKey(key=key, rows=ROWS), SPEC, weight_version=4)
    with pytest.raises(AlreadyConsumed):
        store.adopt_key(EngineKey(key=key, rows=ROWS), SPEC)
    with store.acquire(handle, "buffer/g1") as lease:
        rows = lease.read(100, 250)
    np.testing.assert_array_equal(rows, _expected(5)[100:250])
    assert rows.dtype == np.uint8  # canonical: dense layer dropped, narrowed on read


def test_bad_rows_behind_a_key_are_refused_by_the_adoption(store: RouteStore) -> None:
    """Refused on the rollout side, where the sample can be set aside: no handle to read."""
    engine_store = ray.get_actor("shared_store", namespace="lmdeploy")
    bad = make_routing(SPEC, ROWS, all_layers=True, seed=6)
    bad[7, 3] = 0  # a zero-padded row in MoE layer 2 (decoder layer 3)
    key = ray.get(engine_store.put.remote(bad))
    with pytest.raises(DuplicateExperts, match="row 7, layer 2"):
        store.adopt_key(EngineKey(key=key, rows=ROWS), SPEC)
    assert key not in ray.get(engine_store.keys.remote())  # consumed, its payload dropped


def test_trainer_can_consume_a_key_directly_once(engine: object) -> None:
    key = ray.get(engine.generate_one_write.remote(ROWS, seed=7))  # type: ignore[attr-defined]
    segment = Segment(source=EngineKey(key=key, rows=ROWS), start=0, stop=ROWS, spec=SPEC)
    reader = StoreConfig(run="run-direct", timeout_s=20).build()
    np.testing.assert_array_equal(reader.read(Handle.of(segment)), _expected(7))
    with pytest.raises(AlreadyConsumed):
        reader.read(Handle.of(segment))
    reader.shutdown()


def test_inline_segments_read_without_the_store(store: RouteStore) -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=4)
    array = np.array([[[0, 1], [2, 3]], [[3, 2], [1, 0]]], np.uint8)
    handle = Handle.of(Segment(source=InlineSource(array=array), start=0, stop=2, spec=spec))
    np.testing.assert_array_equal(store.read(handle, 1, 2), array[1:])


def test_a_dropped_sample_frees_its_unread_key(engine: object) -> None:
    engine_store = ray.get_actor("shared_store", namespace="lmdeploy")
    key = ray.get(engine.generate_lmdeploy.remote(ROWS, seed=8))  # type: ignore[attr-defined]
    before = ray.get(engine_store.stats.remote())
    handle = Handle.of(Segment(source=EngineKey(key=key, rows=ROWS), start=0, stop=ROWS, spec=SPEC))
    dropper = StoreConfig(run="run-drop", timeout_s=20).build()
    assert dropper.free_engine_keys(handle) == 1
    assert dropper.free_engine_keys(handle) == 0  # idempotent
    after = ray.get(engine_store.stats.remote())
    assert after.freed - before.freed == 1
    with pytest.raises(AlreadyConsumed, match="freed"):
        ray.get(engine_store.get.remote(key))
    dropper.shutdown()
