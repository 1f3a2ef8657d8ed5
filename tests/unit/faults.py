"""Fault injection for the in-process store: a ``LocalBackend`` with chosen dead leases.

``FaultyBackend`` wraps the real backend (the very same shards and lease tables run)
and answers ``RoutesLost`` where a dead shard would: releasing a chosen lease id, or
any lease granted to a chosen holder, and cloning a chosen lease id. A batched call
(``release_many``, ``clone_many``) naming one of them reached the dead shard: none of it
happens. Every other call goes to the real shards, so the test sees exactly what the
store holds. ``heal()`` brings the "shard" back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from routeplay.core import EngineKey, RouteSpec
from routeplay.errors import RoutesLost
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.client.lease import Lease
from routeplay.store.flow import Flow, Wait
from routeplay.store.remote.backend import LocalBackend, Settled, settled_answers
from routeplay.store.shard.adoption import KeyBatch
from routeplay.store.shard.api import ShardApi, ShardCall
from routeplay.store.shard.shard import Grant

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

    @property
    def identity(self) -> Any:
        return self.inner.identity

    def send(self, calls: Sequence[ShardCall[Any]]) -> list[Any]:
        """Every shard call goes through here (answered now, in process): a dead lease's
        release or an unclonable lease's clone is answered with ``RoutesLost``."""
        return [self._send_one(call) for call in calls]

    def _send_one(self, call: ShardCall[Any]) -> Settled:
        args = call.args
        if _is(call, ShardApi.release) and args[0] in self.dead:
            self.failed_releases += 1
            return Settled(error=RoutesLost("the shard holding the lease died", where=args[0]))
        if _is(call, ShardApi.release_many):
            lost = [lid for lid in args[0] if lid in self.dead]
            if lost:  # the call reached a dead shard: none of its releases happened
                self.failed_releases += len(lost)
                error = RoutesLost("the shard holding the lease died", where=f"lease {lost[0]}")
                return Settled(error=error)
        if _is(call, ShardApi.clone) and args[0] in self.unclonable:
            return Settled(error=RoutesLost("the shard holding the lease died", where=args[0]))
        if _is(call, ShardApi.transfer_many) and any(lid in self.dead for lid in args[0]):
            lost = next(lid for lid in args[0] if lid in self.dead)  # a move on a dead shard:
            self.failed_releases += 1  # nothing of it happens
            return Settled(error=RoutesLost("the shard holding the lease died", where=lost))
        moving = _is(call, ShardApi.clone_many) or _is(call, ShardApi.transfer_many)
        if moving and any(lid in self.unclonable for lid in args[0]):
            lost = next(lid for lid in args[0] if lid in self.unclonable)
            return Settled(error=RoutesLost("the shard holding the lease died", where=lost))
        [settled] = self.inner.send([call])
        self._note_dead_grants(call, settled.value)
        return settled

    def _note_dead_grants(self, call: ShardCall[Any], result: Any) -> None:
        args = call.args
        granting = _is(call, ShardApi.acquire) or _is(call, ShardApi.clone)
        if granting and args[1] in self.dead_holders and isinstance(result, str):
            self.dead.add(result)
        for lease_id in granted_to_dead(call, result, self.dead_holders):
            self.dead.add(lease_id)
        if _is(call, ShardApi.lease_many) and isinstance(result, Grant):  # (ids, holder)s
            for (_, holder), lease_id in zip(args[0], result.lease_ids, strict=True):
                if holder in self.dead_holders:
                    self.dead.add(lease_id)

    def call(
        self, calls: Sequence[ShardCall[Any]], what: str, *, timeout_s: float | None = None
    ) -> list[Any]:
        return settled_answers(Wait(tuple(self.send(calls)), what, timeout_s))

    def resolve(self, wait: Wait) -> list[Any]:
        return self.inner.resolve(wait)

    async def aresolve(self, wait: Wait) -> list[Any]:
        return await self.inner.aresolve(wait)

    def ready(self, pending: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        return self.inner.ready(pending)

    def when_done(self, pending: Any, landed: Callable[[Any], None]) -> Any:
        return self.inner.when_done(pending, landed)

    def pull(self, refs: Sequence[Any]) -> None:
        self.inner.pull(refs)

    def borrow(self, refs: Sequence[Any]) -> list[Any]:
        return self.inner.borrow(refs)

    def send_adopt_keys(
        self,
        shard: int,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        shared_prefix: int = 0,
        starts: Sequence[int] | None = None,
        pack: bool = False,
    ) -> Any:
        return self.inner.send_adopt_keys(shard, keys, spec, shared_prefix, starts, pack)

    def send_adopt_key_batches(self, shard: int, batches: Sequence[KeyBatch]) -> Any:
        return self.inner.send_adopt_key_batches(shard, batches)

    def put_blocks(self, blocks: Sequence[Any]) -> list[Any]:
        return self.inner.put_blocks(blocks)

    def fetch(self, refs: Sequence[Any], what: str) -> list[Any]:
        return self.inner.fetch(refs, what)

    def fetch_as_created(
        self, refs: Sequence[Any], what: str
    ) -> Iterator[tuple[list[int], list[Any]]]:
        return self.inner.fetch_as_created(refs, what)

    def lost_index(self, refs: Sequence[Any], error: BaseException) -> int | None:
        return self.inner.lost_index(refs, error)

    def ask_engines(self, keys: Sequence[EngineKey]) -> Flow[None]:
        return self.inner.ask_engines(keys)

    def send_free_key(self, key: EngineKey, run: str) -> Any:
        return self.inner.send_free_key(key, run)

    def send_key_refs(self, key: EngineKey, run: str) -> Any:
        return self.inner.send_key_refs(key, run)

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


def granted_to_dead(call: ShardCall[Any], result: Any, dead_holders: set[str]) -> list[str]:
    """The leases a batched clone or move granted to holders that cannot release them
    (one holder per lease)."""
    moving = _is(call, ShardApi.clone_many) or _is(call, ShardApi.transfer_many)
    if not moving or not isinstance(result, list):
        return []
    return [lid for lid, h in zip(result, call.args[1], strict=True) if h in dead_holders]
