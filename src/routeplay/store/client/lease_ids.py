"""Lease ids and the shards that granted them: a lease id is
``{run}/{shard}/lease-{random}``, a lease's ``parts`` map each shard to its id there, and
a batched lease call groups many leases' parts by shard (one call per shard).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routeplay.errors import HandleError, RunMismatch
from routeplay.store.shard.lease_table import LeakRecord
from routeplay.store.shard.shard import Grant

__all__ = ["granted_ids", "lease_shard", "parts_by_shard"]


def granted_ids(result: Any) -> list[str]:
    """The lease ids a grant call answered (``lease_many``'s, ``clone_many``'s, ``clone``'s)."""
    if isinstance(result, Grant):
        return list(result.lease_ids)
    return list(result) if isinstance(result, list) else [result]  # clone_many's, clone's


def parts_by_shard(leases: Sequence[Mapping[int, str]]) -> dict[int, list[tuple[int, str]]]:
    """Each shard's ``(position, lease id)`` parts of many leases, in order."""
    grouped: dict[int, list[tuple[int, str]]] = {}
    for at, parts in enumerate(leases):
        for shard, lease_id in parts.items():
            grouped.setdefault(shard, []).append((at, lease_id))
    return grouped


def lease_shard(item: str | LeakRecord, run: str, shards: int) -> tuple[int, str]:
    """The shard that granted a lease: its id is ``{run}/{shard}/lease-{random}``."""
    lease_id = item.lease_id if isinstance(item, LeakRecord) else item
    prefix = lease_id.rsplit("/lease-", 1)[0]
    owner, _, shard = prefix.rpartition("/")
    if owner != run:
        raise RunMismatch(
            "lease of another run",
            expected=f"a lease id of run {run}",
            found=lease_id[:160],
            where=f"run {run}",
        )
    if not shard.isdigit() or int(shard) >= shards:
        raise HandleError("not a lease id of this store", found=lease_id[:160])
    return int(shard), lease_id
