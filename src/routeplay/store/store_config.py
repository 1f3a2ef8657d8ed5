"""``StoreConfig``: how a run's route store is laid out; ``build()`` starts or joins it
(``routeplay.store.client.RouteStore``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from routeplay.errors import MisuseError

if TYPE_CHECKING:
    from routeplay.store.client import RouteStore

__all__ = ["MIN_BLOCK_BYTES", "StoreConfig"]

# Ray returns values under 100 KiB inline to the caller instead of writing them to the
# object store; blocks stay above that so payload bytes never travel through a shard.
MIN_BLOCK_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How a run's route store is laid out."""

    run: str
    """Run id: names the actors and scopes every payload and lease."""
    shards: int = 1
    """Store actors; metadata calls spread over them by hash."""
    ttl_s: float | None = 600.0
    """Seconds a payload may stay stored without any lease before it is dropped."""
    block_rows: int = 0
    """Rows per stored block; 0 (the default) stores one block per payload, split only
    above ``max_block_bytes``. Every block is one more ``ray.put``, and when all the
    readers of a payload sit on one node (the SP ranks of a sample) that node pulls
    every block anyway; set it when readers of different parts sit on different nodes
    (raised for narrow models so a block stays above ``MIN_BLOCK_BYTES``)."""
    max_block_bytes: int = 256 * 1024 * 1024
    """Largest block written when ``block_rows`` is 0 (bounds one object's size)."""
    timeout_s: float = 60.0
    """Deadline of every blocking call."""
    namespace: str = "routeplay"
    """Ray namespace of the store actors."""
    detached: bool = False
    """Keep the actors after the driver exits (long-lived clusters)."""
    resources: tuple[tuple[str, float], ...] = ()
    """Custom resources that place the shard actors (e.g. on the head node)."""
    join: bool = False
    """Share an existing store of the same run (otherwise a clash is refused). Not an
    access control: see docs/security.md."""
    lease_ttl_s: float | None = None
    """Longest a lease may be held before the store ends it (off by default: leases have
    no TTL). For long-running jobs whose holders may die without releasing: expiries are
    logged and counted (``StoreStats.expired_leases``); set it well above a step."""

    def __post_init__(self) -> None:
        checks = (
            ("shards", self.shards >= 1, ">= 1", self.shards),
            ("ttl_s", self.ttl_s is None or self.ttl_s > 0, "None or > 0", self.ttl_s),
            ("block_rows", self.block_rows >= 0, ">= 0", self.block_rows),
            (
                "max_block_bytes",
                self.max_block_bytes >= MIN_BLOCK_BYTES,
                f">= {MIN_BLOCK_BYTES}",
                self.max_block_bytes,
            ),
            ("timeout_s", self.timeout_s > 0, "> 0", self.timeout_s),
            (
                "lease_ttl_s",
                self.lease_ttl_s is None or self.lease_ttl_s > 0,
                "None or > 0",
                self.lease_ttl_s,
            ),
        )
        for name, ok, expected, found in checks:
            if not ok:
                raise MisuseError(f"invalid StoreConfig.{name}", expected=expected, found=found)

    def build(self) -> RouteStore:
        """Start (or join) the run's store actors.

        Example:
            store = StoreConfig(run="run-7", shards=2).build()
        """
        from routeplay.store.client import RouteStore  # the client imports this module

        return RouteStore.start(self)
