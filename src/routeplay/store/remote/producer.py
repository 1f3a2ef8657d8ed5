"""``RoutesProducer``: mix into any actor that produces routing (rollout workers,
engine adapters) to get the one-write put.

``put_routes`` stages the canonical array in this actor's outbox and asks a store shard
to adopt it; the shard calls ``take_staged`` on this actor, which makes the shard the
owner of the blocks this actor returns, and waits until they exist. So when
``put_routes`` returns, the bytes have been written once, into this node's object
store, they survive this actor's death, and they never travel through the shard.

``take_staged`` runs in its own concurrency group (it must answer while ``put_routes``
is waiting), so producer actors are created with ``producer_actor(cls)`` instead of
plain ``ray.remote(cls)``. An asyncio producer awaits ``aput_routes`` /
``aput_routes_many`` instead (no ``ray.get``; its concurrent puts share a shard call,
``WRITE_ROUND`` of them at most).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import ray

from routeplay.core.handle import Handle, StoreRef
from routeplay.core.routes import Routes
from routeplay.store.client.coalesce import Coalescer
from routeplay.store.client.lease import Lease
from routeplay.store.client.route_store import RouteStore
from routeplay.store.client.write_path import (
    LeasedPut,
    LeasedWrite,
    sample_holders,
    shared_samples,
)
from routeplay.store.flow import Flow, primed
from routeplay.store.remote.outbox import PayloadOutbox
from routeplay.store.shard.shard import StoredPayload
from routeplay.store.write_plan import plan_write

__all__ = [
    "PRODUCER_CONCURRENCY",
    "TAKE_GROUP",
    "AsyncRoutesProducer",
    "RoutesProducer",
    "producer_actor",
]

TAKE_GROUP: Final = "routeplay-take"
PRODUCER_CONCURRENCY: Final = {TAKE_GROUP: 1}


WRITE_ROUND: Final = 32
"""Concurrent puts of one actor sent in one adopt call at most: a round that fills goes
at once, so the shard takes its blocks (the copy into the object store) while the loop
lays out the next ones, instead of after all of them (512 groups answered together)."""


def producer_actor(cls: type, **options: Any) -> Any:
    """``ray.remote(cls)`` with the concurrency group ``take_staged`` needs."""
    groups = {**options.pop("concurrency_groups", {}), **PRODUCER_CONCURRENCY}
    remote: Any = ray.remote  # its overloads do not list concurrency_groups
    return remote(concurrency_groups=groups, **options)(cls)


class RoutesProducer:
    """Mixin for Ray actors that hand routing to the route store."""

    _routeplay_outbox: PayloadOutbox | None = None

    def put_routes(self, store: RouteStore, routes: Routes, *, weight_version: int = 0) -> Handle:
        """Store ``routes`` with one object-store write, owned by a store shard."""
        return store.drive(self._put_routes(store, routes, weight_version))

    def _put_routes(self, store: RouteStore, routes: Routes, weight_version: int) -> Flow[Handle]:
        if routes.rows == 0:
            return Handle(routes.spec)
        token, blocks = self.stage_routes(
            routes.array, block_rows=store.block_rows_for(routes.spec)
        )
        me = ray.get_runtime_context().current_actor
        try:
            return (yield from store.put_staged_flow(me, token, blocks, routes, weight_version))
        finally:
            self._outbox().discard(token)  # a no-op once taken; frees it if the put failed

    def put_routes_many(
        self,
        store: RouteStore,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]:
        """Store many samples with one shard call (and one call back to this actor);
        ``shared_prefix`` and ``pack`` as in ``RouteStore.put_many`` (a GRPO group's
        prompt once; the whole batch one payload).

        Example:
            handles = self.put_routes_many(store, group, shared_prefix=prompt_rows)
        """
        flow = self._put_routes_many(store, batch, weight_version, shared_prefix, pack)
        return store.drive(flow)

    def _put_routes_many(
        self,
        store: RouteStore,
        batch: Sequence[Routes],
        weight_version: int,
        shared_prefix: int,
        pack: bool,
    ) -> Flow[list[Handle]]:
        planned = plan_write(batch, prefix_rows=shared_prefix, pack=pack)
        if isinstance(planned, list):
            return planned  # nothing to store
        spec, layout = planned
        blocks, _ = store.layout_blocks(layout, spec)
        token = self._outbox().stage_many(blocks)
        me = ray.get_runtime_context().current_actor
        try:
            return (yield from store.put_staged_many_flow(me, token, layout, spec, weight_version))
        finally:
            self._outbox().discard(token)

    def put_routes_leased_many(
        self,
        store: RouteStore,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = False,
    ) -> list[tuple[Handle, Lease]]:
        """``put_routes_many`` with a lease per sample (``holders``: one for all, or one
        per sample) granted by the same shard call: a group written and its members
        leased in one round trip. Unpinned by default: a producer keeps the rows alive
        for the trainer, it does not read them.

        Example:
            pairs = self.put_routes_leased_many(store, group, holders, shared_prefix=prompt)
        """
        flow = self._put_routes_leased_many(
            store, batch, sample_holders(holders, len(batch)), weight_version,
            shared_prefix, pack, pin,
        )  # fmt: skip
        return store.drive(flow)

    def _put_routes_leased_many(
        self,
        store: RouteStore,
        batch: Sequence[Routes],
        holders: list[str],
        weight_version: int,
        shared_prefix: int,
        pack: bool,
        pin: bool,
    ) -> Flow[list[tuple[Handle, Lease]]]:
        planned = plan_write(batch, prefix_rows=shared_prefix, pack=pack)
        if isinstance(planned, list):  # nothing to store: empty handles, leased as any
            items = list(zip(planned, holders, strict=True))
            leases = yield from store.acquire_many_flow(items, pin=pin)
            return list(zip(planned, leases, strict=True))
        spec, layout = planned
        blocks, payloads = store.layout_blocks(layout, spec)
        token = self._outbox().stage_many(blocks)
        me = ray.get_runtime_context().current_actor
        samples = layout.payloads_per_sample()
        try:
            written = yield from store.staged_leased_adoption(
                me, token, payloads, layout.saved_bytes, samples, holders, pin=pin
            )
        finally:
            self._outbox().discard(token)
        [pairs] = store.leased_handles([LeasedPut(layout, spec, weight_version, holders)], written)
        return pairs

    def stage_routes(self, array: Any, *, block_rows: int) -> tuple[str, int]:
        """Keep ``array`` until a store takes it; returns (token, block count)."""
        return self._outbox().stage(array, block_rows=block_rows)

    @ray.method(concurrency_group=TAKE_GROUP)
    def take_staged(self, token: str) -> Any:
        """Called by a store: return the staged blocks (and forget them), then a small
        marker the store fetches to learn that the hand-over succeeded (``ray.wait``
        counts the errored results of a dead producer as ready)."""
        return self._outbox().hand_over(token)

    def staged_count(self) -> int:
        """Payloads staged and not yet taken (0 in steady state)."""
        return len(self._outbox())

    def _outbox(self) -> PayloadOutbox:
        if self._routeplay_outbox is None:
            self._routeplay_outbox = PayloadOutbox()
        return self._routeplay_outbox


class AsyncRoutesProducer(RoutesProducer):
    """``RoutesProducer`` with awaitable puts, for a producer actor that is asyncio by
    design (its methods ``async def``).

    Kept apart on purpose: Ray makes every actor whose class has one ``async def``
    method an async actor, whose sync methods then share an event loop per concurrency
    group. A threaded producer (a rollout worker blocking on its engine) that inherited
    these would silently become such an actor, and a blocking put would stall the loop
    that must answer the store's ``take_staged``.

    Concurrent puts of one actor (one coroutine per sample or group, as XTuner's and
    verl's rollout workers run them) go out together: the batches awaited on the loop
    before it next runs its ready callbacks are staged under one token and adopted in
    one shard call, with one call back to this actor (``routeplay.store.client.coalesce``),
    ``WRITE_ROUND`` puts a round at most: a round that fills is sent at once.
    Each caller gets only its own handles; a batch that fails is retried put by put, so
    one bad put fails only its caller; a caller cancelled in flight has its payloads
    dropped when the batch lands.

    Example:
        @ray.remote
        class Worker(AsyncRoutesProducer):
            async def ingest(self, store, routes):
                return await self.aput_routes(store, routes)
    """

    _routeplay_writes: dict[int, Coalescer[_Staged, list[StoreRef]]] | None = None
    _routeplay_leased_writes: (
        dict[tuple[int, bool], Coalescer[_StagedLeased, list[tuple[Handle, Lease]]]] | None
    ) = None

    async def aput_routes(
        self, store: RouteStore, routes: Routes, *, weight_version: int = 0
    ) -> Handle:
        """Awaitable ``put_routes``, for an asyncio producer actor (no ``ray.get``).

        Example:
            handle = await self.aput_routes(store, routes, weight_version=2)
        """
        [handle] = await self.aput_routes_many(store, [routes], weight_version=weight_version)
        return handle

    async def aput_routes_many(
        self,
        store: RouteStore,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]:
        """Awaitable ``put_routes_many``; concurrent calls of this actor share one shard
        call per round of at most ``WRITE_ROUND``.

        Example:
            handles = await self.aput_routes_many(store, group, shared_prefix=prompt_rows)
        """
        planned = plan_write(batch, prefix_rows=shared_prefix, pack=pack)
        if isinstance(planned, list):
            return planned  # nothing to store
        spec, layout = planned
        blocks, payloads = store.layout_blocks(layout, spec)
        [stored] = await self._writes(store).submit(
            [_Staged(blocks, tuple(payloads), layout.saved_bytes)]
        )
        return store.written_handles(layout, stored, spec, weight_version)

    async def aput_routes_leased_many(
        self,
        store: RouteStore,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = False,
    ) -> list[tuple[Handle, Lease]]:
        """Awaitable ``put_routes_leased_many``; concurrent calls of this
        actor share one shard call per round of at most ``WRITE_ROUND``: the groups
        answered together are written and their members leased in one call. A caller
        cancelled in flight has its leases ended, and with them its payloads.

        Example:
            pairs = await self.aput_routes_leased_many(store, group, holders,
                                                       shared_prefix=prompt_rows)
        """
        each = sample_holders(holders, len(batch))
        planned = plan_write(batch, prefix_rows=shared_prefix, pack=pack)
        if isinstance(planned, list):  # nothing to store: empty handles, leased as any
            leases = await store.aacquire_many(list(zip(planned, each, strict=True)), pin=pin)
            return list(zip(planned, leases, strict=True))
        spec, layout = planned
        blocks, payloads = store.layout_blocks(layout, spec)
        staged = _Staged(blocks, tuple(payloads), layout.saved_bytes)
        put = LeasedPut(layout, spec, weight_version, tuple(each))
        [pairs] = await self._leased_writes(store, pin).submit([_StagedLeased(staged, put)])
        return pairs

    def _writes(self, store: RouteStore) -> Coalescer[_Staged, list[StoreRef]]:
        """This actor's coalesced writes to ``store`` (one per store it writes to)."""
        if self._routeplay_writes is None:
            self._routeplay_writes = {}
        writes = self._routeplay_writes.get(id(store))
        if writes is None:
            writes = self._routeplay_writes[id(store)] = Coalescer(
                run=lambda staged: self._adopt_together(store, staged),
                undo=lambda stored: store.discard_written([r for refs in stored for r in refs]),
                round_requests=WRITE_ROUND,
            )
        return writes

    def _leased_writes(
        self, store: RouteStore, pin: bool
    ) -> Coalescer[_StagedLeased, list[tuple[Handle, Lease]]]:
        """This actor's coalesced leased writes to ``store`` (one per store, pinned or
        not: a batch's grant carries the block references or does not)."""
        if self._routeplay_leased_writes is None:
            self._routeplay_leased_writes = {}
        writes = self._routeplay_leased_writes.get((id(store), pin))
        if writes is None:
            writes = self._routeplay_leased_writes[(id(store), pin)] = Coalescer(
                run=lambda batches: self._lease_together(store, batches, pin),
                undo=lambda outs: store.release_many([lease for out in outs for _, lease in out]),
                round_requests=WRITE_ROUND,
            )
        return writes

    def _lease_together(
        self, store: RouteStore, batches: list[_StagedLeased], pin: bool
    ) -> Awaitable[list[list[tuple[Handle, Lease]]]]:
        """``_adopt_together`` that leases every batch's samples in the same shard call
        (each sample's payload indices moved past the batches before it); each batch's
        handles and leases, in order."""
        outbox = self._outbox()
        staged = [batch.staged for batch in batches]
        token = outbox.stage_many(tuple(block for one in staged for block in one.blocks))
        payloads = [payload for one in staged for payload in one.payloads]
        samples, holders = shared_samples([batch.put for batch in batches])
        saved = sum(one.saved_bytes for one in staged)
        me = ray.get_runtime_context().current_actor
        try:
            flow = store.staged_leased_adoption(
                me, token, payloads, saved, samples, holders, pin=pin
            )
            pending = primed(flow, store.backend)
        except BaseException:
            outbox.discard(token)
            raise
        return self._leased(store, pending, outbox, token, batches)

    async def _leased(
        self,
        store: RouteStore,
        pending: Awaitable[LeasedWrite],
        outbox: PayloadOutbox,
        token: str,
        batches: list[_StagedLeased],
    ) -> list[list[tuple[Handle, Lease]]]:
        try:
            written = await pending
        finally:
            outbox.discard(token)  # a no-op once taken; frees it if the adopt failed
        return store.leased_handles([batch.put for batch in batches], written)

    def _adopt_together(
        self, store: RouteStore, batches: list[_Staged]
    ) -> Awaitable[list[list[StoreRef]]]:
        """Every batch's blocks staged under one token and adopted in one shard call,
        the call sent now (``flow.primed``: the shard starts taking the blocks while this
        actor's loop lays out the next round); each batch's stored payloads, in order."""
        outbox = self._outbox()
        token = outbox.stage_many(tuple(block for staged in batches for block in staged.blocks))
        payloads = [payload for staged in batches for payload in staged.payloads]
        saved = sum(staged.saved_bytes for staged in batches)
        me = ray.get_runtime_context().current_actor
        try:
            pending = primed(store.staged_adoption(me, token, payloads, saved), store.backend)
        except BaseException:
            outbox.discard(token)
            raise
        return self._adopted(pending, outbox, token, batches)

    async def _adopted(
        self,
        pending: Awaitable[list[StoreRef]],
        outbox: PayloadOutbox,
        token: str,
        batches: list[_Staged],
    ) -> list[list[StoreRef]]:
        try:
            stored = await pending
        finally:
            outbox.discard(token)  # a no-op once taken; frees it if the adopt failed
        out, at = [], 0
        for staged in batches:
            out.append(stored[at : at + len(staged.payloads)])
            at += len(staged.payloads)
        return out


@dataclass(frozen=True, slots=True)
class _Staged:
    """One put's laid-out blocks and what the shard records for its payloads."""

    blocks: tuple[Any, ...]
    payloads: tuple[StoredPayload, ...]
    saved_bytes: int


@dataclass(frozen=True, slots=True)
class _StagedLeased:
    """One leased put: its staged blocks, and what its samples' leases and handles are
    built from (its layout: each sample's payloads; each sample's holder)."""

    staged: _Staged
    put: LeasedPut
