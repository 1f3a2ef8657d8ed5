"""A cancellation or a deadline ends only its own wait (issue 38, point 5), without Ray.

Rescue markers (``RayBackend.when_done``) are plain ``concurrent.futures`` futures that
every later call of the client settles, so many coroutines await the same one. Awaited
through ``asyncio.wrap_future``, a waiter's cancellation (its task's, or ``wait_for``'s
at its deadline) cancelled the shared marker itself: every other waiter, and every later
call that settled it, then raised ``CancelledError``. These tests pin that one waiter's
end leaves the marker, and the other waiters, alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable
from typing import Any

import pytest

from routeplay.errors import ReleaseFailed, RoutesLost, StoreFailure, StoreTimeout
from routeplay.store.client.releases import PendingReleases
from routeplay.store.flow import Wait, adrive
from routeplay.store.remote import ray_calls
from routeplay.store.remote.backend import RayBackend


async def started(*waits: Awaitable[Any]) -> list[asyncio.Task[Any]]:
    """The waits as tasks, each already waiting (past its first await)."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    for _ in range(3):
        await asyncio.sleep(0)
    assert not any(task.done() for task in tasks)
    return tasks


def test_a_cancelled_waiter_leaves_the_shared_marker_to_the_others() -> None:
    marker: concurrent.futures.Future[int] = concurrent.futures.Future()

    async def scenario() -> list[Any]:
        doomed, other = await started(
            ray_calls.aget([marker], timeout_s=30, what="marker"),
            ray_calls.aget([marker], timeout_s=30, what="marker"),
        )
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert not marker.cancelled()  # the marker is not the waiter's to cancel
        marker.set_result(7)  # what the rescue's callback does when its call lands
        later = await ray_calls.aget([marker], timeout_s=30, what="marker")
        return [await other, later]

    assert asyncio.run(scenario()) == [[7], [7]]


def test_a_waiter_past_its_deadline_leaves_the_shared_marker_to_the_others() -> None:
    marker: concurrent.futures.Future[int] = concurrent.futures.Future()

    async def scenario() -> list[int]:
        [other] = await started(ray_calls.aget([marker], timeout_s=30, what="marker"))
        with pytest.raises(StoreTimeout):
            await ray_calls.aget([marker], timeout_s=0.05, what="marker")
        assert not marker.cancelled()
        marker.set_result(7)
        answer: list[int] = await other
        return answer

    assert asyncio.run(scenario()) == [7]


def test_a_cancelled_each_wait_leaves_the_shared_marker_to_the_others() -> None:
    # ``each`` waits (a settle of releases) answer per result: the same shared markers.
    marker: concurrent.futures.Future[int] = concurrent.futures.Future()
    wait = Wait((marker,), "release", timeout_s=30, each=True)

    async def scenario() -> list[Any]:
        doomed, other = await started(ray_calls.RAY.aresolve(wait), ray_calls.RAY.aresolve(wait))
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        marker.set_result(3)
        answer: list[Any] = await other
        return answer

    assert asyncio.run(scenario()) == [3]


def test_each_waiter_gets_the_shared_marker_s_error() -> None:
    marker: concurrent.futures.Future[int] = concurrent.futures.Future()

    async def scenario() -> list[Any]:
        waiting = await started(
            *(ray_calls.aget([marker], timeout_s=30, what="marker") for _ in range(2))
        )
        marker.set_exception(RoutesLost("the rescued call's shard died"))
        return await asyncio.gather(*waiting, return_exceptions=True)

    assert [type(answer) for answer in asyncio.run(scenario())] == [RoutesLost, RoutesLost]


class _InFlight:
    """A Ray reference stand-in: ``future()`` is what Ray completes when the call lands."""

    def __init__(self) -> None:
        self.landing: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future[Any]:
        return self.landing


def test_a_rescue_marker_cannot_be_cancelled_by_anyone() -> None:
    call = _InFlight()
    landed: list[Any] = []
    marker = RayBackend([], timeout_s=30).when_done(call, landed.append)
    assert marker.cancel() is False  # a waiter's wrap_future, anyone's: refused
    call.landing.set_result("grant")
    assert landed == ["grant"]
    assert marker.result(timeout=0) is None


def test_one_settle_cancelled_leaves_the_others_and_later_calls_working() -> None:
    """The failure as found: coroutines settle the client's releases before each call;
    one is cancelled while a rescue is in flight; the others, and the next unrelated
    call's settle, must still end once the rescued call lands."""
    backend = RayBackend([], timeout_s=30)
    releases = PendingReleases(backend)
    call = _InFlight()
    releases.rescue([call], undo=lambda index, value: [])  # its grant needs no undo here

    async def scenario() -> None:
        doomed, *others = await started(
            *(adrive(releases.settle(wait=True), backend) for _ in range(3))
        )
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        call.landing.set_result("grant")
        assert await asyncio.gather(*others) == [None, None]
        await adrive(releases.settle(wait=True), backend)  # a later, unrelated call

    asyncio.run(scenario())
    assert len(releases) == 0


@pytest.mark.parametrize("face", ["blocking", "awaited"])
def test_a_future_cancelled_elsewhere_is_a_typed_error_not_a_cancellation(face: str) -> None:
    # Not a marker of ours (those refuse cancel): any other plain future someone cancelled.
    cancelled: concurrent.futures.Future[int] = concurrent.futures.Future()
    cancelled.cancel()
    wait = Wait((cancelled,), "foreign", timeout_s=5)

    def resolve() -> Any:
        if face == "blocking":
            return ray_calls.RAY.resolve(wait)
        return asyncio.run(ray_calls.RAY.aresolve(wait))

    with pytest.raises(StoreFailure) as raised:
        resolve()
    assert "foreign" in str(raised.value)


def test_a_release_settled_after_a_foreign_cancel_fails_once_typed() -> None:
    backend = RayBackend([], timeout_s=30)
    releases = PendingReleases(backend)
    cancelled: concurrent.futures.Future[None] = concurrent.futures.Future()
    cancelled.cancel()
    releases.track([cancelled])

    async def twice() -> None:
        with pytest.raises(ReleaseFailed):
            await adrive(releases.settle(wait=True), backend)
        await adrive(releases.settle(wait=True), backend)  # raised once, then gone

    asyncio.run(twice())
    assert len(releases) == 0
