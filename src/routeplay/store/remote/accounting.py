"""Object-store accounting straight from Ray's raylets (bytes created, used, objects).

Uses ``ray._private.internal_api.node_stats`` (shipped with ``ray[default]``): it is the
only per-node source of *cumulative created bytes*, which is how "one write per payload"
is measured rather than asserted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray._private import internal_api

__all__ = ["NodeStoreStats", "node_store_stats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStoreStats:
    """One node's object store, as its raylet reports it."""

    node_id: str
    """Ray node id (hex)."""
    address: str
    """Node IP address."""
    created_bytes: int
    """Bytes ever written into this node's object store (every write counts)."""
    created_objects: int
    """Objects ever created on this node."""
    used_bytes: int
    """Bytes in use now."""
    objects: int
    """Objects held now."""


def node_store_stats() -> dict[str, NodeStoreStats]:
    """Stats of every alive node, keyed by node id."""
    out = {}
    list_nodes: Any = ray.nodes  # untyped in Ray
    read_stats: Any = internal_api.node_stats
    for node in list_nodes():
        if not node.get("Alive"):
            continue
        reply = read_stats(
            node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False
        )
        store = reply.store_stats
        out[node["NodeID"]] = NodeStoreStats(
            node_id=node["NodeID"],
            address=node["NodeManagerAddress"],
            created_bytes=int(store.cumulative_created_bytes),
            created_objects=int(store.cumulative_created_objects),
            used_bytes=int(store.object_store_bytes_used),
            objects=int(store.num_local_objects),
        )
    return out
