"""``BlockPins``: the block references of payloads leased in this process.

A lease granted here carries its payloads' block references; the client pins them,
counted per lease, so leased rows read without a shard call
(``routeplay.store.client.read_path``). The last lease of a payload to go (released,
pickled or collected) drops its references: a pin never outlives a lease.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BlockPins"]


class BlockPins:
    """Block references of payloads leased in this process, counted per lease.

    Example:
        pinned = pins.pin({"run/0/p-1": [ref]})   # a lease granted here
        pins.unpin(pinned)                          # ... released: the reference goes
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # leases are released on one thread, read on another
        self._held: dict[str, tuple[list[Any], int]] = {}

    def pin(self, blocks: Mapping[str, list[Any]]) -> tuple[str, ...]:
        """Hold ``blocks`` for one more lease; returns the payload ids pinned."""
        with self._lock:
            for pid, refs in blocks.items():
                _, count = self._held.get(pid, (refs, 0))
                self._held[pid] = (refs, count + 1)
        return tuple(blocks)

    def repin(self, payload_ids: Sequence[str]) -> tuple[str, ...]:
        """Count one more lease on payloads already pinned here (clones); returns those."""
        with self._lock:
            present = tuple(pid for pid in payload_ids if pid in self._held)
            for pid in present:
                refs, count = self._held[pid]
                self._held[pid] = (refs, count + 1)
        return present

    def unpin(self, payload_ids: Sequence[str]) -> None:
        """One lease less; references of payloads no local lease holds are dropped."""
        with self._lock:
            for pid in payload_ids:
                refs, count = self._held.get(pid, ([], 0))
                if count > 1:
                    self._held[pid] = (refs, count - 1)
                else:
                    self._held.pop(pid, None)

    def lookup_many(self, payload_ids: Sequence[str]) -> list[list[Any] | None]:
        """The pinned references of each payload (None: not pinned here), under one lock."""
        with self._lock:
            found = [self._held.get(pid) for pid in payload_ids]
        return [None if held is None else held[0] for held in found]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
