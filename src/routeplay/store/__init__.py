"""routeplay.store: where routing payloads live on Ray, and who keeps them alive.

Ray actors here are thin shells over plain classes (``LeaseTable``, ``StoreShard``,
``EngineStore``, ``PayloadOutbox``) that are unit-tested without Ray. Processes use
``RouteStore`` (the client) and ``Lease``; producer actors mix in ``RoutesProducer``.

Where to read: the write path is ``client.RouteStore.put_many`` / ``put_staged_many`` /
``adopt_keys`` with ``writes`` (batch layout, shared prompt prefixes) and ``key_check``
(adopted keys validated once, near the engine); the read path is ``reads`` (leased
block references, one fetch per read) over ``read_plan``; leases are ``lease`` and
``lease_table``, releases in flight ``releases``.
"""

from routeplay.store.client import RouteStore, StoreConfig, StoreStats
from routeplay.store.engine_service import start_engine_store
from routeplay.store.engine_store import EngineStore, EngineStoreStats
from routeplay.store.lease import Lease
from routeplay.store.lease_table import LeakRecord, LeaseTable, PayloadState, TableStats
from routeplay.store.producer import RoutesProducer, producer_actor

__all__ = [
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
    "producer_actor",
    "start_engine_store",
]
