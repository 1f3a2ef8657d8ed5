"""The lease table: who holds which payload, and when a payload's bytes may go.

Plain Python (no Ray): the route-store actor is a thin shell around it, and tests drive
it directly with a fake clock. A payload's lifetime is a state machine owned here:

    STORED ──acquire──► LEASED ──last release──► RELEASED
      │                   ▲ │
      └──ttl──► EXPIRED   └─┘ acquire / clone / transfer / release (not last)

Invariants: a payload is LEASED iff at least one live lease names it; a RELEASED or
EXPIRED payload holds no reference (its bytes can be reclaimed by Ray); releasing a
lease twice is a no-op; a lease only ever touches payloads of its own run.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Generic, TypeVar

from routeplay.errors import AlreadyReleased, HandleError, RoutesExpired, RoutesLost, RunMismatch

__all__ = ["LeakRecord", "LeaseTable", "PayloadState", "TableStats"]

Ref = TypeVar("Ref")
_GONE_MEMORY = 1 << 16
log = logging.getLogger(__name__)

LEASE_IDS_PER_DRAW: Final = 256
"""Lease ids minted from one draw of the OS's random source (``LeaseTable._new_lease_id``)."""


class PayloadState(Enum):
    """Where a payload is in its lifetime."""

    STORED = "stored"
    LEASED = "leased"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(slots=True)
class _Payload(Generic[Ref]):
    rows: int
    nbytes: int
    created: float
    ref: Ref | None
    state: PayloadState = PayloadState.STORED
    leases: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Lease:
    holder: str
    payloads: tuple[str, ...]
    since: float
    since_wall: float
    fresh: frozenset[str]  # payloads that were STORED (never leased) when this was granted


@dataclass(frozen=True, slots=True, kw_only=True)
class TableStats:
    """A snapshot of the table: what is alive, who holds it, what has gone."""

    live_payloads: int
    """Payloads still referenced (STORED or LEASED)."""
    live_bytes: int
    """Canonical bytes of those payloads."""
    unleased_payloads: int
    """Payloads stored but never leased yet (the TTL applies to these)."""
    leases: int
    """Live leases."""
    leases_by_holder: tuple[tuple[str, int], ...]
    """(holder, live lease count), sorted by holder."""
    bytes_by_holder: tuple[tuple[str, int], ...]
    """(holder, bytes its leases keep alive, counted once per holder and payload)."""
    released_payloads: int
    """Payloads dropped after their last lease went."""
    expired_payloads: int
    """Payloads dropped because nobody leased them before the TTL."""
    released_bytes: int
    """Bytes dropped on last release."""
    expired_bytes: int
    """Bytes dropped on TTL expiry."""
    shared_prefix_bytes_saved: int = 0
    """Bytes never written because samples shared a verified-equal prompt prefix."""
    expired_leases: int = 0
    """Leases ended by the lease TTL (``StoreConfig.lease_ttl_s``): holders that died."""
    revoked_leases: int = 0
    """Leases ended by ``RouteStore.revoke`` / ``revoke_holder`` (a dead holder's)."""
    calls_by_op: tuple[tuple[str, int], ...] = ()
    """(operation, calls the shard served), sorted (``routeplay.store.shard.call_meter``)."""
    calls: int = 0
    """Calls the shard served, all operations (``stats`` itself not counted)."""
    call_cpu_ms: float = 0.0
    """CPU milliseconds of the threads that served those calls."""
    process_cpu_ms: float = 0.0
    """CPU milliseconds of the shard's whole process (a Ray shard actor; 0 in process)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeakRecord:
    """One lease still held: by whom, since when, over what."""

    lease_id: str
    """The lease still held."""
    holder: str
    """Who holds it (e.g. ``buffer/group-17``)."""
    since: float
    """Wall-clock time (epoch seconds) it was granted."""
    age_s: float
    """Seconds it has been held."""
    payloads: tuple[str, ...]
    """Payloads it keeps alive."""
    nbytes: int
    """Canonical bytes of those payloads."""


class LeaseTable(Generic[Ref]):
    """Payload records and leases of one run; ``Ref`` is whatever keeps the bytes alive."""

    def __init__(
        self,
        run: str,
        *,
        ttl_s: float | None = 600.0,
        clock: Callable[[], float] = time.monotonic,
        lease_prefix: str = "",
        wall_clock: Callable[[], float] = time.time,
        lease_ttl_s: float | None = None,
        dispose: Callable[[Ref], object] | None = None,
    ) -> None:
        self.run = run
        self.lease_ttl_s = lease_ttl_s
        # Where a dropped payload's reference goes (None: dropped here, at once).
        self._dispose = dispose
        self._lease_counts = {"expired": 0, "revoked": 0}
        self._lease_prefix = lease_prefix or run
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._payloads: dict[str, _Payload[Ref]] = {}
        self._leases: dict[str, _Lease] = {}
        self._id_pool: list[str] = []  # unguessable lease ids drawn ahead (_new_lease_id)
        self._unleased: list[tuple[float, str]] = []
        self._dropped = {PayloadState.RELEASED: [0, 0], PayloadState.EXPIRED: [0, 0]}
        self._saved_bytes = 0
        # Recently dropped ids, bounded: only used to say "expired" vs "released" in errors.
        self._gone: OrderedDict[str, PayloadState] = OrderedDict()

    # -- payloads -------------------------------------------------------------------
    def add(self, payload_id: str, ref: Ref, *, rows: int, nbytes: int) -> None:
        """Record a stored payload (state STORED, TTL clock starts now)."""
        if payload_id in self._payloads or payload_id in self._gone:
            raise HandleError("payload id already used", found=payload_id, where=f"run {self.run}")
        created = self._clock()
        self._payloads[payload_id] = _Payload(rows=rows, nbytes=nbytes, created=created, ref=ref)
        if self.ttl_s is not None:
            heapq.heappush(self._unleased, (created, payload_id))

    def note_shared(self, saved_bytes: int) -> None:
        """Count bytes a shared prompt prefix spared the object store (for ``stats``)."""
        self._saved_bytes += saved_bytes

    def state(self, payload_id: str) -> PayloadState:
        """Current state of a payload this table has seen."""
        if payload_id in self._payloads:
            return self._payloads[payload_id].state
        if payload_id in self._gone:
            return self._gone[payload_id]
        raise KeyError(payload_id)

    def refs(self, payload_ids: Iterable[str], *, run: str) -> dict[str, Ref]:
        """References of live payloads, for a reader; refuses other runs and gone payloads."""
        self._check_run(run)
        out: dict[str, Ref] = {}
        for pid in payload_ids:
            record = self._live(pid)
            assert record.ref is not None  # live payloads always hold their ref
            out[pid] = record.ref
        return out

    def discard(self, payload_ids: Iterable[str]) -> list[str]:
        """Drop payloads nobody has leased yet, at once (a write whose caller never got
        its handle: a cancelled put); leased or gone ones are left alone. Returns the
        dropped ids (counted as released)."""
        dropped = []
        for pid in payload_ids:
            record = self._payloads.get(pid)
            if record is not None and record.state is PayloadState.STORED:
                self._drop(pid, PayloadState.RELEASED)
                dropped.append(pid)
        return dropped

    def expire(self) -> list[str]:
        """Drop every payload nobody leased within the TTL (and, with a lease TTL, end
        leases held longer than it); returns the dropped payloads' ids."""
        dropped = self._expire_leases()
        if self.ttl_s is None:
            return dropped
        deadline = self._clock() - self.ttl_s
        stale = []
        # Payloads enter the heap in creation order, so expiry costs O(expired), not O(live).
        while self._unleased and self._unleased[0][0] <= deadline:
            _, pid = heapq.heappop(self._unleased)
            record = self._payloads.get(pid)
            if record is not None and record.state is PayloadState.STORED:
                log.warning(
                    "run %s: payload %s (%d bytes) expired: nobody leased it within %.0fs",
                    self.run,
                    pid,
                    record.nbytes,
                    self.ttl_s,
                )
                self._drop(pid, PayloadState.EXPIRED)
                stale.append(pid)
        return dropped + stale

    def _expire_leases(self) -> list[str]:
        """End leases older than the lease TTL (off by default): a holder that died can
        pin bytes only that long. Logged and counted (``expired_leases``)."""
        if self.lease_ttl_s is None:
            return []
        deadline = self._clock() - self.lease_ttl_s
        old = [lid for lid, lease in self._leases.items() if lease.since <= deadline]
        dropped = []
        for lid in old:
            log.warning(
                "run %s: lease %s of %s expired after %.0fs (lease TTL): its holder never "
                "released it",
                self.run,
                lid,
                self._leases[lid].holder,
                self.lease_ttl_s,
            )
            dropped += self.release(lid)
            self._lease_counts["expired"] += 1
        return dropped

    def revoke_holder(self, holder: str) -> list[str]:
        """End every lease of ``holder`` (one that died); returns the lease ids ended."""
        ended = [lid for lid, lease in self._leases.items() if lease.holder == holder]
        for lid in ended:
            self.release(lid)
        self._lease_counts["revoked"] += len(ended)
        return ended

    def revoke_leases(self, lease_ids: Iterable[str]) -> list[str]:
        """End the given leases of a dead holder (idempotent); returns those that were live."""
        ids = list(lease_ids)
        for lid in ids:
            self._check_own(lid)
        ended = [lid for lid in ids if lid in self._leases]
        for lid in ended:
            self.release(lid)
        self._lease_counts["revoked"] += len(ended)
        return ended

    # -- leases ---------------------------------------------------------------------
    def acquire(self, payload_ids: Iterable[str], holder: str, *, run: str) -> str:
        """A new lease of ``holder`` over live payloads; returns its id."""
        self._check_run(run)
        ids = tuple(dict.fromkeys(payload_ids))
        for pid in ids:
            self._live(pid)
        return self._grant(ids, holder)

    def release(self, lease_id: str) -> list[str]:
        """End a lease (idempotent); returns payloads whose last lease this was."""
        return self._end(lease_id, restore_fresh=False)

    def revoke(self, lease_id: str) -> list[str]:
        """Undo a lease as if it had never been granted (rolling back a failed multi-shard
        grant): payloads it first leased go back to STORED, TTL and all; returns dropped."""
        return self._end(lease_id, restore_fresh=True)

    def _check_own(self, lease_id: str) -> None:
        """Refuse a lease id another run's (or shard's) table granted: ids carry their
        granter's prefix. Ids of no table at all stay an idempotent no-op."""
        if "/lease-" in lease_id and not lease_id.startswith(f"{self._lease_prefix}/lease-"):
            raise RunMismatch(
                "lease of another run or shard",
                expected=f"a lease id of {self._lease_prefix}",
                found=lease_id[:160],
                where=f"run {self.run}",
                hint="Each run releases only its own leases, through its own store.",
            )

    def _end(self, lease_id: str, *, restore_fresh: bool) -> list[str]:
        self._check_own(lease_id)
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return []
        dropped = []
        for pid in lease.payloads:
            record = self._payloads[pid]
            record.leases.discard(lease_id)
            if record.leases:
                continue
            if restore_fresh and pid in lease.fresh:
                self._restore(pid, record)
            else:
                self._drop(pid, PayloadState.RELEASED)
                dropped.append(pid)
        return dropped

    def _restore(self, pid: str, record: _Payload[Ref]) -> None:
        record.state = PayloadState.STORED
        if self.ttl_s is not None:
            heapq.heappush(self._unleased, (record.created, pid))

    def clone(self, lease_id: str, holder: str) -> str:
        """A second lease over the same payloads for another holder."""
        return self._grant(self._held(lease_id).payloads, holder, held=True)

    def transfer(self, lease_id: str, holder: str) -> str:
        """Hand a lease to another holder; the payloads never reach zero leases."""
        new_id = self.clone(lease_id, holder)
        self.release(lease_id)
        return new_id

    def is_live(self, lease_id: str) -> bool:
        """True while the lease has not been released."""
        return lease_id in self._leases

    # -- accounting -----------------------------------------------------------------
    def stats(self) -> TableStats:
        """A frozen snapshot of counts and bytes."""
        live = list(self._payloads.values())
        by_holder: dict[str, int] = {}
        holder_payloads: dict[str, set[str]] = {}
        for lease in self._leases.values():
            by_holder[lease.holder] = by_holder.get(lease.holder, 0) + 1
            holder_payloads.setdefault(lease.holder, set()).update(lease.payloads)
        holder_bytes = {
            holder: sum(self._payloads[pid].nbytes for pid in pids)
            for holder, pids in holder_payloads.items()
        }
        released, expired = (
            self._dropped[PayloadState.RELEASED],
            self._dropped[PayloadState.EXPIRED],
        )
        return TableStats(
            live_payloads=len(live),
            live_bytes=sum(rec.nbytes for rec in live),
            unleased_payloads=sum(rec.state is PayloadState.STORED for rec in live),
            leases=len(self._leases),
            leases_by_holder=tuple(sorted(by_holder.items())),
            bytes_by_holder=tuple(sorted(holder_bytes.items())),
            released_payloads=released[0],
            expired_payloads=expired[0],
            released_bytes=released[1],
            expired_bytes=expired[1],
            shared_prefix_bytes_saved=self._saved_bytes,
            expired_leases=self._lease_counts["expired"],
            revoked_leases=self._lease_counts["revoked"],
        )

    def leaks(self) -> list[LeakRecord]:
        """Every lease still held, oldest first."""
        now = self._clock()
        records = [
            LeakRecord(
                lease_id=lid,
                holder=lease.holder,
                since=lease.since_wall,
                age_s=now - lease.since,
                payloads=lease.payloads,
                nbytes=sum(self._payloads[pid].nbytes for pid in lease.payloads),
            )
            for lid, lease in self._leases.items()
        ]
        return sorted(records, key=lambda rec: (rec.since, rec.lease_id))

    # -- internals ------------------------------------------------------------------
    def _grant(self, payload_ids: tuple[str, ...], holder: str, *, held: bool = False) -> str:
        """A lease of ``holder``; ``held``: every payload is leased already (a clone),
        so none is fresh."""
        lease_id = self._new_lease_id()
        fresh = frozenset() if held else self._never_leased(payload_ids)
        self._leases[lease_id] = _Lease(
            holder=holder,
            payloads=payload_ids,
            since=self._clock(),
            since_wall=self._wall_clock(),
            fresh=fresh,
        )
        for pid in payload_ids:
            record = self._payloads[pid]
            record.leases.add(lease_id)
            record.state = PayloadState.LEASED
        return lease_id

    def _never_leased(self, payload_ids: tuple[str, ...]) -> frozenset[str]:
        """The payloads still STORED: a lease's revoke gives them back their TTL."""
        return frozenset(
            pid for pid in payload_ids if self._payloads[pid].state is PayloadState.STORED
        )

    def _new_lease_id(self) -> str:
        """An unguessable lease id (16 random bytes from the OS's source), drawn
        ``LEASE_IDS_PER_DRAW`` at a time: a step grants a few leases per sample, and one
        system call each made a step's lease work 12-17% slower
        (``benchmarks/lease_table_cost.py``). ``pop`` first: it is atomic, so even a
        caller without the shard's lock never gets an id twice."""
        try:
            tail = self._id_pool.pop()
        except IndexError:
            drawn = secrets.token_hex(16 * LEASE_IDS_PER_DRAW)
            pool = [drawn[i : i + 32] for i in range(0, len(drawn), 32)]
            tail = pool.pop()
            self._id_pool = pool
        return f"{self._lease_prefix}/lease-{tail}"

    def _held(self, lease_id: str) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise AlreadyReleased(
                "the lease was already released",
                found=lease_id,
                hint="Clone or transfer a lease before releasing it.",
            )
        return lease

    def _live(self, payload_id: str) -> _Payload[Ref]:
        record = self._payloads.get(payload_id)
        if record is not None:
            return record
        gone = self._gone.get(payload_id)
        if gone is PayloadState.EXPIRED:
            raise RoutesExpired(
                "payload expired: nobody leased it before its TTL",
                where=f"payload {payload_id}",
                found=f"ttl {self.ttl_s}s",
                hint="Acquire a lease right after put, or raise the store's TTL.",
            )
        raise RoutesLost(
            "payload is gone (its last lease was released)"
            if gone is PayloadState.RELEASED
            else "payload is unknown to this store",
            where=f"payload {payload_id}, run {self.run}",
        )

    def _drop(self, payload_id: str, state: PayloadState) -> None:
        record = self._payloads.pop(payload_id)
        # Dropping the reference is what lets Ray reclaim the bytes.
        ref, record.ref = record.ref, None
        if self._dispose is not None and ref is not None:
            self._dispose(ref)
        self._gone[payload_id] = state
        if len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)
        self._dropped[state][0] += 1
        self._dropped[state][1] += record.nbytes

    def _check_run(self, run: str) -> None:
        if run != self.run:
            raise RunMismatch(
                "data of another run",
                expected=f"run {self.run}",
                found=f"run {run}",
                hint="Each run has its own store namespace; pass the run's own client.",
            )
