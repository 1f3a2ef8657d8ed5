"""``RouteStore``: the client every process uses to put, lease and read routing.

It is a small picklable object (config + actor handles) that travels to rollout
workers and trainer ranks; what it holds for this process only (pinned block
references, releases in flight) stays behind when it is pickled. Metadata calls go to
the shard that minted a payload (shards are chosen by hash); payload bytes never pass
through a shard.

- Write path (``put``, ``put_many``, ``put_staged``, ``adopt_keys``): one object-store
  write per payload, one adopt call per shard per batch (``routeplay.store.writes``
  lays a batch out, sharing verified-equal prompt prefixes).
- Leases (``acquire``, ``acquire_many``, ``release_many``): one call per shard for a
  whole step; a grant carries the block references, releases are not waited for
  (``routeplay.store.releases``).
- Read path (``read``, ``read_many``): ``routeplay.store.reads``.
- Awaitable twins (``aput_many``, ``aacquire_many``, ...): each call is one flow
  (``routeplay.store.flow``) that the blocking method drives with ``ray.get`` and the
  ``a``-prefixed one with ``await``; rescues of abandoned calls live in the flows.
"""

from __future__ import annotations

import logging
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, TypeAlias, TypeVar

import numpy.typing as npt

from routeplay.core.handle import EngineKey, Handle, Segment, StoreRef
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import HandleError, MisuseError, RouteplayError, RunMismatch
from routeplay.store.backend import Backend, LocalBackend, RayBackend
from routeplay.store.compaction import Compacted, Write, compact_handles
from routeplay.store.flow import Flow, adrive, awaiting, drive
from routeplay.store.key_check import check_start_rows
from routeplay.store.lease import Lease
from routeplay.store.lease_table import LeakRecord, TableStats
from routeplay.store.reads import BlockPins, Reader
from routeplay.store.releases import PendingReleases, Undo
from routeplay.store.shard import Grant, StoredPayload, shard_of
from routeplay.store.shard_api import ShardApi, ShardCall, shard_call
from routeplay.store.writes import BatchLayout, batch_spec, plan_batch, split_blocks

__all__ = ["MIN_BLOCK_BYTES", "RouteStore", "StoreConfig", "StoreStats"]

log = logging.getLogger(__name__)
R = TypeVar("R")

# Ray returns values under 100 KiB inline to the caller instead of writing them to the
# object store; blocks stay above that so payload bytes never travel through a shard.
MIN_BLOCK_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How a run's route store is laid out."""

    run: str
    """Run id: names the actors and scopes every payload and lease."""
    shards: int = 1
    """Store actors; metadata calls spread over them by hash."""
    ttl_s: float | None = 600.0
    """Seconds a payload may stay stored without any lease before it is dropped."""
    block_rows: int = 0
    """Rows per stored block; 0 (the default) stores one block per payload, split only
    above ``max_block_bytes``. Every block is one more ``ray.put``, and when all the
    readers of a payload sit on one node (the SP ranks of a sample) that node pulls
    every block anyway; set it when readers of different parts sit on different nodes
    (raised for narrow models so a block stays above ``MIN_BLOCK_BYTES``)."""
    max_block_bytes: int = 256 * 1024 * 1024
    """Largest block written when ``block_rows`` is 0 (bounds one object's size)."""
    timeout_s: float = 60.0
    """Deadline of every blocking call."""
    namespace: str = "routeplay"
    """Ray namespace of the store actors."""
    detached: bool = False
    """Keep the actors after the driver exits (long-lived clusters)."""
    resources: tuple[tuple[str, float], ...] = ()
    """Custom resources that place the shard actors (e.g. on the head node)."""
    join: bool = False
    """Share an existing store of the same run (otherwise a clash is refused). Not an
    access control: see docs/security.md."""
    lease_ttl_s: float | None = None
    """Longest a lease may be held before the store ends it (off by default: leases have
    no TTL). For long-running jobs whose holders may die without releasing: expiries are
    logged and counted (``StoreStats.expired_leases``); set it well above a step."""

    def __post_init__(self) -> None:
        checks = (
            ("shards", self.shards >= 1, ">= 1", self.shards),
            ("ttl_s", self.ttl_s is None or self.ttl_s > 0, "None or > 0", self.ttl_s),
            ("block_rows", self.block_rows >= 0, ">= 0", self.block_rows),
            (
                "max_block_bytes",
                self.max_block_bytes >= MIN_BLOCK_BYTES,
                f">= {MIN_BLOCK_BYTES}",
                self.max_block_bytes,
            ),
            ("timeout_s", self.timeout_s > 0, "> 0", self.timeout_s),
            (
                "lease_ttl_s",
                self.lease_ttl_s is None or self.lease_ttl_s > 0,
                "None or > 0",
                self.lease_ttl_s,
            ),
        )
        for name, ok, expected, found in checks:
            if not ok:
                raise MisuseError(f"invalid StoreConfig.{name}", expected=expected, found=found)

    def build(self) -> RouteStore:
        """Start (or join) the run's store actors."""
        return RouteStore.start(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats(TableStats):
    """Store-wide snapshot: every shard's table summed."""

    shards: int
    """Shard actors the numbers come from (live ones)."""
    dead_shards: tuple[str, ...] = ()
    """Shards that did not answer, each with why; their payloads are not counted."""


Request: TypeAlias = tuple[Handle, int, int]
"""Rows ``[start, stop)`` of a handle, as ``read_many`` takes them."""


class RouteStore:
    """Client of one run's route store (picklable with the Ray backend).

    Every call a rollout or a buffer makes has an awaitable twin of the same name with
    an ``a`` in front (``aput_many``, ``aadopt_keys_each``, ``aacquire_many``, ...): the
    same flow (``routeplay.store.flow``), awaited on Ray's references instead of
    blocking in ``ray.get`` (no executor thread; safe inside an async actor). A task
    cancelled in the middle of one leaves nothing behind: what the calls in flight
    grant is undone when they land (docs/asyncio.md).

    Threads: one client may be shared by many threads (and many tasks). Its own state
    (pinned block references, releases in flight) is locked; every call sends its own
    shard calls; a call never overtakes a release any thread of this client sent
    before it, and a failed release is raised once, by the next call that settles it
    (on whichever thread). A ``Lease`` object is not meant to be released from two
    threads at once, but doing so is harmless (releases are idempotent).

    Example:
        store = StoreConfig(run="run-7").build()
        [handle] = store.put_many([routes])
        [lease] = store.acquire_many([(handle, "train/step-0")])
        rows = lease.read(0, 4096)      # no shard call: the grant carried the blocks
        store.release_many([lease])     # sent, not waited for; errors surface later
        [lease] = await store.aacquire_many([(handle, "train/step-1")])  # in a coroutine
    """

    def __init__(self, config: StoreConfig, backend: Backend) -> None:
        self.config = config
        self._backend = backend
        self._pins = BlockPins()
        self._releases = PendingReleases(backend)
        self._reader = Reader(self._call, backend, config.run, self._pins)

    def __reduce__(self) -> tuple[object, ...]:
        # Pinned references and releases in flight belong to this process: a copy
        # elsewhere starts without them (it locates what it reads), so a pickled client
        # can never keep an object alive past the leases of the process that pinned it.
        return (RouteStore, (self.config, self._backend))

    @classmethod
    def start(cls, config: StoreConfig) -> RouteStore:
        """Create the run's shard actors on Ray, or join them if they exist."""
        options: dict[str, Any] = {
            "namespace": config.namespace,
            "get_if_exists": True,
            "resources": dict(config.resources),
        }
        if config.detached:
            options["lifetime"] = "detached"
        backend = RayBackend.start(
            config.run,
            shards=config.shards,
            ttl_s=config.ttl_s,
            timeout_s=config.timeout_s,
            options=options,
            join=config.join,
            lease_ttl_s=config.lease_ttl_s,
        )
        return cls(config, backend)

    @classmethod
    def local(cls, config: StoreConfig) -> RouteStore:
        """The same store with its shards in this process (tests, single-process tools)."""
        backend = LocalBackend(
            config.run, shards=config.shards, ttl_s=config.ttl_s, lease_ttl_s=config.lease_ttl_s
        )
        return cls(config, backend)

    @property
    def run(self) -> str:
        """Run this client belongs to."""
        return self.config.run

    @property
    def backend(self) -> Backend:
        """Where the shards live."""
        return self._backend

    def drive(self, flow: Flow[R]) -> R:
        """Run a flow over this client's backend to its result, blocking.

        Example:
            handles = store.drive(store_flow)   # what every blocking method does
        """
        return drive(flow, self._backend)

    async def adrive(self, flow: Flow[R]) -> R:
        """Run a flow over this client's backend to its result, awaited.

        Example:
            handles = await store.adrive(store_flow)   # what every a-method does
        """
        return await adrive(flow, self._backend)

    # -- writing ----------------------------------------------------------------------
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
        its own handle and its own leases (see ``routeplay.store.writes``). ``pack``
        writes the whole batch as one payload (one write; readers fetch all of it).

        Example:
            handles = store.put_many(group, shared_prefix=prompt_tokens)
            store.stats().shared_prefix_bytes_saved   # (G - 1) prompt copies not written
        """
        return self.drive(self._put_many(batch, weight_version, shared_prefix, pack))

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
        return await self.adrive(self._put_many(batch, weight_version, shared_prefix, pack))

    def _put_many(
        self, batch: Sequence[Routes], weight_version: int, shared_prefix: int, pack: bool
    ) -> Flow[list[Handle]]:
        spec = batch_spec(batch)
        if spec is None:
            return []
        layout = plan_batch(batch, prefix_rows=shared_prefix, pack=pack)
        if not layout.arrays:
            return [Handle(spec) for _ in batch]
        blocks, payloads = self.layout_blocks(layout, spec)
        refs = self._backend.put_blocks(blocks)
        shard = self._pick_shard(uuid.uuid4().hex)
        call = shard_call(shard, ShardApi.adopt_many, refs, payloads, layout.saved_bytes)
        [stored] = yield from self._calls([call], "adopt a batch", undo=_discard_stored(shard))
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
        holder: str,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[tuple[Handle, Lease]]:
        """``put_many`` with a lease of ``holder`` per sample, granted by the same call.

        Example:
            pairs = store.put_leased_many(group, "buffer/g-1", shared_prefix=prompt)
        """
        flow = self._put_leased_many(batch, holder, weight_version, shared_prefix, pack)
        return self.drive(flow)

    async def aput_leased_many(
        self,
        batch: Sequence[Routes],
        holder: str,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[tuple[Handle, Lease]]:
        """Awaitable ``put_leased_many`` (cancelled in flight: leases and payloads end).

        Example:
            pairs = await store.aput_leased_many(group, "buffer/g-1", shared_prefix=prompt)
        """
        flow = self._put_leased_many(batch, holder, weight_version, shared_prefix, pack)
        return await self.adrive(flow)

    def _put_leased_many(
        self,
        batch: Sequence[Routes],
        holder: str,
        weight_version: int,
        shared_prefix: int,
        pack: bool,
    ) -> Flow[list[tuple[Handle, Lease]]]:
        spec = batch_spec(batch)
        if spec is None:
            return []
        layout = plan_batch(batch, prefix_rows=shared_prefix, pack=pack)
        if not layout.arrays:
            empty = [Handle(spec) for _ in batch]
            leases = yield from self._acquire_many([(h, holder) for h in empty])
            return list(zip(empty, leases, strict=True))
        blocks, payloads = self.layout_blocks(layout, spec)
        refs = self._backend.put_blocks(blocks)
        shard = self._pick_shard(uuid.uuid4().hex)
        per_sample = [layout.payloads_of(i) for i in range(len(layout.samples))]
        call = shard_call(
            shard, ShardApi.adopt_leased, refs, payloads, layout.saved_bytes, per_sample, holder
        )
        [(stored, grant)] = yield from self._calls(
            [call], f"put for {holder}", undo=_release_adopted(shard)
        )
        handles = _handles(layout, stored, spec, weight_version)
        return [
            (handle, self._lease_of(handle, holder, shard, lease_id, grant))
            for handle, lease_id in zip(handles, grant.lease_ids, strict=True)
        ]

    def _lease_of(
        self, handle: Handle, holder: str, shard: int, lease_id: str, grant: Grant
    ) -> Lease:
        pids = self._payload_ids(handle)
        blocks = {pid: self._backend.borrow(grant.blocks[pid]) for pid in pids}
        return Lease(self, handle, holder, {shard: lease_id}, pinned=self._pins.pin(blocks))

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
        if self.config.block_rows <= 0:
            return max(1, self.config.max_block_bytes // spec.row_nbytes)
        return max(self.config.block_rows, -(-MIN_BLOCK_BYTES // spec.row_nbytes))

    def put_staged(
        self, producer: Any, token: str, blocks: int, routes: Routes, *, weight_version: int = 0
    ) -> Handle:
        """Have a shard take a producer's staged blocks: one write, owned by the shard."""
        return self.drive(self.put_staged_flow(producer, token, blocks, routes, weight_version))

    async def aput_staged(
        self, producer: Any, token: str, blocks: int, routes: Routes, *, weight_version: int = 0
    ) -> Handle:
        """Awaitable ``put_staged``.

        Example:
            handle = await store.aput_staged(me, token, blocks, routes)
        """
        flow = self.put_staged_flow(producer, token, blocks, routes, weight_version)
        return await self.adrive(flow)

    def put_staged_flow(
        self, producer: Any, token: str, blocks: int, routes: Routes, weight_version: int
    ) -> Flow[Handle]:
        """The flow of ``put_staged`` (a producer drives it blocking or awaited)."""
        block_rows = self.block_rows_for(routes.spec) if blocks > 1 else 0
        shard = self._pick_shard(token)
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
        [stored] = yield from self._calls(
            [call],
            f"adopt {token}",
            timeout_s=2 * self.config.timeout_s,
            undo=lambda _, ref: [shard_call(shard, ShardApi.discard, [ref.payload_id])],
        )
        return self._handle(stored, routes.spec, weight_version)

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
        return self.drive(self.put_staged_many_flow(producer, token, layout, spec, weight_version))

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
        return await self.adrive(flow)

    def put_staged_many_flow(
        self, producer: Any, token: str, layout: BatchLayout, spec: RouteSpec, weight_version: int
    ) -> Flow[list[Handle]]:
        """The flow of ``put_staged_many`` (a producer drives it blocking or awaited)."""
        _, payloads = self.layout_blocks(layout, spec)  # blocks are views: nothing copied
        shard = self._pick_shard(token)
        call = shard_call(
            shard, ShardApi.adopt_from_many, producer, token, payloads, layout.saved_bytes
        )
        [stored] = yield from self._calls(
            [call],
            f"adopt {token}",
            timeout_s=2 * self.config.timeout_s,
            undo=_discard_stored(shard),
        )
        return _handles(layout, stored, spec, weight_version)

    def adopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle:
        """Take an engine-store key over in one call: the shard consumes the key (a key
        whose metadata does not fit ``spec`` is freed, not leaked, and refused) and has
        its rows validated and narrowed once, on the engine store's node, into a block
        the shard owns. Readers only copy; the trainer node pulls compact bytes. A
        payload with up to ``key.trailing_rows`` extra rows keeps ``[0, rows)`` (a slice).

        ``start_row=S`` (a resume or a later turn: the history's rows) stores only the
        rows ``[S, rows)``: the handle covers those ``rows - S`` rows, to append to the
        history; the rows before ``S`` are dropped on the engine's node, unread by
        anyone (``routeplay.store.key_check`` says why they are not compared).

        Example:
            new = store.adopt_key(routing.key, spec, weight_version=2, start_row=history.rows)
            handle = history + new
        """
        flow = self._adopt_keys([key], spec, weight_version, 0, [start_row], False)
        return self.drive(flow)[0]

    async def aadopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle:
        """Awaitable ``adopt_key`` (LMDeploy's and SGLang's keys alike; cancelled in
        flight: the key is consumed and its payload dropped).

        Example:
            new = await store.aadopt_key(routing.key, spec, start_row=history.rows)
        """
        flow = self._adopt_keys([key], spec, weight_version, 0, [start_row], False)
        return (await self.adrive(flow))[0]

    def adopt_keys(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle]:
        """``adopt_key`` for a batch in one call (one engine-store call per engine store,
        validations in parallel on the engine's node). A refused key is freed and its
        error raised; keys of the batch adopted before it expire unleased (TTL).

        ``shared_prefix=P`` (the keys of one GRPO group): validated together, and the
        first ``P`` stored rows that are verified equal across keys are stored once, as
        in ``put_many``; ``pack`` stores the group as one payload. Either makes this call
        wait for the validation (the layout depends on it). ``start_rows``: per key, as
        ``adopt_key``'s ``start_row``. ``adopt_keys_each`` sets refused keys aside.

        Example:
            handles = store.adopt_keys(group_keys, spec, shared_prefix=prompt_tokens)
        """
        flow = self._adopt_keys(keys, spec, weight_version, shared_prefix, start_rows, pack)
        return self.drive(flow)

    async def aadopt_keys(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle]:
        """Awaitable ``adopt_keys``.

        Example:
            handles = await store.aadopt_keys(group_keys, spec, shared_prefix=prompt_tokens)
        """
        flow = self._adopt_keys(keys, spec, weight_version, shared_prefix, start_rows, pack)
        return await self.adrive(flow)

    def _adopt_keys(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        weight_version: int,
        shared_prefix: int,
        start_rows: Sequence[int] | None,
        pack: bool,
    ) -> Flow[list[Handle]]:
        results = yield from self._adopt_keys_each(
            keys, spec, weight_version, shared_prefix, start_rows, pack
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [result for result in results if isinstance(result, Handle)]

    def adopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle | RouteplayError]:
        """``adopt_keys`` that sets a refused key aside: per key, its handle or the typed
        error that refused it (its metadata, another run's, consumed, expired; in a group
        its rows too), so one bad member of a group costs only that member and the
        others are still written together (one payload with ``pack``). A key adopted
        alone is validated without waiting: a bad row is raised by its first read.

        Example:
            out = store.adopt_keys_each(keys, spec, shared_prefix=600, pack=True)
            good = [h for h in out if isinstance(h, Handle)]
        """
        flow = self._adopt_keys_each(keys, spec, weight_version, shared_prefix, start_rows, pack)
        return self.drive(flow)

    async def aadopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle | RouteplayError]:
        """Awaitable ``adopt_keys_each`` (cancelled in flight: the keys are consumed and
        their payloads dropped).

        Example:
            out = await store.aadopt_keys_each(keys, spec, shared_prefix=600, pack=True)
        """
        flow = self._adopt_keys_each(keys, spec, weight_version, shared_prefix, start_rows, pack)
        return await self.adrive(flow)

    def _adopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        weight_version: int,
        shared_prefix: int,
        start_rows: Sequence[int] | None,
        pack: bool,
    ) -> Flow[list[Handle | RouteplayError]]:
        if not keys:
            return []
        keys = [self.scoped(key) for key in keys]
        starts = check_start_rows(keys, start_rows)
        yield from self._releases.settle(wait=False)
        shard = self._pick_shard(keys[0].key)
        pending = self._backend.send_adopt_keys(shard, keys, spec, shared_prefix, starts, pack)
        # The shard itself waits up to timeout_s for the engine store; give it room (its
        # first call to a store also asks its protocol: past this, the undo frees it all).
        [results] = yield from self._await(
            [pending],
            f"adopt {len(keys)} engine keys",
            timeout_s=2 * self.config.timeout_s,
            undo=_discard_adopted(shard),
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, RouteplayError):
                raise result  # not a refusal of one key: the call failed
        return [
            result
            if isinstance(result, RouteplayError)
            else _handle_of(
                result if isinstance(result, tuple) else ((result, 0, result.rows),),
                spec,
                weight_version,
            )
            for result in results
        ]

    def free_engine_keys(self, handle: Handle) -> int:
        """Release the engine-store keys a dropped sample still references (never read);
        returns how many were live. Keys already consumed or expired are skipped.

        Example:
            store.free_engine_keys(dropped.handle)
        """
        return self.drive(self._free_keys(_engine_keys(handle)))

    async def afree_engine_keys(self, handle: Handle) -> int:
        """Awaitable ``free_engine_keys``.

        Example:
            await store.afree_engine_keys(dropped.handle)
        """
        return await self.adrive(self._free_keys(_engine_keys(handle)))

    def free_key(self, key: EngineKey) -> bool:
        """Release one unread engine-store key of this run (idempotent); True if it was
        live. A key of another run is refused (``RunMismatch``) and stays live.

        Example:
            store.free_key(routing.key)
        """
        return self.drive(self._free_keys([key])) > 0

    async def afree_key(self, key: EngineKey) -> bool:
        """Awaitable ``free_key``.

        Example:
            await store.afree_key(routing.key)
        """
        return await self.adrive(self._free_keys([key])) > 0

    def _free_keys(self, keys: Sequence[EngineKey]) -> Flow[int]:
        """Free keys (one engine-store call each, all sent first); how many were live."""
        scoped = [self.scoped(key) for key in keys]
        if not scoped:
            return 0
        yield from self._backend.ask_engines(scoped)
        pending = [self._backend.send_free_key(key, self.run) for key in scoped]
        where = ", ".join(sorted({f"{key.namespace}/{key.actor}" for key in scoped}))
        answers = yield from self._await(pending, f"{where}.free", ends=True)
        return sum(bool(live) for live in answers)

    def scoped(self, key: EngineKey) -> EngineKey:
        """``key`` carrying this run's id (a key read from a response carries none yet);
        a key issued to another run is refused with ``RunMismatch``.

        Example:
            key = store.scoped(routing.key)   # EngineKey(..., run=store.run)
        """
        if key.run == self.run:
            return key
        if key.run:
            raise RunMismatch(
                "engine key of another run",
                expected=f"run {self.run}",
                found=f"run {key.run}",
                where=f"engine key {key.key}",
            )
        return replace(key, run=self.run)

    # -- leases -----------------------------------------------------------------------
    def acquire(self, handle: Handle, holder: str) -> Lease:
        """A lease of ``holder`` over every stored payload of ``handle``.

        Example:
            with store.acquire(handle, "buffer/s-1") as lease: ...
        """
        return self.acquire_many([(handle, holder)])[0]

    async def aacquire(self, handle: Handle, holder: str) -> Lease:
        """Awaitable ``acquire``.

        Example:
            async with await store.aacquire(handle, "buffer/s-1") as lease: ...
        """
        return (await self.aacquire_many([(handle, holder)]))[0]

    def acquire_many(self, items: Sequence[tuple[Handle, str]]) -> list[Lease]:
        """Leases for many ``(handle, holder)`` pairs (a training step): one call per
        shard, all or nothing; each grant carries the block references of its payloads,
        so reading leased rows in this process needs no further shard call.

        Example:
            leases = store.acquire_many([(h, "train/step-3") for h in handles])
            rows = store.read_many([(h, lo, hi) for h in handles])  # no shard call
            store.release_many(leases)
        """
        return self.drive(self._acquire_many(items))

    async def aacquire_many(self, items: Sequence[tuple[Handle, str]]) -> list[Lease]:
        """Awaitable ``acquire_many`` (cancelled in flight: every grant is revoked).

        Example:
            leases = await store.aacquire_many([(h, "train/step-3") for h in handles])
        """
        return await self.adrive(self._acquire_many(items))

    def _acquire_many(self, items: Sequence[tuple[Handle, str]]) -> Flow[list[Lease]]:
        wanted: dict[int, list[tuple[int, list[str]]]] = {}
        for index, (handle, _) in enumerate(items):
            per_shard: dict[int, list[str]] = {}
            for pid in self._payload_ids(handle):
                per_shard.setdefault(shard_of(pid), []).append(pid)
            for shard, pids in per_shard.items():
                wanted.setdefault(shard, []).append((index, pids))
        shards = sorted(wanted)
        calls = [
            shard_call(
                i, ShardApi.lease_many, [(pids, items[at][1]) for at, pids in wanted[i]], self.run
            )
            for i in shards
        ]
        holders = ", ".join(sorted({holder for _, holder in items})[:3])
        grants = yield from self._grant_all(calls, f"acquire for {holders}")
        parts: list[dict[int, str]] = [{} for _ in items]
        blocks: list[dict[str, list[Any]]] = [{} for _ in items]
        borrow = self._backend.borrow
        for shard, grant in zip(shards, grants, strict=True):
            granted = grant.blocks
            for (at, pids), lease_id in zip(wanted[shard], grant.lease_ids, strict=True):
                parts[at][shard] = lease_id
                pinned = blocks[at]
                for pid in pids:
                    pinned[pid] = borrow(granted[pid])
        return [
            Lease(self, handle, holder, parts[at], pinned=self._pins.pin(blocks[at]))
            for at, (handle, holder) in enumerate(items)
        ]

    def release_many(self, leases: Sequence[Lease]) -> None:
        """End many leases with one call per shard, not waited for (idempotent per
        lease): the reader's path (a training step, a materializer's finished samples).
        A failure is raised by this client's next call or ``flush`` (``ReleaseFailed``).
        ``Lease.release`` waits instead, for holders that must know the outcome.

        Example:
            store.release_many(leases)
        """
        by_shard: dict[int, list[str]] = {}
        live = [lease for lease in leases if not lease.released]
        for lease in live:  # another run's lease is refused before anything is marked
            for lease_id in lease.parts.values():
                _lease_shard(lease_id, self.run, self._backend.shard_count)
        for lease in live:
            for shard, lease_id in lease.parts.items():
                by_shard.setdefault(shard, []).append(lease_id)
        self._releases.submit(
            [shard_call(i, ShardApi.release_many, ids) for i, ids in by_shard.items()]
        )
        for lease in live:
            lease.mark_released()

    async def arelease_many(self, leases: Sequence[Lease]) -> None:
        """``release_many`` from a coroutine: it only sends (nothing to await), so it is
        the same call; ``aflush`` awaits the outcome.

        Example:
            await store.arelease_many(leases)
        """
        self.release_many(leases)

    def flush(self) -> None:
        """Wait for every release in flight; raise ``ReleaseFailed`` if one failed.

        Example:
            store.flush()
        """
        self.drive(self._releases.settle(wait=True))

    async def aflush(self) -> None:
        """Awaitable ``flush`` (cancelled: the releases stay in flight, still tracked).

        Example:
            await store.aflush()
        """
        await self.adrive(self._releases.settle(wait=True))

    # -- what a Lease calls (``routeplay.store.lease.LeaseOwner``) ----------------------
    def release_lease(self, parts: Mapping[int, str]) -> None:
        """End one lease's parts (its id per shard), waited for: a holder's lifecycle
        (buffer, session, sample state) must know whether its lease ended, to keep it
        or retry it if the shard failed. ``Lease.release`` calls it."""
        self.drive(self._release_lease(parts))

    async def arelease_lease(self, parts: Mapping[int, str]) -> None:
        """Awaitable ``release_lease`` (``Lease.arelease`` calls it)."""
        await self.adrive(self._release_lease(parts))

    def _release_lease(self, parts: Mapping[int, str]) -> Flow[None]:
        # Cancelled in flight: the release still lands (ending is idempotent), tracked.
        calls = [shard_call(i, ShardApi.release, lid) for i, lid in parts.items()]
        yield from self._calls(calls, "end a lease", ends=True)

    def clone_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """A new lease of ``holder`` over the same payloads, on every shard or none;
        returns its parts. ``Lease.clone`` calls it."""
        return self.drive(self._clone_lease(parts, holder))

    async def aclone_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Awaitable ``clone_lease`` (``Lease.aclone`` calls it)."""
        return await self.adrive(self._clone_lease(parts, holder))

    def _clone_lease(self, parts: Mapping[int, str], holder: str) -> Flow[dict[int, str]]:
        calls = [shard_call(i, ShardApi.clone, lid, holder) for i, lid in parts.items()]
        clones = yield from self._grant_all(calls, f"clone for {holder}")
        return dict(zip(parts, clones, strict=True))

    def transfer_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Clone on every shard (all or nothing), then end the old parts: the payloads
        never reach zero leases. The old parts' release is sent, not waited for (a
        failure is raised by the next call, as ``release_many``'s), so the new lease is
        always handed back. ``Lease.transfer`` calls it."""
        return self.drive(self._transfer_lease(parts, holder))

    async def atransfer_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Awaitable ``transfer_lease`` (``Lease.atransfer`` calls it)."""
        return await self.adrive(self._transfer_lease(parts, holder))

    def _transfer_lease(self, parts: Mapping[int, str], holder: str) -> Flow[dict[int, str]]:
        moved = yield from self._clone_lease(parts, holder)  # cancelled here: nothing moved
        self._releases.submit(
            [shard_call(i, ShardApi.release_many, [lid]) for i, lid in parts.items()]
        )
        return moved

    def repin_blocks(self, payload_ids: Sequence[str]) -> tuple[str, ...]:
        """Count one more local lease on block references pinned here (a clone's);
        returns the payloads that were pinned."""
        return self._pins.repin(payload_ids)

    def unpin_blocks(self, payload_ids: Sequence[str]) -> None:
        """One local lease less on these payloads' pinned block references (a lease
        released, pickled or collected); the last one drops them."""
        self._pins.unpin(payload_ids)

    def _grant_all(self, calls: Sequence[ShardCall[R]], what: str) -> Flow[list[R]]:
        """Per-call grants, or none at all: a shard that fails rolls the others back,
        so a half-granted lease can never be left behind with nobody to release it (nor
        can a wait abandoned in flight: each grant is revoked when it lands)."""

        def revoke(index: int, granted: Any) -> list[ShardCall[list[str]]]:
            return [shard_call(calls[index].shard, ShardApi.revoke_many, _lease_ids(granted))]

        results = yield from self._calls(calls, what, each=True, undo=revoke)
        granted: list[R] = []
        failures: list[BaseException] = []
        undo: list[ShardCall[list[str]]] = []
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                failures.append(result)
            else:
                granted.append(result)
                undo += revoke(index, result)
        if failures:
            yield from self._calls(undo, "roll back")
            raise failures[0]
        return granted

    # -- reading ----------------------------------------------------------------------
    def resolve(
        self, handle: Handle, rows: slice = slice(None), *, holder: str = ""
    ) -> npt.NDArray[Any]:
        """Rows ``handle[rows]`` (a contiguous slice), copied out once: ``read`` by slice."""
        start, stop, step = rows.indices(handle.rows)
        if step != 1:
            raise HandleError("routing rows resolve by contiguous slices", found=rows)
        return self.read(handle, start, max(start, stop), holder=holder)

    def read(
        self, handle: Handle, start: int = 0, stop: int | None = None, *, holder: str = ""
    ) -> npt.NDArray[Any]:
        """Rows ``[start, stop)`` of a handle, copied into memory the caller owns."""
        stop = handle.rows if stop is None else stop
        return self.read_many([(handle, start, stop)], holder=holder)[0]

    def read_many(
        self,
        requests: Sequence[Request],
        *,
        holder: str = "",
        out: Sequence[npt.NDArray[Any]] | None = None,
    ) -> list[npt.NDArray[Any]]:
        """Rows of many handles, each block fetched once; leased payloads need no shard
        call, others one ``locate`` per shard. ``out`` gives buffers to copy into (one
        per request, of its exact shape and dtype: reused memory is faster than fresh
        pages); after an error they hold only part of the rows. ``holder`` only names
        the reader in errors."""
        for handle, _, _ in requests:
            for segment in handle.segments:
                source = segment.source
                if isinstance(source, StoreRef):
                    if source.run != self.run:
                        self._check_run(source)
                elif isinstance(source, EngineKey) and source.run != self.run:
                    self.scoped(source)
        self.drive(self._releases.settle(wait=False))
        return self._reader.read_many(requests, holder=holder, out=out)

    def compact(
        self, handles: Sequence[Handle], holder: str, *, write: Write | None = None
    ) -> Compacted:
        """Copy the rows of long handles once into few payloads and lease the rebuilt
        handles for ``holder``; end the old leases after this returns
        (``routeplay.store.compaction``). The payloads are written from this process,
        which then owns them (a driver), or by ``write`` (a producer actor passes its
        ``put_routes_many`` bound to this store: a shard owns them). Trace sessions
        compact themselves (``TraceStoreClient.compact``).

        Example:
            done = store.compact([history.handle], "driver/history")
            if done.leases[0] is not None:  # None: nothing to copy, the old lease stays
                history.release()           # after: the new lease already holds the rows
                history = done.leases[0]    # one payload, a segment per version run
        """
        return compact_handles(self, handles, holder, write=write)

    # -- accounting -------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Sum of every live shard's snapshot (after the releases in flight have landed);
        a shard that does not answer is named in ``dead_shards``, not fatal.

        Example:
            assert store.stats().leases == 0
        """
        parts, dead = self.drive(self._each_shard(ShardApi.stats))
        return _merge_stats(parts, dead)

    async def astats(self) -> StoreStats:
        """Awaitable ``stats``.

        Example:
            assert (await store.astats()).leases == 0
        """
        parts, dead = await self.adrive(self._each_shard(ShardApi.stats))
        return _merge_stats(parts, dead)

    def leaks(self) -> list[LeakRecord]:
        """Leases still held, oldest first, across the live shards (a dead shard's are
        gone with it: it is logged, and ``stats().dead_shards`` names it).

        Example:
            for leak in store.leaks(): print(leak.holder, leak.age_s)
        """
        return _sorted_leaks(self.run, *self.drive(self._each_shard(ShardApi.leaks)))

    async def aleaks(self) -> list[LeakRecord]:
        """Awaitable ``leaks``.

        Example:
            assert await store.aleaks() == []
        """
        return _sorted_leaks(self.run, *await self.adrive(self._each_shard(ShardApi.leaks)))

    def revoke(self, leases: Sequence[str | LeakRecord | Lease]) -> int:
        """End leases whose holder died (from ``leaks()``, or their ids); returns how many
        were live. Waited for; counted in ``stats().revoked_leases``.

        Example:
            stale = [leak for leak in store.leaks() if leak.age_s > 3600]
            store.revoke(stale)
        """
        return self.drive(self._revoke(leases))

    async def arevoke(self, leases: Sequence[str | LeakRecord | Lease]) -> int:
        """Awaitable ``revoke``.

        Example:
            await store.arevoke(await store.aleaks())
        """
        return await self.adrive(self._revoke(leases))

    def _revoke(self, leases: Sequence[str | LeakRecord | Lease]) -> Flow[int]:
        by_shard: dict[int, list[str]] = {}
        for item in leases:
            ids = (
                item.parts.items()
                if isinstance(item, Lease)
                else [_lease_shard(item, self.run, self._backend.shard_count)]
            )
            for shard, lease_id in ids:
                by_shard.setdefault(shard, []).append(lease_id)
        calls = [shard_call(i, ShardApi.revoke_leases, ids) for i, ids in sorted(by_shard.items())]
        ended = yield from self._calls(calls, "revoke leases", ends=True)
        for item in leases:
            if isinstance(item, Lease):
                item.mark_released()
        return sum(len(ids) for ids in ended)

    def revoke_holder(self, holder: str) -> int:
        """End every lease of ``holder`` (a worker that died) on every shard; returns how
        many there were.

        Example:
            store.revoke_holder("rollout/worker-3")   # its samples' bytes can go now
        """
        return self.drive(self._revoke_holder(holder))

    async def arevoke_holder(self, holder: str) -> int:
        """Awaitable ``revoke_holder``.

        Example:
            await store.arevoke_holder("rollout/worker-3")
        """
        return await self.adrive(self._revoke_holder(holder))

    def _revoke_holder(self, holder: str) -> Flow[int]:
        shards = range(self._backend.shard_count)
        calls = [shard_call(i, ShardApi.revoke_holder, holder) for i in shards]
        ended = yield from self._calls(calls, f"revoke {holder}", ends=True)
        return sum(len(ids) for ids in ended)

    def _each_shard(self, op: Callable[[ShardApi], R]) -> Flow[tuple[list[R], list[str]]]:
        """Every shard's answer to ``op``; those that failed, named, apart."""
        shards = range(self._backend.shard_count)
        calls = [shard_call(i, op) for i in shards]
        results = yield from self._calls(calls, op.__name__, each=True)
        live = [r for r in results if not isinstance(r, BaseException)]
        dead = [
            f"shard {i} ({type(r).__name__}: {r.summary if isinstance(r, RouteplayError) else r})"
            for i, r in zip(shards, results, strict=True)
            if isinstance(r, BaseException)
        ]
        return live, dead

    def shutdown(self) -> None:
        """Stop the shards (their references go, so every payload can be reclaimed);
        a release that failed on the way is still raised."""
        try:
            self.flush()
        finally:
            self._backend.shutdown()

    # -- internals --------------------------------------------------------------------
    def _call(
        self, calls: Sequence[ShardCall[R]], what: str, *, timeout_s: float | None = None
    ) -> list[R]:
        """Shard calls answered, blocking (the reader's metadata call)."""
        return self.drive(self._calls(calls, what, timeout_s=timeout_s))

    def _calls(
        self,
        calls: Sequence[ShardCall[R]],
        what: str,
        *,
        timeout_s: float | None = None,
        each: bool = False,
        undo: Undo | None = None,
        ends: bool = False,
    ) -> Flow[list[Any]]:
        # Shard actors are threaded: wait for this client's releases first, so a call
        # never overtakes a release sent before it.
        yield from self._releases.settle(wait=True)
        pending = self._backend.send(calls)
        flow = self._await(pending, what, timeout_s=timeout_s, each=each, undo=undo, ends=ends)
        return (yield from flow)

    def _await(
        self,
        pending: Sequence[Any],
        what: str,
        *,
        timeout_s: float | None = None,
        each: bool = False,
        undo: Undo | None = None,
        ends: bool = False,
    ) -> Flow[list[Any]]:
        """Wait for calls sent. Abandoned in flight: ``undo`` what they grant as they
        land, or, for calls that end things (``ends``), settle them as releases."""
        rescue: Callable[[Sequence[Any]], None] | None = None
        if ends:
            rescue = self._releases.track
        elif undo is not None:
            rescue = partial(self._releases.rescue, undo=undo)
        what = f"{self.run}: {what}"
        return (yield from awaiting(pending, what, timeout_s=timeout_s, each=each, rescue=rescue))

    def _pick_shard(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self._backend.shard_count

    def _payload_ids(self, handle: Handle) -> list[str]:
        """The stored payloads of a handle, each once, in order; another run's refused."""
        ids = []
        for source in handle.sources():
            if isinstance(source, StoreRef):
                if source.run != self.run:
                    self._check_run(source)
                ids.append(source.payload_id)
        return ids

    def _check_run(self, source: StoreRef) -> None:
        if source.run != self.run:
            raise RunMismatch(
                "payload of another run",
                expected=f"run {self.run}",
                found=f"run {source.run}",
                where=f"payload {source.payload_id}",
            )

    def _handle(self, stored: StoreRef, spec: RouteSpec, weight_version: int) -> Handle:
        segment = Segment(
            source=stored, start=0, stop=stored.rows, spec=spec, weight_version=weight_version
        )
        return Handle.of(segment)


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


def _discard_adopted(shard: int) -> Undo:
    """Undo of an engine-key adopt: drop every payload it stored (keys stay consumed)."""

    def undo(_: int, results: Sequence[Any]) -> list[ShardCall[list[str]]]:
        pids: dict[str, None] = {}
        for result in results:
            if isinstance(result, StoreRef):
                pids[result.payload_id] = None
            elif isinstance(result, tuple):
                pids.update((ref.payload_id, None) for ref, _, _ in result)
        return [shard_call(shard, ShardApi.discard, list(pids))]

    return undo


def _engine_keys(handle: Handle) -> list[EngineKey]:
    return [src for src in handle.sources() if isinstance(src, EngineKey)]


def _sorted_leaks(
    run: str, per_shard: Sequence[list[LeakRecord]], dead: Sequence[str]
) -> list[LeakRecord]:
    for why in dead:
        log.warning("run %s: leaks() skipped %s", run, why)
    return sorted((r for rows in per_shard for r in rows), key=lambda r: (r.since, r.lease_id))


def _handle_of(
    ranges: Sequence[tuple[StoreRef, int, int]], spec: RouteSpec, weight_version: int
) -> Handle:
    """A handle of stored row ranges ``(payload, start, stop)``, in order."""
    segments = [
        Segment(source=ref, start=start, stop=stop, spec=spec, weight_version=weight_version)
        for ref, start, stop in ranges
    ]
    return Handle(spec, segments)


def _lease_ids(result: Any) -> list[str]:
    return list(result.lease_ids) if isinstance(result, Grant) else [result]


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


def _lease_shard(item: str | LeakRecord, run: str, shards: int) -> tuple[int, str]:
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


def _merge_stats(parts: Sequence[TableStats], dead: Sequence[str] = ()) -> StoreStats:
    totals: dict[str, Any] = {}
    for name in (f.name for f in fields(TableStats)):
        values = [getattr(part, name) for part in parts]
        if name.endswith("_by_holder"):  # (holder, count) pairs: sum per holder
            per_holder: dict[str, int] = {}
            for pairs in values:
                for holder, value in pairs:
                    per_holder[holder] = per_holder.get(holder, 0) + value
            totals[name] = tuple(sorted(per_holder.items()))
        else:
            totals[name] = sum(values)
    return StoreStats(shards=len(parts), dead_shards=tuple(dead), **totals)
