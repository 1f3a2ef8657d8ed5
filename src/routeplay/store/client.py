"""``RouteStore``: the client every process uses to put, lease and read routing.

It is a small picklable object (config + actor handles) that travels to rollout
workers and trainer ranks. Metadata calls go to the shard that minted a payload
(shards are chosen by hash); payload bytes never pass through a shard: a reader gets
block references from one batched ``locate`` call per shard, then pulls the blocks
straight from the node that holds them, copies its rows out and drops the views (a
zero-copy view would pin the object after its last lease is gone).
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import EngineKey, Handle, InlineSource, Segment, StoreRef
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize, check_dtype, check_row_count, check_shape
from routeplay.errors import (
    HandleError,
    MisuseError,
    RoutesDataError,
    RoutesLost,
    RunMismatch,
)
from routeplay.store.backend import Backend, LocalBackend, RayBackend, ShardCall
from routeplay.store.engine_store import PayloadMeta
from routeplay.store.lease import Lease
from routeplay.store.lease_table import LeakRecord, TableStats
from routeplay.store.outbox import split_blocks
from routeplay.store.read_plan import BlockCopy, DirectCopy, ReadPlan, plan_reads
from routeplay.store.shard import shard_of

__all__ = ["MIN_BLOCK_BYTES", "RouteStore", "StoreConfig", "StoreStats"]

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
    block_rows: int = 4096
    """Rows per stored block, so a reader of a slice fetches only the blocks it needs
    (raised for narrow models so a block stays above ``MIN_BLOCK_BYTES``)."""
    timeout_s: float = 60.0
    """Deadline of every blocking call."""
    namespace: str = "routeplay"
    """Ray namespace of the store actors."""
    detached: bool = False
    """Keep the actors after the driver exits (long-lived clusters)."""
    resources: tuple[tuple[str, float], ...] = ()
    """Custom resources that place the shard actors (e.g. on the head node)."""
    join: bool = False
    """Share an existing store of the same run (otherwise a clash is refused)."""

    def __post_init__(self) -> None:
        checks = (
            ("shards", self.shards >= 1, ">= 1", self.shards),
            ("ttl_s", self.ttl_s is None or self.ttl_s > 0, "None or > 0", self.ttl_s),
            ("block_rows", self.block_rows >= 0, ">= 0", self.block_rows),
            ("timeout_s", self.timeout_s > 0, "> 0", self.timeout_s),
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
    """Shard actors the numbers come from."""


class RouteStore:
    """Client of one run's route store (picklable with the Ray backend)."""

    def __init__(self, config: StoreConfig, backend: Backend) -> None:
        self.config = config
        self._backend = backend

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
        )
        return cls(config, backend)

    @classmethod
    def local(cls, config: StoreConfig) -> RouteStore:
        """The same store with its shards in this process (tests, single-process tools)."""
        return cls(config, LocalBackend(config.run, shards=config.shards, ttl_s=config.ttl_s))

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
        if routes.rows == 0:
            return Handle(routes.spec)  # nothing to store: an empty handle keeps nothing alive
        blocks = split_blocks(routes.array, self.block_rows_for(routes.spec))
        refs = self._backend.put_blocks(blocks)
        block_rows = self.block_rows_for(routes.spec) if len(blocks) > 1 else 0
        shard = self._pick_shard(uuid.uuid4().hex)
        [stored] = self._call(
            [(shard, "adopt", (refs, routes.rows, routes.nbytes, block_rows))], "adopt"
        )
        return self._handle(stored, routes.spec, weight_version)

    def block_rows_for(self, spec: RouteSpec) -> int:
        """Rows per block for this model: the configured count, or more for narrow rows."""
        return max(self.config.block_rows, -(-MIN_BLOCK_BYTES // spec.row_nbytes))

    def put_staged(
        self, producer: Any, token: str, blocks: int, routes: Routes, *, weight_version: int = 0
    ) -> Handle:
        """Have a shard take a producer's staged blocks: one write, owned by the shard."""
        block_rows = self.block_rows_for(routes.spec) if blocks > 1 else 0
        args = (producer, token, blocks, routes.rows, routes.nbytes, block_rows)
        # The shard itself waits up to timeout_s for the producer; give its answer room.
        [stored] = self._backend.call(
            [(self._pick_shard(token), "adopt_from", args)],
            f"{self.run}: adopt {token}",
            timeout_s=2 * self.config.timeout_s,
        )
        return self._handle(stored, routes.spec, weight_version)

    def adopt_key(self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0) -> Handle:
        """Take an engine-store key over without reading it: the shard borrows the engine
        store's reference (the bytes stay where the engine wrote them) and the key is
        consumed. Shape, dtype and row count are checked from the engine store's metadata
        now (a refused key is freed, not leaked); ids are validated when rows are read."""
        meta = self._backend.engine_call(key.actor, key.namespace, "meta", key.key)
        if meta is not None:
            try:
                _check_key_meta(meta, key, spec)
            except RoutesDataError:
                self._backend.engine_call(key.actor, key.namespace, "free", key.key)
                raise
        wrapped = self._backend.engine_call(key.actor, key.namespace, "get_ref", key.key)
        nbytes = _meta_nbytes(meta) if meta is not None else spec.nbytes(key.rows)
        args = (wrapped, key.rows, nbytes, 0)
        [stored] = self._call([(self._pick_shard(key.key), "adopt", args)], "adopt")
        raw = StoreRef(payload_id=stored.payload_id, run=stored.run, rows=key.rows, canonical=False)
        return self._handle(raw, spec, weight_version)

    def free_engine_keys(self, handle: Handle) -> int:
        """Release the engine-store keys a dropped sample still references (never read);
        returns how many were live. Keys already consumed or expired are skipped."""
        keys = [src for src in handle.sources() if isinstance(src, EngineKey)]
        return sum(self.free_key(key) for key in keys)

    def free_key(self, key: EngineKey) -> bool:
        """Release one unread engine-store key (idempotent); True if it was live."""
        return bool(self._backend.engine_call(key.actor, key.namespace, "free", key.key))

    # -- leases -----------------------------------------------------------------------
    def acquire(self, handle: Handle, holder: str) -> Lease:
        """A lease of ``holder`` over every stored payload of ``handle``."""
        by_shard: dict[int, list[str]] = {}
        for source in handle.sources():
            if isinstance(source, StoreRef):
                self._check_run(source)
                by_shard.setdefault(shard_of(source.payload_id), []).append(source.payload_id)
        calls = [(i, "acquire", (pids, holder, self.run)) for i, pids in by_shard.items()]
        return Lease(self, handle, holder, self._grant_all(calls, f"acquire for {holder}"))

    def _release_parts(self, parts: dict[int, str]) -> None:
        self._call([(i, "release", (lid,)) for i, lid in parts.items()], "release")

    def _clone_parts(self, parts: dict[int, str], holder: str) -> dict[int, str]:
        calls = [(i, "clone", (lid, holder)) for i, lid in parts.items()]
        return self._grant_all(calls, f"clone for {holder}")

    def _transfer_parts(self, parts: dict[int, str], holder: str) -> dict[int, str]:
        """Clone on every shard (all or nothing), then end the old parts."""
        moved = self._clone_parts(parts, holder)
        self._release_parts(parts)
        return moved

    def _grant_all(self, calls: Sequence[ShardCall], what: str) -> dict[int, str]:
        """Per-shard lease ids, or none at all: a shard that fails rolls the others back,
        so a half-granted lease can never be left behind with nobody to release it."""
        results = self._backend.call_each(calls, f"{self.run}: {what}")
        granted = {
            shard: result
            for (shard, _, _), result in zip(calls, results, strict=True)
            if not isinstance(result, BaseException)
        }
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            self._call([(i, "revoke", (lid,)) for i, lid in granted.items()], "roll back")
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
        self, requests: Sequence[tuple[Handle, int, int]], *, holder: str = ""
    ) -> list[npt.NDArray[Any]]:
        """Rows of many handles: one ``locate`` call per shard, one fetch of each block.

        ``holder`` only names the reader in errors (e.g. which batch lost its routing).
        """
        for handle, _, _ in requests:
            for source in handle.sources():
                if isinstance(source, StoreRef):
                    self._check_run(source)
        plan = plan_reads(requests)
        outs = [
            np.empty((rows, *h.spec.row_shape), h.spec.dtype)
            for rows, (h, _, _) in zip(plan.rows, requests, strict=True)
        ]
        consumed: dict[str, npt.NDArray[Any]] = {}  # each engine key is read once per call
        for direct in plan.direct:
            self._copy_direct(direct, outs[direct.request], consumed)
        blocks: dict[tuple[str, int], Any] = {}
        try:
            if plan.copies:
                blocks = self._fetch_blocks(plan, holder)
            for copy in plan.copies:
                self._copy_block(copy, blocks[(copy.payload_id, copy.block)], outs[copy.request])
        finally:
            blocks.clear()  # drop the zero-copy views, also on errors: nothing stays pinned
        return outs

    def _fetch_blocks(self, plan: ReadPlan, holder: str) -> dict[tuple[str, int], Any]:
        shards = sorted(plan.wanted)
        wanted = {i: plan.locate_requests(i) for i in shards}
        located = self._call([(i, "locate", (wanted[i], self.run)) for i in shards], "locate")
        keys: list[tuple[str, int]] = []
        refs: list[Any] = []
        for i, per_shard in zip(shards, located, strict=True):
            for (pid, blocks), block_refs in zip(wanted[i], per_shard, strict=True):
                keys.extend((pid, b) for b in blocks)
                refs.extend(block_refs)
        try:
            values = self._backend.fetch(refs, "blocks")
        except RoutesLost as exc:
            lost = self._backend.lost_index(refs, exc)
            payload = keys[lost][0] if lost is not None else "?"
            reader = holder or "an unnamed reader"
            raise RoutesLost(
                exc.summary,
                where=f"payload {payload} (run {self.run}), read by {reader}",
                found=exc.found,
                hint=exc.hint,
            ) from exc
        return dict(zip(keys, values, strict=True))

    @staticmethod
    def _copy_block(copy: BlockCopy, block: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
        seg = copy.segment
        source = seg.source
        assert isinstance(source, StoreRef)
        if source.canonical:
            out[copy.offset : copy.offset + (copy.hi - copy.lo)] = block[copy.lo : copy.hi]
            return
        # An adopted engine payload: check its length, copy the rows out of the view
        # (an error's traceback must not pin the object), then validate them.
        where = f"payload {source.payload_id}"
        check_row_count(block.shape[0], source.rows, where=where)
        rows = np.array(block[copy.lo : copy.hi])
        del block
        out[copy.offset : copy.offset + rows.shape[0]] = canonicalize(
            rows, seg.spec, start_row=copy.first_row, where=where
        ).array

    def _copy_direct(
        self, copy: DirectCopy, out: npt.NDArray[Any], consumed: dict[str, npt.NDArray[Any]]
    ) -> None:
        seg = copy.segment
        source = seg.source
        if isinstance(source, InlineSource):
            rows = source.array[seg.start : seg.stop]
        else:
            assert isinstance(source, EngineKey)
            if source.key not in consumed:
                consumed[source.key] = self._consume_engine_key(source, seg.spec)
            rows = consumed[source.key][seg.start : seg.stop]
        out[copy.offset : copy.offset + seg.rows] = rows

    def _consume_engine_key(self, key: EngineKey, spec: RouteSpec) -> npt.NDArray[Any]:
        """Read a key's whole payload once (the key is single-use), validated, canonical."""
        where = f"engine key {key.key}"
        wrapped = self._backend.engine_call(key.actor, key.namespace, "get_ref", key.key)
        [view] = self._backend.fetch(wrapped, where)
        full = np.array(view)  # copy out, then drop the view so nothing stays pinned
        del view, wrapped
        check_row_count(full.shape[0], key.rows, where=where)
        return canonicalize(full, spec, where=where).array

    # -- accounting -------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Sum of every shard's snapshot."""
        shards = range(self._backend.shard_count)
        parts: list[TableStats] = self._call([(i, "stats", ()) for i in shards], "stats")
        return _merge_stats(parts)

    def leaks(self) -> list[LeakRecord]:
        """Leases still held, oldest first, across shards."""
        shards = range(self._backend.shard_count)
        per_shard = self._call([(i, "leaks", ()) for i in shards], "leaks")
        return sorted((r for rows in per_shard for r in rows), key=lambda r: (r.since, r.lease_id))

    def shutdown(self) -> None:
        """Stop the shards (their references go, so every payload can be reclaimed)."""
        self._backend.shutdown()

    # -- internals --------------------------------------------------------------------
    def _call(self, calls: Sequence[ShardCall], what: str) -> list[Any]:
        return self._backend.call(calls, f"{self.run}: {what}")

    def _pick_shard(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self._backend.shard_count

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


def _meta_nbytes(meta: PayloadMeta) -> int:
    """Bytes the engine store really holds (LMDeploy: uint16, every decoder layer)."""
    return int(np.prod(meta.shape, dtype=np.int64)) * np.dtype(meta.dtype).itemsize


def _check_key_meta(meta: PayloadMeta, key: EngineKey, spec: RouteSpec) -> None:
    where = f"engine key {key.key}"
    check_dtype(np.dtype(meta.dtype), spec, where=where)
    check_shape(meta.shape, spec, where=where)
    check_row_count(meta.shape[0], key.rows, where=where)


def _merge_stats(parts: Sequence[TableStats]) -> StoreStats:
    totals: dict[str, Any] = {}
    for name in (f.name for f in fields(TableStats)):
        values = [getattr(part, name) for part in parts]
        if isinstance(values[0], tuple):  # (holder, count) pairs: sum per holder
            per_holder: dict[str, int] = {}
            for pairs in values:
                for holder, value in pairs:
                    per_holder[holder] = per_holder.get(holder, 0) + value
            totals[name] = tuple(sorted(per_holder.items()))
        else:
            totals[name] = sum(values)
    return StoreStats(shards=len(parts), **totals)
