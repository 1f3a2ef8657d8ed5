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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.rollout.trace_store import Exported, PrefixMatch, TraceStore, TraceStoreStats
from routeplay.store import ray_calls
from routeplay.store.client import RouteStore
from routeplay.store.lease import Lease

__all__ = ["TraceStoreActor", "TraceStoreClient", "TraceStoreConfig", "TraceStoreShell"]


class TraceStoreShell:
    """Ray actor shell: each method forwards to a ``TraceStore``."""

    def __init__(self, store: RouteStore) -> None:
        self._traces = TraceStore(store)

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


# The Ray actor class (typed Any: ray.remote's result has no useful static type).
TraceStoreActor: Any = ray.remote(num_cpus=0)(TraceStoreShell)


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
        actor = TraceStoreActor.options(num_cpus=self.num_cpus).remote(store)
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
