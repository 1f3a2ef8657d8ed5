"""``TraceStoreClient`` on real Ray: typed calls to the trace-store actor, a deadline on
each, Ray's failures translated (a slow actor, a dead actor, an error raised inside it),
and the client travels to another process like a ``RouteStore``."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray

from routeplay.core import RouteSpec, canonicalize
from routeplay.errors import HandleError, MisuseError, RoutesLost, StoreTimeout
from routeplay.rollout import TraceStoreClient, TraceStoreConfig
from routeplay.store import RouteStore, StoreConfig

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def rows(n: int, seed: int = 0) -> np.ndarray:
    keys = np.random.default_rng(seed).random((n, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


@pytest.fixture(scope="module")
def store(ray_local: None) -> Iterator[RouteStore]:
    built = StoreConfig(run="trace-client", timeout_s=30).build()
    yield built
    built.shutdown()


@ray.remote(num_cpus=0)
def export_elsewhere(traces: TraceStoreClient, tokens: list[int]) -> int:
    exported = traces.export("s", tokens, "rollout/remote")
    assert exported is not None
    exported.lease.release()
    return exported.rows


def test_the_client_calls_the_actor_with_the_plain_classes_signatures(store: RouteStore) -> None:
    traces = TraceStoreConfig(timeout_s=30).build(store)
    try:
        tokens = list(range(10))
        traces.insert("s", tokens, store.put(canonicalize(rows(9), SPEC)))
        assert traces.longest_prefix("s", tokens[:4]).rows == 4
        assert traces.sessions() == ["s"]
        exported = traces.export("s", [*tokens, 99], "rollout/a")
        assert exported is not None
        assert exported.rows == 9
        assert traces.release_session("s") == 1  # the exported lease stays valid
        np.testing.assert_array_equal(store.read(exported.handle), rows(9))
        exported.lease.release()
        assert traces.stats().sessions == 0
        assert traces.take_unreleased() == []
        assert traces.release_all() == 0
        assert store.leaks() == []
    finally:
        traces.shutdown()


def test_the_client_travels_to_another_process(store: RouteStore) -> None:
    traces = TraceStoreConfig().build(store)
    try:
        tokens = list(range(6))
        traces.insert("s", tokens, store.put(canonicalize(rows(5, seed=1), SPEC)))
        assert pickle.loads(pickle.dumps(traces.config)) == traces.config
        assert ray.get(export_elsewhere.remote(traces, tokens)) == 5
        assert traces.release_all() == 1
        assert store.leaks() == []
    finally:
        traces.shutdown()


def test_an_error_raised_inside_the_actor_comes_back_as_itself(store: RouteStore) -> None:
    traces = TraceStoreConfig().build(store)
    try:
        with pytest.raises(HandleError, match="one row per token"):
            traces.insert("s", list(range(4)), store.put(canonicalize(rows(9), SPEC)))
    finally:
        traces.shutdown()


@ray.remote(num_cpus=0)
class SlowShell:
    def stats(self) -> None:
        time.sleep(5)


def test_a_slow_actor_is_a_store_timeout_and_a_dead_one_is_lost(store: RouteStore) -> None:
    slow = TraceStoreClient(actor=SlowShell.remote(), config=TraceStoreConfig(timeout_s=0.2))
    with pytest.raises(StoreTimeout, match="did not answer in time") as waited:
        slow.stats()
    assert "trace store stats" in str(waited.value)
    assert isinstance(waited.value.__cause__, ray.exceptions.GetTimeoutError)
    slow.shutdown()

    traces = TraceStoreConfig(timeout_s=30).build(store)
    traces.shutdown()
    with pytest.raises(RoutesLost) as lost:
        traces.release_session("s")
    assert isinstance(lost.value.__cause__, ray.exceptions.RayActorError)


def test_the_config_refuses_a_deadline_that_cannot_be_met() -> None:
    with pytest.raises(MisuseError, match="timeout_s"):
        TraceStoreConfig(timeout_s=0)
    with pytest.raises(MisuseError, match="num_cpus"):
        TraceStoreConfig(num_cpus=-1)
