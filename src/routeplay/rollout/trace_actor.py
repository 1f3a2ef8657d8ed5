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

The actor is a producer (``routeplay.store.producer``): the rows it compacts are written
through a store shard, which owns them, so a compacted session's payloads (and samples
exported from them) survive the actor. A session that becomes due for compaction is
compacted by a call the actor sends itself after answering the insert: the rollout
worker that inserted does not wait for it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.rollout.session_compaction import CompactionPolicy
from routeplay.rollout.trace_store import Exported, PrefixMatch, TraceStore, TraceStoreStats
from routeplay.store import ray_calls
from routeplay.store.client import RouteStore
from routeplay.store.compaction import CompactionReport
from routeplay.store.lease import Lease
from routeplay.store.producer import RoutesProducer, producer_actor

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
        self._call("insert", session, list(token_ids), handle, where=f"session {session}")

    def longest_prefix(self, session: str, token_ids: Iterable[int]) -> PrefixMatch:
        """``TraceStore.longest_prefix`` (no lease is taken)."""
        match: PrefixMatch = self._call(
            "longest_prefix", session, list(token_ids), where=f"session {session}"
        )
        return match

    def export(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None:
        """``TraceStore.export``: the matched rows with a lease of ``holder`` (the
        caller's to release); None when no row is reusable."""
        exported: Exported | None = self._call(
            "export", session, list(token_ids), holder, where=f"session {session} for {holder}"
        )
        return exported

    def release_session(self, session: str) -> int:
        """``TraceStore.release_session``: the leases released (idempotent)."""
        released: int = self._call("release_session", session, where=f"session {session}")
        return released

    def release_all(self) -> int:
        """``TraceStore.release_all``: every session's leases released."""
        released: int = self._call("release_all", where="every session")
        return released

    def take_unreleased(self) -> list[Lease]:
        """``TraceStore.take_unreleased``: the caller now owns these stuck leases."""
        leases: list[Lease] = self._call("take_unreleased", where="stuck leases")
        return leases

    def compact(self, session: str) -> CompactionReport | None:
        """``TraceStore.compact``, done by the actor: the session's rows copied once
        into few payloads (None for an unknown session). The caller only waits; its
        own leases are untouched.

        Example:
            >>> traces.compact("s1").segments_after  # doctest: +SKIP
            1
        """
        report: CompactionReport | None = self._call("compact", session, where=f"session {session}")
        return report

    def sessions(self) -> list[str]:
        """Live session ids."""
        sessions: list[str] = self._call("sessions", where="sessions")
        return sessions

    def stats(self) -> TraceStoreStats:
        """A snapshot of what the trace store holds."""
        stats: TraceStoreStats = self._call("stats", where="stats")
        return stats

    def shutdown(self) -> None:
        """End the actor (its sessions' leases end with the run's store; release first)."""
        ray.kill(self.actor)

    def _call(self, method: str, *args: Any, where: str) -> Any:
        pending = getattr(self.actor, method).remote(*args)
        what = f"trace store {method}, {where}"
        return ray_calls.get(pending, timeout_s=self.config.timeout_s, what=what)
