"""A rollout worker refuses a dense-model sample before any store call: a routing
continuation's ``finish`` leases first, so a refusal after it would leave that lease
behind (a review found ``rollout`` leaking ``rollout/<id>`` this way)."""

from __future__ import annotations

from typing import Any

import pytest

from routeplay.core import preset
from routeplay.errors import MisuseError
from routeplay.pipeline.rollout_worker import Sampling, WorkerShell
from routeplay.rollout import RolloutState, RoutingKind
from routeplay.store import RouteStore, StoreConfig

SAMPLING = Sampling(max_new_tokens=4)


def _worker(store: RouteStore) -> WorkerShell:
    traces: Any = None  # never reached: the refusal comes first
    # Port 9 (discard) is never asked: a request would fail with EngineUnavailable.
    return WorkerShell(store, traces, "http://127.0.0.1:9", "sglang", preset("qwen3-30b-a3b"))


def _dense(sample_id: str) -> RolloutState:
    return RolloutState(
        sample_id=sample_id, group_id="g", prompt_ids=(1, 2, 3), routing_kind=RoutingKind.DENSE
    )


def test_a_dense_sample_is_refused_before_any_lease() -> None:
    store = RouteStore.local(StoreConfig(run="worker-dense"))
    with pytest.raises(MisuseError, match="dense-model sample has no routing"):
        _worker(store).rollout(_dense("a"), SAMPLING, version=0)
    assert store.leaks() == []
    assert store.stats().leases == 0


def test_a_dense_member_of_a_group_is_set_aside_with_its_error() -> None:
    store = RouteStore.local(StoreConfig(run="worker-dense-group"))
    [out] = _worker(store).rollout_group([_dense("b")], [SAMPLING], version=0)
    assert isinstance(out, MisuseError)
    assert store.leaks() == []
    assert store.stats().leases == 0
