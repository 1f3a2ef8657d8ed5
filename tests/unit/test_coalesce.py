"""Concurrent awaitable lease calls of one process go out as one batch (one call per
shard), each waiter gets its own result, a bad request fails only its caller, and a
cancelled waiter's grant is revoked when the batch lands (``routeplay.store.client.coalesce``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.errors import RunMismatch
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.client.coalesce import Coalescer

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def store_with(count: int, run: str = "co") -> tuple[RouteStore, list[Handle]]:
    store = RouteStore.local(StoreConfig(run=run))
    rows = canonicalize(np.tile(np.array([0, 1]), (5, 2, 1)), SPEC)
    return store, store.put_many([rows] * count)


def calls(store: RouteStore) -> dict[str, int]:
    return dict(store.stats().calls_by_op)


def test_concurrent_acquires_and_releases_are_one_call_each() -> None:
    store, handles = store_with(12)
    before = calls(store)

    async def sample(handle: Handle, at: int) -> str:
        lease = await store.aacquire(handle, f"rollout/s{at}")
        holder = lease.holder
        await lease.arelease()
        return holder

    async def run() -> list[str]:
        return await asyncio.gather(*(sample(h, i) for i, h in enumerate(handles)))

    assert asyncio.run(run()) == [f"rollout/s{i}" for i in range(12)]
    after = calls(store)
    assert after["lease_many"] - before.get("lease_many", 0) == 1
    assert after["release_many"] - before.get("release_many", 0) == 1
    assert "release" not in after
    assert store.stats().leases == 0


def test_a_bad_request_fails_only_its_own_caller() -> None:
    store, handles = store_with(3)
    _, foreign = store_with(1, run="other")

    async def run() -> list[object]:
        wanted = [*handles[:2], foreign[0], handles[2]]
        return await asyncio.gather(
            *(store.aacquire(h, f"r/{i}") for i, h in enumerate(wanted)), return_exceptions=True
        )

    out = asyncio.run(run())
    assert isinstance(out[2], RunMismatch)
    assert [lease.holder for lease in out if not isinstance(lease, Exception)] == [  # type: ignore[attr-defined]
        "r/0", "r/1", "r/3"
    ]  # fmt: skip
    assert store.stats().leases == 3


def test_a_cancelled_waiter_leaves_no_lease() -> None:
    store, handles = store_with(2)

    async def run() -> None:
        kept = asyncio.ensure_future(store.aacquire(handles[0], "kept"))
        dropped = asyncio.ensure_future(store.aacquire(handles[1], "dropped"))
        await asyncio.sleep(0)  # both requests are in the batch
        dropped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        (await kept).release()

    asyncio.run(run())
    store.flush()
    stats = store.stats()
    assert stats.leases == 0
    # The kept payload went with its last release; the dropped waiter's grant was revoked,
    # not released: its payload is back to its TTL, as if never leased.
    assert (stats.live_payloads, stats.unleased_payloads) == (1, 1)


def test_a_waiter_cancelled_in_the_turn_its_batch_lands_has_its_results_undone() -> None:
    """The batch delivers a result to a waiter still pending, and the waiter's task is
    cancelled in that same loop turn: the caller never takes the result, so ``undo``
    ends it (for leased writes: the leases, which would otherwise live on)."""

    async def run() -> tuple[list[str], list[str]]:
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[list[str]] = loop.create_future()
        undone: list[str] = []
        coalescer: Coalescer[str, str] = Coalescer(run=lambda _: landed, undo=undone.extend)
        got: list[str] = []

        async def caller() -> None:
            got.extend(await coalescer.submit(["lease-a"]))

        task = asyncio.ensure_future(caller())
        for _ in range(3):  # submitted, its batch sent, waiting for the answer
            await asyncio.sleep(0)
        landed.set_result(["lease-a"])  # the batch wakes next and delivers
        loop.call_soon(task.cancel)  # the caller is cancelled in that same turn
        with pytest.raises(asyncio.CancelledError):
            await task
        return got, undone

    got, undone = asyncio.run(run())
    assert got == []
    assert undone == ["lease-a"]
