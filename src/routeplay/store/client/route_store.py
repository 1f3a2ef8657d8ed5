"""``RouteStore``: the client every process uses to put, lease and read routing.

It is a small picklable object (config + actor handles) that travels to rollout
workers and trainer ranks; what it holds for this process only (pinned block
references, releases in flight) stays behind when it is pickled. Metadata calls go to
the shard that minted a payload (shards are chosen by hash); payload bytes never pass
through a shard.

The client is one class made of parts, each in its own module over a shared core
(``routeplay.store.client.core``):

- Write path (``put``, ``put_many``, ``put_staged``): ``routeplay.store.client.write_path``;
  one object-store write per payload, one adopt call per shard per batch
  (``routeplay.store.write_plan`` lays a batch out, sharing verified-equal prompt prefixes).
- Adopted engine keys (``adopt_keys``, ``free_engine_keys``):
  ``routeplay.store.client.keys``.
- Leases (``acquire``, ``acquire_many``, ``release_many``): ``routeplay.store.client.leases``;
  one call per shard for a whole step; a grant carries the block references, releases
  are not waited for (``routeplay.store.client.releases``).
- Read path (``read``, ``read_many``): ``routeplay.store.client.core`` (every part and
  every ``Lease`` reads), over ``routeplay.store.client.read_path``.
- Compaction and accounting (``compact``, ``stats``, ``leaks``, ``revoke``): here.
- Awaitable twins (``aput_many``, ``aacquire_many``, ...): each call is one flow
  (``routeplay.store.flow``) that the blocking method drives with ``ray.get`` and the
  ``a``-prefixed one with ``await``; rescues of abandoned calls live in the flows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError, RouteplayError
from routeplay.store.client.compaction import Compacted, Write, compact_handles
from routeplay.store.client.keys import KeyAdoptingStore
from routeplay.store.client.lease import Lease
from routeplay.store.client.leases import lease_shard
from routeplay.store.client.write_path import WritingStore
from routeplay.store.flow import Flow
from routeplay.store.remote.backend import LocalBackend, RayBackend
from routeplay.store.shard.api import ShardApi, shard_call
from routeplay.store.shard.lease_table import LeakRecord, TableStats
from routeplay.store.write_plan import MIN_BLOCK_BYTES

__all__ = ["MIN_BLOCK_BYTES", "RouteStore", "StoreConfig", "StoreStats"]

log = logging.getLogger(__name__)
R = TypeVar("R")


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
        return RouteStore.start(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats(TableStats):
    """Store-wide snapshot: every shard's table summed."""

    shards: int
    """Shard actors the numbers come from (live ones)."""
    dead_shards: tuple[str, ...] = ()
    """Shards that did not answer, each with why; their payloads are not counted."""


class RouteStore(WritingStore, KeyAdoptingStore):
    """Client of one run's route store (picklable with the Ray backend).

    Every call a rollout or a buffer makes has an awaitable twin of the same name with
    an ``a`` in front (``aput_many``, ``aadopt_keys_each``, ``aacquire_many``, ...): the
    same flow (``routeplay.store.flow``), awaited on Ray's references instead of
    blocking in ``ray.get`` (no executor thread; safe inside an async actor). A task
    cancelled in the middle of one leaves nothing behind: what the calls in flight
    grant is undone when they land (docs/asyncio.md).

    Threads: one client may be shared by many threads (and many tasks). Its own state
    (pinned block references, releases in flight) is locked; every call sends its own
    shard calls; a call never overtakes a release any thread of this client sent
    before it, and a failed release is raised once, by the next call that settles it
    (on whichever thread). A ``Lease`` object is not meant to be released from two
    threads at once, but doing so is harmless (releases are idempotent).

    Example:
        store = StoreConfig(run="run-7").build()
        [handle] = store.put_many([routes])
        [lease] = store.acquire_many([(handle, "train/step-0")])
        rows = lease.read(0, 4096)      # no shard call: the grant carried the blocks
        store.release_many([lease])     # sent, not waited for; errors surface later
        [lease] = await store.aacquire_many([(handle, "train/step-1")])  # in a coroutine
    """

    config: StoreConfig
    """How this run's store is laid out (the parts read it as their ``StoreSettings``)."""

    def __reduce__(self) -> tuple[object, ...]:
        # Pinned references and releases in flight belong to this process: a copy
        # elsewhere starts without them (it locates what it reads), so a pickled client
        # can never keep an object alive past the leases of the process that pinned it.
        # The copy is a plain RouteStore, whatever subclass was pickled.
        return (RouteStore, (self.config, self._backend))

    @classmethod
    def start(cls, config: StoreConfig) -> RouteStore:
        """Create the run's shard actors on Ray, or join them if they exist."""
        options: dict[str, Any] = {
            "namespace": config.namespace,
            "get_if_exists": True,
            "resources": dict(config.resources),
        }
        if config.detached:
            options["lifetime"] = "detached"
        backend = RayBackend.start(
            config.run,
            shards=config.shards,
            ttl_s=config.ttl_s,
            timeout_s=config.timeout_s,
            options=options,
            join=config.join,
            lease_ttl_s=config.lease_ttl_s,
        )
        return cls(config, backend)

    @classmethod
    def local(cls, config: StoreConfig) -> RouteStore:
        """The same store with its shards in this process (tests, single-process tools)."""
        backend = LocalBackend(
            config.run, shards=config.shards, ttl_s=config.ttl_s, lease_ttl_s=config.lease_ttl_s
        )
        return cls(config, backend)

    # -- compaction -------------------------------------------------------------------
    def compact(
        self, handles: Sequence[Handle], holder: str, *, write: Write | None = None
    ) -> Compacted:
        """Copy the rows of long handles once into few payloads and lease the rebuilt
        handles for ``holder``; end the old leases after this returns
        (``routeplay.store.client.compaction``). The payloads are written from this process,
        which then owns them (a driver), or by ``write`` (a producer actor passes its
        ``put_routes_many`` bound to this store: a shard owns them). Trace sessions
        compact themselves (``TraceStoreClient.compact``).

        Example:
            done = store.compact([history.handle], "driver/history")
            if done.leases[0] is not None:  # None: nothing to copy, the old lease stays
                history.release()           # after: the new lease already holds the rows
                history = done.leases[0]    # one payload, a segment per version run
        """
        return compact_handles(self, handles, holder, write=write)

    # -- accounting -------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Sum of every live shard's snapshot (after the releases in flight have landed);
        a shard that does not answer is named in ``dead_shards``, not fatal.

        Example:
            assert store.stats().leases == 0
        """
        parts, dead = self.drive(self._each_shard(ShardApi.stats))
        return _merge_stats(parts, dead)

    async def astats(self) -> StoreStats:
        """Awaitable ``stats``.

        Example:
            assert (await store.astats()).leases == 0
        """
        parts, dead = await self.adrive(self._each_shard(ShardApi.stats))
        return _merge_stats(parts, dead)

    def leaks(self) -> list[LeakRecord]:
        """Leases still held, oldest first, across the live shards (a dead shard's are
        gone with it: it is logged, and ``stats().dead_shards`` names it).

        Example:
            for leak in store.leaks(): print(leak.holder, leak.age_s)
        """
        return _sorted_leaks(self.run, *self.drive(self._each_shard(ShardApi.leaks)))

    async def aleaks(self) -> list[LeakRecord]:
        """Awaitable ``leaks``.

        Example:
            assert await store.aleaks() == []
        """
        return _sorted_leaks(self.run, *await self.adrive(self._each_shard(ShardApi.leaks)))

    def revoke(self, leases: Sequence[str | LeakRecord | Lease]) -> int:
        """End leases whose holder died (from ``leaks()``, or their ids); returns how many
        were live. Waited for; counted in ``stats().revoked_leases``.

        Example:
            stale = [leak for leak in store.leaks() if leak.age_s > 3600]
            store.revoke(stale)
        """
        return self.drive(self._revoke(leases))

    async def arevoke(self, leases: Sequence[str | LeakRecord | Lease]) -> int:
        """Awaitable ``revoke``.

        Example:
            await store.arevoke(await store.aleaks())
        """
        return await self.adrive(self._revoke(leases))

    def _revoke(self, leases: Sequence[str | LeakRecord | Lease]) -> Flow[int]:
        by_shard: dict[int, list[str]] = {}
        for item in leases:
            ids = (
                item.parts.items()
                if isinstance(item, Lease)
                else [lease_shard(item, self.run, self._backend.shard_count)]
            )
            for shard, lease_id in ids:
                by_shard.setdefault(shard, []).append(lease_id)
        calls = [shard_call(i, ShardApi.revoke_leases, ids) for i, ids in sorted(by_shard.items())]
        ended = yield from self._calls(calls, "revoke leases", ends=True)
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
        return self.drive(self._revoke_holder(holder))

    async def arevoke_holder(self, holder: str) -> int:
        """Awaitable ``revoke_holder``.

        Example:
            await store.arevoke_holder("rollout/worker-3")
        """
        return await self.adrive(self._revoke_holder(holder))

    def _revoke_holder(self, holder: str) -> Flow[int]:
        shards = range(self._backend.shard_count)
        calls = [shard_call(i, ShardApi.revoke_holder, holder) for i in shards]
        ended = yield from self._calls(calls, f"revoke {holder}", ends=True)
        return sum(len(ids) for ids in ended)

    def _each_shard(self, op: Callable[[ShardApi], R]) -> Flow[tuple[list[R], list[str]]]:
        """Every shard's answer to ``op``; those that failed, named, apart."""
        shards = range(self._backend.shard_count)
        calls = [shard_call(i, op) for i in shards]
        results = yield from self._calls(calls, op.__name__, each=True)
        live = [r for r in results if not isinstance(r, BaseException)]
        dead = [
            f"shard {i} ({type(r).__name__}: {r.summary if isinstance(r, RouteplayError) else r})"
            for i, r in zip(shards, results, strict=True)
            if isinstance(r, BaseException)
        ]
        return live, dead

    def shutdown(self) -> None:
        """Stop the shards (their references go, so every payload can be reclaimed);
        a release that failed on the way is still raised."""
        try:
            self.flush()
        finally:
            self._backend.shutdown()


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
