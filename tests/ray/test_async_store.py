"""The awaitable store on real Ray: an async actor ingesting 100 samples at once without a
blocking ``ray.get`` (and one sample through every awaitable lifecycle step), every
awaitable call cancelled while its Ray reference is in flight (nothing left behind), an
actor killed mid-call (a named leak the lease TTL reclaims), and one synchronous client
shared by many threads."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import kill_and_wait, wait_until

from routeplay.core import EngineKey, Handle, Routes, RouteSpec, Segment, canonicalize
from routeplay.rollout import ADAPTERS, Origin, ProducerWriter, SampleRouting
from routeplay.rollout.fake_engines import FakeLmdeployKey, FakeSglang
from routeplay.rollout.trace_actor import TraceStoreClient, TraceStoreConfig
from routeplay.store import (
    RouteStore,
    StoreConfig,
    aleave_engine_store,
    astart_engine_store,
    start_engine_store,
)
from routeplay.store.flow import Wait
from routeplay.store.remote import ray_calls
from routeplay.store.remote.producer import AsyncRoutesProducer, RoutesProducer, producer_actor
from routeplay.store.write_plan import plan_batch

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
WIRES = ("lmdeploy", "sglang")  # LMDeploy's shared_store; XTuner's patched SGLang's


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Any]]:
    actors = {wire: start_engine_store(namespace=wire, ttl_s=60) for wire in WIRES}
    yield actors
    for actor in actors.values():
        ray.kill(actor)


@pytest.fixture(scope="module")
def store(engines: dict[str, Any]) -> Iterator[RouteStore]:
    built = StoreConfig(run=f"async-{uuid.uuid4().hex[:6]}", shards=2, timeout_s=30).build()
    yield built
    built.shutdown()


@pytest.fixture(scope="module")
def traces(store: RouteStore) -> TraceStoreClient:
    return TraceStoreConfig(timeout_s=30).build(store)


def put_key(engines: dict[str, Any], wire: str, rows: int, seed: int) -> EngineKey:
    """What the engine does: put the payload into its engine store, answer the key."""
    key = ray.get(engines[wire].put.remote(routing(rows, seed).array))
    return EngineKey(key=key, rows=rows, namespace=wire)


def live_keys(engines: dict[str, Any]) -> int:
    return sum(ray.get(engines[wire].stats.remote()).live_keys for wire in WIRES)


def assert_nothing_left(store: RouteStore, engines: dict[str, Any]) -> None:
    def empty() -> bool:
        stats = store.stats()
        return stats.leases == 0 and stats.live_payloads == 0

    assert wait_until(empty, timeout_s=10), (store.leaks(), store.stats())
    assert live_keys(engines) == 0


# -- 100 concurrent ingests in an async actor --------------------------------------


@ray.remote(num_cpus=0)
class AsyncRollout:
    """An asyncio rollout worker: every store call awaited, never ``ray.get``."""

    async def ingest(
        self, store: RouteStore, traces: TraceStoreClient, engines: dict[str, Any], n: int
    ) -> dict[str, Any]:
        async def one(i: int) -> int:
            holder = f"rollout/s-{i}"
            if i % 4 == 0:  # the engine's key, LMDeploy's or SGLang's
                wire = WIRES[i // 4 % 2]
                key = await engines[wire].put.remote(routing(8, i).array)
                handle = await store.aadopt_key(EngineKey(key=key, rows=8, namespace=wire), SPEC)
                lease = await store.aacquire(handle, holder)
            elif i % 4 == 1:
                handle, lease = await store.aput_leased(routing(8, i), holder)
            elif i % 4 == 2:
                [handle] = await store.aput_many([routing(8, i)])
                [lease] = await store.aacquire_many([(handle, holder)])
            else:
                handle = await store.aput(routing(8, i))
                lease = await store.aacquire(handle, holder)
            if i % 20 == 3:  # a multi-turn session: the trace store leases it too
                await traces.ainsert(f"s-{i}", range(9), handle)
                exported = await traces.aexport(f"s-{i}", range(5), f"rollout/x-{i}")
                assert exported is not None
                await exported.lease.arelease()
                await traces.arelease_session(f"s-{i}")
            moved = await (await lease.aclone(f"buffer/s-{i}")).atransfer(f"train/s-{i}")
            async with moved:
                pass
            await store.arelease_many([lease])
            return handle.rows

        rows = await asyncio.gather(*(one(i) for i in range(n)))
        await store.aflush()
        stats = await store.astats()
        return {
            "rows": sum(rows),
            "leases": stats.leases,
            "live_payloads": stats.live_payloads,
            "leaks": await store.aleaks(),
            "warned": _blocking_calls_warned(),
        }

    async def put_blocking(self, store: RouteStore) -> bool:
        """The control: a blocking call here is what Ray warns about."""
        store.release_many([store.put_leased(routing(4, 0), "control")[1]])
        store.flush()
        return _blocking_calls_warned()


def _blocking_calls_warned() -> bool:
    # Ray sets these flags where it warns "Using blocking ray.get inside async actor"
    # (and its ray.wait twin): once per process, so a fresh actor starts clean.
    worker = ray._private.worker
    return bool(worker.blocking_get_inside_async_warned or worker.blocking_wait_inside_async_warned)


def test_an_async_actor_ingests_100_samples_at_once_without_blocking(
    store: RouteStore, traces: TraceStoreClient, engines: dict[str, Any]
) -> None:
    rollout = AsyncRollout.remote()
    result = ray.get(rollout.ingest.remote(store, traces, engines, 100), timeout=120)
    assert result["rows"] == 800
    assert result["leases"] == 0
    assert result["leaks"] == []
    assert result["live_payloads"] == 0
    assert result["warned"] is False  # no blocking ray.get / ray.wait in the actor
    assert live_keys(engines) == 0
    control = AsyncRollout.remote()  # the check can fail: a blocking call is seen
    assert ray.get(control.put_blocking.remote(store), timeout=60) is True
    assert_nothing_left(store, engines)


@producer_actor
class AsyncProducer(AsyncRoutesProducer):
    """An asyncio rollout worker on the one-write path: a shard owns what it writes."""

    async def ingest(self, store: RouteStore, n: int) -> dict[str, Any]:
        async def one(i: int) -> None:
            if i % 2:
                handle = await self.aput_routes(store, routing(8, i))
            else:
                [handle] = await self.aput_routes_many(store, [routing(8, i)])
            lease = await store.aacquire(handle, f"rollout/p-{i}")
            await lease.arelease()

        await asyncio.gather(*(one(i) for i in range(n)))
        stats = await store.astats()
        staged = self.staged_count()
        return {"leases": stats.leases, "staged": staged, "warned": _blocking_calls_warned()}

    async def ingest_sample(self, store: RouteStore) -> dict[str, Any]:
        """One sample's answer written through the producer (``ProducerWriter.aput``)."""
        writer = ProducerWriter(producer=self, store=store)
        full = routing(8, 3).array
        async with await SampleRouting(sample_id="p").acontinuation() as cont:
            body = FakeSglang(spec=SPEC).respond(full, prompt_tokens=5, completion_tokens=4)
            handle = await cont.aingest(
                ADAPTERS["sglang"], body, spec=SPEC, writer=writer, weight_version=0
            )
            done = await cont.afinish(store, handle)
        leased = dict((await store.astats()).leases_by_holder)  # reads are the trainer's
        await done.arelease()
        stats = await store.astats()
        return {
            "rows": done.rows,
            "leased": sorted(leased),
            "leases": stats.leases,
            "staged": self.staged_count(),
            "warned": _blocking_calls_warned(),
        }


def test_an_async_producer_writes_through_a_shard_without_blocking(
    store: RouteStore, engines: dict[str, Any]
) -> None:
    result = ray.get(AsyncProducer.remote().ingest.remote(store, 20), timeout=120)
    assert result == {"leases": 0, "staged": 0, "warned": False}
    assert_nothing_left(store, engines)


def test_an_async_producer_ingests_a_sample_through_its_writer_without_blocking(
    store: RouteStore, engines: dict[str, Any]
) -> None:
    result = ray.get(AsyncProducer.remote().ingest_sample.remote(store), timeout=120)
    expected = {"rows": 8, "leased": ["rollout/p"], "leases": 0, "staged": 0, "warned": False}
    assert result == expected
    assert_nothing_left(store, engines)


# -- cancellation of each awaitable call, its Ray reference in flight ---------------


class CancelInFlight:
    """A backend (or resolver) that reports when a flow starts waiting on calls it has
    sent (not a release settling), so the test cancels the task right there."""

    def __init__(self, inner: Any, *, releases: bool = False) -> None:
        self.inner = inner
        self.releases = releases  # the releases' own wait is the call (flush)
        self.waiting = asyncio.Event()

    async def aresolve(self, wait: Wait) -> list[Any]:
        # Not an engine store's protocol either: asked before its first call is sent.
        if self.releases or not wait.what.endswith((": release", ": protocol")):
            self.waiting.set()
        return list(await self.inner.aresolve(wait))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def cancel_in_flight(start: Callable[[], Awaitable[Any]], probe: CancelInFlight) -> None:
    task = asyncio.ensure_future(start())
    await asyncio.wait_for(probe.waiting.wait(), 30)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


Case = Callable[[RouteStore, dict[str, Any]], Callable[[], Awaitable[Any]]]


def _acquire_one(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    handle, _ = s.put_leased(routing(6, 1), "keeper")
    return lambda: s.aacquire(handle, "cancelled/acquire")


def _acquire_many(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    pairs = s.put_leased_many([routing(6, i) for i in range(4)], "keeper")  # both shards
    return lambda: s.aacquire_many([(h, "cancelled/acquire-many") for h, _ in pairs])


def _release(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    lease = s.put_leased(routing(6, 2), "cancelled/release")[1]
    return lease.arelease


def _clone(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    lease = s.put_leased(routing(6, 3), "keeper")[1]
    return lambda: lease.aclone("cancelled/clone")


def _transfer(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    lease = s.put_leased(routing(6, 4), "keeper")[1]
    return lambda: lease.atransfer("cancelled/transfer")


def _flush(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    leases = [s.put_leased(routing(6, i), "cancelled/flush")[1] for i in range(3)]

    async def release_then_flush() -> None:
        await s.arelease_many(leases)
        await s.aflush()

    return release_then_flush


def _free_key(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    key = put_key(e, "lmdeploy", 6, 5)
    return lambda: s.afree_key(key)


def _adopt_key(wire: str) -> Case:
    def case(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
        key = put_key(e, wire, 6, 6)
        return lambda: s.aadopt_key(key, SPEC)

    return case


def _adopt_group(method: str) -> Case:
    def case(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
        keys = [put_key(e, WIRES[i % 2], 6, 7) for i in range(3)]  # one prompt, both wires
        return lambda: getattr(s, method)(keys, SPEC, shared_prefix=4)

    return case


CASES: dict[str, Case] = {
    "aput": lambda s, e: lambda: s.aput(routing(6, 0)),
    "aput_many": lambda s, e: lambda: s.aput_many([routing(6, i) for i in range(3)]),
    "aput_leased": lambda s, e: lambda: s.aput_leased(routing(6, 0), "cancelled/put"),
    "aput_leased_many": lambda s, e: (
        lambda: s.aput_leased_many(
            [routing(6, i) for i in range(3)], "cancelled/put-many", shared_prefix=2
        )
    ),
    "aadopt_key-lmdeploy": _adopt_key("lmdeploy"),
    "aadopt_key-sglang": _adopt_key("sglang"),
    "aadopt_keys": _adopt_group("aadopt_keys"),
    "aadopt_keys_each": _adopt_group("aadopt_keys_each"),
    "aacquire": _acquire_one,
    "aacquire_many": _acquire_many,
    "Lease.arelease": _release,
    "Lease.aclone": _clone,
    "Lease.atransfer": _transfer,
    "arelease_many+aflush": _flush,
    "afree_key": _free_key,
    "afree_engine_keys": lambda s, e: _free_handle_keys(s, e),
    "arevoke": lambda s, e: _revoke(s, "arevoke"),
    "arevoke_holder": lambda s, e: _revoke(s, "arevoke_holder"),
    "astats": lambda s, e: s.astats,
    "aleaks": lambda s, e: s.aleaks,
    "aput_staged": lambda s, e: _staged(s, e, many=False),
    "aput_staged_many": lambda s, e: _staged(s, e, many=True),
}


@producer_actor
class Producer(RoutesProducer):
    """A rollout-side producer: stages its rows, a shard takes them (one write)."""

    def stage_blocks(self, blocks: tuple[Any, ...]) -> str:
        return self._outbox().stage_many(blocks)


@pytest.fixture(scope="module")
def producer() -> Any:
    return Producer.remote()


def _staged(s: RouteStore, e: dict[str, Any], *, many: bool) -> Callable[[], Awaitable[Any]]:
    producer = e["producer"]
    if not many:
        routes = routing(6, 10)
        token, blocks = ray.get(producer.stage_routes.remote(routes.array, block_rows=0))
        return lambda: s.aput_staged(producer, token, blocks, routes)
    layout = plan_batch([routing(6, 11), routing(6, 12)])
    blocks, _ = s.layout_blocks(layout, SPEC)
    token = ray.get(producer.stage_blocks.remote(blocks))
    return lambda: s.aput_staged_many(producer, token, layout, SPEC)


def _free_handle_keys(s: RouteStore, e: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    key = s.scoped(put_key(e, "sglang", 6, 8))
    handle = Handle.of(Segment(source=key, start=0, stop=6, spec=SPEC))
    return lambda: s.afree_engine_keys(handle)


def _revoke(s: RouteStore, method: str) -> Callable[[], Awaitable[Any]]:
    _, lease = s.put_leased(routing(6, 9), "cancelled/dead-worker")
    if method == "arevoke":
        return lambda: s.arevoke([lease])
    return lambda: s.arevoke_holder("cancelled/dead-worker")


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_cancelled_call_leaves_nothing_behind(
    name: str, store: RouteStore, engines: dict[str, Any], producer: Any
) -> None:
    probe = CancelInFlight(store.backend, releases=name == "arelease_many+aflush")
    client = RouteStore(store.config, probe)  # the same shards, a probed client
    start = CASES[name](client, {**engines, "producer": producer})
    asyncio.run(cancel_in_flight(start, probe))
    client.flush()  # rescues and releases in flight have landed (or failed, raised here)
    for leak in client.leaks():  # only what the test itself still holds
        assert leak.holder == "keeper", leak
    client.revoke_holder("keeper")
    assert_nothing_left(client, engines)


TRACE_CALLS: dict[str, Callable[[TraceStoreClient, str, Handle], Awaitable[Any]]] = {
    "ainsert": lambda t, sid, h: t.ainsert(f"{sid}-new", range(9), h),
    "alongest_prefix": lambda t, sid, h: t.alongest_prefix(sid, range(5)),
    "aexport": lambda t, sid, h: t.aexport(sid, range(5), "cancelled/export"),
    "arelease_session": lambda t, sid, h: t.arelease_session(sid),
    "arelease_all": lambda t, sid, h: t.arelease_all(),
    "atake_unreleased": lambda t, sid, h: t.atake_unreleased(),
    "asessions": lambda t, sid, h: t.asessions(),
    "astats": lambda t, sid, h: t.astats(),
}


@pytest.mark.parametrize("call", sorted(TRACE_CALLS))
def test_a_cancelled_trace_store_call_leaves_nothing_behind(
    call: str,
    store: RouteStore,
    traces: TraceStoreClient,
    engines: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle, lease = store.put_leased(routing(8, 9), "keeper")
    traces.insert(f"c-{call}", range(9), handle)
    lease.release()
    probe = CancelInFlight(ray_calls.RAY)
    monkeypatch.setattr(ray_calls, "RAY", probe)  # the trace client resolves through it
    asyncio.run(cancel_in_flight(lambda: TRACE_CALLS[call](traces, f"c-{call}", handle), probe))
    monkeypatch.undo()
    # an export's lease is ended by the actor; what is left is the sessions' own
    assert wait_until(lambda: all(leak.holder.startswith("session/") for leak in store.leaks()))
    traces.release_all()
    assert_nothing_left(store, engines)


def test_the_engine_store_starts_and_leaves_awaited() -> None:
    async def start_and_leave() -> tuple[int, bool]:
        actor = await astart_engine_store(name="shared_store_async", namespace="sglang", user="u")
        key = await actor.put.remote(routing(4, 0).array)
        live = (await actor.stats.remote()).live_keys
        assert await actor.free.remote(key) is True
        return live, await aleave_engine_store(actor, "u", end_if_last=True)

    assert asyncio.run(start_and_leave()) == (1, True)


# -- an actor killed mid-call -------------------------------------------------------


@ray.remote(num_cpus=0)
class Greedy:
    async def acquire_forever(self, store: RouteStore, handles: list[Any]) -> None:
        while True:  # killed somewhere in here, its leases never released
            await store.aacquire_many([(h, "killed/worker") for h in handles])
            await asyncio.sleep(0.02)


def test_an_actor_killed_mid_call_leaves_named_leases_the_ttl_reclaims() -> None:
    config = StoreConfig(run=f"killed-{uuid.uuid4().hex[:6]}", timeout_s=30, lease_ttl_s=3.0)
    store = config.build()
    greedy = Greedy.remote()
    ray.get(greedy.__ray_ready__.remote(), timeout=60)  # up before the keeper's TTL runs
    try:
        handles = [store.put(routing(6, i)) for i in range(3)]
        keepers = [store.acquire_many([(h, "keeper") for h in handles])]
        greedy.acquire_forever.remote(store, handles)

        def greedy_holds() -> bool:
            if any(leak.holder == "killed/worker" for leak in store.leaks()):
                return True
            # A loaded machine may start the actor's call after the keeper's TTL: a
            # fresh keeper lease keeps the payloads alive until the actor holds them.
            keepers.append(store.acquire_many([(h, "keeper") for h in handles]))
            return False

        assert wait_until(greedy_holds)
        kill_and_wait(greedy)
        holders = {leak.holder for leak in store.leaks()}
        assert holders <= {"killed/worker", "keeper"}  # every leftover lease is named
        assert wait_until(lambda: store.stats().leases == 0, timeout_s=20)  # the TTL's
        assert store.stats().expired_leases > 0
        assert store.stats().live_payloads == 0
        for keeper in keepers:
            store.release_many(keeper)  # idempotent: the TTL ended them already
    finally:
        store.shutdown()


# -- one synchronous client, many threads -------------------------------------------


def test_one_sync_client_shared_by_threads_ends_with_zero_leases(
    store: RouteStore, engines: dict[str, Any]
) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(15):
                handle, lease = store.put_leased(routing(6, t * 100 + i), f"thread/{t}")
                other = store.acquire(handle, f"thread/{t}/reader")
                np.testing.assert_array_equal(other.read(), routing(6, t * 100 + i).array)
                store.release_many([lease])
                moved = other.transfer(f"thread/{t}/train")
                moved.release()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    store.flush()
    assert store.stats().leases == 0
    assert_nothing_left(store, engines)


# -- one sample's lifecycle steps, awaited ---------------------------------------------


async def engine_key_body(engine: Any, full: np.ndarray, prompt: int, completion: int) -> Any:
    """LMDeploy's answer: its rows put into its engine store (awaited), the key in the body."""
    rows: list[Any] = []
    FakeLmdeployKey(spec=SPEC, put=lambda array: rows.append(array) or "").respond(
        full, prompt_tokens=prompt, completion_tokens=completion
    )
    key = await engine.put.remote(rows[0])
    return FakeLmdeployKey(spec=SPEC, put=lambda _: key).respond(
        full, prompt_tokens=prompt, completion_tokens=completion
    )


@ray.remote(num_cpus=0)
class AsyncSampleWorker:
    """An asyncio rollout worker and buffer: every lifecycle step through its awaitable twin."""

    async def run(
        self, store: RouteStore, traces: TraceStoreClient, engines: dict[str, Any]
    ) -> dict[str, Any]:
        prompt, first, second = 5, 4, 3
        full = routing(prompt + first + second - 1, 7).array
        kept, lease = await store.aput_leased(routing(prompt + first - 1, 7), "rollout/w")
        partial = SampleRouting(sample_id="w", session_id="sw").attach(kept, lease, Origin.PRODUCED)
        async with await partial.acontinuation(traces) as cont:  # a resume: its own rows
            body = await engine_key_body(engines["lmdeploy"], full, prompt + first, second)
            handle = await cont.aingest(
                ADAPTERS["lmdeploy"], body, spec=SPEC, writer=store, weight_version=1
            )
            done = await cont.afinish(store, handle)
        done = done.complete(prompt_tokens=prompt, response_tokens=first + second)
        buffered = await done.atake_over("buffer/g", store)
        holders = sorted(dict((await store.astats()).leases_by_holder))  # one per shard
        expiry = await buffered.aexpire_retryably()

        tokens = tuple(range(prompt + first))  # the retry's turn goes to the session
        async with await expiry.retry.acontinuation(traces, tokens[:prompt]) as cont:
            body = FakeSglang(spec=SPEC).respond(
                full, prompt_tokens=prompt, completion_tokens=first, start_row=cont.rows
            )
            handle = await cont.aingest(
                ADAPTERS["sglang"], body, spec=SPEC, writer=store, weight_version=2
            )
            turn = await cont.afinish(store, handle)
        turn = await turn.complete(prompt_tokens=prompt, response_tokens=first).astore_turn(
            traces, tokens
        )
        next_turn = SampleRouting(sample_id="w2", session_id="sw")
        async with await next_turn.acontinuation(traces, (*tokens, 9)) as cont:
            borrowed = cont.rows  # the session's prefix, under the sample's own lease
        await traces.arelease_session("sw")
        await store.aflush()
        stats = await store.astats()
        return {
            "rows": done.rows,
            "holders": holders,
            "retries": expiry.retry.retries,
            "borrowed": borrowed,
            "turn_leased": turn.holds_lease,
            "leases": stats.leases,
            "live_payloads": stats.live_payloads,
            "warned": _blocking_calls_warned(),
        }


def test_an_async_actor_runs_a_sample_through_the_awaitable_steps_without_blocking(
    store: RouteStore, traces: TraceStoreClient, engines: dict[str, Any]
) -> None:
    result = ray.get(AsyncSampleWorker.remote().run.remote(store, traces, engines), timeout=120)
    assert result == {
        "rows": 11,
        "holders": ["buffer/g"],  # taken over: the rollout's lease ended after
        "retries": 1,
        "borrowed": 8,
        "turn_leased": False,
        "leases": 0,
        "live_payloads": 0,
        "warned": False,  # no blocking ray.get / ray.wait in the actor
    }
    assert_nothing_left(store, engines)
