"""The store's fast paths on a local Ray instance: a leased read makes no shard call, a
release is not waited for and its failure is raised by the next call, a GRPO group put
from a producer writes its prompt once (Ray's own byte counters), an LMDeploy key with
one trailing row is adopted, every byte still goes when the last lease does, and a read
fetches each block as soon as it is written, not after the last one."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import created_bytes, kill_and_wait, used_bytes, wait_until

from routeplay.bench.transfer_paths import make_routing
from routeplay.core import EngineKey, Handle, Routes, RouteSpec, canonicalize, preset
from routeplay.errors import ReleaseFailed, StoreFailure, StoreTimeout
from routeplay.store import (
    RoutesProducer,
    RouteStore,
    StoreConfig,
    producer_actor,
    start_engine_store,
)
from routeplay.store.remote import ray_calls
from routeplay.store.remote.ray_calls import get_as_created

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=48, top_k=8, num_experts=128)


def routing(rows: int, seed: int) -> Routes:
    rng = np.random.default_rng(seed)
    table = np.argsort(rng.random((512, SPEC.num_experts)), axis=1)[:, : SPEC.top_k]
    picks = rng.integers(0, len(table), size=(rows, SPEC.num_layers))
    return canonicalize(table[picks].astype(np.uint8), SPEC)


class _GroupWorker(RoutesProducer):
    def __init__(self, store: RouteStore) -> None:
        self.store = store

    def group(self, prompt_rows: int, completions: list[int], seed: int) -> list[Handle]:
        prompt = routing(prompt_rows, seed).array
        batch = [
            canonicalize(np.concatenate([prompt, routing(n, seed + 1 + i).array]), SPEC)
            for i, n in enumerate(completions)
        ]
        return self.put_routes_many(self.store, batch, shared_prefix=prompt_rows)

    def small(self, rows: list[int], seed: int) -> list[Handle]:
        """Payloads far below Ray's 100 KiB inline limit, one each."""
        batch = [routing(n, seed + i) for i, n in enumerate(rows)]
        return self.put_routes_many(self.store, batch, pack=False)


GroupWorker = producer_actor(_GroupWorker, num_cpus=0)


@pytest.fixture(scope="module")
def store() -> RouteStore:
    return StoreConfig(run="run-fast", timeout_s=20).build()


def _created() -> int:
    return sum(node.created_bytes for node in created_bytes().values())


def test_a_group_put_writes_the_prompt_once_and_reads_need_no_shard_call(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = GroupWorker.remote(store)
    ray.get(worker.__ray_ready__.remote())
    baseline = used_bytes()
    before = _created()
    completions = [400, 300, 350, 500]  # each above Ray's 100 KiB inline limit
    handles = ray.get(worker.group.remote(2000, completions, seed=1))
    written = _created() - before
    once = SPEC.nbytes(2000) + SPEC.nbytes(sum(completions))
    assert once <= written < once * 1.01 + 16 * 1024, (written, once)
    assert store.stats().shared_prefix_bytes_saved == 3 * SPEC.nbytes(2000)
    leases = store.acquire_many([(h, f"train/step-0/{i}") for i, h in enumerate(handles)])
    calls: list[str] = []
    backend: Any = store.backend
    real = backend.send  # every shard call a client makes is sent through it
    monkeypatch.setattr(
        backend, "send", lambda c: (calls.extend(call.method for call in c), real(c))[1]
    )
    rows = store.read_many([(h, 1990, h.rows) for h in handles])
    assert calls == []  # every block came with the grant
    prompt = routing(2000, 1).array
    for i, (handle, out) in enumerate(zip(handles, rows, strict=True)):
        tail = routing(completions[i], 2 + i).array
        np.testing.assert_array_equal(out, np.concatenate([prompt[1990:], tail]))
        assert handle.rows == 2000 + completions[i]
    store.release_many(leases)  # not waited for
    assert set(calls) == {"release_many"}  # the spy sees every call sent
    assert store.stats().live_payloads == 0  # ... but a later call sees it landed
    assert wait_until(lambda: used_bytes() <= baseline), (used_bytes(), baseline)


def _objects() -> int:
    return sum(node.created_objects for node in created_bytes().values())


def test_small_payloads_live_in_the_object_store_written_once(store: RouteStore) -> None:
    worker = GroupWorker.remote(store)
    ray.get(worker.__ray_ready__.remote())
    objects, before = _objects(), _created()
    rows = [3, 40, 100]  # 480 bytes to 16 KB: results Ray would keep in the shard's heap
    handles = ray.get(worker.small.remote(rows, seed=5))
    assert _objects() - objects == len(rows)  # one object-store write per payload
    assert _created() - before >= SPEC.nbytes(sum(rows))
    leases = store.acquire_many([(h, f"small/{i}") for i, h in enumerate(handles)])
    reads = store.read_many([(h, 0, h.rows) for h in handles])
    for i, (handle, out) in enumerate(zip(handles, reads, strict=True)):
        np.testing.assert_array_equal(out, routing(rows[i], 5 + i).array)
        assert handle.rows == rows[i]
    store.release_many(leases)
    assert store.stats().live_payloads == 0


def test_a_release_that_fails_at_its_shard_is_raised_by_the_next_call() -> None:
    # The first call waits for the shard's worker process to start: under a loaded suite
    # that took over 5 s once. A killed shard fails its calls at once, not at the deadline.
    doomed = StoreConfig(run="run-doomed", timeout_s=30).build()
    [handle] = doomed.put_many([routing(100, seed=3)])
    lease = doomed.acquire(handle, "train/x")
    backend: Any = doomed.backend
    for shard in backend._shards:
        kill_and_wait(shard)
    doomed.release_many([lease])  # returns at once: nothing waits for the dead shard
    assert lease.released
    with pytest.raises(ReleaseFailed, match="release failed"):
        doomed.flush()
    doomed.flush()  # raised once, then settled


def test_an_lmdeploy_key_with_a_trailing_row_is_validated_once_near_the_engine(
    store: RouteStore,
) -> None:
    spec = preset("qwen3-30b-a3b")
    engine_store = start_engine_store(name="shared_store_fast", ttl_s=30)
    payload = make_routing(spec, 501, all_layers=True, seed=4)  # one row past the key's 500
    key = ray.get(engine_store.put.remote(payload))  # type: ignore[attr-defined]
    handle = store.adopt_key(
        EngineKey(key=key, rows=500, actor="shared_store_fast", trailing_rows=1), spec
    )
    assert handle.rows == 500
    with store.acquire(handle, "buffer/k") as lease:
        rows = lease.read()
    moe = payload[:500, list(spec.moe_layer_indices()), :].astype(spec.dtype)
    np.testing.assert_array_equal(rows, moe)
    stats = ray.get(engine_store.stats.remote())  # type: ignore[attr-defined]
    assert (stats.live_keys, stats.consumed) == (0, 1)
    ray.kill(engine_store)


def test_a_grpo_group_of_lmdeploy_keys_is_validated_together_and_shares_its_prompt(
    store: RouteStore,
) -> None:
    spec = preset("qwen3-30b-a3b")
    engine_store = start_engine_store(name="shared_store_group", ttl_s=30)
    prompt = make_routing(spec, 700, all_layers=True, seed=5)
    payloads = []
    for i, extra in enumerate((300, 400, 500)):
        own = make_routing(spec, 700 + extra, all_layers=True, seed=6 + i)
        own[:700] = prompt  # routed alike: an engine with prefix caching
        payloads.append(own)
    keys = [
        EngineKey(
            key=ray.get(engine_store.put.remote(p)),  # type: ignore[attr-defined]
            rows=len(p),
            actor="shared_store_group",
        )
        for p in payloads
    ]
    before = _created()
    handles = store.adopt_keys(keys, spec, shared_prefix=700)
    written = _created() - before
    once = spec.nbytes(700) + spec.nbytes(300 + 400 + 500)
    assert once <= written < once * 1.02, (written, once)  # the prompt written once
    with store.acquire(handles[2], "buffer/g") as lease:
        np.testing.assert_array_equal(lease.read(), payloads[2].astype(spec.dtype))
    ray.kill(engine_store)


@ray.remote(num_cpus=0)
class _Gate:
    """Writes its block only once opened (an adopted payload still being validated)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()

    async def block_when_open(self, nbytes: int) -> Any:
        await self._open.wait()
        return np.ones(nbytes, np.uint8)

    def open(self) -> None:
        self._open.set()


def test_a_block_is_fetched_as_soon_as_it_exists_not_after_the_last_one() -> None:
    # One ray.get of both would pull neither until the late one exists (Ray's pull
    # manager activates a get's objects together, once it knows all their sizes).
    gate = _Gate.remote()
    try:
        late = gate.block_when_open.remote(300_000)
        early = ray.put(np.arange(200_000, dtype=np.uint32) % 251)
        batches = get_as_created([late, early, early], timeout_s=30, what="blocks")
        positions, values = next(batches)
        assert positions == [1, 2]  # while the late block does not exist yet (a repeat too)
        np.testing.assert_array_equal(values[0], np.arange(200_000, dtype=np.uint32) % 251)
        ray.get(gate.open.remote())
        positions, values = next(batches)
        assert positions == [0]
        assert values[0].nbytes == 300_000
        assert next(batches, None) is None
    finally:
        ray.kill(gate)


def test_blocks_that_all_exist_are_fetched_with_one_get(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every block written (a trainer's read long after adoption, a producer's blocks):
    # one bundle, no per-object pulls (measured ~25 ms faster for 197 MB to 4 ranks).
    first = ray.put(np.arange(100_000, dtype=np.uint32))
    second = ray.put(np.ones(50_000, np.uint8))
    waits: list[bool] = []
    real_wait = ray_calls.ray.wait

    def spy(*args: Any, **kwargs: Any) -> Any:
        waits.append(kwargs.get("fetch_local", True))
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(ray_calls.ray, "wait", spy)
    [(positions, values)] = list(get_as_created([second, first, second], timeout_s=30, what="b"))
    assert positions == [0, 1, 2]
    np.testing.assert_array_equal(values[1], np.arange(100_000, dtype=np.uint32))
    np.testing.assert_array_equal(values[0], np.ones(50_000, np.uint8))
    np.testing.assert_array_equal(values[2], np.ones(50_000, np.uint8))
    assert waits == [False]  # only asked whether they exist, nothing pulled one by one


def test_one_block_is_fetched_without_asking_whether_it_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A trainer rank's micro-batch reads one packed group (one block): asking first
    # whether it exists was one more raylet round trip per micro-batch, for nothing (one
    # object is its own bundle either way). Repeats of it are still one object.
    block = ray.put(np.arange(100_000, dtype=np.uint32))
    waits: list[Any] = []
    real_wait = ray_calls.ray.wait

    def spy(*args: Any, **kwargs: Any) -> Any:
        waits.append(args)
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(ray_calls.ray, "wait", spy)
    [(positions, values)] = list(get_as_created([block, block], timeout_s=30, what="b"))
    assert positions == [0, 1]
    np.testing.assert_array_equal(values[1], np.arange(100_000, dtype=np.uint32))
    assert waits == []


@ray.remote(num_cpus=0)
def _refused_block() -> None:
    raise ValueError("not a block")


def test_a_failed_block_among_blocks_that_all_exist_fails_the_read_typed() -> None:
    good, bad = ray.put(np.ones(1000, np.uint8)), _refused_block.remote()
    ray.wait([bad], timeout=20)
    with pytest.raises(StoreFailure, match="not a block"):
        list(get_as_created([good, bad], timeout_s=20, what="blocks"))
    assert list(get_as_created([], timeout_s=1, what="blocks")) == []


@ray.remote(num_cpus=0)
def _timed_out_writer() -> None:
    raise StoreTimeout("the writer's own call timed out", where="writer")


def test_a_writers_own_timeout_is_not_told_as_blocks_that_did_not_arrive() -> None:
    failed = _timed_out_writer.remote()
    ray.wait([failed], timeout=20)
    with pytest.raises(StoreTimeout, match="the writer's own call timed out"):
        list(get_as_created([failed], timeout_s=20, what="blocks"))


def test_a_block_never_written_fails_the_read_at_its_deadline() -> None:
    gate = _Gate.remote()
    try:
        never = gate.block_when_open.remote(1000)
        with pytest.raises(StoreTimeout, match="did not arrive in time") as timed_out:
            list(get_as_created([never], timeout_s=0.5, what="blocks of payload p"))
        assert "blocks of payload p" in str(timed_out.value)
    finally:
        ray.kill(gate)
