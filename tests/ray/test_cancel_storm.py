"""A cancellation or a timeout ends only its own call (issue 38, point 5), on real Ray,
under load: many coroutines in one async actor share one store client (and one trace
store client) while most of them are cancelled, or run past a deadline, at random
moments in any of their awaitable calls, with every core of the machine kept busy.

Every coroutine left alone must succeed or fail with a typed routeplay error (never a
``CancelledError`` of someone else's), later calls must work, and once the abandoned
coroutines' holders are revoked the store must hold exactly what the survivors hold.
The worker's hand-over of staged rows is slow, as a busy rollout worker's is: a put
cancelled while a shard waits for it leaves a rescue in flight that every other call of
the client waits on, which is where one waiter's cancellation used to reach the rest.

Seeds print in the test ids; ``ROUTEPLAY_STORM_SEEDS`` picks others (``7``, ``3,9``,
``100-119``), and ``benchmarks/cancel_storm.py`` runs 20 in a row and reports each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import wait_until

from routeplay.core import Handle, Routes, RouteSpec, canonicalize
from routeplay.errors import RouteplayError
from routeplay.rollout.trace_actor import TraceStoreClient, TraceStoreConfig
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.client.lease import Lease
from routeplay.store.remote.producer import TAKE_GROUP, AsyncRoutesProducer, producer_actor

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.long]

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
COROUTINES = int(os.environ.get("ROUTEPLAY_STORM_COROUTINES", "80"))
"""Coroutines storming one client at once."""
CANCELLED_SHARE = 0.45
"""Coroutines cancelled (``Task.cancel``) at a random moment."""
TIMED_OUT_SHARE = 0.15
"""Coroutines whose one call runs under a random short deadline (``asyncio.wait_for``)."""
JITTER_S = float(os.environ.get("ROUTEPLAY_STORM_JITTER", "0.03"))
"""A cancellation or deadline lands up to this long after its call started."""
STEPS = 12
"""Awaitable calls in one coroutine's script (``Storm.script``)."""
LOAD_DUTY = float(os.environ.get("ROUTEPLAY_STORM_DUTY", "0.5"))
"""Share of the time each core's busy loop spins."""
TAKE_DELAY_S = 0.02
"""How long the worker's hand-over of staged rows takes (a busy rollout worker): a put
cancelled while the shard waits for it is rescued by a marker that every other call of
the client then waits on, for that long at least."""


def storm_seeds(spec: str) -> list[int]:
    """``"7"``, ``"3,9"`` or ``"100-119"`` (ranges inclusive) as a list of seeds."""
    seeds: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        seeds += range(int(first), int(last or first) + 1)
    return seeds


SEEDS = storm_seeds(os.environ.get("ROUTEPLAY_STORM_SEEDS", "1,2"))


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


SPIN = """
import sys, time
busy, idle = float(sys.argv[1]), float(sys.argv[2])
while True:
    start = time.monotonic()
    while time.monotonic() - start < busy:
        pass
    time.sleep(idle)
"""
"""A process that keeps one core busy ``busy`` seconds out of every ``busy + idle``."""


@contextlib.contextmanager
def busy_cores(duty: float = LOAD_DUTY, period_s: float = 0.02) -> Iterator[None]:
    """One process per core, each busy ``duty`` of the time, for the duration (the
    failure showed only on a loaded machine: waits in flight last longer, so
    cancellations land inside them)."""
    busy, idle = duty * period_s, (1.0 - duty) * period_s
    spin = [sys.executable, "-c", SPIN, str(busy), str(idle)]
    loops = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait(timeout=10)


# -- the storm, inside one async actor ----------------------------------------------


@dataclass(slots=True)
class Fate:
    """What the storm does to one coroutine: nothing, a cancel, or a deadline, at the
    ``at``-th call of its script, ``delay_s`` after that call started."""

    kind: str
    """``"left"``, ``"cancelled"`` or ``"timed_out"``."""
    at: int
    """Which call of the script (0-based)."""
    delay_s: float
    """How long after that call started."""


def fates(seed: int, n: int) -> list[Fate]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        kind = (
            "cancelled"
            if u < CANCELLED_SHARE
            else "timed_out"
            if u < CANCELLED_SHARE + TIMED_OUT_SHARE
            else "left"
        )
        out.append(Fate(kind, rng.randrange(STEPS), rng.uniform(0.0, JITTER_S)))
    return out


@dataclass(slots=True)
class Coroutine:
    """One storming coroutine's record, written between its awaits (so it is exact
    whenever the coroutine is cancelled)."""

    index: int
    prefix: str
    fate: Fate
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the fated call starts (the canceller waits for it)."""
    handles: list[Handle] = field(default_factory=list)
    """Handles it received (a payload it may have left unleased)."""
    session: str = ""
    """Its trace-store session, once it inserted into one."""
    kept: Lease | None = None
    """The lease it holds at its end (None: it keeps nothing)."""

    def holder(self, role: str) -> str:
        return f"{self.prefix}/{self.index}/{role}"


class Storm:
    """Runs ``script`` in many coroutines over one client, cancelling or timing out
    those whose fate says so, and tells what came of each."""

    def __init__(
        self,
        store: RouteStore,
        traces: TraceStoreClient,
        producer: AsyncRoutesProducer,
        seed: int,
    ) -> None:
        self.store, self.traces, self.producer = store, traces, producer
        self.prefix = f"storm/{seed}"
        self.seed = seed

    async def call(self, me: Coroutine, step: int, awaitable: Awaitable[Any]) -> Any:
        """One call of the script: under a short deadline if it is the timed-out one."""
        if step != me.fate.at:
            return await awaitable
        me.reached.set()
        if me.fate.kind == "timed_out":
            return await asyncio.wait_for(awaitable, me.fate.delay_s)
        return await awaitable

    async def script(self, me: Coroutine) -> None:
        """Every awaitable call of the store and trace clients, one after the other."""
        s, t, i = self.store, self.traces, me.index
        handle = await self.call(me, 0, self.put(i, routing(8, self.seed * 10_000 + i)))
        me.handles.append(handle)
        if i % 2:
            lease = await self.call(me, 1, s.aacquire(handle, me.holder("a")))
        else:
            [lease] = await self.call(me, 1, s.aacquire_many([(handle, me.holder("a"))]))
        clone = await self.call(me, 2, lease.aclone(me.holder("b")))
        moved = await self.call(me, 3, clone.atransfer(me.holder("c")))
        me.session = f"storm-{self.seed}-{i}"
        await self.call(me, 4, t.ainsert(me.session, range(9), handle))
        exported = await self.call(me, 5, t.aexport(me.session, range(5), me.holder("x")))
        await self.call(me, 6, exported.lease.arelease())
        await self.call(me, 7, t.arelease_session(me.session))
        await self.call(me, 8, lease.arelease())
        assert await self.call(me, 9, s.arevoke_holder(me.holder("none"))) == 0
        if i % 3 == 0:
            await self.call(me, 10, moved.arelease())
        elif i % 3 == 1:
            await self.call(me, 10, s.arelease_many([moved]))
            await self.call(me, 11, s.aflush())
        else:
            await self.call(me, 10, s.astats())
            await self.call(me, 11, t.alongest_prefix(me.session, range(5)))
            me.kept = moved

    async def put(self, i: int, routes: Routes) -> Handle:
        """Written from this process, or through a shard that takes it from the worker."""
        s, producer = self.store, self.producer
        if i % 4 == 0:
            return await s.aput(routes)
        if i % 4 == 1:
            return (await s.aput_many([routes]))[0]
        if i % 4 == 2:
            return await producer.aput_routes(s, routes)
        return (await producer.aput_routes_many(s, [routes]))[0]

    async def cancel_later(self, me: Coroutine, task: asyncio.Task[None]) -> bool:
        """Cancel ``task`` once its fated call has run ``delay_s``; whether it was."""
        await me.reached.wait()
        await asyncio.sleep(me.fate.delay_s)
        return task.cancel()

    async def run(self, n: int) -> dict[str, Any]:
        crew = [Coroutine(i, self.prefix, fate) for i, fate in enumerate(fates(self.seed, n))]
        started = time.monotonic()
        outcome = await self.storm(crew)
        storm_s = time.monotonic() - started
        violations = [
            f"coroutine {me.index} ({me.fate.kind} at call {me.fate.at}): {outcome[me.index]}"
            for me in crew
            if outcome[me.index].startswith("violation")
        ]
        violations += await self.later_calls()
        violations += await self.clean_up([me for me in crew if outcome[me.index] != "ok"])
        kept = [me for me in crew if outcome[me.index] == "ok" and me.kept is not None]
        kinds = list(outcome.values())
        return {
            "seed": self.seed,
            "violations": violations,
            "outcomes": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
            "expected": sorted((me.holder("c"), 1) for me in kept),
            "storm_s": round(storm_s, 2),
            "rest_s": round(time.monotonic() - started - storm_s, 2),
        }

    async def storm(self, crew: list[Coroutine]) -> dict[int, str]:
        """Every coroutine's script at once, the fated ones cancelled; each one's outcome."""
        tasks = {me.index: asyncio.ensure_future(self.script(me)) for me in crew}
        cancels = {
            me.index: asyncio.ensure_future(self.cancel_later(me, tasks[me.index]))
            for me in crew
            if me.fate.kind == "cancelled"
        }
        await asyncio.wait(tasks.values())
        cancelled = {i for i, c in cancels.items() if c.done() and c.result()}
        for canceller in cancels.values():
            canceller.cancel()  # still waiting: its task ended before its fated call
        return {i: _outcome(task, i in cancelled) for i, task in tasks.items()}

    async def later_calls(self) -> list[str]:
        """The actor's next, unrelated calls: each must answer."""
        s, t = self.store, self.traces
        calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("arevoke_holder", lambda: s.arevoke_holder(f"{self.prefix}/nobody")),
            ("astats", s.astats),
            ("aflush", s.aflush),
            ("traces.astats", t.astats),
            ("aput+aacquire+arelease", self.fresh_lease),
        ]
        failed = []
        for name, call in calls:
            try:
                await call()
            except BaseException as exc:  # CancelledError included: the bug's symptom
                failed.append(f"violation: later call {name} raised {exc!r}")
        return failed

    async def fresh_lease(self) -> None:
        handle = await self.store.aput(routing(4, self.seed))
        await (await self.store.aacquire(handle, f"{self.prefix}/later")).arelease()

    async def clean_up(self, abandoned: list[Coroutine]) -> list[str]:
        """End everything the abandoned coroutines left (``end``); any error is one."""
        try:
            await self.end(abandoned)
        except BaseException as exc:  # CancelledError included: the bug's symptom
            return [f"violation: cleaning up after the storm raised {exc!r}"]
        return []

    async def end(self, abandoned: list[Coroutine]) -> None:
        """Their sessions, their leases (by holder), and payloads they received but
        never leased (leased here, then revoked), once every rescue of theirs has
        landed (``aflush``)."""
        await self.store.aflush()
        for me in abandoned:
            if me.session:
                await self.traces.arelease_session(me.session)
            for handle in me.handles:
                with contextlib.suppress(RouteplayError):  # already gone: fine
                    await self.store.aacquire(handle, f"{self.prefix}/cleanup")
        theirs = {me.holder(r) for me in abandoned for r in "abcx"} | {f"{self.prefix}/cleanup"}
        await self.store.arevoke([r for r in await self.store.aleaks() if r.holder in theirs])


def _outcome(task: asyncio.Task[None], cancelled_by_us: bool) -> str:
    """``ok``, ``cancelled``, ``timed_out``, ``typed: <error>`` or ``violation: ...``."""
    if task.cancelled():
        return "cancelled" if cancelled_by_us else "violation: cancelled by someone else"
    error = task.exception()
    if error is None:
        return "ok"
    if isinstance(error, RouteplayError):
        return f"typed: {type(error).__name__}"
    if isinstance(error, asyncio.TimeoutError):  # our own wait_for's deadline
        return "timed_out"
    return f"violation: {error!r}"


class StormWorker(AsyncRoutesProducer):
    """An asyncio rollout worker: one store client shared by every coroutine; a
    producer too, whose hand-over of staged rows is slow (``TAKE_DELAY_S``)."""

    async def storm(
        self, store: RouteStore, traces: TraceStoreClient, seed: int, n: int
    ) -> dict[str, Any]:
        return await Storm(store, traces, self, seed).run(n)

    @ray.method(concurrency_group=TAKE_GROUP)
    def take_staged(self, token: str) -> Any:
        time.sleep(TAKE_DELAY_S)  # its own thread (the take group): the loop runs on
        return super().take_staged(token)


Stormer: Any = producer_actor(StormWorker, num_cpus=0)


# -- the test -------------------------------------------------------------------------


class Stores:
    """The route store and trace store the seeds share, started on first use. A seed
    that fails leaves its leftovers behind: the next one starts on a fresh pair."""

    def __init__(self) -> None:
        self._pair: tuple[RouteStore, TraceStoreClient] | None = None

    def pair(self) -> tuple[RouteStore, TraceStoreClient]:
        if self._pair is None:
            config = StoreConfig(run=f"storm-{uuid.uuid4().hex[:6]}", shards=2, timeout_s=60)
            store = config.build()
            self._pair = store, TraceStoreConfig(timeout_s=60).build(store)
        return self._pair

    def spoil(self) -> None:
        if self._pair is not None:
            store, traces = self._pair
            self._pair = None
            traces.shutdown()
            with contextlib.suppress(RouteplayError):  # a failed release, raised again
                store.shutdown()


@pytest.fixture(scope="module")
def stores() -> Iterator[Stores]:
    shared = Stores()
    yield shared
    shared.spoil()


@pytest.fixture(scope="module")
def stormer() -> Any:
    actor = Stormer.remote()
    ray.get(actor.__ray_ready__.remote(), timeout=60)  # started before the cores are busy
    return actor


def run_storm(store: RouteStore, traces: TraceStoreClient, stormer: Any, seed: int) -> Any:
    """One seeded storm under load; what the actor reported."""
    print(f"cancel storm: seed {seed} (replay: ROUTEPLAY_STORM_SEEDS={seed})")
    with busy_cores():
        return ray.get(stormer.storm.remote(store, traces, seed, COROUTINES), timeout=240)


def summary(violations: list[str]) -> str:
    """The first few violations, and every one that is not a storming coroutine's."""
    others = [v for v in violations if not v.startswith("coroutine")]
    return f"{len(violations)} violations: " + "; ".join(violations[:5] + others)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_cancellation_or_timeout_ends_only_its_own_call(
    seed: int, stores: Stores, stormer: Any
) -> None:
    store, traces = stores.pair()
    try:
        check_storm(store, traces, stormer, seed)
    except BaseException:
        stores.spoil()
        raise


def check_storm(store: RouteStore, traces: TraceStoreClient, stormer: Any, seed: int) -> None:
    report = run_storm(store, traces, stormer, seed)
    figures = {k: report[k] for k in ("seed", "outcomes", "storm_s", "rest_s")}
    print(f"cancel storm: {json.dumps(figures)}")  # benchmarks/cancel_storm.py reads it
    assert report["violations"] == [], summary(report["violations"])
    counts = report["outcomes"]
    assert counts.get("cancelled", 0) > 0  # a storm ...
    assert counts.get("ok", 0) > 0  # ... and survivors
    expected = [tuple(pair) for pair in report["expected"]]

    def only_the_survivors() -> bool:
        stats = store.stats()
        return (
            sorted(stats.leases_by_holder) == expected
            and stats.live_payloads == len(expected)  # one payload under each kept lease
            and stats.unleased_payloads == 0
            and traces.stats().leases == 0
        )

    assert wait_until(only_the_survivors, timeout_s=30), (store.stats(), traces.stats())
    store.revoke(store.leaks())  # the survivors' kept leases: the next seed starts empty
    assert wait_until(lambda: store.stats().live_payloads == 0), store.stats()
