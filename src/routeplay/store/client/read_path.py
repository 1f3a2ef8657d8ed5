"""The read path of the route-store client (``ReadPath``, a part of ``RouteStore``): rows
of many handles copied once into memory the caller owns (``Reader`` runs the plans).

Where the bytes come from, cheapest first:
- **block references this process already holds**: a lease granted here carries the
  references of its payloads' blocks (``BlockPins``), so reading leased rows needs no
  shard call at all;
- otherwise one batched ``locate`` call per shard (a reader without a lease of its own,
  e.g. a copy of a lease pickled into another process, or a checkpoint export).

The blocks of one read are fetched in as few ``ray.get``s as their writing allows (one
when they all exist; else a batch each time more of them exist, so a block crosses
while later ones are still written), each batch's rows copied into the outputs and its
zero-copy views dropped at once (also on errors): a view would pin the object after
its last lease is gone. Pinned references go when the lease that pinned them is
released, never later, so a reader never outlives a lease's semantics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import EngineKey, Handle, InlineSource, StoreRef
from routeplay.core.layers import LayerSubset
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize
from routeplay.errors import HandleError, MisuseError, RoutesLost, SpecMismatch, StoreTimeout
from routeplay.store.client.block_copies import HeldBlocks, copy_blocks
from routeplay.store.client.core import StoreCore
from routeplay.store.client.pins import BlockPins
from routeplay.store.client.read_plan import BlockCopy, ReadPlan, plan_reads
from routeplay.store.engine.key_check import check_key_payload
from routeplay.store.flow import Wait, drive
from routeplay.store.remote.backend import Backend
from routeplay.store.shard.api import ShardApi, ShardCall, shard_call

__all__ = ["HeldBlocks", "MetadataCall", "ReadPath", "Reader", "Request"]

R = TypeVar("R")

Request: TypeAlias = tuple[Handle, int, int]
"""Rows ``[start, stop)`` of a handle, as ``read_many`` takes them."""


class MetadataCall(Protocol):
    """The client's shard call (it settles releases in flight first)."""

    def __call__(self, calls: Sequence[ShardCall[R]], what: str) -> list[R]: ...


class ReadPath:
    """The reads of one client (a part of ``RouteStore``; every ``Lease`` reads through
    it): requests checked against the run, releases that landed settled, then one
    ``Reader`` pass.

    Example:
        reads = ReadPath(core)
        [rows] = reads.read_many([(handle, 0, handle.rows)])
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self._reader = Reader(core.call, core.backend, core.run, core.pins)

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
        layers: LayerSubset | None = None,
        held: HeldBlocks | None = None,
    ) -> list[npt.NDArray[Any]]:
        """Rows of many handles, each block fetched once; leased payloads need no shard
        call, others one ``locate`` per shard. ``out`` gives buffers to copy into (one
        per request, of its exact shape and dtype: reused memory is faster than fresh
        pages); after an error they hold only part of the rows. ``holder`` only names
        the reader in errors. ``layers`` copies only those MoE layers' columns (a
        pipeline stage's: ``[rows, len(layers.layers), K]`` per request). ``held``
        (``hold_blocks``): blocks already fetched; a read they do not wholly cover
        fetches as it would without them.

        Example:
            [rows] = store.read_many([(handle, 0, handle.rows)], layers=stage_layers)
        """
        self._check_runs(requests)
        core = self._core
        core.drive(core.releases.settle(wait=False))
        return self._reader.read_many(requests, holder=holder, out=out, layers=layers, held=held)

    def _check_runs(self, requests: Sequence[Request]) -> None:
        """Every stored source and engine key of the requests belongs to this run."""
        core = self._core
        run = core.run
        for handle, _, _ in requests:
            for segment in handle.segments:
                source = segment.source
                if isinstance(source, StoreRef):
                    if source.run != run:
                        core.check_run(source)
                elif isinstance(source, EngineKey) and source.run != run:
                    core.scoped(source)

    def hold_blocks(self, requests: Sequence[Request], *, holder: str = "") -> HeldBlocks:
        """Fetch every stored block ``requests`` read, at once, and hold them as zero-copy
        views until the result is released: later ``read_many(..., held=...)`` calls
        over those rows copy from them without fetching (a trainer rank's next
        micro-batches: one fetch, not one per micro-batch). The views pin the blocks in
        the node's object store, not in this process; release them as soon as the reads
        are done (``with``). Rows from engine keys are not held (keys are single-use:
        their read consumes them). Held rows are the rows as fetched: a payload dropped
        after the fetch (revoked, expired) is still read from the views until they are
        released, as a read that finished just before the drop would have returned it;
        hold only what leases of the reader's keep alive.

        Example:
            with store.hold_blocks(requests) as held:
                for request, buffer in zip(requests, buffers):
                    store.read_many([request], out=[buffer], held=held)
        """
        self._check_runs(requests)
        core = self._core
        core.drive(core.releases.settle(wait=False))
        return self._reader.hold(requests, holder=holder)


class Reader:
    """Executes read plans for one client (``ReadPath.read_many`` delegates here)."""

    def __init__(
        self,
        call: MetadataCall,
        backend: Backend,
        run: str,
        pins: BlockPins,
    ) -> None:
        self._call = call  # the client's metadata call (it settles releases first)
        self._backend = backend
        self._run = run
        self._pins = pins

    def read_many(
        self,
        requests: Sequence[tuple[Handle, int, int]],
        *,
        holder: str,
        out: Sequence[npt.NDArray[Any]] | None = None,
        layers: LayerSubset | None = None,
        held: HeldBlocks | None = None,
    ) -> list[npt.NDArray[Any]]:
        """Rows of each request, copied into ``out`` (reused buffers) or fresh arrays;
        with ``layers``, only those MoE layers' columns; from ``held`` blocks when they
        cover every block the read needs."""
        plan = plan_reads(requests)
        columns = _columns(layers, requests)
        # Engine keys first: their payloads are checked against the rows the responses
        # claimed before anything is allocated for those rows (a claim is not a size).
        consumed = self._consume_engine_keys(plan)
        outs = _outputs(plan, requests, out, columns)
        for direct in plan.direct:
            seg = direct.segment
            if isinstance(seg.source, InlineSource):
                rows = seg.source.array[seg.start : seg.stop]
            else:
                assert isinstance(seg.source, EngineKey)
                rows = consumed[seg.source.key][seg.start : seg.stop]
            into = outs[direct.request][direct.offset : direct.offset + seg.rows]
            if columns is None:
                into[...] = rows
            else:
                columns.copy(rows, into)
        if plan.copies and not (held is not None and held.copy_into(plan.copies, outs, columns)):
            self._copy_as_fetched(plan, holder, outs, columns)
        return outs

    def hold(self, requests: Sequence[Request], *, holder: str) -> HeldBlocks:
        """Every stored block the requests read, fetched at once and held (engine keys
        are left to their own read: consuming one here would spend it). Only the blocks
        are planned: each later read plans its own copies."""
        plan = plan_reads(requests, copies=False)
        if not plan.blocks:
            return HeldBlocks({})
        keys, refs = self._block_refs(plan)
        views: dict[tuple[str, int], Any] = {}
        fetched = False
        try:
            for now, values in self._backend.fetch_as_created(refs, "blocks"):
                views.update((keys[i], value) for i, value in zip(now, values, strict=True))
                values.clear()
            fetched = True
        except (RoutesLost, StoreTimeout) as exc:
            raise self._named(exc, keys, refs, holder) from exc
        finally:
            refs.clear()
            if not fetched:  # any error: no view may stay pinned by a traceback
                views.clear()
        return HeldBlocks(views)

    def _named(
        self,
        exc: RoutesLost | StoreTimeout,
        keys: Sequence[tuple[str, int]],
        refs: Sequence[Any],
        holder: str,
    ) -> RoutesLost | StoreTimeout:
        """``exc`` again, naming the payload (or the candidates) and the reader."""
        # Named only on an error: a read's payload list is not built on every read.
        lost = self._backend.lost_index(refs, exc) if isinstance(exc, RoutesLost) else None
        payload = f"payload {keys[lost][0]}" if lost is not None else _candidates(keys)
        return type(exc)(
            exc.summary,
            where=f"{payload} (run {self._run}), read by {holder or 'an unnamed reader'}",
            expected=exc.expected,
            found=exc.found,
            hint=exc.hint,
        )

    def _copy_as_fetched(
        self,
        plan: ReadPlan,
        holder: str,
        outs: Sequence[npt.NDArray[Any]],
        columns: LayerSubset | None,
    ) -> None:
        """Copy every planned block range into its output, a batch of blocks at a time
        as the blocks arrive (``Backend.fetch_as_created``): a block crosses and is
        copied while later blocks are still being written or crossing (blocks that all
        exist already come as one batch, Ray's fastest pull). Each batch's zero-copy
        views are dropped before the next batch is fetched, also on errors: nothing
        stays pinned. After an error the outputs hold the batches copied before it."""
        keys, refs = self._block_refs(plan)
        copies = _CopiesByBlock(plan.copies)
        blocks: dict[tuple[str, int], Any] = {}
        try:
            for now, values in self._backend.fetch_as_created(refs, "blocks"):
                blocks = {keys[i]: value for i, value in zip(now, values, strict=True)}
                values.clear()
                batch = copies.of(blocks, whole=len(blocks) == len(keys))
                copy_blocks(batch, blocks, outs, columns)
                blocks.clear()
        except (RoutesLost, StoreTimeout) as exc:
            raise self._named(exc, keys, refs, holder) from exc
        finally:
            blocks.clear()
            refs.clear()

    def _block_refs(self, plan: ReadPlan) -> tuple[list[tuple[str, int]], list[Any]]:
        """Every block reference the plan needs: pinned ones here, the rest located."""
        keys: list[tuple[str, int]] = []
        refs: list[Any] = []
        missing: dict[int, list[tuple[str, list[int]]]] = {}
        for shard in sorted(plan.wanted):
            requests = plan.locate_requests(shard)
            pins = self._pins.lookup_many([pid for pid, _ in requests])
            for (pid, wanted), pinned in zip(requests, pins, strict=True):
                if pinned is None:
                    missing.setdefault(shard, []).append((pid, wanted))
                elif len(wanted) == 1 and wanted[0] == 0 and pinned:  # one block: the default
                    keys.append((pid, 0))
                    refs.append(pinned[0])
                else:
                    _check_blocks(pid, wanted, len(pinned))
                    keys.extend([(pid, b) for b in wanted])
                    refs.extend([pinned[b] for b in wanted])
        if missing:
            shards = sorted(missing)
            calls = [shard_call(i, ShardApi.locate, missing[i], self._run) for i in shards]
            located = self._call(calls, "locate blocks")
            for shard, per_shard in zip(shards, located, strict=True):
                for (pid, wanted), block_refs in zip(missing[shard], per_shard, strict=True):
                    keys.extend((pid, b) for b in wanted)
                    refs.extend(block_refs)
        return keys, refs

    def _consume_engine_keys(self, plan: ReadPlan) -> dict[str, npt.NDArray[Any]]:
        """Every engine key the plan reads, consumed once (keys are single-use)."""
        consumed: dict[str, npt.NDArray[Any]] = {}
        for direct in plan.direct:
            key = direct.segment.source
            if isinstance(key, EngineKey) and key.key not in consumed:
                consumed[key.key] = self._consume_engine_key(key, direct.segment.spec)
        return consumed

    def _consume_engine_key(self, key: EngineKey, spec: RouteSpec) -> npt.NDArray[Any]:
        """Read a key's whole payload once (the key is single-use), validated, canonical.

        Type, shape and rows are checked on the fetched view before anything is copied,
        so a payload that is not an array, or not the rows the key claims, is refused
        without allocating for the claim."""
        where = f"engine key {key.key}"
        drive(self._backend.ask_engines([key]), self._backend)
        pending = self._backend.send_key_refs(key, self._run)
        [wrapped] = self._backend.resolve(Wait((pending,), f"{key.namespace}/{key.actor}.get_ref"))
        del pending
        [view] = self._backend.fetch(wrapped, where)
        del wrapped
        try:  # copy the counted rows out; the view goes, also on a refusal: nothing pinned
            counted = np.array(check_key_payload(view, key, spec, where=where)[: key.rows])
        finally:
            del view
        return canonicalize(counted, spec, where=where).array


def _outputs(
    plan: ReadPlan,
    requests: Sequence[tuple[Handle, int, int]],
    out: Sequence[npt.NDArray[Any]] | None,
    columns: LayerSubset | None,
) -> list[npt.NDArray[Any]]:
    shapes = [
        (rows, *_row_shape(h.spec, columns))
        for rows, (h, _, _) in zip(plan.rows, requests, strict=True)
    ]
    if out is None:
        pairs = zip(shapes, requests, strict=True)
        return [np.empty(shape, handle.spec.dtype) for shape, (handle, _, _) in pairs]
    given = list(out)
    for buffer, shape, (handle, _, _) in zip(given, shapes, requests, strict=True):
        if buffer.shape != shape or buffer.dtype != handle.spec.dtype:
            raise MisuseError(
                "an output buffer does not fit its request",
                expected=f"{shape} {handle.spec.dtype}",
                found=f"{buffer.shape} {buffer.dtype}",
            )
    return given


class _CopiesByBlock:
    """The planned copies of the blocks in a batch, in plan order (indexed by block on
    the first partial batch, so a read never scans every copy once per batch)."""

    def __init__(self, copies: Sequence[BlockCopy]) -> None:
        self._copies = copies
        self._by_block: dict[tuple[str, int], list[int]] | None = None

    def of(self, blocks: Mapping[tuple[str, int], Any], *, whole: bool) -> Sequence[BlockCopy]:
        if whole:
            return self._copies
        if self._by_block is None:
            self._by_block = {}
            for position, copy in enumerate(self._copies):
                self._by_block.setdefault((copy.payload_id, copy.block), []).append(position)
        positions = sorted(p for block in blocks for p in self._by_block.get(block, ()))
        return [self._copies[p] for p in positions]


def _columns(
    layers: LayerSubset | None, requests: Sequence[tuple[Handle, int, int]]
) -> LayerSubset | None:
    """The columns to copy (None: every one), checked against each request's spec."""
    if layers is None:
        return None
    for index, (handle, _, _) in enumerate(requests):
        if handle.spec.num_layers != layers.of_layers:
            raise SpecMismatch(
                "a layer subset of another model",
                expected=f"a subset of {handle.spec.num_layers} MoE layers",
                found=f"a subset of {layers.of_layers} MoE layers",
                where=f"request {index}",
            )
    return None if layers.whole else layers


def _row_shape(spec: RouteSpec, columns: LayerSubset | None) -> tuple[int, ...]:
    if columns is None:
        return spec.row_shape
    return (len(columns.layers), *spec.row_shape[1:])


def _candidates(keys: Sequence[tuple[str, int]]) -> str:
    """The payloads a failed batch fetch was about, when Ray does not say which one."""
    pids = sorted({pid for pid, _ in keys})
    shown = ", ".join(pids[:4]) + (f" (+{len(pids) - 4} more)" if len(pids) > 4 else "")
    return f"one of payloads {shown}" if len(pids) > 1 else f"payload {shown}"


def _check_blocks(pid: str, wanted: Sequence[int], count: int) -> None:
    if any(not 0 <= block < count for block in wanted):
        raise HandleError(
            "block index outside the payload",
            expected=f"blocks in [0, {count})",
            found=list(wanted),
            where=f"payload {pid}",
        )
