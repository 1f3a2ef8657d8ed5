"""``RouteStore``: the client every process uses to put, lease and read routing.

It is a small picklable object (config + actor handles) that travels to rollout
workers and trainer ranks; what it holds for this process only (pinned block
references, releases in flight, batched awaitable calls) stays behind when it is
pickled. Metadata calls go to the shard that minted a payload (shards are chosen by
hash); payload bytes never pass through a shard.

The client is one class holding small parts, each in its own module, each importable
alone and none importing this one; every public method is one line here that forwards
to the part that owns it (``routeplay.store.client.forwarding``):

- ``StoreCore`` (``core``): config, backend, pinned block references, releases in flight,
  shard calls and the ``drive``/``adrive`` of flows; the parts below are built over it.
- ``WritePath`` (``write_path``: ``put``, ``put_many``, ``put_leased_many``,
  ``put_staged_many``): one object-store write per payload, one adopt call per shard per
  batch (``routeplay.store.write_plan`` lays a batch out, sharing verified-equal prompt
  prefixes); it holds the leases too, so a put can lease in the same call.
- ``ReadPath`` (``read_path``: ``read``, ``read_many``, ``hold_blocks``): every ``Lease``
  reads through it.
- ``Leases`` (``leases``: ``acquire_many``, ``release_many`` and what a ``Lease`` calls):
  one call per shard for a whole step; a grant carries the block references, releases
  are not waited for (``routeplay.store.client.releases``).
- ``KeyAdoption`` (``keys``: ``adopt_keys``, ``free_engine_keys``): adopted engine keys.
- ``Accounting`` (``accounting``: ``stats``, ``leaks``, ``revoke``).
- Compaction (``compact``: ``routeplay.store.client.compaction``) and the lifecycle
  (``start``, ``local``, ``shutdown``): here.

Awaitable twins (``aput_many``, ``aacquire_many``, ...): each call is one flow
(``routeplay.store.flow``) that the part's blocking method drives with ``ray.get`` and its
``a``-prefixed one with ``await``; rescues of abandoned calls live in the flows.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.store.client.accounting import Accounting, StoreStats
from routeplay.store.client.compaction import Compacted, Write, compact_handles
from routeplay.store.client.core import StoreCore
from routeplay.store.client.forwarding import forward
from routeplay.store.client.keys import KeyAdoption
from routeplay.store.client.leases import Leases
from routeplay.store.client.read_path import ReadPath
from routeplay.store.client.write_path import WritePath
from routeplay.store.remote.backend import Backend, LocalBackend, RayBackend
from routeplay.store.write_plan import MIN_BLOCK_BYTES

__all__ = ["MIN_BLOCK_BYTES", "RouteStore", "StoreConfig", "StoreStats"]


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
        """Start (or join) the run's store actors.

        Example:
            store = StoreConfig(run="run-7", shards=2).build()
        """
        return RouteStore.start(self)


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
        """How this run's store is laid out (the parts read it as their ``StoreSettings``)."""
        self._core = StoreCore(config, backend)
        self._leases = Leases(self._core, owner=self)  # its Lease objects call back here
        self._writes = WritePath(self._core, self._leases)
        self._reads = ReadPath(self._core)
        self._keys = KeyAdoption(self._core)
        self._accounts = Accounting(self._core)

    def __reduce__(self) -> tuple[object, ...]:
        # Pinned references and releases in flight belong to this process: a copy
        # elsewhere starts without them (it locates what it reads), so a pickled client
        # can never keep an object alive past the leases of the process that pinned it.
        # The copy is a plain RouteStore, whatever subclass was pickled.
        return (RouteStore, (self.config, self._core.backend))

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
    def identity(self) -> Hashable:
        """The same for every client of this store, in any process (its run and shards):
        leases granted through different copies of the client (unpickled one by one, as a
        driver gets samples from many workers) move together, one call per shard."""
        return self._core.identity

    @property
    def backend(self) -> Backend:
        """Where the shards live."""
        return self._core.backend

    # -- the core: flows, engine keys of this run, payloads nobody leased -------------
    drive = forward("_core", StoreCore.drive)
    adrive = forward("_core", StoreCore.adrive)
    scoped = forward("_core", StoreCore.scoped)
    discard_written = forward("_core", StoreCore.discard_written)

    # -- the write path ---------------------------------------------------------------
    put = forward("_writes", WritePath.put)
    aput = forward("_writes", WritePath.aput)
    put_many = forward("_writes", WritePath.put_many)
    aput_many = forward("_writes", WritePath.aput_many)
    put_leased = forward("_writes", WritePath.put_leased)
    aput_leased = forward("_writes", WritePath.aput_leased)
    put_leased_many = forward("_writes", WritePath.put_leased_many)
    aput_leased_many = forward("_writes", WritePath.aput_leased_many)
    layout_blocks = forward("_writes", WritePath.layout_blocks)
    block_rows_for = forward("_writes", WritePath.block_rows_for)
    put_staged = forward("_writes", WritePath.put_staged)
    aput_staged = forward("_writes", WritePath.aput_staged)
    put_staged_flow = forward("_writes", WritePath.put_staged_flow)
    put_staged_many = forward("_writes", WritePath.put_staged_many)
    aput_staged_many = forward("_writes", WritePath.aput_staged_many)
    put_staged_many_flow = forward("_writes", WritePath.put_staged_many_flow)
    staged_adoption = forward("_writes", WritePath.staged_adoption)
    written_handles = forward("_writes", WritePath.written_handles)
    staged_leased_adoption = forward("_writes", WritePath.staged_leased_adoption)
    leased_handles = forward("_writes", WritePath.leased_handles)

    # -- adopted engine keys ----------------------------------------------------------
    adopt_key = forward("_keys", KeyAdoption.adopt_key)
    aadopt_key = forward("_keys", KeyAdoption.aadopt_key)
    adopt_keys = forward("_keys", KeyAdoption.adopt_keys)
    aadopt_keys = forward("_keys", KeyAdoption.aadopt_keys)
    adopt_keys_each = forward("_keys", KeyAdoption.adopt_keys_each)
    aadopt_keys_each = forward("_keys", KeyAdoption.aadopt_keys_each)
    free_engine_keys = forward("_keys", KeyAdoption.free_engine_keys)
    afree_engine_keys = forward("_keys", KeyAdoption.afree_engine_keys)
    free_key = forward("_keys", KeyAdoption.free_key)
    afree_key = forward("_keys", KeyAdoption.afree_key)

    # -- leases -----------------------------------------------------------------------
    acquire = forward("_leases", Leases.acquire)
    aacquire = forward("_leases", Leases.aacquire)
    acquire_many = forward("_leases", Leases.acquire_many)
    aacquire_many = forward("_leases", Leases.aacquire_many)
    acquire_many_flow = forward("_leases", Leases.acquire_many_flow)
    pull = forward("_leases", Leases.pull)
    release_many = forward("_leases", Leases.release_many)
    arelease_many = forward("_leases", Leases.arelease_many)
    flush = forward("_leases", Leases.flush)
    aflush = forward("_leases", Leases.aflush)

    # -- what a Lease calls (``routeplay.store.client.lease.LeaseOwner``) -------------
    release_lease = forward("_leases", Leases.release_lease)
    arelease_lease = forward("_leases", Leases.arelease_lease)
    clone_lease = forward("_leases", Leases.clone_lease)
    aclone_lease = forward("_leases", Leases.aclone_lease)
    transfer_lease = forward("_leases", Leases.transfer_lease)
    atransfer_lease = forward("_leases", Leases.atransfer_lease)
    clone_leases = forward("_leases", Leases.clone_leases)
    aclone_leases = forward("_leases", Leases.aclone_leases)
    transfer_leases = forward("_leases", Leases.transfer_leases)
    atransfer_leases = forward("_leases", Leases.atransfer_leases)
    release_leases = forward("_leases", Leases.release_leases)
    arelease_leases = forward("_leases", Leases.arelease_leases)
    repin_blocks = forward("_leases", Leases.repin_blocks)
    unpin_blocks = forward("_leases", Leases.unpin_blocks)

    # -- the read path ----------------------------------------------------------------
    resolve = forward("_reads", ReadPath.resolve)
    read = forward("_reads", ReadPath.read)
    read_many = forward("_reads", ReadPath.read_many)
    hold_blocks = forward("_reads", ReadPath.hold_blocks)

    # -- accounting -------------------------------------------------------------------
    stats = forward("_accounts", Accounting.stats)
    astats = forward("_accounts", Accounting.astats)
    leaks = forward("_accounts", Accounting.leaks)
    aleaks = forward("_accounts", Accounting.aleaks)
    revoke = forward("_accounts", Accounting.revoke)
    arevoke = forward("_accounts", Accounting.arevoke)
    revoke_holder = forward("_accounts", Accounting.revoke_holder)
    arevoke_holder = forward("_accounts", Accounting.arevoke_holder)

    # -- compaction and shutdown ------------------------------------------------------
    def compact(
        self, handles: Sequence[Handle], holder: str, *, write: Write | None = None
    ) -> Compacted:
        """Copy the rows of long handles once into few payloads and lease the rebuilt
        handles for ``holder``; end the old leases after this returns
        (``routeplay.store.client.compaction``). The payloads are written from this process,
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

    def shutdown(self) -> None:
        """Stop the shards (their references go, so every payload can be reclaimed);
        a release that failed on the way is still raised."""
        try:
            self.flush()
        finally:
            self._core.backend.shutdown()
