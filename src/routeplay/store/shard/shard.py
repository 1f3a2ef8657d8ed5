"""One store shard: payload references and leases of one run, never payload bytes.

``StoreShard`` is plain Python; ``routeplay.store.remote.actors`` wraps it in a Ray actor.
What keeps bytes alive is the list of block references the shard holds per payload;
the lease table decides when to drop it. The shard owns those references either
because it called the producer (``adopt_from``: the one-write path) or because a
long-lived process handed it references it owns (``adopt``: drivers, engine stores).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from routeplay.core.handle import StoreRef
from routeplay.errors import HandleError, MisuseError
from routeplay.store.shard.call_meter import CallMeter
from routeplay.store.shard.lease_table import LeakRecord, LeaseTable, TableStats

__all__ = ["CallProducer", "Grant", "StoreShard", "StoredPayload", "check_holders", "shard_of"]

# (producer handle, token, block count) -> one reference per block, owned by the caller.
CallProducer = Callable[[Any, str, int], list[Any]]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredPayload:
    """What a shard needs to record one payload (one entry of a batched adopt)."""

    blocks: int
    """Block references this payload takes from the batch, in order."""
    rows: int
    """Token rows of the payload."""
    nbytes: int
    """Canonical bytes of the payload."""
    block_rows: int
    """Rows per block (0: one block)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """Leases granted by one shard in one call, with what a reader needs to fetch.

    ``blocks`` carries the block references of every leased payload, so the holder reads
    without asking the shard again (in a reader process they are borrowed references:
    the client drops them when the lease is released, never later).
    """

    lease_ids: tuple[str, ...]
    """One lease id per request, in request order."""
    blocks: dict[str, list[Any]]
    """Block references of every payload leased, by payload id."""


def check_holders(samples: Sequence[Sequence[int]], holders: Sequence[str]) -> None:
    """Refuse a leased adopt that does not name one holder per sample (``MisuseError``)."""
    if isinstance(holders, str) or len(holders) != len(samples):
        raise MisuseError(
            "a leased adopt names one holder per sample",
            expected=f"a list of {len(samples)} holders",
            found=repr(holders)[:80] if isinstance(holders, str) else len(holders),
        )


def shard_of(payload_id: str) -> int:
    """The shard index a payload id was minted by (ids look like ``"3.1f"``)."""
    return int(payload_id.split(".", 1)[0])


class StoreShard:
    """Payload records and leases for one run on one shard."""

    def __init__(
        self,
        run: str,
        index: int,
        *,
        ttl_s: float | None = 600.0,
        clock: Callable[[], float] = time.monotonic,
        call_producer: CallProducer | None = None,
        lease_ttl_s: float | None = None,
        dispose: Callable[[list[Any]], object] | None = None,
    ) -> None:
        self.run = run
        self.index = index
        self._table: LeaseTable[list[Any]] = LeaseTable(
            run,
            ttl_s=ttl_s,
            clock=clock,
            lease_prefix=f"{run}/{index}",
            lease_ttl_s=lease_ttl_s,
            dispose=dispose,
        )
        self._ids = itertools.count()
        self._call_producer = call_producer
        self.meter = CallMeter()
        """The calls served on this shard (metered by whoever serves them)."""

    def adopt(self, refs: Sequence[Any], rows: int, nbytes: int, block_rows: int) -> StoreRef:
        """Keep references to a stored payload's blocks; returns the payload's StoreRef."""
        self._table.expire()
        # Unguessable (128 CSPRNG bits): ids cross process boundaries, see docs/security.md.
        payload_id = f"{self.index}.{secrets.token_hex(16)}"
        self._table.add(payload_id, list(refs), rows=rows, nbytes=nbytes)
        return StoreRef(payload_id=payload_id, run=self.run, rows=rows, block_rows=block_rows)

    def adopt_from(
        self, producer: Any, token: str, blocks: int, rows: int, nbytes: int, block_rows: int
    ) -> StoreRef:
        """Call the producer for its staged blocks, so this shard owns them (one write)."""
        refs = self._producer_call()(producer, token, blocks)
        return self.adopt(refs, rows=rows, nbytes=nbytes, block_rows=block_rows)

    def _producer_call(self) -> CallProducer:
        if self._call_producer is None:
            raise MisuseError(
                "this shard was built without a way to call producers",
                hint="Pass call_producer= (the Ray actor shell does) or use adopt().",
            )
        return self._call_producer

    def adopt_from_many(
        self, producer: Any, token: str, payloads: Sequence[StoredPayload], saved_bytes: int = 0
    ) -> list[StoreRef]:
        """``adopt_from`` for every staged block of a batch, with one producer call."""
        call = self._producer_call()
        refs = call(producer, token, sum(payload.blocks for payload in payloads))
        return self.adopt_many(refs, payloads, saved_bytes)

    def adopt_many(
        self, refs: Sequence[Any], payloads: Sequence[StoredPayload], saved_bytes: int = 0
    ) -> list[StoreRef]:
        """Record a batch of payloads in one call (``refs`` are their blocks, in order);
        ``saved_bytes`` counts the bytes not written because a prefix was shared."""
        out, at = [], 0
        for payload in payloads:
            blocks = refs[at : at + payload.blocks]
            at += payload.blocks
            out.append(self.adopt(blocks, payload.rows, payload.nbytes, payload.block_rows))
        if at != len(refs):
            raise HandleError(
                "batched adopt got a different number of blocks than its payloads name",
                expected=at,
                found=len(refs),
            )
        self._table.note_shared(saved_bytes)
        return out

    def lease_many(
        self, requests: Sequence[tuple[Sequence[str], str]], run: str, *, with_blocks: bool = True
    ) -> Grant:
        """Leases for many ``(payload_ids, holder)`` requests, all or none, plus the block
        references of every payload leased (a training step acquires in one call)."""
        self._table.expire()
        granted: list[str] = []
        try:
            for payload_ids, holder in requests:
                granted.append(self._table.acquire(payload_ids, holder, run=run))
        except BaseException:
            for lease_id in granted:
                self._table.revoke(lease_id)
            raise
        blocks: dict[str, list[Any]] = {}
        if with_blocks:
            # The table's own lists: the grant is serialized on Ray, and a local reader
            # borrows its own copy (``Backend.borrow``), so nobody can change them.
            wanted = dict.fromkeys(pid for ids, _ in requests for pid in ids)
            blocks = self._table.refs(wanted, run=run)
        return Grant(lease_ids=tuple(granted), blocks=blocks)

    def release_many(self, lease_ids: Sequence[str]) -> list[str]:
        """End many leases (each idempotent); returns payloads dropped by them."""
        return [pid for lease_id in lease_ids for pid in self._table.release(lease_id)]

    def adopt_leased(
        self,
        refs: Sequence[Any],
        payloads: Sequence[StoredPayload],
        saved_bytes: int,
        samples: Sequence[Sequence[int]],
        holders: Sequence[str],
        *,
        with_blocks: bool = True,
    ) -> tuple[list[StoreRef], Grant]:
        """``adopt_many`` and a lease per sample (its payload indices in ``samples``,
        its holder in ``holders``), in one step: no TTL can drop a payload between the
        put and the lease, and a group's members are leased by the write's own call."""
        check_holders(samples, holders)
        stored = self.adopt_many(refs, payloads, saved_bytes)
        requests = [
            ([stored[i].payload_id for i in parts], holder)
            for parts, holder in zip(samples, holders, strict=True)
        ]
        return stored, self.lease_many(requests, self.run, with_blocks=with_blocks)

    def adopt_from_leased(
        self,
        producer: Any,
        token: str,
        payloads: Sequence[StoredPayload],
        saved_bytes: int,
        samples: Sequence[Sequence[int]],
        holders: Sequence[str],
        *,
        with_blocks: bool = True,
    ) -> tuple[list[StoreRef], Grant]:
        """``adopt_from_many`` and ``adopt_leased``'s leases, in one call: a producer's
        staged batch owned by this shard and leased to its samples' holders."""
        check_holders(samples, holders)  # before the producer hands its blocks over
        call = self._producer_call()
        refs = call(producer, token, sum(payload.blocks for payload in payloads))
        return self.adopt_leased(
            refs, payloads, saved_bytes, samples, holders, with_blocks=with_blocks
        )

    def discard(self, payload_ids: Sequence[str]) -> list[str]:
        """Drop payloads nobody leased yet (a write its caller never saw); returns them."""
        return self._table.discard(payload_ids)

    def revoke_holder(self, holder: str) -> list[str]:
        """End every lease of a dead holder; returns the lease ids ended."""
        return self._table.revoke_holder(holder)

    def revoke_leases(self, lease_ids: Sequence[str]) -> list[str]:
        """End leases of a dead holder (not a rollback); returns those that were live."""
        return self._table.revoke_leases(lease_ids)

    def revoke_many(self, lease_ids: Sequence[str]) -> list[str]:
        """Roll back many leases of a multi-shard grant that failed elsewhere."""
        return [pid for lease_id in lease_ids for pid in self._table.revoke(lease_id)]

    def acquire(self, payload_ids: Sequence[str], holder: str, run: str) -> str:
        """A lease of ``holder`` over payloads of this shard."""
        self._table.expire()
        return self._table.acquire(payload_ids, holder, run=run)

    def release(self, lease_id: str) -> list[str]:
        """End a lease (idempotent); returns payloads dropped by it."""
        return self._table.release(lease_id)

    def revoke(self, lease_id: str) -> list[str]:
        """Undo a lease granted in a multi-shard step that failed elsewhere."""
        return self._table.revoke(lease_id)

    def clone(self, lease_id: str, holder: str) -> str:
        """Another lease over the same payloads."""
        return self._table.clone(lease_id, holder)

    def clone_many(self, lease_ids: Sequence[str], holders: Sequence[str]) -> list[str]:
        """Another lease over the payloads of each lease, of its holder in ``holders``
        (one per lease), all or none (a group or a batch, or a buffer's many groups,
        taken over in one call)."""
        if isinstance(holders, str) or len(holders) != len(lease_ids):
            raise MisuseError(
                "a batched clone names one holder per lease",
                expected=f"a list of {len(lease_ids)} holders",
                found=repr(holders)[:80] if isinstance(holders, str) else len(holders),
            )
        cloned: list[str] = []
        try:
            for lease_id, holder in zip(lease_ids, holders, strict=True):
                cloned.append(self._table.clone(lease_id, holder))
        except BaseException:
            for lease_id in cloned:
                self._table.revoke(lease_id)
            raise
        return cloned

    def transfer_many(self, lease_ids: Sequence[str], holders: Sequence[str]) -> list[str]:
        """Move many leases, each to its holder in ``holders``, in one step: every new
        lease first (all or none), then the old ones end; the payloads never reach zero
        leases."""
        moved = self.clone_many(lease_ids, holders)
        for lease_id in lease_ids:
            self._table.release(lease_id)
        return moved

    def transfer(self, lease_id: str, holder: str) -> str:
        """Move a lease to another holder without the payloads ever reaching zero leases."""
        return self._table.transfer(lease_id, holder)

    def locate(self, wanted: Sequence[tuple[str, Sequence[int]]], run: str) -> list[list[Any]]:
        """Block references for ``(payload_id, block indices)`` requests, in request order."""
        self._table.expire()
        refs = self._table.refs((pid for pid, _ in wanted), run=run)
        for pid, blocks in wanted:
            if any(not 0 <= block < len(refs[pid]) for block in blocks):
                raise HandleError(
                    "block index outside the payload",
                    expected=f"blocks in [0, {len(refs[pid])})",
                    found=list(blocks),
                    where=f"payload {pid}",
                )
        return [[refs[pid][block] for block in blocks] for pid, blocks in wanted]

    def expire(self) -> list[str]:
        """Drop payloads nobody leased within the TTL."""
        return self._table.expire()

    def stats(self) -> TableStats:
        """Snapshot of this shard's table and of the calls it served."""
        self._table.expire()
        served = self.meter.snapshot()
        return dataclasses.replace(
            self._table.stats(),
            calls_by_op=served.by_op,
            calls=served.calls,
            call_cpu_ms=served.cpu_ms,
        )

    def leaks(self) -> list[LeakRecord]:
        """Leases still held on this shard."""
        return self._table.leaks()
