"""The producer side of a one-write put.

On Ray 2.60 an object dies with the process that created it, unless a long-lived
process owns it. A rollout worker therefore does not ``ray.put`` its routing: it
*stages* the canonical array here and asks the store shard to adopt it; the shard calls
the worker's ``take`` method, so the shard owns the returned blocks while the bytes
are written once, into the worker's node object store, and never pass through the
shard. The array leaves the worker's heap when ``take`` runs.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

from routeplay.errors import AlreadyConsumed
from routeplay.store.write_plan import Rows, split_blocks

__all__ = ["HANDED_OVER", "PayloadOutbox", "split_blocks"]

HANDED_OVER = "handed-over"
"""Last return value of a ``take_staged`` (a producer's, a key validator's): fetched (a
few bytes) to check the hand-over."""


class PayloadOutbox:
    """Arrays staged by a producer until a store shard takes them (once)."""

    def __init__(self) -> None:
        # stage() and take() run on different threads of a producer actor.
        self._lock = threading.Lock()
        self._staged: dict[str, tuple[tuple[Rows, ...], float]] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}"

    def stage_many(self, blocks: tuple[Rows, ...]) -> str:
        """Keep ready-made blocks (of a whole batch) until taken in one call."""
        token = f"{self._prefix}-{next(self._ids)}"
        with self._lock:
            self._staged[token] = (blocks, time.monotonic())
        return token

    def stage(self, array: Rows, *, block_rows: int) -> tuple[str, int]:
        """Keep ``array`` until taken; returns the token and the number of blocks."""
        token = f"{self._prefix}-{next(self._ids)}"
        blocks = split_blocks(array, block_rows)
        with self._lock:
            self._staged[token] = (blocks, time.monotonic())
        return token, len(blocks)

    def take(self, token: str) -> tuple[Rows, ...] | Rows:
        """Hand the blocks over (a single block is returned bare, as Ray's num_returns=1 wants)."""
        with self._lock:
            staged = self._staged.pop(token, None)
        if staged is None:
            raise AlreadyConsumed("staged payload already taken or never staged", found=token)
        blocks, _ = staged
        return blocks[0] if len(blocks) == 1 else blocks

    def hand_over(self, token: str) -> tuple[Rows | str, ...]:
        """``take``'s blocks, then ``HANDED_OVER``: what a ``take_staged`` returns (Ray's
        ``num_returns`` = blocks + 1), the marker fetched by the taker.

        Example:
            >>> outbox = PayloadOutbox()
            >>> outbox.hand_over(outbox.stage_many(("block",)))
            ('block', 'handed-over')
        """
        blocks = self.take(token)
        return (*(blocks if isinstance(blocks, tuple) else (blocks,)), HANDED_OVER)

    def sweep(self, older_than_s: float) -> int:
        """Forget what was staged more than ``older_than_s`` ago and never taken (a taker
        that gave up: its deadline passed, or the call that staged ran twice); how many.

        Example:
            >>> PayloadOutbox().sweep(600.0)
            0
        """
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            old = [token for token, (_, at) in self._staged.items() if at < cutoff]
            for token in old:
                del self._staged[token]
        return len(old)

    def discard(self, token: str) -> None:
        """Forget a staged payload that will never be adopted (idempotent)."""
        with self._lock:
            self._staged.pop(token, None)

    def __len__(self) -> int:
        return len(self._staged)
