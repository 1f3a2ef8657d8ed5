"""The route store on a local Ray instance: one-write puts, leases, reads, TTL, runs,
shards and failures."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import created_bytes, used_bytes, wait_until

from routeplay.core import Handle, Routes, RouteSpec, canonicalize
from routeplay.errors import RoutesExpired, RoutesLost, RunMismatch, StoreTimeout
from routeplay.store import Lease, RoutesProducer, RouteStore, StoreConfig, producer_actor
from routeplay.store.remote.producer import TAKE_GROUP

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=48, top_k=8, num_experts=128)  # 384 B a row, 1000-row blocks


def routing(rows: int, seed: int) -> Routes:
    """Valid routing rows drawn from a small table of distinct top-k rows (fast to build)."""
    rng = np.random.default_rng(seed)
    table = np.argsort(rng.random((512, SPEC.num_experts)), axis=1)[:, : SPEC.top_k]
    picks = rng.integers(0, len(table), size=(rows, SPEC.num_layers))
    return canonicalize(table[picks].astype(np.uint8), SPEC)


class _Worker(RoutesProducer):
    """A rollout worker: decodes routing and hands it to the store."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store

    def produce(self, rows: int, seed: int, version: int = 0) -> Handle:
        return self.put_routes(self.store, routing(rows, seed), weight_version=version)

    def put_owned_by_me(self, rows: int, seed: int) -> Handle:
        return self.store.put(routing(rows, seed))  # this short-lived worker owns the bytes


class _SlowWorker(RoutesProducer):
    def __init__(self, store: RouteStore) -> None:
        self.store = store

    def produce(self, rows: int, seed: int) -> Handle:
        return self.put_routes(self.store, routing(rows, seed))

    @ray.method(concurrency_group=TAKE_GROUP)
    def take_staged(self, token: str) -> Any:
        time.sleep(3)
        return super().take_staged(token)


Worker = producer_actor(_Worker, num_cpus=0)
SlowWorker = producer_actor(_SlowWorker, num_cpus=0)


@pytest.fixture(scope="module")
def store() -> RouteStore:
    return StoreConfig(run="run-main", block_rows=1000, timeout_s=20).build()


def _created() -> int:
    return sum(node.created_bytes for node in created_bytes().values())


def test_one_write_put_survives_the_producer(store: RouteStore) -> None:
    worker = Worker.remote(store)
    ray.get(worker.__ray_ready__.remote())
    before = _created()
    handle = ray.get(worker.produce.remote(3500, seed=1))
    ray.kill(worker)  # at once: when put_routes returned, the shard already owned the blocks
    nbytes = routing(3500, 1).nbytes
    assert nbytes <= _created() - before < nbytes + 16 * 1024  # one write, 4 blocks
    with store.acquire(handle, "train/step-0"):
        np.testing.assert_array_equal(store.read(handle), routing(3500, 1).array)


def test_reads_return_exact_rows_in_owned_memory(store: RouteStore) -> None:
    worker = Worker.remote(store)
    first = ray.get(worker.produce.remote(2500, seed=2, version=1))
    second = ray.get(worker.produce.remote(1200, seed=3, version=2))
    joined = first + second
    expected = np.concatenate([routing(2500, 2).array, routing(1200, 3).array])
    with store.acquire(joined, "train/step-1"):
        part = store.resolve(joined, slice(2100, 3000))
        many = store.read_many([(joined, 0, 10), (second, 1000, 1200), (joined, 0, 3700)])
    np.testing.assert_array_equal(part, expected[2100:3000])
    np.testing.assert_array_equal(many[0], expected[:10])
    np.testing.assert_array_equal(many[1], expected[3500:3700])
    np.testing.assert_array_equal(many[2], expected)
    assert part.flags.owndata
    assert part.flags.writeable
    np.testing.assert_array_equal(joined.weight_versions()[2499:2501], [1, 2])


def test_last_release_returns_the_object_store_to_baseline(store: RouteStore) -> None:
    worker = Worker.remote(store)
    handle = ray.get(worker.produce.remote(4000, seed=4))
    peak = used_bytes()
    lease = store.acquire(handle, "buffer/g1")
    session = lease.clone("session/s1")
    rows = store.read(handle, 0, 100)
    lease.release()
    lease.release()  # idempotent
    assert store.read(handle, 0, 100).tobytes() == rows.tobytes()  # the session still holds it
    session.release()
    # this payload's bytes leave the object store (other tests' objects may remain)
    assert wait_until(lambda: used_bytes() <= peak - handle.nbytes), (used_bytes(), peak)
    with pytest.raises(RoutesLost, match="last lease"):
        store.read(handle)


def test_clone_transfer_and_holder_accounting(store: RouteStore) -> None:
    worker = Worker.remote(store)
    handle = ray.get(worker.produce.remote(500, seed=5))
    buffer = store.acquire(handle, "buffer/g7")
    session = buffer.clone("session/abc")
    batch = buffer.transfer("train/step-3")
    assert buffer.released
    assert not batch.released
    stats = store.stats()
    holders = dict(stats.leases_by_holder)
    assert holders["session/abc"] == 1
    assert holders["train/step-3"] == 1
    assert "buffer/g7" not in holders
    assert dict(stats.bytes_by_holder)["train/step-3"] == handle.nbytes
    leaked = {leak.holder for leak in store.leaks()}
    assert {"session/abc", "train/step-3"} <= leaked
    batch.release()
    session.release()
    assert not {leak.holder for leak in store.leaks()} & {"session/abc", "train/step-3"}


def test_lease_context_manager_releases_when_the_step_raises(store: RouteStore) -> None:
    worker = Worker.remote(store)
    handle = ray.get(worker.produce.remote(300, seed=6))
    with pytest.raises(RuntimeError, match="step failed"), store.acquire(handle, "train/step-9"):
        raise RuntimeError("step failed")
    assert "train/step-9" not in dict(store.stats().leases_by_holder)
    with pytest.raises(RoutesLost):
        store.read(handle)


def test_unleased_payloads_expire_after_the_ttl() -> None:
    short = StoreConfig(run="run-ttl", ttl_s=0.4, timeout_s=20).build()
    worker = Worker.remote(short)
    handle = ray.get(worker.produce.remote(2000, seed=7))
    peak = used_bytes()
    assert wait_until(lambda: short.stats().expired_payloads == 1, timeout_s=10)
    assert short.stats().expired_bytes == handle.nbytes
    with pytest.raises(RoutesExpired, match="TTL"):
        short.acquire(handle, "late/holder")
    assert wait_until(lambda: used_bytes() <= peak - handle.nbytes)
    short.shutdown()


def test_runs_cannot_touch_each_others_payloads(store: RouteStore) -> None:
    other = StoreConfig(run="run-other", timeout_s=20).build()
    worker = Worker.remote(store)
    handle = ray.get(worker.produce.remote(100, seed=8))
    with store.acquire(handle, "buffer/mine"):
        with pytest.raises(RunMismatch):
            other.acquire(handle, "intruder")
        with pytest.raises(RunMismatch):
            other.read(handle)
        np.testing.assert_array_equal(store.read(handle), routing(100, 8).array)
    other.shutdown()


def test_shards_spread_payloads_and_reads_batch_across_them() -> None:
    sharded = StoreConfig(run="run-sharded", shards=3, block_rows=64, timeout_s=20).build()
    worker = Worker.remote(sharded)
    handles = [ray.get(worker.produce.remote(150, seed=20 + i)) for i in range(12)]
    used = {h.segments[0].source.payload_id.split(".")[0] for h in handles}  # type: ignore[union-attr]
    assert len(used) >= 2
    leases = [sharded.acquire(h, f"buffer/{i}") for i, h in enumerate(handles)]
    outs = sharded.read_many([(h, 10, 140) for h in handles])
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, routing(150, 20 + i).array[10:140])
    assert sharded.stats().shards == 3
    assert sharded.stats().live_payloads == 12
    for lease in leases:
        lease.release()
    assert sharded.stats().live_payloads == 0
    sharded.shutdown()


def test_owner_death_is_a_typed_loss_and_the_store_keeps_serving(store: RouteStore) -> None:
    doomed, survivor = Worker.remote(store), Worker.remote(store)
    lost = ray.get(doomed.put_owned_by_me.remote(2000, seed=9))
    healthy = ray.get(survivor.produce.remote(2000, seed=10))
    lost_lease, healthy_lease = (
        store.acquire(lost, "buffer/lost"),
        store.acquire(healthy, "buffer/ok"),
    )
    ray.kill(doomed)
    assert wait_until(lambda: _is_dead(doomed))  # ray.kill is asynchronous
    lost_error = _eventually_lost(lost_lease)
    payload = lost.segments[0].source.payload_id  # type: ignore[union-attr]
    assert f"payload {payload}" in str(lost_error)
    assert "buffer/lost" in str(lost_error)
    np.testing.assert_array_equal(healthy_lease.read(), routing(2000, 10).array)
    lost_lease.release()
    healthy_lease.release()


def _is_dead(actor: Any) -> bool:
    try:
        ray.get(actor.staged_count.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False


def _eventually_lost(lease: Lease) -> RoutesLost:
    """Ray frees a dead owner's objects asynchronously: a read may still succeed for a
    moment, but within seconds it must fail with RoutesLost (never hang or crash)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            lease.read()
        except RoutesLost as lost:
            return lost
        time.sleep(0.2)
    pytest.fail("reads of a dead owner's payload kept succeeding")


def test_a_put_that_cannot_finish_times_out_with_a_clear_error() -> None:
    impatient = StoreConfig(run="run-timeout", timeout_s=0.5).build()
    slow = SlowWorker.remote(impatient)
    # The shard gives up on the hand-over after 0.5 s; on a loaded machine its answer can
    # come after the client's own deadline for it (1 s): a timeout either way, named.
    waited = r"did not hand over .* within 0\.5s|adopt .* expected an answer within 1\.0s"
    with pytest.raises(StoreTimeout, match=waited):
        ray.get(slow.produce.remote(100, seed=11))
    assert impatient.stats().live_payloads == 0  # nothing half-adopted
    impatient.shutdown()


def test_a_second_store_for_the_same_run_is_refused_unless_it_joins(store: RouteStore) -> None:
    with pytest.raises(RunMismatch, match="already exists"):
        StoreConfig(run="run-main").build()
    joined = StoreConfig(run="run-main", join=True, timeout_s=20).build()
    handle = ray.get(Worker.remote(store).produce.remote(10, seed=12))
    with joined.acquire(handle, "train/joined"):
        np.testing.assert_array_equal(joined.read(handle), routing(10, 12).array)


def test_a_shard_actor_counts_the_calls_it_serves_and_their_cpu(store: RouteStore) -> None:
    """One acquire of many handles is one ``lease_many`` per shard, and the releases one
    ``release_many``: the counts a step's control-plane cost is read from."""
    handles = store.put_many([routing(10, seed) for seed in range(6)])
    before = store.stats()
    leases = store.acquire_many([(handle, "train/metered") for handle in handles])
    store.release_many(leases)
    store.flush()
    after = store.stats()
    served = dict(after.calls_by_op)
    was = dict(before.calls_by_op)
    assert served["lease_many"] - was.get("lease_many", 0) == after.shards
    assert served["release_many"] - was.get("release_many", 0) == after.shards
    assert after.calls - before.calls == 2 * after.shards  # stats itself is not counted
    assert after.call_cpu_ms > before.call_cpu_ms
    assert after.process_cpu_ms > 0
