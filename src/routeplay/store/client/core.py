"""``StoreCore``: the state and shard calls every part of the route-store client shares.

It holds the client's config and backend, the block references pinned for its leases
(``pins``), its releases in flight (``releases``), and the way every part sends shard
calls and waits for them (``send_and_wait``, ``wait_for``: flows of
``routeplay.store.flow``, driven blocking with ``drive`` or awaited with ``adrive``).

``RouteStore`` (``routeplay.store.client.route_store``) is one class holding one core and
the parts built over it, each in its own module and each importable alone: the write
path (``write_path.WritePath``, over the core and the leases: a put can lease in the same
call), the read path (``read_path.ReadPath``), leases (``leases.Leases``), adopted engine
keys (``keys.KeyAdoption``) and accounting (``accounting.Accounting``). None of them
imports the client; the core imports none of them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol, TypeVar

from routeplay.core.handle import EngineKey, Handle, StoreRef
from routeplay.errors import RunMismatch
from routeplay.store.client.pins import BlockPins
from routeplay.store.client.releases import PendingReleases, Undo
from routeplay.store.flow import Flow, adrive, awaiting, drive
from routeplay.store.remote.backend import Backend
from routeplay.store.shard.api import ShardApi, ShardCall, shard_call
from routeplay.store.shard.shard import shard_of

__all__ = ["StoreCore", "StoreSettings"]

R = TypeVar("R")


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
    """The state and shard calls the parts of one ``RouteStore`` share.

    Example:
        core = StoreCore(config, backend)
        leases = Leases(core, owner=store)      # every part is built over the one core
        answers = core.drive(core.send_and_wait(calls, "stats"))
    """

    def __init__(self, config: StoreSettings, backend: Backend) -> None:
        self.config = config
        self._backend = backend
        self.pins = BlockPins()
        """Block references of the leases granted through this client, in this process."""
        self.releases = PendingReleases(backend)
        """This client's releases in flight (settled before its next shard call)."""

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

    def discard_written(self, stored: Sequence[StoreRef]) -> None:
        """Drop written payloads nobody leased (a writer that gave up before it got its
        handles); sent, not waited for. A payload someone leased meanwhile stays.

        Example:
            store.discard_written(stored)
        """
        by_shard: dict[int, list[str]] = {}
        for ref in stored:
            by_shard.setdefault(shard_of(ref.payload_id), []).append(ref.payload_id)
        self.releases.submit([shard_call(i, ShardApi.discard, ids) for i, ids in by_shard.items()])

    # -- shard calls ------------------------------------------------------------------
    def call(
        self, calls: Sequence[ShardCall[R]], what: str, *, timeout_s: float | None = None
    ) -> list[R]:
        """Shard calls answered, blocking (the reader's metadata call)."""
        return self.drive(self.send_and_wait(calls, what, timeout_s=timeout_s))

    def send_and_wait(
        self,
        calls: Sequence[ShardCall[R]],
        what: str,
        *,
        timeout_s: float | None = None,
        each: bool = False,
        undo: Undo | None = None,
        ends: bool = False,
    ) -> Flow[list[Any]]:
        """Send shard calls after this client's releases in flight have landed, and wait
        for them (``wait_for``)."""
        # Shard actors are threaded: wait for this client's releases first, so a call
        # never overtakes a release sent before it.
        yield from self.releases.settle(wait=True)
        pending = self._backend.send(calls)
        flow = self.wait_for(pending, what, timeout_s=timeout_s, each=each, undo=undo, ends=ends)
        return (yield from flow)

    def wait_for(
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
            rescue = self.releases.track
        elif undo is not None:
            rescue = partial(self.releases.rescue, undo=undo)
        what = f"{self.run}: {what}"
        return (yield from awaiting(pending, what, timeout_s=timeout_s, each=each, rescue=rescue))

    # -- where things are -------------------------------------------------------------
    def pick_shard(self, key: str) -> int:
        """The shard a new payload or batch named ``key`` goes to (by hash)."""
        return zlib.crc32(key.encode()) % self._backend.shard_count

    def payload_ids(self, handle: Handle) -> list[str]:
        """The stored payloads of a handle, each once, in order; another run's refused."""
        ids = []
        for source in handle.sources():
            if isinstance(source, StoreRef):
                if source.run != self.run:
                    self.check_run(source)
                ids.append(source.payload_id)
        return ids

    def check_run(self, source: StoreRef) -> None:
        """Refuse a payload of another run (``RunMismatch``)."""
        if source.run != self.run:
            raise RunMismatch(
                "payload of another run",
                expected=f"run {self.run}",
                found=f"run {source.run}",
                where=f"payload {source.payload_id}",
            )
