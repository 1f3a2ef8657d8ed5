"""Object-store probes for Ray tests (Ray frees asynchronously, so tests poll)."""

from __future__ import annotations

import time
from collections.abc import Callable

from routeplay.store.accounting import NodeStoreStats, node_store_stats


def used_bytes() -> int:
    """Object-store bytes in use, summed over nodes."""
    return sum(node.used_bytes for node in node_store_stats().values())


def created_bytes() -> dict[str, NodeStoreStats]:
    """Per-node stats (created bytes are cumulative)."""
    return node_store_stats()


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 15.0) -> bool:
    """Poll until ``predicate()`` holds (Ray frees objects asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
