"""Object-store probes for Ray tests (Ray frees asynchronously, so tests poll)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from routeplay.store.remote.accounting import NodeStoreStats, node_store_stats


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


def kill_and_wait(actor: Any, *, timeout_s: float = 30.0) -> None:
    """``ray.kill`` and wait until the actor answers as dead (the kill is asynchronous:
    a call made right after it may still be served)."""
    ray.kill(actor)

    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        return False

    assert wait_until(dead, timeout_s=timeout_s), f"actor alive {timeout_s}s after ray.kill"
