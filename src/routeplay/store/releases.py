"""Releases that do not block the reader, and whose errors are never lost.

A release is sent to its shard and not waited for: a trainer rank moves on to its next
micro-batch at once, and sending never raises what an earlier release did. Each later
call of the client settles what has finished: a read looks without waiting; a metadata
call (acquire, stats, ...) first waits for every release in flight (shard actors are
threaded, so this keeps "release, then ask" in order for one client); ``flush`` and
``shutdown`` wait too. A failed release is raised there (``ReleaseFailed``), once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from routeplay.errors import ReleaseFailed
from routeplay.store.backend import Backend
from routeplay.store.shard_api import ShardCall

__all__ = ["PendingReleases"]


class PendingReleases:
    """Release calls in flight for one client, settled at the client's next calls."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._pending: list[Any] = []

    def submit(self, calls: Sequence[ShardCall[Any]]) -> None:
        """Send the calls; their outcome is collected by a later call, never here."""
        futures = self._backend.submit(calls)
        with self._lock:
            self._pending.extend(futures)

    def settle(self, *, wait: bool) -> None:
        """Collect finished releases (all of them when ``wait``); raise the first failure."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        outcomes, running = self._backend.settle(pending, wait=wait)
        with self._lock:
            self._pending.extend(running)
        failures = [outcome.error for outcome in outcomes if outcome.error is not None]
        if failures:
            first = failures[0]
            raise ReleaseFailed(
                "a lease release failed at its store shard",
                found=f"{len(failures)} failed: {type(first).__name__}: {first}",
                hint="The lease may still be held: see RouteStore.leaks().",
            ) from first

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
