"""Store flows driven without Ray: one generator per call, two drivers, one rescue.

``drive`` and ``adrive`` run the same flow to the same result; an error at a wait is
thrown into the flow; ``awaiting`` rescues calls only when a wait is abandoned with
them in flight (cancelled, timed out), never when they answered with their own error;
and every awaitable store call, abandoned at its wait, leaves no lease and no payload
(the in-process backend: the calls already ran, the answer never arrived).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
from faults import FaultyBackend

from routeplay.core import EngineKey, Routes, RouteSpec, canonicalize
from routeplay.errors import ReleaseFailed, RoutesExpired, RoutesLost, StoreTimeout
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.flow import Flow, Wait, adrive, awaiting, drive
from routeplay.store.remote.backend import Backend, LocalBackend, RayBackend

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


class Answers:
    """A resolver that answers each wait with the next scripted value or error."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.waits: list[Wait] = []

    def _next(self, wait: Wait) -> list[Any]:
        self.waits.append(wait)
        answer = self.script.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)

    def resolve(self, wait: Wait) -> list[Any]:
        return self._next(wait)

    async def aresolve(self, wait: Wait) -> list[Any]:
        await asyncio.sleep(0)
        return self._next(wait)


def two_steps(rescued: list[Sequence[Any]]) -> Flow[str]:
    [first] = yield from awaiting(["a"], "first", rescue=rescued.append)
    try:
        [second] = yield from awaiting(["b"], "second", rescue=rescued.append)
    except RoutesLost:
        second = "lost"
    return f"{first}+{second}"


@pytest.mark.parametrize("driver", ["drive", "adrive"])
def test_both_drivers_run_one_flow_to_one_result(driver: str) -> None:
    def run(*script: Any) -> tuple[str, list[Sequence[Any]]]:
        rescued: list[Sequence[Any]] = []
        flow, answers = two_steps(rescued), Answers(*script)
        result = drive(flow, answers) if driver == "drive" else asyncio.run(adrive(flow, answers))
        assert [w.what for w in answers.waits] == ["first", "second"]
        return result, rescued

    assert run([1], [2]) == ("1+2", [])
    # the call's own error is thrown into the flow at its wait: nothing to rescue
    assert run([1], RoutesLost("gone")) == ("1+lost", [])


@pytest.mark.parametrize(
    "abandoned", [asyncio.CancelledError(), StoreTimeout("late"), KeyboardInterrupt()]
)
def test_a_wait_abandoned_in_flight_hands_its_calls_to_the_rescue(
    abandoned: BaseException,
) -> None:
    rescued: list[Sequence[Any]] = []
    with pytest.raises(type(abandoned)):
        drive(two_steps(rescued), Answers([1], abandoned))
    assert rescued == [["b"]]


def test_a_call_that_answered_its_own_error_is_not_rescued() -> None:
    rescued: list[Sequence[Any]] = []

    def flow() -> Flow[None]:
        yield from awaiting(["x"], "x", rescue=rescued.append)

    with pytest.raises(RoutesExpired):
        drive(flow(), Answers(RoutesExpired("ttl")))
    assert rescued == []


# -- every awaitable store call, abandoned at its wait ----------------------------


class AbandonAt:
    """The in-process backend, with the first wait on sent calls (not a release's)
    abandoned as a cancelled task abandons it: the calls ran, their answer is lost."""

    def __init__(self, inner: LocalBackend, *, releases: bool = False) -> None:
        self.inner = inner
        self.releases = releases
        self.armed = True

    async def aresolve(self, wait: Wait) -> list[Any]:
        if self.armed and (self.releases or not wait.what.endswith(": release")):
            self.armed = False
            raise asyncio.CancelledError
        return list(await self.inner.aresolve(wait))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


Start = Callable[[RouteStore], Callable[[], Awaitable[Any]]]


def _engine_key(store: RouteStore, seed: int, rows: int = 6) -> EngineKey:
    backend = store.backend
    inner = backend.inner if isinstance(backend, AbandonAt) else backend
    assert isinstance(inner, LocalBackend)
    return EngineKey(key=inner.engine_store().put(routing(rows, seed).array), rows=rows)


def _kept(store: RouteStore) -> Any:
    return store.put_leased(routing(6, 1), "keeper")


CASES: dict[str, Start] = {
    "aput": lambda s: lambda: s.aput(routing(6, 0)),
    "aput_many": lambda s: lambda: s.aput_many([routing(6, i) for i in range(3)], pack=True),
    "aput_leased": lambda s: lambda: s.aput_leased(routing(6, 0), "cancelled"),
    "aput_leased_many": lambda s: (
        lambda: s.aput_leased_many([routing(6, 0)] * 3, "cancelled", shared_prefix=4)
    ),
    "aadopt_key": lambda s: lambda: s.aadopt_key(_engine_key(s, 2), SPEC),
    "aadopt_keys_each": lambda s: (
        lambda: s.aadopt_keys_each(
            [_engine_key(s, 3) for _ in range(3)], SPEC, shared_prefix=4, pack=True
        )
    ),
    "aacquire_many": lambda s: (
        lambda: s.aacquire_many([(_kept(s)[0], "cancelled"), (_kept(s)[0], "cancelled")])
    ),
    "Lease.aclone": lambda s: _kept(s)[1].aclone,
    "Lease.atransfer": lambda s: _kept(s)[1].atransfer,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_abandoned_call_leaves_no_lease_and_no_payload(name: str) -> None:
    backend = AbandonAt(LocalBackend("flows", shards=2, ttl_s=600))
    store = RouteStore(StoreConfig(run="flows", shards=2), backend)
    start = CASES[name](store)
    call = start if name not in ("Lease.aclone", "Lease.atransfer") else lambda: start("x")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(call())
    assert {leak.holder for leak in store.leaks()} <= {"keeper"}
    store.revoke_holder("keeper")
    stats = store.stats()
    assert (stats.leases, stats.live_payloads) == (0, 0), stats
    assert backend.inner.engine_store().stats().live_keys == 0


def test_a_cancelled_flush_keeps_its_releases_and_raises_a_failure_once() -> None:
    backend = AbandonAt(LocalBackend("flush", shards=1, ttl_s=600), releases=True)
    store = RouteStore(StoreConfig(run="flush"), backend)
    store.release_many([store.put_leased(routing(6, 1), "reader")[1]])
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(store.aflush())
    assert len(store._core.releases) == 1  # still tracked: a cancelled wait took nothing away
    store.flush()
    assert store.stats().leases == 0
    assert len(store._core.releases) == 0


def test_a_release_failure_is_raised_by_one_call_only() -> None:
    from faults import faulty_store

    store, faults = faulty_store("once")
    _, lease = store.put_leased(routing(6, 0), "reader")
    faults.lose_releases(lease)
    store.release_many([lease])
    with pytest.raises(ReleaseFailed):
        asyncio.run(store.aflush())
    store.flush()  # already reported: not raised twice
    faults.heal()
    store.revoke([lease])
    assert store.stats().leases == 0


@pytest.mark.parametrize("face", ["sync", "async"])
def test_the_two_faces_store_the_same_rows(face: str) -> None:
    store = RouteStore.local(StoreConfig(run=f"faces-{face}"))
    group = [routing(8, 0), routing(8, 0), routing(8, 1)]
    key = _engine_key(store, 4, rows=8)
    if face == "sync":
        pairs = store.put_leased_many(group, "g", shared_prefix=4)
        adopted = store.adopt_key(key, SPEC, start_row=2)
    else:

        async def both() -> tuple[Any, Any]:
            pairs = await store.aput_leased_many(group, "g", shared_prefix=4)
            return pairs, await store.aadopt_key(key, SPEC, start_row=2)

        pairs, adopted = asyncio.run(both())
    for (handle, _), routes in zip(pairs, group, strict=True):
        np.testing.assert_array_equal(store.read(handle), routes.array)
    np.testing.assert_array_equal(store.read(adopted), routing(8, 4).array[2:])
    assert store.stats().shared_prefix_bytes_saved == routing(4, 0).nbytes
    store.release_many([lease for _, lease in pairs])
    assert store.stats().leases == 0


@pytest.mark.parametrize("backend", [LocalBackend, RayBackend, FaultyBackend])
def test_every_backend_has_every_call_of_the_backend_interface(backend: type) -> None:
    """A backend missing a call fails only on the path that makes it (the fault wrapper
    once lacked ``ask_engines``: a rare lifecycle path raised AttributeError mid-release)."""
    calls = {name for name in vars(Backend) if not name.startswith("_")}
    assert calls
    assert not {name for name in calls if not hasattr(backend, name)}
