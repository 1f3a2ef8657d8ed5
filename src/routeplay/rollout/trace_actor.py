"""The trace store as a Ray actor, and ``TraceStoreClient``: the typed way to call it.

``TraceStoreShell`` is the thin actor shell over the plain ``TraceStore``;
``TraceStoreActor`` is that shell made remote. Processes never call the actor's methods
by name: they hold a ``TraceStoreClient`` (a small picklable object: the actor handle
and its config, like ``RouteStore`` for the route store), whose methods have the plain
class's signatures, a deadline on every call (``TraceStoreConfig.timeout_s``) and Ray's
failures translated into routeplay's errors (``StoreTimeout`` when the actor does not
answer in time, ``RoutesLost`` when it died; an error raised inside the actor, e.g.
``HandleError``, comes back as itself), each ``raise ... from`` the Ray exception.

The ownership rules are the plain class's (``routeplay.rollout.trace_store``): a lease
the client returns (``export``, ``take_unreleased``) is the caller's to release.

The actor is a producer (``routeplay.store.remote.producer``): the rows it compacts are written
through a store shard, which owns them, so a compacted session's payloads (and samples
exported from them) survive the actor. A session that becomes due for compaction is
compacted by a call the actor sends itself after answering the insert: the rollout
worker that inserted does not wait for it.

Each call has an awaitable twin (``ainsert``, ``aexport``, ``arelease_session``, ...):
the same flow (``routeplay.store.flow``), awaited on the actor's reference instead of
``ray.get``. Cancelled in flight, a call still lands in the actor: an insert is the
session's (``release_session`` ends it), a release still ends its leases, and an
export's lease is released by the actor as soon as the export is done
(``release_exported``, handed the export's own reference): nobody is left holding it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.rollout.session_compaction import CompactionPolicy
from routeplay.rollout.trace_store import Exported, PrefixMatch, TraceStore, TraceStoreStats
from routeplay.store.client.compaction import CompactionReport
from routeplay.store.client.lease import Lease
from routeplay.store.client.route_store import RouteStore
from routeplay.store.flow import Flow, adrive, awaiting, drive
from routeplay.store.remote import ray_calls
from routeplay.store.remote.producer import RoutesProducer, producer_actor

__all__ = ["TraceStoreActor", "TraceStoreClient", "TraceStoreConfig", "TraceStoreShell"]


class TraceStoreShell(RoutesProducer):
    """Ray actor shell: each method forwards to a ``TraceStore``. In an actor, compacted
    rows are written through a store shard and due sessions compacted by a call to
    itself; in process (tests), as the plain class does."""

    def __init__(self, store: RouteStore, policy: CompactionPolicy | None = None) -> None:
        me = _this_actor()
        if me is None:
            self._traces = TraceStore(store, policy=policy)
            return
        self._traces = TraceStore(
            store,
            policy=policy,
            write=functools.partial(self.put_routes_many, store),
            schedule=me.compact_due.remote,  # runs after the call that made a session due
        )

    def insert(self, session: str, token_ids: list[int], handle: Handle) -> None:
        self._traces.insert(session, token_ids, handle)

    def longest_prefix(self, session: str, token_ids: list[int]) -> PrefixMatch:
        return self._traces.longest_prefix(session, token_ids)

    def export(self, session: str, token_ids: list[int], holder: str) -> Exported | None:
        return self._traces.export(session, token_ids, holder)

    def release_exported(self, exported: Exported | None) -> int:
        """End an export's lease that nobody received (its caller was cancelled); Ray
        hands the export's result here once it exists. Returns the leases ended."""
        if exported is None:
            return 0
        exported.lease.release()
        return 1

    def release_session(self, session: str) -> int:
        return self._traces.release_session(session)

    def release_all(self) -> int:
        return self._traces.release_all()

    def take_unreleased(self) -> list[Lease]:
        return self._traces.take_unreleased()

    def sessions(self) -> list[str]:
        return self._traces.sessions()

    def stats(self) -> TraceStoreStats:
        return self._traces.stats()

    def compact(self, session: str) -> CompactionReport | None:
        return self._traces.compact(session)

    def compact_due(self) -> list[CompactionReport]:
        return self._traces.compact_due()


def _this_actor() -> Any:
    """The handle of the actor this code runs in, or None outside an actor (checked
    without starting Ray: ``get_runtime_context`` would)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    return ray.get_runtime_context().current_actor


# The Ray actor class (typed Any: ray.remote's result has no useful static type); a
# producer actor, so the shard can take the rows it compacts.
TraceStoreActor: Any = producer_actor(TraceStoreShell, num_cpus=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceStoreConfig:
    """How a run's trace-store actor is started and called.

    Example:
        >>> traces = TraceStoreConfig(timeout_s=30).build(store)  # doctest: +SKIP
    """

    timeout_s: float = 60.0
    """Deadline of every call to the actor (seconds)."""
    num_cpus: float = 0.0
    """CPUs the actor reserves (0: it mostly waits on the route store)."""
    compaction: CompactionPolicy = field(default_factory=CompactionPolicy)
    """When sessions are compacted (past 64 segments, automatically, by default)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise MisuseError(
                "invalid TraceStoreConfig.timeout_s", expected="> 0", found=self.timeout_s
            )
        if self.num_cpus < 0:
            raise MisuseError(
                "invalid TraceStoreConfig.num_cpus", expected=">= 0", found=self.num_cpus
            )

    def build(self, store: RouteStore) -> TraceStoreClient:
        """Start the trace-store actor over ``store``; returns its client."""
        actor = TraceStoreActor.options(num_cpus=self.num_cpus).remote(store, self.compaction)
        return TraceStoreClient(actor=actor, config=self)


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceStoreClient:
    """Typed, deadline-bound calls to one trace-store actor (picklable: pass it to
    rollout workers like a ``RouteStore``).

    Example:
        >>> traces = TraceStoreConfig().build(store)  # doctest: +SKIP
        >>> traces.insert("s1", prompt + response, handle)
        >>> exported = traces.export("s1", prompt + response + user_turn, "rollout/a")
        >>> traces.release_session("s1")  # the exported lease stays valid
        1
    """

    actor: Any
    """The ``TraceStoreActor`` handle."""
    config: TraceStoreConfig
    """Deadlines (and how the actor was started)."""

    def insert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None:
        """``TraceStore.insert``: the session leases ``handle`` (its own lease)."""
        drive(self._insert(session, token_ids, handle), ray_calls.RAY)

    async def ainsert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None:
        """Awaitable ``insert``.

        Example:
            >>> await traces.ainsert("s1", prompt + response, handle)  # doctest: +SKIP
        """
        await adrive(self._insert(session, token_ids, handle), ray_calls.RAY)

    def _insert(self, session: str, token_ids: Iterable[int], handle: Handle) -> Flow[None]:
        call = self.actor.insert.remote(session, list(token_ids), handle)
        yield from self._await(call, "insert", f"session {session}")

    def longest_prefix(self, session: str, token_ids: Iterable[int]) -> PrefixMatch:
        """``TraceStore.longest_prefix`` (no lease is taken)."""
        match: PrefixMatch = drive(self._longest_prefix(session, token_ids), ray_calls.RAY)
        return match

    async def alongest_prefix(self, session: str, token_ids: Iterable[int]) -> PrefixMatch:
        """Awaitable ``longest_prefix``.

        Example:
            >>> match = await traces.alongest_prefix("s1", prompt)  # doctest: +SKIP
        """
        match: PrefixMatch = await adrive(self._longest_prefix(session, token_ids), ray_calls.RAY)
        return match

    def _longest_prefix(self, session: str, token_ids: Iterable[int]) -> Flow[Any]:
        call = self.actor.longest_prefix.remote(session, list(token_ids))
        return (yield from self._await(call, "longest_prefix", f"session {session}"))

    def export(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None:
        """``TraceStore.export``: the matched rows with a lease of ``holder`` (the
        caller's to release); None when no row is reusable."""
        exported: Exported | None = drive(self._export(session, token_ids, holder), ray_calls.RAY)
        return exported

    async def aexport(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None:
        """Awaitable ``export`` (cancelled in flight: the actor ends the export's lease).

        Example:
            >>> exported = await traces.aexport("s1", prompt, "rollout/a")  # doctest: +SKIP
        """
        flow = self._export(session, token_ids, holder)
        exported: Exported | None = await adrive(flow, ray_calls.RAY)
        return exported

    def _export(self, session: str, token_ids: Iterable[int], holder: str) -> Flow[Any]:
        call = self.actor.export.remote(session, list(token_ids), holder)
        where = f"session {session} for {holder}"
        return (yield from self._await(call, "export", where, rescue=self._release_exported))

    def _release_exported(self, pending: Sequence[Any]) -> None:
        # A top-level reference argument is resolved by Ray before the task runs: the
        # actor gets the export itself, once it exists, and ends its lease. Not waited for.
        for export in pending:
            self.actor.release_exported.remote(export)

    def release_session(self, session: str) -> int:
        """``TraceStore.release_session``: the leases released (idempotent)."""
        released: int = drive(self._release_session(session), ray_calls.RAY)
        return released

    async def arelease_session(self, session: str) -> int:
        """Awaitable ``release_session`` (cancelled in flight: the release still lands).

        Example:
            >>> await traces.arelease_session("s1")  # doctest: +SKIP
            1
        """
        released: int = await adrive(self._release_session(session), ray_calls.RAY)
        return released

    def _release_session(self, session: str) -> Flow[Any]:
        call = self.actor.release_session.remote(session)
        return (yield from self._await(call, "release_session", f"session {session}"))

    def release_all(self) -> int:
        """``TraceStore.release_all``: every session's leases released."""
        released: int = drive(self._simple("release_all", "every session"), ray_calls.RAY)
        return released

    async def arelease_all(self) -> int:
        """Awaitable ``release_all``.

        Example:
            >>> await traces.arelease_all()  # doctest: +SKIP
        """
        released: int = await adrive(self._simple("release_all", "every session"), ray_calls.RAY)
        return released

    def take_unreleased(self) -> list[Lease]:
        """``TraceStore.take_unreleased``: the caller now owns these stuck leases."""
        leases: list[Lease] = drive(self._simple("take_unreleased", "stuck"), ray_calls.RAY)
        return leases

    async def atake_unreleased(self) -> list[Lease]:
        """Awaitable ``take_unreleased`` (cancelled in flight: the actor has let go of
        them, so ``RouteStore.leaks()`` names them under their session holders, for
        ``revoke`` or the lease TTL).

        Example:
            >>> stuck = await traces.atake_unreleased()  # doctest: +SKIP
        """
        leases: list[Lease] = await adrive(self._simple("take_unreleased", "stuck"), ray_calls.RAY)
        return leases

    def compact(self, session: str) -> CompactionReport | None:
        """``TraceStore.compact``, done by the actor: the session's rows copied once
        into few payloads (None for an unknown session). The caller only waits; its
        own leases are untouched.

        Example:
            >>> traces.compact("s1").segments_after  # doctest: +SKIP
            1
        """
        report: CompactionReport | None = drive(self._compact(session), ray_calls.RAY)
        return report

    async def acompact(self, session: str) -> CompactionReport | None:
        """Awaitable ``compact`` (cancelled in flight: the compaction still runs in the
        actor, which swaps its own leases; nothing is left to the caller).

        Example:
            >>> report = await traces.acompact("s1")  # doctest: +SKIP
        """
        report: CompactionReport | None = await adrive(self._compact(session), ray_calls.RAY)
        return report

    def _compact(self, session: str) -> Flow[Any]:
        call = self.actor.compact.remote(session)
        return (yield from self._await(call, "compact", f"session {session}"))

    def sessions(self) -> list[str]:
        """Live session ids."""
        sessions: list[str] = drive(self._simple("sessions", "sessions"), ray_calls.RAY)
        return sessions

    async def asessions(self) -> list[str]:
        """Awaitable ``sessions``.

        Example:
            >>> await traces.asessions()  # doctest: +SKIP
        """
        sessions: list[str] = await adrive(self._simple("sessions", "sessions"), ray_calls.RAY)
        return sessions

    def stats(self) -> TraceStoreStats:
        """A snapshot of what the trace store holds."""
        stats: TraceStoreStats = drive(self._simple("stats", "stats"), ray_calls.RAY)
        return stats

    async def astats(self) -> TraceStoreStats:
        """Awaitable ``stats``.

        Example:
            >>> (await traces.astats()).leases  # doctest: +SKIP
        """
        stats: TraceStoreStats = await adrive(self._simple("stats", "stats"), ray_calls.RAY)
        return stats

    def shutdown(self) -> None:
        """End the actor (its sessions' leases end with the run's store; release first)."""
        ray.kill(self.actor)

    def _simple(self, method: str, where: str) -> Flow[Any]:
        """A call without arguments (``sessions``, ``stats``, ...)."""
        call = getattr(self.actor, method).remote()
        return (yield from self._await(call, method, where))

    def _await(
        self,
        pending: Any,
        method: str,
        where: str,
        *,
        rescue: Callable[[Sequence[Any]], None] | None = None,
    ) -> Flow[Any]:
        what = f"trace store {method}, {where}"
        timeout_s = self.config.timeout_s
        [answer] = yield from awaiting([pending], what, timeout_s=timeout_s, rescue=rescue)
        return answer
