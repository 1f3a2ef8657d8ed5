"""What a store shard served: calls per operation and the CPU they took.

A step's control-plane cost is its shard calls, not its bytes (a store shard holds
references, never payloads), so a shard counts every call it serves and the CPU time
of the thread that served it (``time.thread_time``: the method's own work, lock waits
and Ray's waits excluded). Whoever serves a call meters it: the Ray actor shell around
each public method, the local backend around each call it runs in process. The counts
travel in ``TableStats`` (``calls_by_op``, ``calls``, ``call_cpu_ms``) and add up over
shards in ``RouteStore.stats()``: a step's calls are the difference of two snapshots.

Example:
    >>> meter = CallMeter()
    >>> with meter.served("lease_many"):
    ...     pass
    >>> meter.snapshot().calls
    1
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["CallMeter", "CallsServed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CallsServed:
    """A snapshot of a meter."""

    by_op: tuple[tuple[str, int], ...]
    """(operation, calls served), sorted by operation."""
    cpu_ms: float
    """CPU milliseconds of the threads that served them, all operations."""

    @property
    def calls(self) -> int:
        """Calls served, all operations."""
        return sum(count for _, count in self.by_op)


class CallMeter:
    """Counts the calls one shard served (thread-safe: a shard actor serves on threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._cpu_ns = 0

    @contextmanager
    def served(self, op: str) -> Iterator[None]:
        """Count one call of ``op`` and the CPU of the thread serving it (also when it
        raises: a refused call was served too)."""
        started = time.thread_time_ns()
        try:
            yield
        finally:
            spent = time.thread_time_ns() - started
            with self._lock:
                self._calls[op] = self._calls.get(op, 0) + 1
                self._cpu_ns += spent

    def snapshot(self) -> CallsServed:
        """The counts so far."""
        with self._lock:
            return CallsServed(by_op=tuple(sorted(self._calls.items())), cpu_ms=self._cpu_ns / 1e6)
