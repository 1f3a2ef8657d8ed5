"""The engine-side store: a drop-in for LMDeploy's ``shared_store`` actor, plus lifetimes.

LMDeploy's engine looks the actor up by name (``shared_store``) in namespace
``lmdeploy``, calls ``put(data)`` and returns the key (``ObjectRef.hex()``) to the client,
who later calls the destructive ``get(key)``. LMDeploy's own actor never expires a key,
so every response that is dropped before its key is read leaks its payload. This class
keeps LMDeploy's contract (``put``/``get``/``clear``) and adds ``peek``, ``get_ref``
(hand out the reference: the caller reads from the object store directly), ``free``, a
TTL for unconsumed keys, and ``stats``.

Validated at ingest: a store that knows the model's routing spec has each payload
validated and narrowed as it is put (the actor shell starts that work; this class keeps
its result next to the key, ``prepare``). An adopting store with the same spec then
takes the canonical rows ready-made (``prepared``) instead of validating the raw payload
on the trainer's step; the result goes with the key when it is consumed, freed or
expired, like the raw payload.

Plain Python with the object-store operations passed in; the actor shell is in
``routeplay.store.remote.actors``. A key is consumed once: a second ``get``/``get_ref`` raises
``AlreadyConsumed`` (a ``KeyError`` too, as LMDeploy clients expect).

Run scope: one engine store serves every run on the cluster, and LMDeploy's engine puts
keys without knowing the run. A key belongs to the first run whose store claims it
(adopts, peeks or frees it with ``run=``), or to the run given at put; a claim by any
other run raises ``RunMismatch`` and leaves the key untouched, and ``keys(run)`` lists
one run's keys only. Calls without ``run`` are LMDeploy's own contract (unscoped).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from routeplay.errors import AlreadyConsumed, KeyExpired, RunMismatch

__all__ = ["EngineStore", "EngineStoreStats", "PayloadMeta"]

Ref = TypeVar("Ref")
_FORGOTTEN_MEMORY = 1 << 16
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStoreStats:
    """Snapshot of the engine store."""

    live_keys: int
    """Keys put and not yet consumed, freed or expired."""
    puts: int
    """Keys ever put."""
    consumed: int
    """Keys handed over by ``get`` or ``get_ref``."""
    freed: int
    """Keys dropped by ``free`` or ``clear``."""
    expired: int
    """Keys dropped because nobody consumed them within the TTL."""
    prepared: int = 0
    """Payloads validated and narrowed at ingest (``prepare``)."""
    prepared_bytes: int = 0
    """Canonical bytes of those payloads (counted as each validation starts)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadMeta:
    """Shape and dtype of a stored payload, known without reading its bytes."""

    shape: tuple[int, ...]
    """Array shape (``[T, L, K]`` for routing)."""
    dtype: str
    """Element type name."""

    @classmethod
    def of(cls, data: Any) -> PayloadMeta | None:
        """Metadata of an array-like, or None for anything else."""
        shape, dtype = getattr(data, "shape", None), getattr(data, "dtype", None)
        if shape is None or dtype is None:
            return None
        return cls(shape=tuple(int(n) for n in shape), dtype=str(dtype))


@dataclass(slots=True)
class _Entry(Generic[Ref]):
    ref: Ref
    created: float
    meta: PayloadMeta | None
    run: str = ""  # "" until a run claims the key
    prepared: object = None  # the payload's ingest validation (opaque here), if any


class EngineStore(Generic[Ref]):
    """Keys to payload references; ``put_object``/``get_object``/``key_of`` talk to Ray."""

    def __init__(
        self,
        *,
        put_object: Callable[[Any], Ref],
        get_object: Callable[[Ref], Any],
        key_of: Callable[[Ref], str],
        ttl_s: float | None = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._put_object = put_object
        self._get_object = get_object
        self._key_of = key_of
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry[Ref]] = {}
        self._by_age: list[tuple[float, str]] = []
        self._forgotten: OrderedDict[str, str] = OrderedDict()  # key -> why it is gone
        self._counts = {"puts": 0, "consumed": 0, "freed": 0, "expired": 0}
        self._prepared = {"prepared": 0, "prepared_bytes": 0}

    # -- LMDeploy's contract ---------------------------------------------------------
    def put(self, data: Any, run: str = "") -> str:
        """Store ``data``; the key has the shape LMDeploy returns (56 hex, from ``key_of``)."""
        return self.adopt(self._put_object(data), PayloadMeta.of(data), run=run)

    def adopt(self, ref: Ref, meta: PayloadMeta | None = None, run: str = "") -> str:
        """Keep a reference this process already owns (the one-write path: the actor shell
        got it by calling the producer); the key is its hex, as for ``put``."""
        self.expire()
        key = self._key_of(ref)
        now = self._clock()
        self._entries[key] = _Entry(ref=ref, created=now, meta=meta, run=run)
        if self.ttl_s is not None:
            heapq.heappush(self._by_age, (now, key))
        self._counts["puts"] += 1
        return key

    def get(self, key: str) -> Any:
        """The payload, consuming the key (a second get raises ``AlreadyConsumed``)."""
        return self._get_object(self._consume(key, None))

    def clear(self) -> None:
        """Drop every key (LMDeploy's clear freed the objects but kept the keys)."""
        for key in list(self._entries):
            self.free(key)

    # -- additions -------------------------------------------------------------------
    def peek(self, key: str, run: str | None = None) -> Any:
        """The payload without consuming the key."""
        return self._get_object(self._entry(key, run).ref)

    def peek_ref(self, key: str, run: str | None = None) -> Ref:
        """The reference of a live key, without consuming it."""
        return self._entry(key, run).ref

    def meta(self, key: str, run: str | None = None) -> PayloadMeta | None:
        """Shape and dtype of a live key's payload (recorded at put; nothing is read)."""
        return self._entry(key, run).meta

    def get_ref(self, key: str, run: str | None = None) -> list[Ref]:
        """Consume the key and hand out its reference, wrapped in a list so Ray passes it
        through unresolved; the caller reads the bytes from the object store itself."""
        return [self._consume(key, run)]

    def take_checked(
        self, key: str, check: Callable[[PayloadMeta], None], run: str | None = None
    ) -> list[Ref]:
        """``get_ref`` after ``check`` accepted the key's metadata; a key it refuses is
        freed here (never leaked) and the refusal raised. One call for an adopting store.
        A key of another run is refused with ``RunMismatch`` and left alone."""
        meta = self.meta(key, run)
        if meta is not None:
            try:
                check(meta)
            except Exception:
                self.free(key, run)
                raise
        return self.get_ref(key, run)

    def prepare(self, key: str, prepared: object, nbytes: int) -> bool:
        """Keep the ingest validation of a live key's payload (``nbytes``: the canonical
        bytes it writes); False when the key is already gone (its result is dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.prepared = prepared
        self._prepared["prepared"] += 1
        self._prepared["prepared_bytes"] += nbytes
        return True

    def prepared(self, key: str) -> object:
        """The ingest validation kept for a key (None when it has none or is gone); the
        caller takes the key itself with ``take_checked``, which checks its run."""
        entry = self._entries.get(key)
        return None if entry is None else entry.prepared

    def free(self, key: str, run: str | None = None) -> bool:
        """Drop a key nobody will consume (idempotent); True if it was live. A key of
        another run is refused (``RunMismatch``), never freed."""
        self.expire()
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._claim(key, entry, run)
        del self._entries[key]
        self._forget(key, "freed")
        return True

    def expire(self) -> list[str]:
        """Drop keys older than the TTL; returns them."""
        if self.ttl_s is None:
            return []
        deadline = self._clock() - self.ttl_s
        gone = []
        while self._by_age and self._by_age[0][0] <= deadline:
            created, key = heapq.heappop(self._by_age)
            entry = self._entries.get(key)
            if entry is not None and entry.created == created:
                del self._entries[key]
                self._forget(key, "expired")
                gone.append(key)
                log.warning("engine key %s expired unconsumed after %.0fs", key, self.ttl_s)
        return gone

    def stats(self) -> EngineStoreStats:
        """Counts of live, put, consumed, freed and expired keys."""
        self.expire()
        return EngineStoreStats(live_keys=len(self._entries), **self._counts, **self._prepared)

    def keys(self, run: str = "") -> list[str]:
        """Live keys of ``run``, oldest first ("": keys no run has claimed yet)."""
        self.expire()
        mine = [key for key, entry in self._entries.items() if entry.run == run]
        return sorted(mine, key=lambda key: self._entries[key].created)

    # -- internals -------------------------------------------------------------------
    def _consume(self, key: str, run: str | None) -> Ref:
        entry = self._entry(key, run)
        del self._entries[key]
        self._forget(key, "consumed")
        return entry.ref

    def _claim(self, key: str, entry: _Entry[Ref], run: str | None) -> None:
        """Bind an unclaimed key to ``run``; refuse a key another run claimed."""
        if run is None or entry.run == run:
            return
        if entry.run:
            raise RunMismatch(
                "engine key of another run",
                expected=f"a key of run {run}",
                found="a key claimed by another run",
                where=f"engine key {key}",
                hint="Each run adopts, reads and frees only the keys of its own responses.",
            )
        entry.run = run

    def _entry(self, key: str, run: str | None = None) -> _Entry[Ref]:
        self.expire()
        entry = self._entries.get(key)
        if entry is not None:
            self._claim(key, entry, run)
            return entry
        why = self._forgotten.get(key)
        if why == "expired":
            raise KeyExpired(
                "engine key expired before anyone consumed it",
                where=f"key {key}",
                found=f"ttl {self.ttl_s}s",
                hint="Consume keys promptly or raise the engine store TTL.",
            )
        raise AlreadyConsumed(
            f"engine key {why}" if why else "unknown engine key",
            where=f"key {key}",
            expected="a key put and not yet consumed",
            hint="Each key is read once; clone the handle's lease instead of reading twice.",
        )

    def _forget(self, key: str, why: str) -> None:
        self._counts[why] += 1
        self._forgotten[key] = why
        if len(self._forgotten) > _FORGOTTEN_MEMORY:
            self._forgotten.popitem(last=False)
