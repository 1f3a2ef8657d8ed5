"""Accounting of the route-store client (``Accounting``, a part of ``RouteStore``): what
every shard holds (``stats``), the leases still held (``leaks``), and ending the leases of
holders that died (``revoke``, ``revoke_holder``). Every call asks each shard once; a
shard that does not answer is named, not fatal, where the question is a survey
(``stats``, ``leaks``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from routeplay.errors import RouteplayError
from routeplay.store.client.core import StoreCore
from routeplay.store.client.lease import Lease
from routeplay.store.client.lease_ids import lease_shard
from routeplay.store.flow import Flow
from routeplay.store.shard.api import ShardApi, shard_call
from routeplay.store.shard.lease_table import LeakRecord, TableStats

__all__ = ["Accounting", "StoreStats"]

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats(TableStats):
    """Store-wide snapshot: every shard's table summed."""

    shards: int
    """Shard actors the numbers come from (live ones)."""
    dead_shards: tuple[str, ...] = ()
    """Shards that did not answer, each with why; their payloads are not counted."""


class Accounting:
    """Store-wide stats and leaks, and revoking dead holders' leases (a part of
    ``RouteStore``).

    Example:
        accounts = Accounting(core)
        store.revoke([leak for leak in store.leaks() if leak.age_s > 3600])
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def stats(self) -> StoreStats:
        """Sum of every live shard's snapshot (after the releases in flight have landed);
        a shard that does not answer is named in ``dead_shards``, not fatal.

        Example:
            assert store.stats().leases == 0
        """
        parts, dead = self._core.drive(self._each_shard(ShardApi.stats))
        return _merge_stats(parts, dead)

    async def astats(self) -> StoreStats:
        """Awaitable ``stats``.

        Example:
            assert (await store.astats()).leases == 0
        """
        parts, dead = await self._core.adrive(self._each_shard(ShardApi.stats))
        return _merge_stats(parts, dead)

    def leaks(self) -> list[LeakRecord]:
        """Leases still held, oldest first, across the live shards (a dead shard's are
        gone with it: it is logged, and ``stats().dead_shards`` names it).

        Example:
            for leak in store.leaks(): print(leak.holder, leak.age_s)
        """
        per_shard, dead = self._core.drive(self._each_shard(ShardApi.leaks))
        return _sorted_leaks(self._core.run, per_shard, dead)

    async def aleaks(self) -> list[LeakRecord]:
        """Awaitable ``leaks``.

        Example:
            assert await store.aleaks() == []
        """
        per_shard, dead = await self._core.adrive(self._each_shard(ShardApi.leaks))
        return _sorted_leaks(self._core.run, per_shard, dead)

    def revoke(self, leases: Sequence[str | LeakRecord | Lease]) -> int:
        """End leases whose holder died (from ``leaks()``, or their ids); returns how many
        were live. Waited for; counted in ``stats().revoked_leases``.

        Example:
            stale = [leak for leak in store.leaks() if leak.age_s > 3600]
            store.revoke(stale)
        """
        return self._core.drive(self._revoke(leases))

    async def arevoke(self, leases: Sequence[str | LeakRecord | Lease]) -> int:
        """Awaitable ``revoke``.

        Example:
            await store.arevoke(await store.aleaks())
        """
        return await self._core.adrive(self._revoke(leases))

    def _revoke(self, leases: Sequence[str | LeakRecord | Lease]) -> Flow[int]:
        core = self._core
        by_shard: dict[int, list[str]] = {}
        for item in leases:
            ids = (
                item.parts.items()
                if isinstance(item, Lease)
                else [lease_shard(item, core.run, core.backend.shard_count)]
            )
            for shard, lease_id in ids:
                by_shard.setdefault(shard, []).append(lease_id)
        calls = [shard_call(i, ShardApi.revoke_leases, ids) for i, ids in sorted(by_shard.items())]
        ended = yield from core.send_and_wait(calls, "revoke leases", ends=True)
        for item in leases:
            if isinstance(item, Lease):
                item.mark_released()
        return sum(len(ids) for ids in ended)

    def revoke_holder(self, holder: str) -> int:
        """End every lease of ``holder`` (a worker that died) on every shard; returns how
        many there were.

        Example:
            store.revoke_holder("rollout/worker-3")   # its samples' bytes can go now
        """
        return self._core.drive(self._revoke_holder(holder))

    async def arevoke_holder(self, holder: str) -> int:
        """Awaitable ``revoke_holder``.

        Example:
            await store.arevoke_holder("rollout/worker-3")
        """
        return await self._core.adrive(self._revoke_holder(holder))

    def _revoke_holder(self, holder: str) -> Flow[int]:
        shards = range(self._core.backend.shard_count)
        calls = [shard_call(i, ShardApi.revoke_holder, holder) for i in shards]
        ended = yield from self._core.send_and_wait(calls, f"revoke {holder}", ends=True)
        return sum(len(ids) for ids in ended)

    def _each_shard(self, op: Callable[[ShardApi], R]) -> Flow[tuple[list[R], list[str]]]:
        """Every shard's answer to ``op``; those that failed, named, apart."""
        shards = range(self._core.backend.shard_count)
        calls = [shard_call(i, op) for i in shards]
        results = yield from self._core.send_and_wait(calls, op.__name__, each=True)
        live = [r for r in results if not isinstance(r, BaseException)]
        dead = [
            f"shard {i} ({type(r).__name__}: {r.summary if isinstance(r, RouteplayError) else r})"
            for i, r in zip(shards, results, strict=True)
            if isinstance(r, BaseException)
        ]
        return live, dead


def _sorted_leaks(
    run: str, per_shard: Sequence[list[LeakRecord]], dead: Sequence[str]
) -> list[LeakRecord]:
    for why in dead:
        log.warning("run %s: leaks() skipped %s", run, why)
    return sorted((r for rows in per_shard for r in rows), key=lambda r: (r.since, r.lease_id))


def _merge_stats(parts: Sequence[TableStats], dead: Sequence[str] = ()) -> StoreStats:
    totals: dict[str, Any] = {}
    for name in (f.name for f in fields(TableStats)):
        values = [getattr(part, name) for part in parts]
        if name.endswith(("_by_holder", "_by_op")):  # (key, count) pairs: sum per key
            per_holder: dict[str, int] = {}
            for pairs in values:
                for holder, value in pairs:
                    per_holder[holder] = per_holder.get(holder, 0) + value
            totals[name] = tuple(sorted(per_holder.items()))
        else:
            totals[name] = sum(values)
    return StoreStats(shards=len(parts), dead_shards=tuple(dead), **totals)
