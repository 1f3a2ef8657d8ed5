"""``RoutesProducer``: mix into any actor that produces routing (rollout workers,
engine adapters) to get the one-write put.

``put_routes`` stages the canonical array in this actor's outbox and asks a store shard
to adopt it; the shard then calls ``take_staged`` on this actor, which makes the shard
the owner of the blocks this actor returns. The bytes are written once, into this
node's object store, survive this actor's death, and never travel through the shard.
Do not block inside the same actor call on reading those routes back: ``take_staged``
runs after the current call returns (for a non-concurrent actor).
"""

from __future__ import annotations

from typing import Any

import ray

from routeplay.core.handle import Handle
from routeplay.core.routes import Routes
from routeplay.store.client import RouteStore
from routeplay.store.outbox import PayloadOutbox

__all__ = ["RoutesProducer"]


class RoutesProducer:
    """Mixin for Ray actors that hand routing to the route store."""

    _routeplay_outbox: PayloadOutbox | None = None

    def put_routes(self, store: RouteStore, routes: Routes, *, weight_version: int = 0) -> Handle:
        """Store ``routes`` with one object-store write, owned by a store shard."""
        outbox = self._outbox()
        token, blocks = outbox.stage(routes.array, block_rows=store.block_rows_for(routes.spec))
        me = ray.get_runtime_context().current_actor
        try:
            return store.put_staged(me, token, blocks, routes, weight_version=weight_version)
        except BaseException:
            outbox.discard(token)
            raise

    def take_staged(self, token: str) -> Any:
        """Called by a store shard: return the staged blocks (and forget them)."""
        return self._outbox().take(token)

    def staged_count(self) -> int:
        """Payloads staged and not yet taken (0 in steady state)."""
        return len(self._outbox())

    def _outbox(self) -> PayloadOutbox:
        if self._routeplay_outbox is None:
            self._routeplay_outbox = PayloadOutbox()
        return self._routeplay_outbox
