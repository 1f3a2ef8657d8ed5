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
"""

from __future__ import annotations

import logging
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeAlias, TypeVar

import numpy.typing as npt

from routeplay.core.handle import EngineKey, Handle, Segment, StoreRef
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import HandleError, MisuseError, RouteplayError, RunMismatch
from routeplay.store.backend import Backend, LocalBackend, RayBackend
from routeplay.store.compaction import Compacted, Write, compact_handles
from routeplay.store.key_check import check_start_rows
from routeplay.store.lease import Lease
from routeplay.store.lease_table import LeakRecord, TableStats
from routeplay.store.reads import BlockPins, Reader
from routeplay.store.releases import PendingReleases
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

    Example:
        store = StoreConfig(run="run-7").build()
        [handle] = store.put_many([routes])
        [lease] = store.acquire_many([(handle, "train/step-0")])
        rows = lease.read(0, 4096)      # no shard call: the grant carried the blocks
        store.release_many([lease])     # sent, not waited for; errors surface later
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

    # -- writing ----------------------------------------------------------------------
    def put(self, routes: Routes, *, weight_version: int = 0) -> Handle:
        """Write from *this* process, which then owns the bytes: for long-lived callers
        (the driver, a store-side service). Rollout workers use ``RoutesProducer``."""
        return self.put_many([routes], weight_version=weight_version)[0]

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
        [stored] = self._call([call], "adopt a batch")
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
        spec = batch_spec(batch)
        if spec is None:
            return []
        layout = plan_batch(batch, prefix_rows=shared_prefix, pack=pack)
        if not layout.arrays:
            return [(h, self.acquire(h, holder)) for h in (Handle(spec) for _ in batch)]
        blocks, payloads = self.layout_blocks(layout, spec)
        refs = self._backend.put_blocks(blocks)
        shard = self._pick_shard(uuid.uuid4().hex)
        per_sample = [layout.payloads_of(i) for i in range(len(layout.samples))]
        call = shard_call(
            shard, ShardApi.adopt_leased, refs, payloads, layout.saved_bytes, per_sample, holder
        )
        [(stored, grant)] = self._call([call], f"put for {holder}")
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
        block_rows = self.block_rows_for(routes.spec) if blocks > 1 else 0
        call = shard_call(
            self._pick_shard(token),
            ShardApi.adopt_from,
            producer,
            token,
            blocks,
            routes.rows,
            routes.nbytes,
            block_rows,
        )
        # The shard itself waits up to timeout_s for the producer; give its answer room.
        [stored] = self._call([call], f"adopt {token}", timeout_s=2 * self.config.timeout_s)
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
        _, payloads = self.layout_blocks(layout, spec)  # blocks are views: nothing copied
        shard = self._pick_shard(token)
        call = shard_call(
            shard, ShardApi.adopt_from_many, producer, token, payloads, layout.saved_bytes
        )
        [stored] = self._call([call], f"adopt {token}", timeout_s=2 * self.config.timeout_s)
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
        return self.adopt_keys([key], spec, weight_version=weight_version, start_rows=[start_row])[
            0
        ]

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
        results = self.adopt_keys_each(
            keys,
            spec,
            weight_version=weight_version,
            shared_prefix=shared_prefix,
            start_rows=start_rows,
            pack=pack,
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
        if not keys:
            return []
        keys = [self.scoped(key) for key in keys]
        starts = check_start_rows(keys, start_rows)
        self._releases.settle(wait=False)
        shard = self._pick_shard(keys[0].key)
        results = self._backend.adopt_keys(shard, keys, spec, shared_prefix, starts, pack)
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
        returns how many were live. Keys already consumed or expired are skipped."""
        keys = [src for src in handle.sources() if isinstance(src, EngineKey)]
        return sum(self.free_key(key) for key in keys)

    def free_key(self, key: EngineKey) -> bool:
        """Release one unread engine-store key of this run (idempotent); True if it was
        live. A key of another run is refused (``RunMismatch``) and stays live."""
        key = self.scoped(key)
        return self._backend.free_key(key, self.run)

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
        """A lease of ``holder`` over every stored payload of ``handle``."""
        return self.acquire_many([(handle, holder)])[0]

    def acquire_many(self, items: Sequence[tuple[Handle, str]]) -> list[Lease]:
        """Leases for many ``(handle, holder)`` pairs (a training step): one call per
        shard, all or nothing; each grant carries the block references of its payloads,
        so reading leased rows in this process needs no further shard call.

        Example:
            leases = store.acquire_many([(h, "train/step-3") for h in handles])
            rows = store.read_many([(h, lo, hi) for h in handles])  # no shard call
            store.release_many(leases)
        """
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
        grants = self._grant_all(calls, f"acquire for {holders}")
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
        ``Lease.release`` waits instead, for holders that must know the outcome."""
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

    def flush(self) -> None:
        """Wait for every release in flight; raise ``ReleaseFailed`` if one failed."""
        self._releases.settle(wait=True)

    # -- what a Lease calls (``routeplay.store.lease.LeaseOwner``) ----------------------
    def release_lease(self, parts: Mapping[int, str]) -> None:
        """End one lease's parts (its id per shard), waited for: a holder's lifecycle
        (buffer, session, sample state) must know whether its lease ended, to keep it
        or retry it if the shard failed. ``Lease.release`` calls it."""
        calls = [shard_call(i, ShardApi.release, lid) for i, lid in parts.items()]
        self._call(calls, "end a lease")

    def clone_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """A new lease of ``holder`` over the same payloads, on every shard or none;
        returns its parts. ``Lease.clone`` calls it."""
        calls = [shard_call(i, ShardApi.clone, lid, holder) for i, lid in parts.items()]
        clones = self._grant_all(calls, f"clone for {holder}")
        return dict(zip(parts, clones, strict=True))

    def transfer_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Clone on every shard (all or nothing), then end the old parts: the payloads
        never reach zero leases. ``Lease.transfer`` calls it."""
        moved = self.clone_lease(parts, holder)
        self.release_lease(parts)
        return moved

    def repin_blocks(self, payload_ids: Sequence[str]) -> tuple[str, ...]:
        """Count one more local lease on block references pinned here (a clone's);
        returns the payloads that were pinned."""
        return self._pins.repin(payload_ids)

    def unpin_blocks(self, payload_ids: Sequence[str]) -> None:
        """One local lease less on these payloads' pinned block references (a lease
        released, pickled or collected); the last one drops them."""
        self._pins.unpin(payload_ids)

    def _grant_all(self, calls: Sequence[ShardCall[R]], what: str) -> list[R]:
        """Per-call grants, or none at all: a shard that fails rolls the others back,
        so a half-granted lease can never be left behind with nobody to release it."""
        self._releases.settle(wait=True)
        results = self._backend.call_each(calls, f"{self.run}: {what}")
        granted: list[R] = []
        failures: list[BaseException] = []
        undo: list[ShardCall[list[str]]] = []
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):
                failures.append(result)
            else:
                granted.append(result)
                undo.append(shard_call(call.shard, ShardApi.revoke_many, _lease_ids(result)))
        if failures:
            self._call(undo, "roll back")
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
        pages). ``holder`` only names the reader in errors."""
        for handle, _, _ in requests:
            for segment in handle.segments:
                source = segment.source
                if isinstance(source, StoreRef):
                    if source.run != self.run:
                        self._check_run(source)
                elif isinstance(source, EngineKey) and source.run != self.run:
                    self.scoped(source)
        self._releases.settle(wait=False)
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
        a shard that does not answer is named in ``dead_shards``, not fatal."""
        parts, dead = self._each_shard(ShardApi.stats)
        return _merge_stats(parts, dead)

    def leaks(self) -> list[LeakRecord]:
        """Leases still held, oldest first, across the live shards (a dead shard's are
        gone with it: it is logged, and ``stats().dead_shards`` names it)."""
        per_shard, dead = self._each_shard(ShardApi.leaks)
        for why in dead:
            log.warning("run %s: leaks() skipped %s", self.run, why)
        return sorted((r for rows in per_shard for r in rows), key=lambda r: (r.since, r.lease_id))

    def revoke(self, leases: Sequence[str | LeakRecord | Lease]) -> int:
        """End leases whose holder died (from ``leaks()``, or their ids); returns how many
        were live. Waited for; counted in ``stats().revoked_leases``.

        Example:
            stale = [leak for leak in store.leaks() if leak.age_s > 3600]
            store.revoke(stale)
        """
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
        ended = self._call(calls, "revoke leases")
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
        shards = range(self._backend.shard_count)
        calls = [shard_call(i, ShardApi.revoke_holder, holder) for i in shards]
        ended = self._call(calls, f"revoke {holder}")
        return sum(len(ids) for ids in ended)

    def _each_shard(self, op: Callable[[ShardApi], R]) -> tuple[list[R], list[str]]:
        """Every shard's answer to ``op``; those that failed, named, apart."""
        self._releases.settle(wait=True)
        shards = range(self._backend.shard_count)
        calls = [shard_call(i, op) for i in shards]
        results = self._backend.call_each(calls, f"{self.run}: {op.__name__}")
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
        # Shard actors are threaded: wait for this client's releases first, so a call
        # never overtakes a release sent before it.
        self._releases.settle(wait=True)
        return self._backend.call(calls, f"{self.run}: {what}", timeout_s=timeout_s)

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
