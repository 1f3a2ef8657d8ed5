"""The write path of the route-store client (``WritePath``, a part of ``RouteStore``):
``put_many`` writes a laid-out batch (``routeplay.store.write_plan``: shared prompt prefixes
stored once, ``pack``) with one object-store write per payload and one adopt call;
``put_leased_many`` leases in the same call; ``put_staged``/``put_staged_many`` have a
shard take a producer's staged blocks, so the shard owns them (``RoutesProducer``). A
call abandoned in flight drops what it wrote when the shard's answer lands.

Built over the client's ``StoreCore`` and its ``Leases`` (a put that leases in the same
call hands out the same ``Lease`` objects an acquire does).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from routeplay.core.handle import Handle, Segment, StoreRef
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError
from routeplay.store.client.core import StoreCore
from routeplay.store.client.lease import Lease
from routeplay.store.client.leases import Leases
from routeplay.store.client.releases import Undo
from routeplay.store.flow import Flow
from routeplay.store.shard.api import ShardApi, ShardCall, shard_call
from routeplay.store.shard.shard import Grant, StoredPayload
from routeplay.store.write_plan import (
    MIN_BLOCK_BYTES,
    BatchLayout,
    batch_spec,
    plan_batch,
    plan_write,
    split_blocks,
)

__all__ = ["LeasedPut", "LeasedWrite", "WritePath", "sample_holders", "shared_samples"]


class WritePath:
    """Put routing from this process or from a producer (a part of ``RouteStore``).

    Example:
        writes = WritePath(core, leases)
        handles = store.put_many(group, shared_prefix=prompt_tokens)
    """

    def __init__(self, core: StoreCore, leases: Leases) -> None:
        self._core = core
        self._leases = leases

    def put(self, routes: Routes, *, weight_version: int = 0) -> Handle:
        """Write from *this* process, which then owns the bytes: for long-lived callers
        (the driver, a store-side service). Rollout workers use ``RoutesProducer``.

        Example:
            handle = store.put(routes, weight_version=3)
        """
        return self.put_many([routes], weight_version=weight_version)[0]

    async def aput(self, routes: Routes, *, weight_version: int = 0) -> Handle:
        """Awaitable ``put``.

        Example:
            handle = await store.aput(routes, weight_version=3)
        """
        return (await self.aput_many([routes], weight_version=weight_version))[0]

    def put_many(
        self,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]:
        """Write many samples with one adopt call (many small samples: one round trip).

        ``shared_prefix=P``: samples whose first ``P`` rows are verified equal (a GRPO
        group's prompt) store them once and point at the shared rows; each still gets
        its own handle and its own leases (see ``routeplay.store.write_plan``). ``pack``
        writes the whole batch as one payload (one write; readers fetch all of it).

        Example:
            handles = store.put_many(group, shared_prefix=prompt_tokens)
            store.stats().shared_prefix_bytes_saved   # (G - 1) prompt copies not written
        """
        return self._core.drive(self._put_many(batch, weight_version, shared_prefix, pack))

    async def aput_many(
        self,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]:
        """Awaitable ``put_many`` (cancelled in flight: the payloads are dropped).

        Example:
            handles = await store.aput_many(group, shared_prefix=prompt_tokens)
        """
        return await self._core.adrive(self._put_many(batch, weight_version, shared_prefix, pack))

    def _put_many(
        self, batch: Sequence[Routes], weight_version: int, shared_prefix: int, pack: bool
    ) -> Flow[list[Handle]]:
        planned = plan_write(batch, prefix_rows=shared_prefix, pack=pack)
        if isinstance(planned, list):
            return planned  # nothing to store
        spec, layout = planned
        blocks, payloads = self.layout_blocks(layout, spec)
        refs = self._core.backend.put_blocks(blocks)
        shard = self._core.pick_shard(uuid.uuid4().hex)
        call = shard_call(shard, ShardApi.adopt_many, refs, payloads, layout.saved_bytes)
        [stored] = yield from self._core.send_and_wait(
            [call], "adopt a batch", undo=_discard_stored(shard)
        )
        return _handles(layout, stored, spec, weight_version)

    def put_leased(
        self, routes: Routes, holder: str, *, weight_version: int = 0
    ) -> tuple[Handle, Lease]:
        """``put`` and a lease of ``holder`` in one shard call: a slow caller cannot lose
        the payload to the TTL between the two (as it can with ``put`` then ``acquire``).

        Example:
            handle, lease = store.put_leased(routes, "sample/s-3")
        """
        [pair] = self.put_leased_many([routes], holder, weight_version=weight_version)
        return pair

    async def aput_leased(
        self, routes: Routes, holder: str, *, weight_version: int = 0
    ) -> tuple[Handle, Lease]:
        """Awaitable ``put_leased``.

        Example:
            handle, lease = await store.aput_leased(routes, "sample/s-3")
        """
        [pair] = await self.aput_leased_many([routes], holder, weight_version=weight_version)
        return pair

    def put_leased_many(
        self,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = True,
    ) -> list[tuple[Handle, Lease]]:
        """``put_many`` with a lease per sample, granted by the same call: of ``holders``
        (one for all, or one per sample: a group's members ``rollout/<id>``). ``pin``:
        the grant carries the block references and this process holds them (a reader);
        ``pin=False`` for a holder that only keeps the rows alive (a rollout worker).

        Example:
            pairs = store.put_leased_many(group, "buffer/g-1", shared_prefix=prompt)
        """
        flow = self._put_leased_many(batch, holders, weight_version, shared_prefix, pack, pin)
        return self._core.drive(flow)

    async def aput_leased_many(
        self,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = True,
    ) -> list[tuple[Handle, Lease]]:
        """Awaitable ``put_leased_many`` (cancelled in flight: leases and payloads end).

        Example:
            pairs = await store.aput_leased_many(group, "buffer/g-1", shared_prefix=prompt)
        """
        flow = self._put_leased_many(batch, holders, weight_version, shared_prefix, pack, pin)
        return await self._core.adrive(flow)

    def _put_leased_many(
        self,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        weight_version: int,
        shared_prefix: int,
        pack: bool,
        pin: bool,
    ) -> Flow[list[tuple[Handle, Lease]]]:
        each = sample_holders(holders, len(batch))
        spec = batch_spec(batch)
        if spec is None:
            return []
        layout = plan_batch(batch, prefix_rows=shared_prefix, pack=pack)
        if not layout.arrays:
            empty = [Handle(spec) for _ in batch]
            items = list(zip(empty, each, strict=True))
            leases = yield from self._leases.acquire_many_flow(items, pin=pin)
            return list(zip(empty, leases, strict=True))
        blocks, payloads = self.layout_blocks(layout, spec)
        refs = self._core.backend.put_blocks(blocks)
        shard = self._core.pick_shard(uuid.uuid4().hex)
        put = LeasedPut(layout, spec, weight_version, each)
        samples, _ = shared_samples([put])
        call = shard_call(
            shard,
            ShardApi.adopt_leased,
            refs,
            payloads,
            layout.saved_bytes,
            samples,
            each,
            with_blocks=pin,
        )
        [(stored, grant)] = yield from self._core.send_and_wait(
            [call], f"put for {each[0]}", undo=_release_adopted(shard)
        )
        [pairs] = self.leased_handles([put], LeasedWrite(shard, list(stored), grant))
        return pairs

    def staged_leased_adoption(
        self,
        producer: Any,
        token: str,
        payloads: Sequence[StoredPayload],
        saved_bytes: int,
        samples: Sequence[tuple[int, ...]],
        holders: Sequence[str],
        *,
        pin: bool = False,
    ) -> Flow[LeasedWrite]:
        """``staged_adoption`` that also leases each sample (its payload indices in
        ``samples``) to its holder in ``holders``, in the same shard call: a producer's
        group written and its members leased with one round trip. Abandoned in flight:
        the leases end when the answer lands, and with them the payloads.

        Example:
            written = yield from store.staged_leased_adoption(me, token, payloads, 0,
                                                              [(0,), (0,)], holders)
        """
        shard = self._core.pick_shard(token)
        call = shard_call(
            shard,
            ShardApi.adopt_from_leased,
            producer,
            token,
            list(payloads),
            saved_bytes,
            list(samples),
            list(holders),
            with_blocks=pin,
        )
        [(stored, grant)] = yield from self._core.send_and_wait(
            [call],
            f"adopt {token}",
            timeout_s=2 * self._core.config.timeout_s,
            undo=_release_adopted(shard),
        )
        return LeasedWrite(shard, list(stored), grant)

    def leased_handles(
        self, puts: Sequence[LeasedPut], written: LeasedWrite
    ) -> list[list[tuple[Handle, Lease]]]:
        """Each put's handles and leases from one leased write (``written``: the puts'
        payloads as the shard adopted them, in order, and their samples' lease ids, in
        order: a producer's coalesced puts share one). If any cannot be built, every
        lease the write granted ends (not waited for): nobody will hold them.

        Example:
            [pairs] = store.leased_handles([LeasedPut(layout, spec, 3, holders)], written)
        """
        out: list[list[tuple[Handle, Lease]]] = []
        payload_at = sample_at = 0
        try:
            for put in puts:
                stored = written.stored[payload_at : payload_at + len(put.layout.arrays)]
                ids = written.grant.lease_ids[sample_at : sample_at + len(put.layout.samples)]
                handles = _handles(put.layout, stored, put.spec, put.weight_version)
                out.append([
                    (handle, self._lease_of(handle, holder, written.shard, lease_id, written.grant))
                    for handle, holder, lease_id in zip(handles, put.holders, ids, strict=True)
                ])  # fmt: skip
                payload_at += len(put.layout.arrays)
                sample_at += len(put.layout.samples)
            if sample_at != len(written.grant.lease_ids):  # a lease no put would end
                raise ValueError(f"{len(written.grant.lease_ids)} leases for {sample_at} samples")
        except BaseException:
            granted = list(written.grant.lease_ids)
            call = shard_call(written.shard, ShardApi.release_many, granted)
            self._core.releases.submit([call])
            raise
        return out

    def _lease_of(
        self, handle: Handle, holder: str, shard: int, lease_id: str, grant: Grant
    ) -> Lease:
        borrow = self._core.backend.borrow
        # An unpinned grant carries no block references: its lease pins nothing here.
        pids = self._core.payload_ids(handle) if grant.blocks else ()
        blocks = {pid: borrow(grant.blocks[pid]) for pid in pids}
        return self._leases.granted_lease(handle, holder, {shard: lease_id}, blocks)

    def layout_blocks(
        self, layout: BatchLayout, spec: RouteSpec
    ) -> tuple[tuple[Any, ...], list[StoredPayload]]:
        """The blocks of a laid-out batch, flattened, and what the shard records for each
        payload (producers stage these blocks, then ``put_staged_many``)."""
        block_rows = self.block_rows_for(spec)
        blocks: list[Any] = []
        payloads = []
        for array in layout.arrays:
            parts = split_blocks(array, block_rows)
            blocks.extend(parts)
            payloads.append(
                StoredPayload(
                    blocks=len(parts),
                    rows=int(array.shape[0]),
                    nbytes=spec.nbytes(int(array.shape[0])),
                    block_rows=block_rows if len(parts) > 1 else 0,
                )
            )
        return tuple(blocks), payloads

    def block_rows_for(self, spec: RouteSpec) -> int:
        """Rows per block for this model: the configured count (more for narrow rows),
        or, by default, as many rows as fit in ``max_block_bytes``."""
        if self._core.config.block_rows <= 0:
            return max(1, self._core.config.max_block_bytes // spec.row_nbytes)
        return max(self._core.config.block_rows, -(-MIN_BLOCK_BYTES // spec.row_nbytes))

    def put_staged(
        self, producer: Any, token: str, blocks: int, routes: Routes, *, weight_version: int = 0
    ) -> Handle:
        """Have a shard take a producer's staged blocks: one write, owned by the shard."""
        return self._core.drive(
            self.put_staged_flow(producer, token, blocks, routes, weight_version)
        )

    async def aput_staged(
        self, producer: Any, token: str, blocks: int, routes: Routes, *, weight_version: int = 0
    ) -> Handle:
        """Awaitable ``put_staged``.

        Example:
            handle = await store.aput_staged(me, token, blocks, routes)
        """
        flow = self.put_staged_flow(producer, token, blocks, routes, weight_version)
        return await self._core.adrive(flow)

    def put_staged_flow(
        self, producer: Any, token: str, blocks: int, routes: Routes, weight_version: int
    ) -> Flow[Handle]:
        """The flow of ``put_staged`` (a producer drives it blocking or awaited)."""
        block_rows = self.block_rows_for(routes.spec) if blocks > 1 else 0
        shard = self._core.pick_shard(token)
        call = shard_call(
            shard,
            ShardApi.adopt_from,
            producer,
            token,
            blocks,
            routes.rows,
            routes.nbytes,
            block_rows,
        )
        # The shard itself waits up to timeout_s for the producer; give its answer room.
        [stored] = yield from self._core.send_and_wait(
            [call],
            f"adopt {token}",
            timeout_s=2 * self._core.config.timeout_s,
            undo=lambda _, ref: [shard_call(shard, ShardApi.discard, [ref.payload_id])],
        )
        return _handle(stored, routes.spec, weight_version)

    def put_staged_many(
        self,
        producer: Any,
        token: str,
        layout: BatchLayout,
        spec: RouteSpec,
        *,
        weight_version: int = 0,
    ) -> list[Handle]:
        """``put_staged`` for a whole laid-out batch: one shard call, one producer call."""
        return self._core.drive(
            self.put_staged_many_flow(producer, token, layout, spec, weight_version)
        )

    async def aput_staged_many(
        self,
        producer: Any,
        token: str,
        layout: BatchLayout,
        spec: RouteSpec,
        *,
        weight_version: int = 0,
    ) -> list[Handle]:
        """Awaitable ``put_staged_many``.

        Example:
            handles = await store.aput_staged_many(me, token, layout, spec)
        """
        flow = self.put_staged_many_flow(producer, token, layout, spec, weight_version)
        return await self._core.adrive(flow)

    def put_staged_many_flow(
        self, producer: Any, token: str, layout: BatchLayout, spec: RouteSpec, weight_version: int
    ) -> Flow[list[Handle]]:
        """The flow of ``put_staged_many`` (a producer drives it blocking or awaited)."""
        _, payloads = self.layout_blocks(layout, spec)  # blocks are views: nothing copied
        stored = yield from self.staged_adoption(producer, token, payloads, layout.saved_bytes)
        return self.written_handles(layout, stored, spec, weight_version)

    def staged_adoption(
        self, producer: Any, token: str, payloads: Sequence[StoredPayload], saved_bytes: int
    ) -> Flow[list[StoreRef]]:
        """The flow of one shard's adoption of every block a producer staged under
        ``token`` (one call to the shard, one from it to the producer): the stored
        payloads, in order. Abandoned in flight: the payloads are dropped when the
        answer lands. A producer adopting many writers' batches at once (its concurrent
        coroutines, ``AsyncRoutesProducer``) stages them under one token.

        Example:
            stored = yield from store.staged_adoption(me, token, payloads, saved_bytes)
        """
        shard = self._core.pick_shard(token)
        call = shard_call(
            shard, ShardApi.adopt_from_many, producer, token, list(payloads), saved_bytes
        )
        [stored] = yield from self._core.send_and_wait(
            [call],
            f"adopt {token}",
            timeout_s=2 * self._core.config.timeout_s,
            undo=_discard_stored(shard),
        )
        return list(stored)

    def written_handles(
        self, layout: BatchLayout, stored: Sequence[StoreRef], spec: RouteSpec, weight_version: int
    ) -> list[Handle]:
        """Each sample's handle of a written layout: the stored row ranges its rows are
        made of, in order (``stored``: the layout's payloads, as the shard adopted them).

        Example:
            handles = store.written_handles(layout, stored, spec, weight_version=3)
        """
        return _handles(layout, stored, spec, weight_version)


def _discard_stored(shard: int) -> Undo:
    """Undo of an adopt whose caller never got the handles: drop the unleased payloads."""

    def undo(_: int, stored: Sequence[StoreRef]) -> list[ShardCall[list[str]]]:
        return [shard_call(shard, ShardApi.discard, [ref.payload_id for ref in stored])]

    return undo


def _release_adopted(shard: int) -> Undo:
    """Undo of ``adopt_leased``: end its leases, which drops the payloads they alone hold."""

    def undo(_: int, result: tuple[list[StoreRef], Grant]) -> list[ShardCall[list[str]]]:
        return [shard_call(shard, ShardApi.release_many, list(result[1].lease_ids))]

    return undo


class LeasedWrite(NamedTuple):
    """A leased write's answer: the shard, its stored payloads, the samples' grant."""

    shard: int
    stored: list[StoreRef]
    grant: Grant


class LeasedPut(NamedTuple):
    """What one leased put's handles are built from: its layout, spec and weight
    version, and each sample's holder."""

    layout: BatchLayout
    spec: RouteSpec
    weight_version: int
    holders: Sequence[str]


def shared_samples(puts: Sequence[LeasedPut]) -> tuple[list[tuple[int, ...]], list[str]]:
    """Each sample's payload indices and holder when ``puts`` share one leased write
    (each put's payloads follow the puts' before it, as ``leased_handles`` slices the
    answer): what the shard's ``adopt_leased`` is asked for.

    Example:
        samples, holders = shared_samples([LeasedPut(layout, spec, 3, ["rollout/a"])])
    """
    samples: list[tuple[int, ...]] = []
    at = 0
    for put in puts:
        samples.extend(tuple(at + i for i in parts) for parts in put.layout.payloads_per_sample())
        at += len(put.layout.arrays)
    return samples, [holder for put in puts for holder in put.holders]


def sample_holders(holders: str | Sequence[str], samples: int) -> list[str]:
    """One holder per sample: ``holders`` itself for each, or the list as given (one
    per sample, else ``MisuseError``)."""
    if isinstance(holders, str):
        return [holders] * samples
    if len(holders) != samples:
        raise MisuseError(
            "a leased put names one holder, or one per sample",
            expected=f"a holder or a list of {samples}",
            found=len(holders),
        )
    return list(holders)


def _handles(
    layout: BatchLayout, stored: Sequence[StoreRef], spec: RouteSpec, weight_version: int
) -> list[Handle]:
    """Each sample's handle: the stored row ranges its rows are made of, in order."""
    return [
        Handle(
            spec,
            [
                Segment(
                    source=stored[part.array],
                    start=part.start,
                    stop=part.stop,
                    spec=spec,
                    weight_version=weight_version,
                )
                for part in parts
            ],
        )
        for parts in layout.samples
    ]


def _handle(stored: StoreRef, spec: RouteSpec, weight_version: int) -> Handle:
    """The handle of one whole stored payload."""
    segment = Segment(
        source=stored, start=0, stop=stored.rows, spec=spec, weight_version=weight_version
    )
    return Handle.of(segment)
