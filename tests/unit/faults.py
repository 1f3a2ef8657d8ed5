"""Fault injection for the in-process store: a ``LocalBackend`` with chosen dead leases.

``FaultyBackend`` wraps the real backend (the very same shards and lease tables run)
and answers ``RoutesLost`` where a dead shard would: releasing a chosen lease id, or
any lease granted to a chosen holder, and cloning a chosen lease id. Every other call,
and the healthy part of a batched call, goes to the real shards, so the test sees
exactly what the store holds. ``heal()`` brings the "shard" back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from routeplay.core import EngineKey, RouteSpec
from routeplay.errors import RoutesLost
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.backend import LocalBackend, Settled
from routeplay.store.lease import Lease
from routeplay.store.shard import Grant
from routeplay.store.shard_api import ShardApi, ShardCall, shard_call

__all__ = ["FaultyBackend", "faulty_store"]


class FaultyBackend:
    """A ``LocalBackend`` whose releases (and clones) of chosen leases raise."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.dead: set[str] = set()
        """Lease ids whose release raises."""
        self.dead_holders: set[str] = set()
        """Holders whose leases, once granted, cannot be released."""
        self.unclonable: set[str] = set()
        """Lease ids whose clone raises."""
        self.failed_releases = 0
        """Releases answered with ``RoutesLost`` so far."""

    # -- choosing faults --------------------------------------------------------------
    def lose_releases(self, *leases: Lease) -> None:
        """Every release of these leases raises until ``heal()``."""
        for lease in leases:
            self.dead.update(lease.lease_ids)

    def lose_clones(self, *leases: Lease) -> None:
        for lease in leases:
            self.unclonable.update(lease.lease_ids)

    def heal(self) -> None:
        self.dead.clear()
        self.dead_holders.clear()
        self.unclonable.clear()

    # -- the Backend protocol ---------------------------------------------------------
    @property
    def shard_count(self) -> int:
        return self.inner.shard_count

    def call(
        self, calls: Sequence[ShardCall[Any]], what: str, *, timeout_s: float | None = None
    ) -> list[Any]:
        lost = [c.args[0] for c in calls if _is(c, ShardApi.release) and c.args[0] in self.dead]
        healthy = [c for c in calls if not (_is(c, ShardApi.release) and c.args[0] in self.dead)]
        results = self.inner.call(healthy, what, timeout_s=timeout_s)
        if lost:
            self.failed_releases += len(lost)
            raise RoutesLost("the shard holding the lease died", where=f"lease {lost[0]}")
        return results

    def call_each(self, calls: Sequence[ShardCall[Any]], what: str) -> list[Any]:
        out: list[Any] = []
        for call in calls:
            args = call.args
            if _is(call, ShardApi.clone) and args[0] in self.unclonable:
                out.append(RoutesLost("the shard holding the lease died", where=f"{args[0]}"))
                continue
            [result] = self.inner.call_each([call], what)
            granting = _is(call, ShardApi.acquire) or _is(call, ShardApi.clone)
            holder = args[1] if granting else None
            if holder in self.dead_holders and isinstance(result, str):
                self.dead.add(result)
            if _is(call, ShardApi.lease_many) and isinstance(result, Grant):  # (ids, holder)s
                for (_, holder), lease_id in zip(args[0], result.lease_ids, strict=True):
                    if holder in self.dead_holders:
                        self.dead.add(lease_id)
            out.append(result)
        return out

    def submit(self, calls: Sequence[ShardCall[Any]]) -> list[Any]:
        """Releases sent without waiting: a dead lease's outcome is a ``RoutesLost``."""
        out: list[Any] = []
        for call in calls:
            releasing = _is(call, ShardApi.release_many)
            lost = [lid for lid in call.args[0] if lid in self.dead] if releasing else []
            if lost:
                self.failed_releases += len(lost)
                healthy = [lid for lid in call.args[0] if lid not in self.dead]
                self.inner.submit([shard_call(call.shard, ShardApi.release_many, healthy)])
                error = RoutesLost("the shard holding the lease died", where=f"lease {lost[0]}")
                out.append(Settled(error=error))
                continue
            out.extend(self.inner.submit([call]))
        return out

    def settle(self, pending: Sequence[Any], *, wait: bool) -> tuple[list[Settled], list[Any]]:
        return self.inner.settle(pending, wait=wait)

    def borrow(self, refs: Sequence[Any]) -> list[Any]:
        return self.inner.borrow(refs)

    def adopt_keys(
        self,
        shard: int,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        shared_prefix: int = 0,
        starts: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Any]:
        return self.inner.adopt_keys(shard, keys, spec, shared_prefix, starts, pack)

    def put_blocks(self, blocks: Sequence[Any]) -> list[Any]:
        return self.inner.put_blocks(blocks)

    def fetch(self, refs: Sequence[Any], what: str) -> list[Any]:
        return self.inner.fetch(refs, what)

    def lost_index(self, refs: Sequence[Any], error: BaseException) -> int | None:
        return self.inner.lost_index(refs, error)

    def free_key(self, key: EngineKey, run: str) -> bool:
        return self.inner.free_key(key, run)

    def key_refs(self, key: EngineKey, run: str) -> list[Any]:
        return self.inner.key_refs(key, run)

    def shutdown(self) -> None:
        self.inner.shutdown()


def _is(call: ShardCall[Any], op: Any) -> bool:
    """Whether ``call`` runs the ``ShardApi`` operation ``op``."""
    return call.method == op.__name__


def faulty_store(run: str = "faults", shards: int = 1) -> tuple[RouteStore, FaultyBackend]:
    """A real in-process store behind a ``FaultyBackend``."""
    config = StoreConfig(run=run, shards=shards)
    backend = FaultyBackend(LocalBackend(run, shards=shards, ttl_s=config.ttl_s))
    return RouteStore(config, backend), backend
