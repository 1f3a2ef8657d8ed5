"""routeplay.store: where routing payloads live on Ray, and who keeps them alive.

Ray actors here are thin shells over plain classes (``LeaseTable``, ``StoreShard``,
``EngineStore``, ``PayloadOutbox``) that are unit-tested without Ray. Processes use
``RouteStore`` (the client) and ``Lease``; producer actors mix in ``RoutesProducer``.

Where to read: a folder per concern.

- ``client/``: the client every process uses. ``RouteStore`` and the ``StoreConfig`` that
  builds it (``route_store``): one class holding small parts, each method forwarded to
  the part that owns it (``forwarding``). The parts, each importable alone: ``core``
  (``StoreCore``: state, shard calls, flows driven), the write path (``write_path``:
  ``put_many``, ``put_staged_many``), the read path (``read_path`` over ``read_plan``:
  leased block references, ``pins``, one fetch per read), leases (``leases``; a lease
  is ``lease``, its ids ``lease_ids``, releases in flight ``releases``, concurrent
  awaitable calls batched by ``coalesce``), adopted engine keys (``keys``),
  ``accounting`` (stats, leaks, revokes) and ``compaction`` (long handles' rows copied
  once into few payloads).
- ``shard/``: one shard's tables, never payload bytes: ``shard`` (payload references),
  ``lease_table`` (who holds what), ``call_meter`` (calls served and their CPU),
  ``adoption`` (adopting engine keys: decisions, waits, the raw fallback) and ``api``
  (every shard operation, typed: a call is built from a ``ShardApi`` operation with
  ``shard_call``, never from a method name).
- ``engine/``: the engine-side store (``engine_store``: a drop-in for LMDeploy's
  ``shared_store``), where engines look for it (``service``), validation at ingest
  (``ingest``) and of adopted keys (``key_check``).
- ``remote/``: the Ray plumbing: actor shells (``actors``), how a client reaches its
  shards (``backend``: Ray actors or plain objects in process), every Ray wait with a
  deadline (``ray_calls``), version checks of peers (``protocol``), producer actors
  (``producer``, ``outbox``) and Ray's own object-store counters (``accounting``).
- Shared by all four: every store call is one flow (``flow``), driven blocking or awaited
  (the ``a``-prefixed twins: docs/asyncio.md); ``write_plan`` lays a batch out (shared
  prompt prefixes, blocks) and ``joined_rows`` joins its pieces as the write happens.

Names are resolved on first use (PEP 562), so the plain modules (``client.lease``,
``shard.lease_table``, ``shard.shard``, ``engine.engine_store``) import without Ray;
``RouteStore``, ``StoreConfig`` and the actor helpers load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from routeplay.core.lazy import LazyExports

if TYPE_CHECKING:
    from routeplay.store.client.accounting import StoreStats
    from routeplay.store.client.compaction import Compacted, CompactionReport
    from routeplay.store.client.lease import Lease
    from routeplay.store.client.route_store import RouteStore, StoreConfig
    from routeplay.store.engine.engine_store import EngineStore, EngineStoreStats
    from routeplay.store.engine.service import (
        aleave_engine_store,
        astart_engine_store,
        leave_engine_store,
        start_engine_store,
    )
    from routeplay.store.remote.producer import AsyncRoutesProducer, RoutesProducer, producer_actor
    from routeplay.store.shard.lease_table import LeakRecord, LeaseTable, PayloadState, TableStats

_HOME = {
    "Compacted": "client.compaction",
    "CompactionReport": "client.compaction",
    "EngineStore": "engine.engine_store",
    "EngineStoreStats": "engine.engine_store",
    "LeakRecord": "shard.lease_table",
    "Lease": "client.lease",
    "LeaseTable": "shard.lease_table",
    "PayloadState": "shard.lease_table",
    "RouteStore": "client.route_store",
    "AsyncRoutesProducer": "remote.producer",
    "RoutesProducer": "remote.producer",
    "StoreConfig": "client.route_store",
    "StoreStats": "client.accounting",
    "TableStats": "shard.lease_table",
    "aleave_engine_store": "engine.service",
    "astart_engine_store": "engine.service",
    "leave_engine_store": "engine.service",
    "producer_actor": "remote.producer",
    "start_engine_store": "engine.service",
}

__all__ = [
    "AsyncRoutesProducer",
    "Compacted",
    "CompactionReport",
    "EngineStore",
    "EngineStoreStats",
    "LeakRecord",
    "Lease",
    "LeaseTable",
    "PayloadState",
    "RouteStore",
    "RoutesProducer",
    "StoreConfig",
    "StoreStats",
    "TableStats",
    "aleave_engine_store",
    "astart_engine_store",
    "leave_engine_store",
    "producer_actor",
    "start_engine_store",
]


_LAZY = LazyExports(__name__, _HOME)


def __getattr__(name: str) -> Any:
    return _LAZY.resolve(name)


def __dir__() -> list[str]:
    return _LAZY.names(__all__)
