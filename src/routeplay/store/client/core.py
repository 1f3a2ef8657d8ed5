"""What every part of the route-store client shares (``StoreCore``): its config and
backend, the block references it pins for its leases, its releases in flight, its reader,
the way it sends shard calls and waits for them (``routeplay.store.flow``), and the
read path (``read``, ``read_many``: ``routeplay.store.client.read_path``; a ``Lease``
calls ``read``).

``RouteStore`` (``routeplay.store.client.route_store``) is this core with its parts: leases
(``leases``), the write path (``write_path``), adopted engine keys
(``keys``), compaction and accounting (``route_store``). Each part is a class over
this core (the write path over the leases: a put can lease in the same call).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy.typing as npt

from routeplay.core.handle import EngineKey, Handle, Segment, StoreRef
from routeplay.core.layers import LayerSubset
from routeplay.core.spec import RouteSpec
from routeplay.errors import HandleError, RunMismatch
from routeplay.store.client.read_path import BlockPins, Reader
from routeplay.store.client.releases import PendingReleases, Undo
from routeplay.store.flow import Flow, adrive, awaiting, drive
from routeplay.store.remote.backend import Backend
from routeplay.store.shard.api import ShardApi, ShardCall, shard_call
from routeplay.store.shard.shard import shard_of

__all__ = ["StoreCore", "StoreSettings"]

R = TypeVar("R")

Request: TypeAlias = tuple[Handle, int, int]
"""Rows ``[start, stop)`` of a handle, as ``read_many`` takes them."""


class StoreSettings(Protocol):
    """What the client's parts read of its ``StoreConfig`` (typed by these fields, so this
    module does not import the module of the client it is a part of: no import circle)."""

    @property
    def run(self) -> str:
        """Run id."""
        ...

    @property
    def timeout_s(self) -> float:
        """Deadline of every blocking call."""
        ...

    @property
    def block_rows(self) -> int:
        """Rows per stored block (0: one block per payload)."""
        ...

    @property
    def max_block_bytes(self) -> int:
        """Largest block written when ``block_rows`` is 0."""
        ...


class StoreCore:
    """The state and shard calls the parts of ``RouteStore`` share (not used alone).

    Example:
        store.drive(flow)   # a RouteStore is a StoreCore: every blocking method does this
    """

    def __init__(self, config: StoreSettings, backend: Backend) -> None:
        self.config = config
        self._backend = backend
        self._pins = BlockPins()
        self._releases = PendingReleases(backend)
        self._reader = Reader(self._call, backend, config.run, self._pins)

    @property
    def run(self) -> str:
        """Run this client belongs to."""
        return self.config.run

    @property
    def identity(self) -> Hashable:
        """The same for every client of this store, in any process (its run and shards):
        leases granted through different copies of the client (unpickled one by one, as a
        driver gets samples from many workers) move together, one call per shard."""
        return (self.config.run, self._backend.identity)

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
        layers: LayerSubset | None = None,
    ) -> list[npt.NDArray[Any]]:
        """Rows of many handles, each block fetched once; leased payloads need no shard
        call, others one ``locate`` per shard. ``out`` gives buffers to copy into (one
        per request, of its exact shape and dtype: reused memory is faster than fresh
        pages); after an error they hold only part of the rows. ``holder`` only names
        the reader in errors. ``layers`` copies only those MoE layers' columns (a
        pipeline stage's: ``[rows, len(layers.layers), K]`` per request).

        Example:
            [rows] = store.read_many([(handle, 0, handle.rows)], layers=stage_layers)
        """
        for handle, _, _ in requests:
            for segment in handle.segments:
                source = segment.source
                if isinstance(source, StoreRef):
                    if source.run != self.run:
                        self._check_run(source)
                elif isinstance(source, EngineKey) and source.run != self.run:
                    self.scoped(source)
        self.drive(self._releases.settle(wait=False))
        return self._reader.read_many(requests, holder=holder, out=out, layers=layers)

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

    def discard_written(self, stored: Sequence[StoreRef]) -> None:
        """Drop written payloads nobody leased (a writer that gave up before it got its
        handles); sent, not waited for. A payload someone leased meanwhile stays.

        Example:
            store.discard_written(stored)
        """
        by_shard: dict[int, list[str]] = {}
        for ref in stored:
            by_shard.setdefault(shard_of(ref.payload_id), []).append(ref.payload_id)
        self._releases.submit([shard_call(i, ShardApi.discard, ids) for i, ids in by_shard.items()])

    def _handle(self, stored: StoreRef, spec: RouteSpec, weight_version: int) -> Handle:
        segment = Segment(
            source=stored, start=0, stop=stored.rows, spec=spec, weight_version=weight_version
        )
        return Handle.of(segment)
