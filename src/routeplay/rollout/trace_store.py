"""``TraceStore``: per-session routing of every token sequence a multi-turn session saw.

Routing row ``i`` is the routing of input token ``i`` and depends only on tokens
``0..i`` (causal), so a stored sequence of ``n`` tokens carries rows ``[0, n - 1)``,
and a query sharing its first ``m`` tokens with it may reuse rows
``[0, min(m, n - 1))``. Each session keeps a ``TokenTrie`` of those sequences.

Ownership (the rules that keep routing neither freed early nor leaked):
- every trie value holds its own lease, holder ``session/<id>``; that lease is released
  exactly when the value is overwritten, or when the session is released;
- ``export`` gives the caller a *separate* lease (its own holder), so releasing the
  session never invalidates an exported sample, and releasing the sample never touches
  the session;
- ``release_session`` is the one place a session's leases end; it is idempotent, and
  ``session()`` / ``close()`` call it on exit so an exception cannot leak a session;
- a release that fails (a dead shard) never loses the lease: it is kept as the
  session's *unreleased* lease (counted by ``stats().unreleased``), retried by the next
  ``release_session`` of that session and by ``release_all``/``close``, or handed to a
  caller that can revoke it with ``take_unreleased``. Every lease of a release step is
  attempted and the first failure is raised afterwards (``releasing.first_error``).

Weight versions: stored handles keep their segments, and an export is a slice of one,
so every exported row carries the weight version it was stored with (a later turn's
prompt rows stay at the version of the turn that produced them, and the replay
buffer's staleness counts them).

The trace store writes payloads only to compact: a later turn's handle normally reuses
the earlier turn's segments and appends only the new rows, so shared prefixes are stored
once in the route store and the trie holds one node per inserted sequence. A session
whose handles pass ``CompactionPolicy.threshold`` segments is compacted
(``routeplay.store.client.compaction``: each row copied once, a prefix shared by branches one
payload, every row's weight version kept); the session leases the rebuilt handles
first and ends its old leases after, so nothing held is freed early or leaked (leases
of exported samples are never touched: they keep reading the old rows).

This module is plain Python (no Ray): the Ray actor that serves it to rollout workers,
and the typed client they call it through, live in ``routeplay.rollout.trace_actor``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple

from routeplay.core.handle import Handle
from routeplay.errors import HandleError, RouteplayError
from routeplay.rollout.releasing import attempt_each, raise_first
from routeplay.rollout.session_compaction import CompactionPolicy
from routeplay.rollout.token_trie import TokenTrie, as_key
from routeplay.store.client.compaction import CompactionReport, Write, compact_handles
from routeplay.store.client.lease import Lease

if TYPE_CHECKING:  # the client loads Ray; the trace store only calls it
    from routeplay.store.client.route_store import RouteStore

log = logging.getLogger(__name__)

__all__ = [
    "Exported",
    "PrefixMatch",
    "TraceEntry",
    "TraceStore",
    "TraceStoreStats",
    "session_holder",
]


def session_holder(session_id: str) -> str:
    """The lease holder name of a session's trie entries."""
    return f"session/{session_id}"


class TraceEntry(NamedTuple):
    """One stored sequence: its routing handle and the session's lease on it."""

    handle: Handle
    """Rows ``[0, len(tokens) - 1)`` of the sequence."""
    lease: Lease
    """The session's lease over the handle's payloads."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixMatch:
    """How much stored routing a query can reuse."""

    matched: int
    """Leading tokens of the query found in the session's trie."""
    rows: int
    """Routing rows ``[0, rows)`` valid for the query (0 when nothing is reusable)."""
    handle: Handle | None
    """Those rows of a stored sequence (``handle.rows == rows``); None when ``rows == 0``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Exported:
    """A prefix match handed to a caller together with the caller's own lease."""

    matched: int
    """Leading tokens of the query found in the session's trie."""
    rows: int
    """Routing rows ``[0, rows)`` valid for the query (always > 0)."""
    lease: Lease
    """The caller's lease on exactly those rows; the caller releases it."""

    @property
    def handle(self) -> Handle:
        """The exported rows (the lease's handle)."""
        return self.lease.handle


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceStoreStats:
    """A snapshot of what the trace store holds."""

    sessions: int
    """Live sessions."""
    nodes: int
    """Trie nodes over all sessions (stored sequences plus branch points)."""
    leases: int
    """Session leases held: one per stored sequence."""
    rows: int
    """Routing rows the stored handles cover, summed per sequence (rows shared by two
    sequences count twice here; their bytes live once in the route store)."""
    unreleased: int = 0
    """Leases whose release failed, kept for a retry or a revoke (not in ``leases``)."""
    compactions: int = 0
    """Session compactions that copied rows, since the start."""
    due: int = 0
    """Sessions past the compaction threshold, waiting for their compaction."""


_NO_MATCH = PrefixMatch(matched=0, rows=0, handle=None)


class TraceStore:
    """Session tries of ``(Handle, Lease)`` entries over a ``RouteStore`` client.

    Example:
        >>> traces = TraceStore(store, policy=CompactionPolicy(threshold=64))  # doctest: +SKIP
    """

    def __init__(
        self,
        store: RouteStore,
        *,
        policy: CompactionPolicy | None = None,
        write: Write | None = None,
        schedule: Callable[[], object] | None = None,
    ) -> None:
        """``write`` stores compacted rows (default: ``store.put_many``, owned by this
        process; the actor shell writes through a store shard). ``schedule`` arranges a
        later ``compact_due()`` call when a session becomes due (the actor sends it to
        itself); without it a due session is compacted before ``insert`` returns."""
        self._store = store
        self._tries: dict[str, TokenTrie[TraceEntry]] = {}
        self._unreleased: dict[str, list[Lease]] = {}
        self._policy = policy or CompactionPolicy()
        self._write = write
        self._schedule = schedule
        self._due: dict[str, None] = {}  # sessions past the threshold, in order
        self._compactions = 0

    # -- writing ----------------------------------------------------------------------
    def insert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None:
        """Store the routing of a full token sequence; the session leases the handle.

        An entry already stored under the same tokens is replaced and only the session's
        lease on it is released (leases of samples exported from it stay valid); if
        that release fails, the lease is kept as unreleased (the insert still counts).

        Example:
            >>> traces.insert("s", prompt + response, handle)  # doctest: +SKIP
        """
        tokens = as_key(token_ids)
        if handle.rows != len(tokens) - 1:
            raise HandleError(
                "a routing handle has one row per token except the last",
                expected=f"{len(tokens) - 1} rows for {len(tokens)} tokens",
                found=f"{handle.rows} rows",
                where=f"session {session}",
                hint="Pass the handle of the whole sequence (history rows + new rows).",
            )
        lease = self._store.acquire(handle, session_holder(session))
        trie = self._tries.setdefault(session, TokenTrie())
        old = trie.insert(tokens, TraceEntry(handle, lease))
        if old is not None:  # acquired first, so shared payloads never reach zero leases
            self._end(session, [old.lease])
        if self._policy.due(handle) and session not in self._due:
            self._due[session] = None
            if self._schedule is not None:
                self._schedule()
            else:
                self.compact_due()

    # -- compacting -------------------------------------------------------------------
    def compact(self, session: str) -> CompactionReport | None:
        """Copy the session's rows once into few payloads (a prefix its branches share
        stays one payload) and swap its entries to them; None for an unknown session.

        The session leases the rebuilt handles, then ends its old leases (a failed
        release is kept as unreleased, as everywhere here); exported samples keep
        their own leases on the old rows. Readers are never blocked by it.

        Example:
            >>> traces.compact("s").segments_after  # doctest: +SKIP
            1
        """
        self._due.pop(session, None)
        trie = self._tries.get(session)
        if trie is None:
            return None
        items = trie.items()
        holder = session_holder(session)
        done = compact_handles(self._store, [e.handle for _, e in items], holder, write=self._write)
        replaced = []
        for (tokens, old), handle, lease in zip(items, done.handles, done.leases, strict=True):
            if lease is not None:
                trie.insert(tokens, TraceEntry(handle, lease))
                replaced.append(old.lease)
        if replaced:
            self._compactions += 1
        raise_first(self._end(session, replaced), f"compacting session {session}")
        return done.report

    def compact_due(self) -> list[CompactionReport]:
        """Compact every due session; one that fails is logged (nothing of it changed,
        and its next insert past the threshold makes it due again), the others go on.

        Example:
            >>> traces.compact_due()  # doctest: +SKIP
        """
        reports = []
        for session in list(self._due):
            try:
                report = self.compact(session)
            except RouteplayError as exc:
                log.warning("compacting trace session %s failed: %s", session, exc)
                continue
            if report is not None:
                reports.append(report)
        return reports

    # -- reading ----------------------------------------------------------------------
    def longest_prefix(self, session: str, token_ids: Iterable[int]) -> PrefixMatch:
        """The stored routing rows a query can reuse (none for an unknown session)."""
        trie = self._tries.get(session)
        if trie is None:
            return _NO_MATCH
        matched, exact, below = trie.longest_match(token_ids)
        entry = below if below is not None else exact  # below: longer key, more rows
        if entry is None:
            return PrefixMatch(matched=matched, rows=0, handle=None)
        rows = min(matched, entry.handle.rows)
        if rows == 0:
            return PrefixMatch(matched=matched, rows=0, handle=None)
        return PrefixMatch(matched=matched, rows=rows, handle=entry.handle[:rows])

    def export(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None:
        """``longest_prefix`` plus a lease of ``holder`` on the matched rows (None when no
        row is reusable). The exported sample outlives the session until it is released;
        its rows keep the weight versions they were stored with.

        Example:
            >>> exported = traces.export("s", prompt, "rollout/a")  # doctest: +SKIP
        """
        match = self.longest_prefix(session, token_ids)
        if match.handle is None:
            return None
        lease = self._store.acquire(match.handle, holder)
        return Exported(matched=match.matched, rows=match.rows, lease=lease)

    def sessions(self) -> list[str]:
        """Live session ids, in order of their first insert."""
        return list(self._tries)

    def stats(self) -> TraceStoreStats:
        """Sessions, nodes, session leases and rows held right now."""
        tries = list(self._tries.values())
        return TraceStoreStats(
            sessions=len(tries),
            nodes=sum(trie.node_count() for trie in tries),
            leases=sum(len(trie) for trie in tries),
            rows=sum(entry.handle.rows for trie in tries for entry in trie.values()),
            unreleased=sum(len(leases) for leases in self._unreleased.values()),
            compactions=self._compactions,
            due=len(self._due),
        )

    # -- releasing --------------------------------------------------------------------
    def release_session(self, session: str) -> int:
        """Release every lease the session holds and drop its trie (idempotent), and
        retry the session's unreleased leases.

        Returns the leases released. Every lease is attempted even if one release fails;
        the failed ones are kept as unreleased and the first failure is raised.
        """
        released, errors = self._release(session)
        raise_first(errors, f"releasing session {session}")
        return released

    def release_all(self) -> int:
        """Release every session (all attempted, first failure raised); returns the
        leases released."""
        total, errors = 0, []
        for session in dict.fromkeys([*self._tries, *self._unreleased]):
            released, failed = self._release(session)
            total += released
            errors.extend(failed)
        raise_first(errors, "releasing every trace session")
        return total

    def take_unreleased(self) -> list[Lease]:
        """Hand the leases whose release failed to the caller (e.g. to revoke them once
        the dead shard is known); the trace store forgets them."""
        out = [lease for leases in self._unreleased.values() for lease in leases]
        self._unreleased.clear()
        return out

    def close(self) -> None:
        """Release every session (idempotent)."""
        self.release_all()

    @contextlib.contextmanager
    def session(self, session_id: str) -> Iterator[str]:
        """``with store.session(sid):`` releases the session on exit, exceptions included."""
        try:
            yield session_id
        finally:
            self.release_session(session_id)

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------
    def _release(self, session: str) -> tuple[int, list[Exception]]:
        self._due.pop(session, None)
        trie = self._tries.pop(session, None)
        leases = [entry.lease for entry in trie.values()] if trie is not None else []
        leases += self._unreleased.pop(session, [])
        live = [lease for lease in leases if not lease.released]
        errors = self._end(session, live)
        return len(live) - len(errors), errors

    def _end(self, session: str, leases: list[Lease]) -> list[Exception]:
        """Release ``leases``; keep each one that fails as the session's unreleased."""
        failures = attempt_each(leases, Lease.release)
        if failures:
            self._unreleased.setdefault(session, []).extend(lease for lease, _ in failures)
        return [exc for _, exc in failures]
