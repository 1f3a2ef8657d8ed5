"""Issue 12 on the in-process backend: engine keys scoped to a run, unguessable ids,
put-and-lease in one step, revoking a dead holder's leases, the optional lease TTL."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from routeplay.core import EngineKey, Routes, RouteSpec, canonicalize
from routeplay.errors import AlreadyConsumed, MisuseError, RoutesLost, RunMismatch
from routeplay.store import LeaseTable, RouteStore, StoreConfig
from routeplay.store.engine.key_check import take_checked_many
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)
HEX56 = re.compile(r"[0-9a-f]{56}")


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


def _two_runs() -> tuple[RouteStore, RouteStore, LocalBackend]:
    """Two runs' stores sharing one engine store (the local backend of run a)."""
    a = RouteStore.local(StoreConfig(run="run-a"))
    b = RouteStore.local(StoreConfig(run="run-b"))
    backend_a, backend_b = a.backend, b.backend
    assert isinstance(backend_a, LocalBackend)
    assert isinstance(backend_b, LocalBackend)
    backend_b._engine_stores = backend_a._engine_stores  # one engine store on the cluster
    return a, b, backend_a


def test_a_key_of_one_run_cannot_be_adopted_read_or_freed_by_another() -> None:
    a, b, backend = _two_runs()
    key = EngineKey(key=backend.engine_store().put(routing(20, 1).array), rows=20)
    handle = a.adopt_key(key, SPEC)  # run a claims it (its response carried the key)
    issued_to_a = a.scoped(key)
    assert issued_to_a.run == "run-a"
    for attempt in (
        lambda: b.adopt_key(issued_to_a, SPEC),
        lambda: b.free_key(issued_to_a),
        lambda: b.scoped(issued_to_a),
    ):
        with pytest.raises(RunMismatch):
            attempt()
    with a.acquire(handle, "train/0"):
        np.testing.assert_array_equal(a.read(handle), routing(20, 1).array)


def test_a_key_claimed_by_one_run_is_refused_to_another_and_left_live() -> None:
    a, b, backend = _two_runs()
    engine = backend.engine_store()
    raw = engine.put(routing(10, 2).array)
    engine.peek(raw, "run-a")  # a lazy read by run a claims the key
    with pytest.raises(RunMismatch):
        b.adopt_key(EngineKey(key=raw, rows=10), SPEC)  # unstamped: b believes it is its own
    with pytest.raises(RunMismatch):
        b.free_key(EngineKey(key=raw, rows=10))
    assert engine.keys("run-a") == [raw]  # untouched: not freed by the refusal
    assert engine.keys("run-b") == []
    assert engine.keys() == []  # no unclaimed key left
    a.adopt_key(EngineKey(key=raw, rows=10), SPEC)
    with pytest.raises(AlreadyConsumed):
        a.adopt_key(EngineKey(key=raw, rows=10), SPEC)


def test_ids_crossing_processes_are_random_and_keys_keep_lmdeploys_shape() -> None:
    store = RouteStore.local(StoreConfig(run="ids"))
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    keys = [backend.engine_store().put(routing(2, i).array) for i in range(2)]
    assert all(HEX56.fullmatch(key) for key in keys)
    # All 224 bits vary, not a counter's low bits: the keys differ early on too.
    assert keys[0][:28] != keys[1][:28]
    first, second = store.put_many([routing(5, 1), routing(5, 2)])
    pids = [first.segments[0].source, second.segments[0].source]
    ids = [p.payload_id for p in pids]
    assert all(len(pid.split(".", 1)[1]) == 32 for pid in ids)  # 128 random bits
    lease_ids = [
        lid
        for lease in store.acquire_many([(first, "h"), (second, "h")])
        for lid in lease.parts.values()
    ]
    assert all(len(lid.rsplit("lease-", 1)[1]) == 32 for lid in lease_ids)


def test_put_leased_leases_in_the_same_step_as_the_put() -> None:
    store = RouteStore.local(StoreConfig(run="leased", ttl_s=5.0))
    _handle, lease = store.put_leased(routing(30, 3), "sample/s-1")
    stats = store.stats()
    assert stats.unleased_payloads == 0  # never exposed to the TTL
    assert stats.leases_by_holder == (("sample/s-1", 1),)
    np.testing.assert_array_equal(lease.read(0, 30), routing(30, 3).array)
    lease.release()
    assert store.stats().live_payloads == 0


def test_a_dead_holders_leases_can_be_revoked() -> None:
    store = RouteStore.local(StoreConfig(run="revoke", shards=2))
    handles = store.put_many([routing(8, i) for i in range(4)])
    store.acquire_many([(h, "rollout/worker-3") for h in handles[:3]])  # the worker dies
    kept = store.acquire(handles[3], "buffer/g-1")
    leak = next(r for r in store.leaks() if r.holder == "rollout/worker-3")
    assert store.revoke([leak]) == 1
    assert store.revoke([leak]) == 0  # idempotent
    assert store.revoke_holder("rollout/worker-3") == 2
    stats = store.stats()
    assert stats.revoked_leases == 3
    assert stats.leases_by_holder == (("buffer/g-1", 1),)
    assert stats.live_payloads == 1
    with pytest.raises(RoutesLost):
        store.read(handles[0])
    np.testing.assert_array_equal(kept.read(0, 8), routing(8, 3).array)
    assert store.revoke([kept]) == 1
    assert kept.released


def test_another_runs_lease_is_refused_by_the_shard_itself() -> None:
    """Pins ``LeaseTable._check_own``: the client sends a ``Lease``'s parts as they are
    (``revoke``, ``release_lease``), so only the shard's table can refuse a lease id
    another run granted. Without that check the call ends nothing and reports 0."""
    a = RouteStore.local(StoreConfig(run="run-a", shards=1))
    b = RouteStore.local(StoreConfig(run="run-b", shards=1))
    lease = a.acquire(a.put(routing(8, 5)), "train/a-0")
    with pytest.raises(RunMismatch, match="another run or shard"):  # the table's words
        b.revoke([lease])
    with pytest.raises(RunMismatch, match="another run or shard"):
        b.release_lease(lease.parts)
    assert not lease.released
    assert a.stats().leases_by_holder == (("train/a-0", 1),)
    assert b.stats().revoked_leases == 0
    np.testing.assert_array_equal(lease.read(0, 8), routing(8, 5).array)
    lease.release()


def test_take_checked_many_refuses_a_key_issued_to_another_run() -> None:
    """Pins ``take_checked_many``'s own run check (the client refuses such a key before
    it gets there): a key issued to run a that no run has claimed in the engine store yet
    is refused to run b and stays live; without the check run b would consume it."""
    backend = RouteStore.local(StoreConfig(run="run-b")).backend
    assert isinstance(backend, LocalBackend)
    engine = backend.engine_store()
    raw = engine.put(routing(10, 6).array)  # unclaimed: nobody has read it yet
    [refused] = take_checked_many(engine, [EngineKey(key=raw, rows=10, run="run-a")], SPEC, "run-b")
    assert isinstance(refused, RunMismatch)
    assert "issued to another run" in str(refused)
    assert engine.keys() == [raw]  # still live, still unclaimed
    assert engine.stats().consumed == 0
    [taken] = take_checked_many(engine, [EngineKey(key=raw, rows=10, run="run-a")], SPEC, "run-a")
    assert not isinstance(taken, BaseException)  # its own run takes it
    assert engine.keys() == []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_lease_ttl_ends_old_leases_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    table: LeaseTable[object] = LeaseTable("ttl", ttl_s=None, lease_ttl_s=30.0, clock=clock)
    table.add("0.a", object(), rows=1, nbytes=100)
    table.add("0.b", object(), rows=1, nbytes=100)
    old = table.acquire(["0.a"], "dead-holder", run="ttl")
    clock.now = 20.0
    young = table.acquire(["0.b"], "live-holder", run="ttl")
    clock.now = 31.0
    with caplog.at_level(logging.WARNING):
        assert table.expire() == ["0.a"]
    assert "dead-holder" in caplog.text
    assert not table.is_live(old)
    assert table.is_live(young)
    assert table.stats().expired_leases == 1


def test_leases_have_no_ttl_by_default() -> None:
    clock = Clock()
    table: LeaseTable[object] = LeaseTable("ttl", ttl_s=None, clock=clock)
    table.add("0.a", object(), rows=1, nbytes=100)
    lease = table.acquire(["0.a"], "holder", run="ttl")
    clock.now = 1e9
    table.expire()
    assert table.is_live(lease)
    with pytest.raises(MisuseError):
        StoreConfig(run="x", lease_ttl_s=0)
