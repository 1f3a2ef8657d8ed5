"""How a ``RouteStore`` client reaches its shards: Ray actors, or plain objects in process.

``RayBackend`` is the real one. ``LocalBackend`` runs the very same ``StoreShard`` and
``EngineStore`` classes in the calling process (the "fake for actors" of our tests and
of single-process tools); its block references are the arrays themselves. Sending and
waiting are apart: ``send`` (and ``send_adopt_keys``, ``send_free_key``,
``send_key_refs``) only sends and returns pending results; ``resolve`` blocks for them
and ``aresolve`` awaits them, so the client's flows (``routeplay.store.flow``) run
blocking or awaited over the same sends. Shard calls are typed ``ShardCall``s
(``routeplay.store.shard.api``); engine-store calls are typed methods here: no caller
names a method.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import ray

from routeplay.core.handle import EngineKey, StoreRef
from routeplay.core.spec import RouteSpec
from routeplay.errors import RouteplayError, RoutesLost, RunMismatch
from routeplay.store.engine.engine_store import EngineStore
from routeplay.store.engine.key_check import canonical_rows, take_checked_many
from routeplay.store.flow import Flow, Wait, drive
from routeplay.store.remote import ray_calls
from routeplay.store.remote.actors import StoreShardActor
from routeplay.store.remote.protocol import SHARDS_HINT, ask_engine_stores, ask_peers
from routeplay.store.shard.adoption import (
    KeyBatch,
    Where,
    adopt_batch,
    adopt_in_rounds,
    adopt_round,
)
from routeplay.store.shard.api import ShardCall
from routeplay.store.shard.group_answers import GroupRequest, LaidOut, lay_out_groups
from routeplay.store.shard.shard import StoredPayload, StoreShard

__all__ = ["Backend", "LocalBackend", "RayBackend", "Settled", "settled_answers"]

R = TypeVar("R")


class Settled:
    """The outcome of a call submitted without waiting: its value or its error."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error


class Backend(Protocol):
    """What the client needs from wherever the shards live."""

    @property
    def shard_count(self) -> int: ...

    @property
    def identity(self) -> Hashable:
        """The same for every copy of this backend (its shards), in any process."""
        ...

    def send(self, calls: Sequence[ShardCall[Any]]) -> list[Any]:
        """Send the calls; their pending results, one per call (nothing waited for)."""
        ...

    def resolve(self, wait: Wait) -> list[Any]:
        """The answers of pending results, blocking (``routeplay.store.flow.Wait``)."""
        ...

    async def aresolve(self, wait: Wait) -> list[Any]:
        """The answers of pending results, awaited on the running event loop."""
        ...

    def ready(self, pending: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """The pending results that are done and those still running (no waiting)."""
        ...

    def when_done(self, pending: Any, landed: Callable[[Any], None]) -> Any:
        """Call ``landed(value)`` once ``pending`` has a value (not if it failed), on
        whatever thread completes it; returns a pending result that is done after."""
        ...

    def call(
        self, calls: Sequence[ShardCall[R]], what: str, *, timeout_s: float | None = None
    ) -> list[R]:
        """``send`` then ``resolve``: the blocking shortcut (tools, tests)."""
        ...

    def put_blocks(self, blocks: Sequence[Any]) -> list[Any]: ...

    def fetch(self, refs: Sequence[Any], what: str) -> list[Any]: ...

    def fetch_as_created(
        self, refs: Sequence[Any], what: str
    ) -> Iterator[tuple[list[int], list[Any]]]:
        """``fetch`` in batches as the blocks arrive: positions into ``refs`` and their
        values (``ray_calls.get_as_created``: each block crosses as soon as it is written)."""
        ...

    def pull(self, refs: Sequence[Any]) -> None:
        """Start bringing ``refs`` to this node, all at once, without waiting (a rank's
        whole share of a step, as one bundle: its reads then find them here)."""
        ...

    def borrow(self, refs: Sequence[Any]) -> list[Any]:
        """What a reader keeps of block references granted with a lease."""
        ...

    def lost_index(self, refs: Sequence[Any], error: BaseException) -> int | None: ...

    def ask_engines(self, keys: Sequence[EngineKey]) -> Flow[None]:
        """Before the first call to the engine stores of ``keys``: ask which protocol
        each speaks (``ProtocolMismatch`` if not this one's;
        ``routeplay.store.remote.protocol``)."""
        ...

    def send_free_key(self, key: EngineKey, run: str) -> Any:
        """Free an unread engine-store key of ``run``; answers True if it was live."""
        ...

    def send_key_refs(self, key: EngineKey, run: str) -> Any:
        """Consume a key; answers its payload (one reference, wrapped so it is not
        resolved)."""
        ...

    def send_adopt_keys(
        self,
        shard: int,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        shared_prefix: int = 0,
        starts: Sequence[int] | None = None,
        pack: bool = False,
    ) -> Any:
        """Have a shard adopt engine keys; answers, per key, a StoreRef (all its rows), a
        tuple of ``(StoreRef, start, stop)`` row ranges (a group's: a shared prompt, then
        its own rows), or the error that refused it. ``starts``: per key, the first row
        stored (rows before it are dropped where the key is validated);
        ``shared_prefix`` or ``pack`` make the keys one group (laid out together, a
        refused member set aside)."""
        ...

    def send_adopt_key_batches(self, shard: int, batches: Sequence[KeyBatch]) -> Any:
        """Have a shard adopt many callers' keys in one call (``send_adopt_keys`` per
        batch); answers, per batch, its answers or the typed error that failed it."""
        ...

    def shutdown(self) -> None: ...


class RayBackend:
    """Shards are Ray actors; every call has the configured deadline."""

    def __init__(self, shards: Sequence[Any], timeout_s: float) -> None:
        self._shards = list(shards)
        self._identity: tuple[str, ...] | None = None
        self._timeout_s = timeout_s
        self._waits = ray_calls.RayWaits(timeout_s)
        self._engines: dict[tuple[str, str], Any] = {}  # ray.get_actor costs a GCS call
        self._asked: set[tuple[str, str]] = set()  # engine stores that speak our protocol

    @classmethod
    def start(
        cls,
        run: str,
        *,
        shards: int,
        ttl_s: float | None,
        timeout_s: float,
        options: dict[str, Any],
        join: bool,
        lease_ttl_s: float | None = None,
    ) -> RayBackend:
        """Create the run's shard actors; join existing ones only when ``join`` is set
        (then each is asked for its protocol first: ``ProtocolMismatch``)."""
        if not join:
            _refuse_existing(_shard_name(run, 0), options["namespace"], run)
        handles: list[Any] = []
        # Shard 0 first: if it is refused, no other shard was started beside the old run's.
        for indices in (range(1), range(1, shards)):
            started = _start_shards(run, indices, options, (ttl_s, timeout_s, lease_ttl_s))
            if join:  # started by another job, they may run another routeplay
                _ask_shards(started, run, indices, options["namespace"], timeout_s)
            handles += started
        return cls(handles, timeout_s)

    @property
    def shard_count(self) -> int:
        return len(self._shards)

    @property
    def identity(self) -> Hashable:
        # Actor ids survive pickling: a client unpickled from another process's copy
        # reaches the same shard actors. Kept once made: a batch asks it per lease.
        if self._identity is None:
            self._identity = tuple(shard._actor_id.hex() for shard in self._shards)
        return self._identity

    def send(self, calls: Sequence[ShardCall[Any]]) -> list[Any]:
        return [call.send_to(self._shards[call.shard]) for call in calls]

    def resolve(self, wait: Wait) -> list[Any]:
        return self._waits.resolve(wait)

    async def aresolve(self, wait: Wait) -> list[Any]:
        return await self._waits.aresolve(wait)

    def ready(self, pending: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        markers = [p for p in pending if isinstance(p, concurrent.futures.Future)]
        refs = [p for p in pending if not isinstance(p, concurrent.futures.Future)]
        done: list[Any] = [m for m in markers if m.done()]
        running: list[Any] = [m for m in markers if not m.done()]
        if refs:  # timeout 0: never blocks (and Ray does not call it blocking in async)
            ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            done += ready
            running += waiting
        return done, running

    def when_done(self, pending: Any, landed: Callable[[Any], None]) -> Any:
        """Ray completes the reference's future on its own thread and runs the callback
        there: no thread of ours, no wait. The returned future is done after it.

        The marker is shared: every later call of the client that settles releases
        waits on it. Marked running, it refuses ``cancel()``, so no waiter's
        cancellation or deadline can end it for the others (issue 38)."""
        marker: concurrent.futures.Future[None] = concurrent.futures.Future()
        marker.set_running_or_notify_cancel()

        def done(future: concurrent.futures.Future[Any], ref: Any = pending) -> None:
            try:
                if future.exception() is None:  # a failed call granted nothing
                    landed(future.result())
            except BaseException as exc:  # never lost: the waiter of the marker sees it
                marker.set_exception(exc)
            else:
                marker.set_result(None)

        pending.future().add_done_callback(done)
        return marker

    def call(
        self, calls: Sequence[ShardCall[R]], what: str, *, timeout_s: float | None = None
    ) -> list[R]:
        return self.resolve(Wait(tuple(self.send(calls)), what, timeout_s))

    def put_blocks(self, blocks: Sequence[Any]) -> list[Any]:
        return [ray.put(block) for block in blocks]

    def fetch(self, refs: Sequence[Any], what: str) -> list[Any]:
        return list(ray_calls.get(list(refs), timeout_s=self._timeout_s, what=what))

    def fetch_as_created(
        self, refs: Sequence[Any], what: str
    ) -> Iterator[tuple[list[int], list[Any]]]:
        return ray_calls.get_as_created(refs, timeout_s=self._timeout_s, what=what)

    def pull(self, refs: Sequence[Any]) -> None:
        ray_calls.pull(refs)

    def borrow(self, refs: Sequence[Any]) -> list[Any]:
        """The references themselves: Ray counts this process as a borrower until the
        client drops them (when the lease that pinned them is released)."""
        return list(refs)

    def lost_index(self, refs: Sequence[Any], error: BaseException) -> int | None:
        return ray_calls.lost_index(list(refs), error)

    def ask_engines(self, keys: Sequence[EngineKey]) -> Flow[None]:
        """Once per engine store (a detached one can be older than this process), the
        stores not asked yet all at once."""
        unasked = {(k.actor, k.namespace) for k in keys} - self._asked
        if not unasked:
            return
        self._engines.update((yield from ask_engine_stores(unasked, self._timeout_s)))
        self._asked |= unasked

    def send_free_key(self, key: EngineKey, run: str) -> Any:
        return self._engine(key).free.remote(key.key, run)

    def send_key_refs(self, key: EngineKey, run: str) -> Any:
        return self._engine(key).get_ref.remote(key.key, run)

    def _engine(self, key: EngineKey) -> Any:
        """The engine store actor of ``key`` (looked up once: a look-up is a GCS call)."""
        where = (key.actor, key.namespace)
        if where not in self._engines:
            self._engines[where] = ray_calls.get_actor(key.actor, key.namespace)
        return self._engines[where]

    def send_adopt_keys(
        self,
        shard: int,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        shared_prefix: int = 0,
        starts: Sequence[int] | None = None,
        pack: bool = False,
    ) -> Any:
        """One call: the shard consumes the keys and validates them on the engine's node."""
        begin = list(starts) if starts is not None else None
        return self._shards[shard].adopt_keys.remote(list(keys), spec, shared_prefix, begin, pack)

    def send_adopt_key_batches(self, shard: int, batches: Sequence[KeyBatch]) -> Any:
        """One call: the shard adopts every batch as its own ``adopt_keys`` would."""
        return self._shards[shard].adopt_key_batches.remote(list(batches))

    def shutdown(self) -> None:
        for shard in self._shards:
            ray.kill(shard)


def _shard_name(run: str, index: int) -> str:
    return f"routeplay.store.{run}.{index}"


def _start_shards(
    run: str, indices: range, options: dict[str, Any], args: tuple[Any, ...]
) -> list[Any]:
    """Shard actors ``indices`` of ``run`` (an existing one of the name is joined)."""
    return [
        StoreShardActor.options(name=_shard_name(run, i), **options).remote(run, i, *args)
        for i in indices
    ]


def _ask_shards(
    handles: Sequence[Any], run: str, indices: range, namespace: str, timeout_s: float
) -> None:
    named = [ray_calls.actor_where(namespace, _shard_name(run, i)) for i in indices]
    asked = list(zip(handles, named, strict=True))
    drive(ask_peers(asked, SHARDS_HINT, timeout_s), ray_calls.RAY)


def _refuse_existing(name: str, namespace: str, run: str) -> None:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    raise RunMismatch(
        "a route store for this run already exists on the cluster",
        where=f"run {run}",
        hint="Use a unique run id per job, or StoreConfig(join=True) to share that store.",
    )


class LocalBackend:
    """Shards and engine stores as plain objects in this process (tests, tools)."""

    def __init__(
        self, run: str, *, shards: int, ttl_s: float | None, lease_ttl_s: float | None = None
    ) -> None:
        # One lock for all shards: like the actors' locks, it keeps each plain shard
        # single-threaded when several threads (e.g. a prefetching reader) share the store.
        self._lock = threading.RLock()
        self._shards = [
            StoreShard(run, i, ttl_s=ttl_s, lease_ttl_s=lease_ttl_s) for i in range(shards)
        ]
        self._engine_stores: dict[tuple[str, str], EngineStore[Any]] = {}

    @property
    def shard_count(self) -> int:
        return len(self._shards)

    @property
    def identity(self) -> Hashable:
        return ("local", id(self))  # in process: this object is the shards

    def send(self, calls: Sequence[ShardCall[Any]]) -> list[Any]:
        """Runs the calls now: in process there is nothing to overlap with."""
        with self._lock:
            return [self._served(call) for call in calls]

    def _served(self, call: ShardCall[Any]) -> Settled:
        shard = self._shards[call.shard]
        if call.method == "stats":  # reading the meter is not a call it counts
            return _settled(call.run_on, shard)
        with shard.meter.served(call.method):
            return _settled(call.run_on, shard)

    def resolve(self, wait: Wait) -> list[Any]:
        return settled_answers(wait)

    async def aresolve(self, wait: Wait) -> list[Any]:
        return settled_answers(wait)

    def ready(self, pending: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        return list(pending), []

    def when_done(self, pending: Any, landed: Callable[[Any], None]) -> Any:
        if pending.error is None:
            landed(pending.value)
        return Settled()

    def call(
        self, calls: Sequence[ShardCall[R]], what: str, *, timeout_s: float | None = None
    ) -> list[R]:
        return settled_answers(Wait(tuple(self.send(calls)), what, timeout_s))

    def put_blocks(self, blocks: Sequence[Any]) -> list[Any]:
        return [_LocalBlock(block.copy()) for block in blocks]  # the store owns its bytes

    def fetch(self, refs: Sequence[Any], what: str) -> list[Any]:
        return [_local_value(ref, what) for ref in refs]

    def fetch_as_created(
        self, refs: Sequence[Any], what: str
    ) -> Iterator[tuple[list[int], list[Any]]]:
        yield list(range(len(refs))), self.fetch(refs, what)  # in process: all exist

    def pull(self, refs: Sequence[Any]) -> None:
        """In process every block is here already."""

    def borrow(self, refs: Sequence[Any]) -> list[Any]:
        """Weak references: here the shard is the only holder of a block, so anything
        that ends a payload at the shard (even a foreign "free" of its leases) is seen by
        every reader, as an object freed in a real object store would be."""
        return [weakref.ref(ref) if isinstance(ref, _LocalBlock) else ref for ref in refs]

    def lost_index(self, refs: Sequence[Any], error: BaseException) -> int | None:
        return None

    def engine_store(
        self, actor: str = "shared_store", namespace: str = "lmdeploy", ttl_s: float | None = 600.0
    ) -> EngineStore[Any]:
        """The in-process engine store with that name (created on first use)."""
        key = (actor, namespace)
        if key not in self._engine_stores:
            self._engine_stores[key] = EngineStore(
                put_object=_LocalObject,
                get_object=_LocalObject.value,
                key_of=_LocalObject.key,
                ttl_s=ttl_s,
            )
        return self._engine_stores[key]

    def ask_engines(self, keys: Sequence[EngineKey]) -> Flow[None]:
        """In-process engine stores run this very routeplay: nothing to ask."""
        yield from ()

    def send_free_key(self, key: EngineKey, run: str) -> Any:
        with self._lock:
            return _settled(self.engine_store(key.actor, key.namespace).free, key.key, run)

    def send_key_refs(self, key: EngineKey, run: str) -> Any:
        with self._lock:
            taken = _settled(self.engine_store(key.actor, key.namespace).get_ref, key.key, run)
        if taken.error is None:  # what a block reference is here: the value
            taken.value = [ref.value() for ref in taken.value]
        return taken

    def send_adopt_keys(
        self,
        shard: int,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        shared_prefix: int = 0,
        starts: Sequence[int] | None = None,
        pack: bool = False,
    ) -> Any:
        begin = tuple(starts) if starts is not None else None
        batch = KeyBatch(keys=tuple(keys), spec=spec, shared_prefix=shared_prefix,
                         starts=begin, pack=pack)  # fmt: skip
        return _settled(self._adopt_keys, shard, [batch], "adopt_keys")

    def send_adopt_key_batches(self, shard: int, batches: Sequence[KeyBatch]) -> Any:
        return _settled(self._adopt_keys, shard, batches, "adopt_key_batches")

    def _adopt_keys(
        self, shard: int, batches: Sequence[KeyBatch], op: str
    ) -> list[Any] | list[list[Any] | RouteplayError]:
        """The Ray shard's adoption (``routeplay.store.shard.adoption``), in process: one
        batch answers its keys' answers (``adopt_keys``), several answer per batch its
        answers or the typed error that failed it (``adopt_key_batches``)."""
        with self._lock, self._shards[shard].meter.served(op):
            steps = _LocalAdoption(self, self._shards[shard])
            if op == "adopt_keys":
                return drive(adopt_batch(batches[0], steps=steps, timeout_s=60.0), self)
            return adopt_in_rounds(
                batches,
                lambda picked: drive(adopt_round(picked, steps=steps, timeout_s=60.0), self),
            )

    def shutdown(self) -> None:
        self._shards.clear()


class _LocalAdoption:
    """``AdoptionSteps`` in process: engine stores and the shard are plain objects, a
    validation runs at once (its answer settled), a block reference is the array."""

    def __init__(self, backend: LocalBackend, shard: StoreShard) -> None:
        self._backend = backend
        self._shard = shard

    def engines(self, wheres: Sequence[Where], *, fresh: bool = False) -> Flow[dict[Where, Any]]:
        yield from ()  # in-process engine stores run this very routeplay: nothing to ask
        return {where: self._backend.engine_store(*where) for where in wheres}

    def send_take(
        self, engine: Any, keys: list[EngineKey], spec: RouteSpec, starts: list[int]
    ) -> Any:
        taken = take_checked_many(engine, keys, spec, self._shard.run)
        return Settled(value=(taken, "local", [None] * len(taken)))

    def send_validate(
        self, node: str, raw: Any, key: EngineKey, spec: RouteSpec, start: int
    ) -> tuple[Any, Any]:
        try:
            block = _LocalBlock(canonical_rows(raw.value(), key, spec, start))
        except RouteplayError as exc:
            return Settled(error=exc), None
        return Settled(), block

    def send_rows_of(self, node: str, canonical: Any, start: int, stop: int) -> Any:
        return _LocalBlock(canonical.array[start:stop])

    def send_groups(
        self, node: str, spec: RouteSpec, requests: list[GroupRequest], payloads: list[Any]
    ) -> Any:
        # In process nothing is validated at ingest (``send_take`` offers no block):
        # every payload is a raw one, validated here.
        arrays, answers = lay_out_groups(requests, spec, [raw.value() for raw in payloads])
        return Settled(value=LaidOut(token=arrays, groups=tuple(answers)))

    def take_group(self, node: str, token: Any, count: int) -> list[Any]:
        return [_LocalBlock(np.asarray(array)) for array in token]  # packed: joined now

    def adopt(self, blocks: list[Any], rows: int, nbytes: int) -> StoreRef:
        return self._shard.adopt(blocks, rows, nbytes, 0)

    def adopt_many(
        self, blocks: list[Any], payloads: list[StoredPayload], saved_bytes: int
    ) -> list[StoreRef]:
        return self._shard.adopt_many(blocks, payloads, saved_bytes)


def _settled(call: Callable[..., Any], *args: Any) -> Settled:
    try:
        return Settled(value=call(*args))
    except RouteplayError as exc:
        return Settled(error=exc)


def settled_answers(wait: Wait) -> list[Any]:
    """The answers of settled results (``LocalBackend``'s pending results)."""
    if wait.each:
        return [s.value if s.error is None else s.error for s in wait.pending]
    for settled in wait.pending:
        if settled.error is not None:
            raise settled.error
    return [settled.value for settled in wait.pending]


class _LocalBlock:
    """A stored block in process: what a block reference is for the local backend."""

    __slots__ = ("__weakref__", "array")

    def __init__(self, array: Any) -> None:
        self.array = array


def _local_value(ref: Any, what: str) -> Any:
    if isinstance(ref, weakref.ref):
        ref = ref()
        if ref is None:
            raise RoutesLost("routing payload is lost (its block was dropped)", where=what)
    return ref.array if isinstance(ref, _LocalBlock) else ref


class _LocalObject:
    """An in-process stand-in for an ObjectRef: a value and a Ray-shaped hex key."""

    _count = 0

    def __init__(self, data: Any) -> None:
        _LocalObject._count += 1
        self._data = data
        self._key = secrets.token_hex(28)  # as unguessable as the Ray engine store's keys

    def value(self) -> Any:
        return self._data

    def key(self) -> str:
        return self._key
