"""Releases that do not block the reader, and whose errors are never lost.

A release is sent to its shard and not waited for: a trainer rank moves on to its next
micro-batch at once, and sending never raises what an earlier release did. Each later
call of the client settles what has finished: a read looks without waiting; a metadata
call (acquire, stats, ...) first waits for every release in flight (shard actors are
threaded, so this keeps "release, then ask" in order for one client); ``flush`` and
``shutdown`` wait too. A failed release is raised there (``ReleaseFailed``), once.

Calls that end things (revokes, frees, a waited release) whose wait was abandoned in
flight are tracked here as well (``track``), so no later call overtakes them. Rescues
land here too: a call abandoned while in flight (a cancelled task, a deadline)
hands its pending results to ``rescue``; when each lands, the calls that undo what it
granted are sent like releases, so their failures surface the same way and ``flush``
waits for them.

Threads: one client may be used from many threads (and many tasks). A settling call
waits for every release in flight when it started, whichever thread sent it, and takes
them off the list only once they are done: so no call overtakes a release sent before
it, a cancelled wait leaves them on the list, and each failure is raised by the one call
that took it off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from routeplay.errors import ReleaseFailed
from routeplay.store.flow import Flow, awaiting
from routeplay.store.remote.backend import Backend
from routeplay.store.shard.api import ShardCall

__all__ = ["PendingReleases", "Undo"]

Undo = Callable[[int, Any], Sequence[ShardCall[Any]]]
"""What undoes a landed call: ``(index of the pending result, its value)`` -> calls."""


class PendingReleases:
    """Release calls in flight for one client, settled at the client's next calls."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}  # id -> pending result (kept alive here)

    def submit(self, calls: Sequence[ShardCall[Any]]) -> None:
        """Send the calls; their outcome is collected by a later call, never here."""
        if calls:
            self._keep(self._backend.send(calls))

    def track(self, pending: Sequence[Any]) -> None:
        """Settle calls that end things (releases, revokes, frees) whose wait was
        abandoned in flight, as releases: later calls wait for them, failures surface."""
        self._keep(pending)

    def rescue(self, pending: Sequence[Any], undo: Undo) -> None:
        """When each of ``pending`` lands, send what ``undo`` makes of its value (the
        calls that end what it granted); a call that failed granted nothing."""
        for index, item in enumerate(pending):

            def landed(value: Any, index: int = index) -> None:
                self.submit(undo(index, value))

            self._keep([self._backend.when_done(item, landed)])

    def settle(self, *, wait: bool) -> Flow[None]:
        """Collect finished releases (every one in flight when ``wait``), raising the
        first failure. A second pass catches the undo calls of rescues that landed."""
        failures: list[BaseException] = []
        for _ in range(2 if wait else 1):
            with self._lock:
                snapshot = list(self._pending.values())
            done = snapshot if wait else self._backend.ready(snapshot)[0]
            if not done:
                break
            answers = yield from awaiting(done, "release", each=True)
            with self._lock:
                mine = [self._pending.pop(id(item), None) is not None for item in done]
            failures += [
                answer
                for answer, taken in zip(answers, mine, strict=True)
                if taken and isinstance(answer, BaseException)
            ]
        if failures:
            first = failures[0]
            raise ReleaseFailed(
                "a lease release failed at its store shard",
                found=f"{len(failures)} failed: {type(first).__name__}: {first}",
                hint="The lease may still be held: see RouteStore.leaks().",
            ) from first

    def _keep(self, pending: Sequence[Any]) -> None:
        with self._lock:
            self._pending.update((id(item), item) for item in pending)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
