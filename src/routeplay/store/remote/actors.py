"""Ray actor shells over the plain store classes. Each method takes the lock (a reaper
thread expires TTLs in the background) and forwards; the only steps of their own are
the Ray-side hops of the two adopt paths, done outside the lock: calling a producer for
its staged blocks, and handing an engine key's payload to the ``KeyValidator`` on the
engine store's node (so the shard owns the validated, compact block it returns), unless
the engine store validated it as it was put (``routeplay.store.engine.ingest``: the shard then
borrows the engine store's block)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from routeplay.core.handle import EngineKey, StoreRef
from routeplay.core.spec import RouteSpec
from routeplay.errors import (
    AlreadyConsumed,
    LifetimeError,
    RouteplayError,
    RoutesLost,
    StoreTimeout,
)
from routeplay.store.engine.engine_store import EngineStore, EngineStoreStats, PayloadMeta
from routeplay.store.engine.ingest import Prepared, decide, fits, settle
from routeplay.store.engine.key_check import canonical_rows, take_checked_many
from routeplay.store.flow import Flow, drive
from routeplay.store.remote import ray_calls
from routeplay.store.remote.dropped_refs import DroppedRefs
from routeplay.store.remote.outbox import PayloadOutbox
from routeplay.store.remote.protocol import ask_engine_stores
from routeplay.store.shard.adoption import (
    KeyBatch,
    Where,
    adopt_batch,
    adopt_in_rounds,
    adopt_round,
)
from routeplay.store.shard.api import ShardApi
from routeplay.store.shard.group_answers import GroupRequest, LaidOut, lay_out_groups
from routeplay.store.shard.lease_table import LeakRecord, TableStats
from routeplay.store.shard.shard import Grant, StoredPayload, StoreShard, check_holders

__all__ = [
    "EngineStoreActor",
    "EngineStoreShell",
    "KeyValidator",
    "StoreShardActor",
    "StoreShardShell",
    "call_producer",
    "take_and_wait",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


def call_producer(producer: Any, token: str, blocks: int) -> tuple[list[Any], Any]:
    """Ask a producer actor for its staged blocks; the caller owns the returned refs.
    Returns the block refs and the ref of the hand-over marker (see ``take_staged``)."""
    refs = list(producer.take_staged.options(num_returns=blocks + 1).remote(token))
    return refs[:-1], refs[-1]


KEY_BATCH_THREADS: Final = 4
"""Rounds of one ``adopt_key_batches`` call adopted at once (each waits on its engine
stores and validators; a node's validator checks one payload at a time anyway)."""


def take_and_wait(producer: Any, token: str, blocks: int, timeout_s: float) -> list[Any]:
    """Call the producer and wait until its blocks exist in the object store (without
    fetching them here), so the payload survives the producer from the moment the
    producer's put returns. The producer runs ``take_staged`` in its own concurrency
    group, so it can answer while its put is still waiting on us. A producer that died
    before the hand-over raises ``RoutesLost`` naming the staged payload, at once."""
    block_refs, marker = call_producer(producer, token, blocks)
    refs = [*block_refs, marker]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    if len(ready) < len(refs):
        raise StoreTimeout(
            "the producer did not hand over its staged payload in time",
            where=f"token {token}",
            expected=f"{len(refs)} blocks within {timeout_s}s",
            found=f"{len(ready)} ready",
            hint="Create producer actors with routeplay.store.producer_actor(...) so that "
            "take_staged has its own concurrency group.",
        )
    _check_handed_over(marker, token, timeout_s)
    return ray_calls.in_object_store(block_refs, timeout_s=timeout_s, what=f"token {token}")


def _check_handed_over(marker: Any, token: str, timeout_s: float) -> None:
    """Ready is not written: an errored result is ready too. The marker comes from the
    same task as the blocks, so fetching its few bytes tells whether they exist."""
    try:
        ray_calls.get(marker, timeout_s=timeout_s, what=f"staged payload {token}")
    except LifetimeError as exc:
        raise RoutesLost(
            "the producer died before handing over its staged payload: nothing was stored",
            where=f"staged payload {token}",
            found=exc.found,
            hint="Write the sample again from a live producer; no handle was returned.",
        ) from exc


class _Reaped:
    """A lock shared by calls and a daemon thread that calls ``expire`` periodically."""

    def _start_reaper(self, expire: Callable[[], object], ttl_s: float | None) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if ttl_s is None:
            return
        interval = max(0.05, min(ttl_s / 4, 5.0))

        def loop() -> None:
            while not self._stop.wait(interval):
                self._locked(expire)

        threading.Thread(target=loop, name="routeplay-reaper", daemon=True).start()

    def _locked(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return fn()


class StoreShardShell(_Reaped):
    """One shard of a run's route store. Holds references and leases, never bytes."""

    def __init__(
        self,
        run: str,
        index: int,
        ttl_s: float | None,
        timeout_s: float = 60.0,
        lease_ttl_s: float | None = None,
    ) -> None:
        # A dropped payload's references go on a thread of their own: Ray's freeing of
        # the bytes is not part of the call that ended the payload's last lease.
        self._dropped = DroppedRefs()
        self._shard = StoreShard(
            run, index, ttl_s=ttl_s, lease_ttl_s=lease_ttl_s, dispose=self._dropped.put
        )
        self._timeout_s = timeout_s
        self._engines: dict[tuple[str, str], Any] = {}  # engine-store handles, looked up once
        self._validators: dict[str, Any] = {}  # one validator actor per engine node
        # The shell serves calls on several threads: without this lock, concurrent first
        # adoptions on a node each started a validator actor (a worker process each).
        self._handles_lock = threading.Lock()
        ttls = [t for t in (ttl_s, lease_ttl_s) if t is not None]
        self._start_reaper(self._shard.expire, min(ttls) if ttls else None)

    def adopt_many(
        self, refs: list[Any], payloads: list[StoredPayload], saved_bytes: int = 0
    ) -> list[StoreRef]:
        return self._locked(lambda: self._shard.adopt_many(refs, payloads, saved_bytes))

    def adopt_from_many(
        self, producer: Any, token: str, payloads: list[StoredPayload], saved_bytes: int = 0
    ) -> list[StoreRef]:
        """One call to the producer for every staged block of a batch (many small puts)."""
        refs = take_and_wait(producer, token, sum(p.blocks for p in payloads), self._timeout_s)
        return self._locked(lambda: self._shard.adopt_many(refs, payloads, saved_bytes))

    def adopt_keys(
        self,
        keys: list[EngineKey],
        spec: RouteSpec,
        shared_prefix: int = 0,
        starts: list[int] | None = None,
        pack: bool = False,
    ) -> list[Any]:
        """Consume engine keys and adopt the rows of each once they are validated, near
        the engine (``routeplay.store.shard.adoption``: the decisions, the waits, the raw
        fallback): this shard owns the canonical blocks the validator returns, or borrows
        the engine store's where it validated the payload at ingest
        (``routeplay.store.engine.ingest``). ``starts``: per key, the first row to keep (a
        resume's or a later turn's history is not stored again).

        Returns a StoreRef per key (a tuple of row ranges in a group, or of a longer
        block), or the typed error that refused it: its metadata, its rows (validated
        before this returns, with a deadline), another run's. A refused key is consumed
        and its payload dropped."""
        begin = tuple(starts) if starts is not None else None
        return self._adopted(KeyBatch(keys=tuple(keys), spec=spec, shared_prefix=shared_prefix,
                                      starts=begin, pack=pack))  # fmt: skip

    def adopt_key_batches(self, batches: list[KeyBatch]) -> list[list[Any] | RouteplayError]:
        """``adopt_keys`` for many callers in one call (the groups an asyncio rollout
        worker's coroutines adopt at once): groups of one engine store adopted together,
        ``GROUP_ROUND`` a round (one take, one layout call, one hand-over each), any other
        batch on its own, up to ``KEY_BATCH_THREADS`` rounds at a time; per batch its
        answers, or the typed error that failed it (``adoption.adopt_round``)."""

        def adopt(picked: list[KeyBatch]) -> list[Any]:
            flow = adopt_round(picked, steps=_RayAdoption(self), timeout_s=self._timeout_s)
            return drive(flow, ray_calls.RAY)

        return adopt_in_rounds(batches, adopt, threads=KEY_BATCH_THREADS)

    def _adopted(self, batch: KeyBatch) -> list[Any]:
        flow = adopt_batch(batch, steps=_RayAdoption(self), timeout_s=self._timeout_s)
        return drive(flow, ray_calls.RAY)

    def _adopt_blocks(self, blocks: list[Any], rows: int, nbytes: int) -> StoreRef:
        return self._locked(lambda: self._shard.adopt(blocks, rows, nbytes, 0))

    def _engines_asked(
        self, wheres: Sequence[Where], fresh: bool = False
    ) -> Flow[dict[Where, Any]]:
        """The engine stores' handles (``(name, namespace)`` each), those not known yet
        (all with ``fresh``: a store restarted since) asked for their protocol first, all
        at once (a detached store can be older than this shard); looked up and asked
        outside the lock."""
        with self._handles_lock:
            if fresh:
                for where in wheres:
                    self._engines.pop(where, None)
            known = {where: self._engines[where] for where in wheres if where in self._engines}
        unknown = [where for where in wheres if where not in known]
        found = yield from ask_engine_stores(unknown, self._timeout_s)
        with self._handles_lock:
            for where, engine in found.items():
                known[where] = self._engines.setdefault(where, engine)
        return known

    def _validator(self, node_id: str) -> Any:
        with self._handles_lock:
            if node_id not in self._validators:
                place = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
                self._validators[node_id] = KeyValidator.options(scheduling_strategy=place).remote()
            return self._validators[node_id]

    def lease_many(
        self, requests: list[tuple[list[str], str]], run: str, *, with_blocks: bool = True
    ) -> Grant:
        return self._locked(lambda: self._shard.lease_many(requests, run, with_blocks=with_blocks))

    def release_many(self, lease_ids: list[str]) -> list[str]:
        return self._locked(lambda: self._shard.release_many(lease_ids))

    def revoke_many(self, lease_ids: list[str]) -> list[str]:
        return self._locked(lambda: self._shard.revoke_many(lease_ids))

    def adopt_leased(
        self,
        refs: list[Any],
        payloads: list[StoredPayload],
        saved_bytes: int,
        samples: list[tuple[int, ...]],
        holders: list[str],
        *,
        with_blocks: bool = True,
    ) -> tuple[list[StoreRef], Grant]:
        return self._locked(
            lambda: self._shard.adopt_leased(
                refs, payloads, saved_bytes, samples, holders, with_blocks=with_blocks
            )
        )

    def adopt_from_leased(
        self,
        producer: Any,
        token: str,
        payloads: list[StoredPayload],
        saved_bytes: int,
        samples: list[tuple[int, ...]],
        holders: list[str],
        *,
        with_blocks: bool = True,
    ) -> tuple[list[StoreRef], Grant]:
        """``adopt_from_many`` and a lease per sample: the producer's blocks taken
        outside the lock, then adopted and leased under it."""
        check_holders(samples, holders)  # before the producer hands its blocks over
        refs = take_and_wait(producer, token, sum(p.blocks for p in payloads), self._timeout_s)
        return self._locked(
            lambda: self._shard.adopt_leased(
                refs, payloads, saved_bytes, samples, holders, with_blocks=with_blocks
            )
        )

    def discard(self, payload_ids: list[str]) -> list[str]:
        return self._locked(lambda: self._shard.discard(payload_ids))

    def revoke_holder(self, holder: str) -> list[str]:
        return self._locked(lambda: self._shard.revoke_holder(holder))

    def revoke_leases(self, lease_ids: list[str]) -> list[str]:
        return self._locked(lambda: self._shard.revoke_leases(lease_ids))

    def adopt(self, refs: list[Any], rows: int, nbytes: int, block_rows: int) -> StoreRef:
        return self._locked(lambda: self._shard.adopt(refs, rows, nbytes, block_rows))

    def adopt_from(
        self, producer: Any, token: str, blocks: int, rows: int, nbytes: int, block_rows: int
    ) -> StoreRef:
        refs = take_and_wait(producer, token, blocks, self._timeout_s)  # outside the lock
        return self._locked(lambda: self._shard.adopt(refs, rows, nbytes, block_rows))

    def acquire(self, payload_ids: Sequence[str], holder: str, run: str) -> str:
        return self._locked(lambda: self._shard.acquire(payload_ids, holder, run))

    def release(self, lease_id: str) -> list[str]:
        return self._locked(lambda: self._shard.release(lease_id))

    def revoke(self, lease_id: str) -> list[str]:
        return self._locked(lambda: self._shard.revoke(lease_id))

    def clone(self, lease_id: str, holder: str) -> str:
        return self._locked(lambda: self._shard.clone(lease_id, holder))

    def clone_many(self, lease_ids: list[str], holders: list[str]) -> list[str]:
        return self._locked(lambda: self._shard.clone_many(lease_ids, holders))

    def transfer_many(self, lease_ids: list[str], holders: list[str]) -> list[str]:
        return self._locked(lambda: self._shard.transfer_many(lease_ids, holders))

    def transfer(self, lease_id: str, holder: str) -> str:
        return self._locked(lambda: self._shard.transfer(lease_id, holder))

    def locate(self, wanted: Sequence[tuple[str, Sequence[int]]], run: str) -> list[list[Any]]:
        return self._locked(lambda: self._shard.locate(wanted, run))

    def stats(self) -> TableStats:
        table = self._locked(self._shard.stats)
        return dataclasses.replace(table, process_cpu_ms=time.process_time() * 1e3)

    def leaks(self) -> list[LeakRecord]:
        return self._locked(self._shard.leaks)


def _metered(cls: type[StoreShardShell]) -> type[StoreShardShell]:
    """Meter every call the shard actor serves (``routeplay.store.shard.call_meter``): each
    public method but ``stats`` (reading the meter is not a call it counts) runs inside
    ``meter.served``. ``functools.wraps`` keeps each signature, which Ray and the
    protocol check read."""
    for name, method in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name == "stats":
            continue

        @functools.wraps(method)
        def served(self: StoreShardShell, *args: Any, _m: Any = method, _op: str = name,
                   **kwargs: Any) -> Any:  # fmt: skip
            with self._shard.meter.served(_op):
                return _m(self, *args, **kwargs)

        setattr(cls, name, served)
    return cls


_metered(StoreShardShell)


class _RayAdoption:
    """``AdoptionSteps`` on Ray for one ``adopt_keys`` call of a shard: engine stores and
    the engine node's ``KeyValidator`` are actors; blocks are stored under the shard's
    lock."""

    def __init__(self, shell: StoreShardShell) -> None:
        self._shell = shell

    def engines(self, wheres: Sequence[Where], *, fresh: bool = False) -> Flow[dict[Where, Any]]:
        return (yield from self._shell._engines_asked(wheres, fresh))

    def send_take(
        self, engine: Any, keys: list[EngineKey], spec: RouteSpec, starts: list[int]
    ) -> Any:
        # A group too: a member validated at ingest comes as its block, laid out as it is.
        return engine.take_offered_many.remote(keys, spec, self._shell._shard.run, starts)

    def send_validate(
        self, node: str, raw: Any, key: EngineKey, spec: RouteSpec, start: int
    ) -> tuple[Any, Any]:
        status, block = self._shell._validator(node).canonical.remote(raw, key, spec, start)
        return status, block

    def send_rows_of(self, node: str, canonical: Any, start: int, stop: int) -> Any:
        return self._shell._validator(node).rows_of.remote(canonical, start, stop)

    def send_groups(
        self, node: str, spec: RouteSpec, requests: list[GroupRequest], payloads: list[Any]
    ) -> Any:
        return self._shell._validator(node).canonical_groups.remote(spec, requests, *payloads)

    def take_group(self, node: str, token: Any, count: int) -> list[Any]:
        # Written on the engine's node before the shard answers (as a producer's blocks),
        # and the hand-over checked: a validator restarted since the layout has none.
        validator = self._shell._validator(node)
        try:
            return take_and_wait(validator, token, count, self._shell._timeout_s)
        except AlreadyConsumed as exc:
            raise RoutesLost(
                "the engine node's validator restarted before handing over a round's "
                "laid-out blocks: nothing was stored",
                where=f"staged layout {token}",
                hint="The round's samples are set aside (their keys are consumed).",
            ) from exc

    def adopt(self, blocks: list[Any], rows: int, nbytes: int) -> StoreRef:
        return self._shell._adopt_blocks(blocks, rows, nbytes)

    def adopt_many(
        self, blocks: list[Any], payloads: list[StoredPayload], saved_bytes: int
    ) -> list[StoreRef]:
        shard = self._shell._shard
        return self._shell._locked(lambda: shard.adopt_many(blocks, payloads, saved_bytes))


def _random_key(ref: Any) -> str:
    """A key of LMDeploy's shape (56 lowercase hex, as ``ObjectRef.hex()``), all 224 bits
    from the CSPRNG: a key is a capability to consume a payload, so it is unguessable."""
    return secrets.token_hex(28)


class EngineStoreShell(_Reaped):
    """Drop-in for LMDeploy's ``shared_store`` (and an SGLang-side Ray store)."""

    def __init__(self, ttl_s: float | None = 600.0, timeout_s: float = 60.0) -> None:
        self._store: EngineStore[Any] = EngineStore(
            put_object=ray.put, get_object=ray.get, key_of=_random_key, ttl_s=ttl_s
        )
        self._timeout_s = timeout_s
        self._node_id = ray.get_runtime_context().get_node_id()
        self._ingest_spec: RouteSpec | None = None  # see validate_as
        self._validator: Any = None  # this node's, started on the first ingest
        self._users: set[str] = set()  # runs using this shared actor (see leave_engine_store)
        self._start_reaper(self._store.expire, ttl_s)

    def attach(self, user: str) -> int:
        """Count ``user`` (a run) among this actor's users; returns how many there are."""
        return self._locked(lambda: self._attach(user))

    def detach(self, user: str) -> int:
        """``user`` is done with this actor; returns how many users remain."""
        return self._locked(lambda: self._detach(user))

    def _attach(self, user: str) -> int:
        self._users.add(user)
        return len(self._users)

    def _detach(self, user: str) -> int:
        self._users.discard(user)
        return len(self._users)

    def validate_as(self, spec: RouteSpec | None) -> None:
        """Validate and narrow each payload put from now on against ``spec`` as it
        arrives (``routeplay.store.engine.ingest``); None stops it. One spec per store: the
        engine's model (a later call replaces it)."""
        self._ingest_spec = spec

    def take_checked_many(
        self, keys: list[EngineKey], spec: RouteSpec, run: str | None = None
    ) -> tuple[list[Any], str, list[object]]:
        """Consume keys whose metadata fits ``spec``; a refused key is freed and its error
        returned in its place (a key of another run is refused and left alone). Also
        returns this actor's node, where the bytes live, and no validation to wait for
        (the shape of ``take_offered_many``'s answer)."""
        taken = self._locked(lambda: take_checked_many(self._store, keys, spec, run))
        return taken, self._node_id, [None] * len(taken)

    def take_offered_many(
        self,
        keys: list[EngineKey],
        spec: RouteSpec,
        run: str | None,
        starts: list[int],
    ) -> tuple[list[Any], str, list[object]]:
        """``take_checked_many`` with each key's validation at ingest applied where it
        ended valid (``ingest.decide``, after ``ingest.settle``: this actor owns the
        statuses, so finding out costs no call): per key its ``Validated`` block, its raw
        reference or its refusal, and the validations the adopter must wait for
        (``routeplay.store.shard.adoption``). Nothing here waits."""

        def take() -> tuple[list[Any], list[object]]:
            offered = [self._store.prepared(key.key) for key in keys]
            return take_checked_many(self._store, keys, spec, run), offered

        taken, offered = self._locked(take)
        offered = settle(offered, outcomes=ray_calls.outcomes_now)
        decided, waits = decide(taken, offered, keys, starts, spec)
        return decided, self._node_id, waits

    def validated(self, key: str) -> bool | None:
        """How the key's validation at ingest ended, without waiting: True valid, False
        refused or lost, None still running (or none: no spec, or the key is gone)."""
        ready = self._locked(lambda: self._store.prepared(key))
        return ray_calls.outcome_now(ready.status) if isinstance(ready, Prepared) else None

    def put(self, data: Any, run: str = "") -> str:
        def put() -> tuple[str, Any, PayloadMeta | None]:
            key = self._store.put(data, run)
            return key, self._store.peek_ref(key), self._store.meta(key)

        key, ref, meta = self._locked(put)
        self._ingest(key, ref, meta)
        return key

    def put_from(
        self, producer: Any, token: str, shape: tuple[int, ...] | None = None, dtype: str = ""
    ) -> str:
        """One-write put: call the producer for its staged payload, so this actor owns it."""
        [ref] = take_and_wait(producer, token, 1, self._timeout_s)  # outside the lock
        meta = PayloadMeta(shape=tuple(shape), dtype=dtype) if shape is not None else None
        key = self._locked(lambda: self._store.adopt(ref, meta))
        self._ingest(key, ref, meta)
        return key

    def _ingest(self, key: str, ref: Any, meta: PayloadMeta | None) -> None:
        """Start validating a new key's payload when a spec is set and its metadata fits
        (before the key is returned: whoever adopts it finds the validation under way).
        Best effort: the key is stored already, so a failure here is logged and the key
        is adopted from its raw payload, as without a spec."""
        spec = self._ingest_spec
        if spec is None or meta is None or not fits(meta, spec):
            return
        rows = meta.shape[0]
        whole = EngineKey(key=key, rows=rows)  # every row: the adopter picks its own
        try:
            status, canonical = self._ingest_validator().ingest.remote(ref, whole, spec)
        except Exception:  # Ray's errors starting a call or an actor: logged, not raised
            log.warning("engine key %s: validation at ingest not started", key, exc_info=True)
            return
        prepared = Prepared(spec=spec, rows=rows, status=status, canonical=[canonical])
        self._locked(lambda: self._store.prepare(key, prepared, spec.nbytes(rows)))

    def _ingest_validator(self) -> Any:
        with self._lock:
            if self._validator is None:
                place = NodeAffinitySchedulingStrategy(node_id=self._node_id, soft=False)
                self._validator = KeyValidator.options(scheduling_strategy=place).remote()
            return self._validator

    def meta(self, key: str) -> PayloadMeta | None:
        return self._locked(lambda: self._store.meta(key))

    def get(self, key: str) -> Any:
        [ref] = self._locked(lambda: self._store.get_ref(key))
        return self._value(ref, key)  # fetched outside the lock: other keys keep flowing

    def clear(self) -> None:
        self._locked(self._store.clear)

    def peek(self, key: str, run: str | None = None) -> Any:
        return self._value(self._locked(lambda: self._store.peek_ref(key, run)), key)

    def _value(self, ref: Any, key: str) -> Any:
        return ray_calls.get(ref, timeout_s=self._timeout_s, what=f"engine key {key}")

    def get_ref(self, key: str, run: str | None = None) -> list[Any]:
        return self._locked(lambda: self._store.get_ref(key, run))

    def free(self, key: str, run: str | None = None) -> bool:
        return self._locked(lambda: self._store.free(key, run))

    def stats(self) -> EngineStoreStats:
        return self._locked(self._store.stats)

    def keys(self, run: str = "") -> list[str]:
        return self._locked(lambda: self._store.keys(run))


VALIDATE_GROUP: Final = "routeplay-validate"
"""The validator's lane for single payloads: one at a time, in the order adopted."""

INGEST_THREADS: Final = 1
"""Cores one validation at ingest uses. One: it runs next to the engine, whose own
processes (scheduler, detokenizer) need the node's other cores, and a payload's
validation (about 25 ms for 32k tokens of Qwen3-235B) is shorter than the time between
an engine's samples. Only the step's last payload is validated while the step runs, and
its one core leaves the others to the adopter's calls and the transfer (measured on the
bench's 2-core cluster, 12 paired steps each: the adopted-key step took 31 ms beyond
Ray's own fetch floor, against 45 ms with every core validating).

Priority: Ray starts workers at niceness 15 (its ``worker_niceness``) and raylets at 0,
so while a step's transfer runs, the raylets take the cores and every actor of the step
waits: traced on the bench's cluster, the last payload's validation (21 ms on an
idle core) took 70-180 ms, and a trainer rank took up to 118 ms to copy its 6 MB of
rows out of one block that had arrived.
Raising this validator to the raylets' niceness did not shorten the step (20
alternating pairs: 62 ms beyond Ray's fetch floor at niceness 0, 46 ms at 15), so it
keeps Ray's."""


RETRIES: Final = 3
"""Times a validator call that only reads its arguments is sent again when the validator
died or was restarting (``max_restarts`` below). Ray counts each call that finds the
actor still restarting as a try: under a busy CPU, adopting right after a kill was
refused in 1 of 2 runs with no retry and 3 of 7 with one; with three, none of 4. The
cost: a payload that kills the validator does so four times. ``take_staged`` is never
sent again: the arrays it would take died with the process."""

STAGED_TTL_S: Final = 600.0
"""Laid-out arrays never taken are dropped this long after staging (a shard that gave up
on the layout, or a layout run twice by a retry): ten times the default deadline."""


class KeyValidatorShell:
    """Validates adopted engine payloads on the node that holds them (one per node).

    Pipelined: single payloads are validated one at a time, in the order they were
    adopted (``VALIDATE_GROUP`` has one thread), each with every core of the node (the
    sweep's numpy loops release the GIL). So the first payload of a step is ready after
    its own validation, and its transfer to the trainer overlaps the validation of the
    next, where validating all at once would make every payload wait for the slowest.
    The readers' side of the overlap: a read fetches each block as soon as it exists
    (``routeplay.store.remote.ray_calls.get_as_created``), not in one ``ray.get`` of all of
    them, which Ray would pull only once the last one exists (once all exist, it is
    one ``ray.get``).

    An engine store that knows the spec has a validator of its own on its node and calls
    its ``ingest`` as each payload is put (one at a time, on ``INGEST_THREADS`` cores,
    while the engine generates), so adopting the key later takes the block as it is
    (``routeplay.store.engine.ingest``).
    """

    def __init__(self) -> None:
        self._outbox = PayloadOutbox()
        self._threads = len(os.sched_getaffinity(0))  # the cores this worker may use

    @ray.method(max_task_retries=RETRIES)
    def canonical_groups(
        self, spec: RouteSpec, requests: list[GroupRequest], *payloads: Any
    ) -> LaidOut:
        """Validate groups' payloads (rows from each start; a block validated at ingest,
        where its request says so, taken as it is) and lay each group's accepted members
        out (``adoption.lay_out_groups``); the arrays wait here, under one token, until
        the shard takes them, so the shard owns the blocks. Returns the token and, per
        group, its members' outcomes (sample index or error), the samples' parts, the
        payloads and the bytes the shared prefix saved, or the error that failed it."""
        self._outbox.sweep(STAGED_TTL_S)  # a round whose taker gave up, long ago
        arrays, answers = lay_out_groups(requests, spec, payloads)
        del payloads
        return LaidOut(
            token=self._outbox.stage_many(tuple(arrays)) if arrays else "",
            groups=tuple(answers),
        )

    def take_staged(self, token: str) -> Any:
        """The staged arrays of ``canonical_groups`` (called by the shard that owns them),
        then the hand-over marker the shard fetches, as a producer's ``take_staged``: a
        validator restarted since the layout has nothing to hand over, and says so."""
        return self._outbox.hand_over(token)

    @ray.method(concurrency_group=VALIDATE_GROUP, num_returns=2, max_task_retries=RETRIES)
    def ingest(
        self, payload: npt.NDArray[Any], key: EngineKey, spec: RouteSpec
    ) -> tuple[None, npt.NDArray[np.unsignedinteger]]:
        """A payload validated as it is put (``routeplay.store.engine.ingest``): None (the
        status) and its canonical rows; a refusal is raised, so both results hold it
        (a reader of the block gets it, as from ``canonical``)."""
        return None, canonical_rows(payload, key, spec, threads=INGEST_THREADS)

    @ray.method(max_task_retries=RETRIES)
    def rows_of(
        self, canonical: npt.NDArray[np.unsignedinteger], start: int, stop: int
    ) -> npt.NDArray[np.unsignedinteger]:
        """Rows ``[start, stop)`` of a block validated at ingest (a resume's new rows):
        Ray writes only these rows as the result; nothing is validated again."""
        return canonical[start:stop]

    @ray.method(concurrency_group=VALIDATE_GROUP, num_returns=2, max_task_retries=RETRIES)
    def canonical(
        self, payload: npt.NDArray[Any], key: EngineKey, spec: RouteSpec, start: int = 0
    ) -> tuple[None, npt.NDArray[np.unsignedinteger]]:
        """None (the status the adopter waits for, a few bytes) and the key's rows from
        ``start``, validated and canonical; a refusal is raised, so both results hold it.
        Ray resolved ``payload`` from this node's object store (zero copy), so the only
        write is the compact result (the history rows before ``start`` are never copied)."""
        return None, canonical_rows(payload, key, spec, start, threads=self._threads)


# The Ray actor classes (typed Any: ray.remote's result has no useful static type).
# Threaded (max_concurrency): a call that waits on a producer or fetches a payload does
# not hold up the others; the shell's lock keeps the plain class single-threaded.
_remote: Any = ray.remote  # its overloads do not list actor options such as max_concurrency
StoreShardActor: Any = _remote(num_cpus=0, max_concurrency=8)(StoreShardShell)
EngineStoreActor: Any = _remote(num_cpus=0, max_concurrency=8)(EngineStoreShell)
# Restarted when it dies (an engine node's OOM killer, a crash): a validator holds nothing
# that outlives a call but the arrays staged for the shard, whose round is refused anyway
# (its calls fail), and a dead handle cached by a shard or an engine store would refuse
# every later adoption (or validation at ingest) on that node.
KeyValidator: Any = _remote(
    num_cpus=0, max_concurrency=4, concurrency_groups={VALIDATE_GROUP: 1}, max_restarts=-1
)(KeyValidatorShell)


def _implement_the_shard_api(
    shell: StoreShardShell, shard: StoreShard
) -> tuple[ShardApi, ShardApi]:
    """Never called: here mypy checks that the Ray actor and the plain shard both
    implement every typed shard operation (``routeplay.store.shard.api``)."""
    return shell, shard
