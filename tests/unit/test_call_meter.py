"""``CallMeter`` and what the local backend meters: calls per operation, their CPU, and
``stats`` not counting itself."""

from __future__ import annotations

import numpy as np
import pytest

from routeplay.core import RouteSpec, canonicalize
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.shard.call_meter import CallMeter

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def test_a_meter_counts_calls_per_operation_even_when_they_raise() -> None:
    meter = CallMeter()
    with meter.served("lease_many"):
        sum(range(10_000))
    with pytest.raises(ValueError, match="served too"), meter.served("release_many"):
        raise ValueError("refused calls were served too")
    with meter.served("lease_many"):
        pass
    snapshot = meter.snapshot()
    assert snapshot.by_op == (("lease_many", 2), ("release_many", 1))
    assert snapshot.calls == 3
    assert snapshot.cpu_ms >= 0


def test_the_local_store_counts_one_call_per_shard_for_a_batch() -> None:
    store = RouteStore.local(StoreConfig(run="metered", shards=2))
    rows = np.tile(np.array([0, 1]), (5, 2, 1))
    handles = store.put_many([canonicalize(rows, SPEC) for _ in range(8)])
    before = store.stats()
    leases = store.acquire_many([(h, "train/step") for h in handles])
    store.release_many(leases)
    after = store.stats()
    grew = {op: n - dict(before.calls_by_op).get(op, 0) for op, n in after.calls_by_op}
    touched = len({h.segments[0].source.payload_id.split(".")[0] for h in handles})
    assert grew["lease_many"] == touched
    assert grew["release_many"] == touched
    assert after.calls - before.calls == 2 * touched
    assert after.process_cpu_ms == 0.0  # in process: no shard process of its own
