"""routeplay.store: where routing payloads live on Ray, and who keeps them alive.

Ray actors here are thin shells over plain classes (``LeaseTable``, ``StoreShard``,
``EngineStore``, ``PayloadOutbox``) that are unit-tested without Ray. Processes use
``RouteStore`` (the client) and ``Lease``; producer actors mix in ``RoutesProducer``.

Where to read: ``RouteStore`` (``client``) is made of parts over ``client_core`` (its
state, shard calls and reads): the write path is ``client_writes`` (``put_many``,
``put_staged_many``) and ``client_keys`` (``adopt_keys``) with ``writes`` (batch layout,
shared prompt prefixes) and ``key_check`` (adopted keys validated once, near the engine)
and ``compaction`` (long handles' rows copied once into few payloads); leases are
``client_leases``; the read path is ``reads`` (leased block references, one fetch per
read) over ``read_plan``; a lease is ``lease`` and ``lease_table``, releases in flight
``releases``; every call is one flow (``flow``), driven blocking or awaited (the
``a``-prefixed twins: docs/asyncio.md). Every call to a shard is typed: built from a
``shard_api.ShardApi`` operation (``shard_call``), never from a method name.

Names are resolved on first use (PEP 562), so the plain modules (``lease``,
``lease_table``, ``shard``, ``engine_store``, ``store_config``) import without Ray;
``RouteStore`` and the actor helpers load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from routeplay.core.lazy import LazyExports

if TYPE_CHECKING:
    from routeplay.store.client import RouteStore, StoreStats
    from routeplay.store.compaction import Compacted, CompactionReport
    from routeplay.store.engine_service import (
        aleave_engine_store,
        astart_engine_store,
        leave_engine_store,
        start_engine_store,
    )
    from routeplay.store.engine_store import EngineStore, EngineStoreStats
    from routeplay.store.lease import Lease
    from routeplay.store.lease_table import LeakRecord, LeaseTable, PayloadState, TableStats
    from routeplay.store.producer import AsyncRoutesProducer, RoutesProducer, producer_actor
    from routeplay.store.store_config import StoreConfig

_HOME = {
    "Compacted": "compaction",
    "CompactionReport": "compaction",
    "EngineStore": "engine_store",
    "EngineStoreStats": "engine_store",
    "LeakRecord": "lease_table",
    "Lease": "lease",
    "LeaseTable": "lease_table",
    "PayloadState": "lease_table",
    "RouteStore": "client",
    "AsyncRoutesProducer": "producer",
    "RoutesProducer": "producer",
    "StoreConfig": "store_config",
    "StoreStats": "client",
    "TableStats": "lease_table",
    "aleave_engine_store": "engine_service",
    "astart_engine_store": "engine_service",
    "leave_engine_store": "engine_service",
    "producer_actor": "producer",
    "start_engine_store": "engine_service",
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
