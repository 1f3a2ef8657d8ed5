"""Leases of the route-store client (``Leases``, a part of ``RouteStore``):
``acquire_many`` asks every shard a step touches once and pins the block references the
grants carry; ``release_many`` sends and does not wait (``routeplay.store.client.releases``);
what a ``Lease`` calls (release, clone, transfer) is here too. A grant is all or nothing:
a shard that fails rolls the others back (``_grant_all``).

Built over the client's ``StoreCore`` and handed the client itself as the ``LeaseOwner``
of the ``Lease`` objects it grants (a lease calls back into, and pickles with, the client).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.store.client.coalesce import Coalescer
from routeplay.store.client.core import StoreCore
from routeplay.store.client.lease import Holders, Lease, LeaseOwner, holders_of
from routeplay.store.client.lease_ids import granted_ids, lease_shard, parts_by_shard
from routeplay.store.flow import Flow
from routeplay.store.shard.api import ShardApi, ShardCall, shard_call
from routeplay.store.shard.shard import shard_of

__all__ = ["Leases"]

R = TypeVar("R")


class Leases:
    """Acquire, release, clone and transfer leases (a part of ``RouteStore``).

    Example:
        leases = Leases(core, owner=store)   # the Lease objects call back into ``store``
        [lease] = store.acquire_many([(handle, "train/step-0")])
        store.release_many([lease])
    """

    def __init__(self, core: StoreCore, owner: LeaseOwner) -> None:
        self._core = core
        self._owner = owner

    def acquire(self, handle: Handle, holder: str, *, pin: bool = True) -> Lease:
        """A lease of ``holder`` over every stored payload of ``handle`` (``pin``: see
        ``acquire_many``).

        Example:
            with store.acquire(handle, "buffer/s-1") as lease: ...
        """
        return self.acquire_many([(handle, holder)], pin=pin)[0]

    async def aacquire(self, handle: Handle, holder: str, *, pin: bool = True) -> Lease:
        """Awaitable ``acquire``.

        Example:
            async with await store.aacquire(handle, "buffer/s-1") as lease: ...
        """
        return (await self.aacquire_many([(handle, holder)], pin=pin))[0]

    def acquire_many(self, items: Sequence[tuple[Handle, str]], *, pin: bool = True) -> list[Lease]:
        """Leases for many ``(handle, holder)`` pairs (a training step): one call per
        shard, all or nothing. With ``pin`` (the default) each grant carries the block
        references of its payloads, pinned in this process while the lease lives, so
        reading leased rows here needs no further shard call. ``pin=False`` is for a
        holder that keeps rows alive without reading them (a rollout worker's sample
        leases): no references cross, nothing is pinned or handed back here, and a read
        asks the shard where the blocks are (one ``locate`` per shard).

        Example:
            leases = store.acquire_many([(h, "train/step-3") for h in handles])
            rows = store.read_many([(h, lo, hi) for h in handles])  # no shard call
            store.release_many(leases)
        """
        return self._core.drive(self.acquire_many_flow(items, pin=pin))

    async def aacquire_many(
        self, items: Sequence[tuple[Handle, str]], *, pin: bool = True
    ) -> list[Lease]:
        """Awaitable ``acquire_many``. Concurrent awaitable acquires of this process (one
        coroutine per sample finishing) go out together, one call per shard
        (``routeplay.store.client.coalesce``); cancelled in flight: the grants it asked for are
        released when they land.

        Example:
            leases = await store.aacquire_many([(h, "train/step-3") for h in handles])
        """
        return await self._acquires[pin].submit(items)

    @functools.cached_property
    def _acquires(self) -> dict[bool, Coalescer[tuple[Handle, str], Lease]]:
        """One coalescer per ``pin``: pinned and unpinned grants are different calls."""
        return {pin: Coalescer(run=functools.partial(self._acquire_now, pin=pin),
                               undo=self._revoke_granted) for pin in (True, False)}  # fmt: skip

    async def _acquire_now(self, items: Sequence[tuple[Handle, str]], pin: bool) -> list[Lease]:
        return await self._core.adrive(self.acquire_many_flow(items, pin=pin))

    def _revoke_granted(self, leases: Sequence[Lease]) -> None:
        """Undo grants nobody took (their waiter gave up): revoked, not released, so a
        payload they first leased goes back to its TTL as if never leased (sent, not
        waited for)."""
        self._end_parts([lease.parts for lease in leases])
        for lease in leases:
            lease.mark_released()

    def acquire_many_flow(
        self, items: Sequence[tuple[Handle, str]], *, pin: bool = True
    ) -> Flow[list[Lease]]:
        """The flow of ``acquire_many`` (the write path runs it for empty handles).

        Example:
            leases = yield from store.acquire_many_flow([(handle, "rollout/a")], pin=False)
        """
        wanted: dict[int, list[tuple[int, list[str]]]] = {}
        for index, (handle, _) in enumerate(items):
            per_shard: dict[int, list[str]] = {}
            for pid in self._core.payload_ids(handle):
                per_shard.setdefault(shard_of(pid), []).append(pid)
            for shard, pids in per_shard.items():
                wanted.setdefault(shard, []).append((index, pids))
        shards = sorted(wanted)
        calls = [
            shard_call(
                i,
                ShardApi.lease_many,
                [(pids, items[at][1]) for at, pids in wanted[i]],
                self._core.run,
                with_blocks=pin,
            )
            for i in shards
        ]
        holders = ", ".join(sorted({holder for _, holder in items})[:3])
        grants = yield from self._grant_all(calls, f"acquire for {holders}")
        parts: list[dict[int, str]] = [{} for _ in items]
        blocks: list[dict[str, list[Any]]] = [{} for _ in items]
        borrow = self._core.backend.borrow
        for shard, grant in zip(shards, grants, strict=True):
            granted = grant.blocks
            for (at, pids), lease_id in zip(wanted[shard], grant.lease_ids, strict=True):
                parts[at][shard] = lease_id
                pinned = blocks[at]
                for pid in pids if pin else ():
                    pinned[pid] = borrow(granted[pid])
        return [
            self.granted_lease(handle, holder, parts[at], blocks[at])
            for at, (handle, holder) in enumerate(items)
        ]

    def granted_lease(
        self, handle: Handle, holder: str, parts: dict[int, str], blocks: dict[str, list[Any]]
    ) -> Lease:
        """The ``Lease`` object of a grant (its id per shard, ``parts``), pinning the block
        references it carried (borrowed: ``Backend.borrow``) in this process."""
        return Lease(self._owner, handle, holder, parts, pinned=self._core.pins.pin(blocks))

    def pull(self, leases: Sequence[Lease]) -> None:
        """Start bringing every block the leases pinned in this process to this node, all
        at once, without waiting (``Backend.pull``): a trainer rank's share arrives as one
        bundle while it starts on its first micro-batch, instead of one pull per
        micro-batch. The blocks land in this node's object store (spillable), not in the
        process; ``Materializer.leasing`` calls it.

        Example:
            store.pull(leases)
        """
        held = self._core.pins.lookup_many([pid for lease in leases for pid in lease.pinned])
        self._core.backend.pull([ref for refs in held if refs for ref in refs])

    def release_many(self, leases: Sequence[Lease]) -> None:
        """End many leases with one call per shard, not waited for (idempotent per
        lease): the reader's path (a training step, a materializer's finished samples).
        A failure is raised by this client's next call or ``flush`` (``ReleaseFailed``).
        ``Lease.release`` waits instead, for holders that must know the outcome.

        Example:
            store.release_many(leases)
        """
        by_shard: dict[int, list[str]] = {}
        live = [lease for lease in leases if not lease.released]
        for lease in live:  # another run's lease is refused before anything is marked
            for lease_id in lease.parts.values():
                lease_shard(lease_id, self._core.run, self._core.backend.shard_count)
        for lease in live:
            for shard, lease_id in lease.parts.items():
                by_shard.setdefault(shard, []).append(lease_id)
        self._core.releases.submit(
            [shard_call(i, ShardApi.release_many, ids) for i, ids in by_shard.items()]
        )
        for lease in live:
            lease.mark_released()

    async def arelease_many(self, leases: Sequence[Lease]) -> None:
        """``release_many`` from a coroutine: it only sends (nothing to await), so it is
        the same call; ``aflush`` awaits the outcome.

        Example:
            await store.arelease_many(leases)
        """
        self.release_many(leases)

    def flush(self) -> None:
        """Wait for every release in flight; raise ``ReleaseFailed`` if one failed.

        Example:
            store.flush()
        """
        self._core.drive(self._core.releases.settle(wait=True))

    async def aflush(self) -> None:
        """Awaitable ``flush`` (cancelled: the releases stay in flight, still tracked).

        Example:
            await store.aflush()
        """
        await self._core.adrive(self._core.releases.settle(wait=True))

    # -- what a Lease calls (``routeplay.store.client.lease.LeaseOwner``) ----------------------
    def release_lease(self, parts: Mapping[int, str]) -> None:
        """End one lease's parts (its id per shard), waited for: a holder's lifecycle
        (buffer, session, sample state) must know whether its lease ended, to keep it
        or retry it if the shard failed. ``Lease.release`` calls it."""
        self._core.drive(self._release_lease(parts))

    async def arelease_lease(self, parts: Mapping[int, str]) -> None:
        """Awaitable ``release_lease`` (``Lease.arelease`` calls it). Concurrent awaitable
        releases of this process go out together, one call per shard; each waiter gets
        its own lease's outcome."""
        [error] = await self._lease_releases.submit([dict(parts)])
        if error is not None:
            raise error

    @functools.cached_property
    def _lease_releases(self) -> Coalescer[dict[int, str], BaseException | None]:
        return Coalescer(run=lambda parts: self._core.adrive(self._release_leases(parts)))

    def _release_lease(self, parts: Mapping[int, str]) -> Flow[None]:
        # Cancelled in flight: the release still lands (ending is idempotent), tracked.
        calls = [shard_call(i, ShardApi.release, lid) for i, lid in parts.items()]
        yield from self._core.send_and_wait(calls, "end a lease", ends=True)

    def clone_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """A new lease of ``holder`` over the same payloads, on every shard or none;
        returns its parts. ``Lease.clone`` calls it."""
        return self._core.drive(self._clone_lease(parts, holder))

    async def aclone_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Awaitable ``clone_lease`` (``Lease.aclone`` calls it). Concurrent awaitable
        clones of this process go out together (one call per shard and holder); cancelled
        in flight: the clone is released when it lands."""
        [cloned] = await self._clones.submit([(dict(parts), holder)])
        return cloned

    @functools.cached_property
    def _clones(self) -> Coalescer[tuple[dict[int, str], str], dict[int, str]]:
        return Coalescer(run=lambda items: self._core.adrive(self._clone_by_holder(items)),
                         undo=self._end_parts)  # fmt: skip

    def _clone_by_holder(
        self, items: Sequence[tuple[dict[int, str], str]]
    ) -> Flow[list[dict[int, str]]]:
        """Clones of many ``(parts, holder)``, one call per shard, in order."""
        leases = [parts for parts, _ in items]
        return (yield from self._clone_leases(leases, [holder for _, holder in items]))

    def _end_parts(self, leases: Sequence[Mapping[int, str]]) -> None:
        """Revoke leases nobody will hold (sent, not waited for; as a rescue's undo)."""
        by_shard = parts_by_shard(leases)
        self._core.releases.submit(
            [shard_call(i, ShardApi.revoke_many, [lid for _, lid in parts])
             for i, parts in by_shard.items()]
        )  # fmt: skip

    def _clone_lease(self, parts: Mapping[int, str], holder: str) -> Flow[dict[int, str]]:
        calls = [shard_call(i, ShardApi.clone, lid, holder) for i, lid in parts.items()]
        clones = yield from self._grant_all(calls, f"clone for {holder}")
        return dict(zip(parts, clones, strict=True))

    def transfer_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Clone on every shard (all or nothing), then end the old parts: the payloads
        never reach zero leases. The old parts' release is sent, not waited for (a
        failure is raised by the next call, as ``release_many``'s), so the new lease is
        always handed back. ``Lease.transfer`` calls it."""
        return self._core.drive(self._transfer_lease(parts, holder))

    async def atransfer_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Awaitable ``transfer_lease`` (``Lease.atransfer`` calls it)."""
        return await self._core.adrive(self._transfer_lease(parts, holder))

    def _transfer_lease(self, parts: Mapping[int, str], holder: str) -> Flow[dict[int, str]]:
        moved = yield from self._clone_lease(parts, holder)  # cancelled here: nothing moved
        self._core.releases.submit(
            [shard_call(i, ShardApi.release_many, [lid]) for i, lid in parts.items()]
        )
        return moved

    def clone_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """A new lease of ``holder`` (or of each lease's own holder in a list, one per
        lease) for each lease (its parts), one call per shard for all of them, all or
        none; returns the new parts in order. ``Lease.clone_all`` calls it (a group or a
        batch taken over at once)."""
        return self._core.drive(self._clone_leases(leases, holder))

    async def aclone_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """Awaitable ``clone_leases`` (``Lease.aclone_all``; cancelled: every clone is
        revoked as it lands)."""
        return await self._core.adrive(self._clone_leases(leases, holder))

    def _clone_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> Flow[list[dict[int, str]]]:
        holders = holders_of(holder, len(leases))
        by_shard = parts_by_shard(leases)
        shards = sorted(by_shard)
        calls = [
            shard_call(
                i,
                ShardApi.clone_many,
                [lid for _, lid in by_shard[i]],
                [holders[at] for at, _ in by_shard[i]],
            )
            for i in shards
        ]
        what = f"clone {len(leases)} leases for {_named(holders)}"
        granted = yield from self._grant_all(calls, what)
        parts: list[dict[int, str]] = [{} for _ in leases]
        for shard, clones in zip(shards, granted, strict=True):
            for (at, _), clone in zip(by_shard[shard], clones, strict=True):
                parts[at][shard] = clone
        return parts

    def transfer_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """Move leases that all live on one and the same shard to ``holder`` (or each to
        its own holder in a list, one per lease) in one call:
        every new lease first, all or none, then the old ones end (atomically, on that
        shard: nothing to retry); returns the new parts. ``Lease.transfer_all`` calls it.
        Leases on other or several shards are refused (``MisuseError``): move them with
        ``clone_leases`` then ``release_leases``."""
        return self._core.drive(self._transfer_leases(leases, holder))

    async def atransfer_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """Awaitable ``transfer_leases`` (cancelled: the moves land; the new leases are
        revoked as they land, the old ones have ended)."""
        return await self._core.adrive(self._transfer_leases(leases, holder))

    def _transfer_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> Flow[list[dict[int, str]]]:
        holders = holders_of(holder, len(leases))
        by_shard = parts_by_shard(leases)
        if len(by_shard) != 1 or any(len(parts) != 1 for parts in leases):
            raise MisuseError(
                "a batched transfer moves leases of one shard",
                expected="every lease on one and the same shard",
                found=f"leases over shards {sorted(by_shard)}",
                hint="Clone them (clone_leases), then end the old ones (release_leases).",
            )
        [(shard, parts)] = by_shard.items()
        call = shard_call(
            shard,
            ShardApi.transfer_many,
            [lid for _, lid in parts],
            [holders[at] for at, _ in parts],
        )
        what = f"move {len(leases)} leases to {_named(holders)}"
        [moved] = yield from self._grant_all([call], what)
        return [{shard: lease_id} for lease_id in moved]

    def release_leases(self, leases: Sequence[Mapping[int, str]]) -> list[BaseException | None]:
        """End many leases (their parts), one call per shard, waited for: per lease,
        None once every part ended, or the error of a shard that failed (the lease may
        still be held there: a retry may end it). ``Lease.release_each`` calls it, for
        holders that must know which releases failed (a buffer's, a batch's samples)."""
        return self._core.drive(self._release_leases(leases))

    async def arelease_leases(
        self, leases: Sequence[Mapping[int, str]]
    ) -> list[BaseException | None]:
        """Awaitable ``release_leases`` (cancelled: the releases still land, tracked)."""
        return await self._core.adrive(self._release_leases(leases))

    def _release_leases(
        self, leases: Sequence[Mapping[int, str]]
    ) -> Flow[list[BaseException | None]]:
        by_shard = parts_by_shard(leases)
        shards = sorted(by_shard)
        calls = [
            shard_call(i, ShardApi.release_many, [lid for _, lid in by_shard[i]]) for i in shards
        ]
        answers = yield from self._core.send_and_wait(
            calls, f"end {len(leases)} leases", each=True, ends=True
        )
        # A failed shard call says only that its shard failed: each of its leases is then
        # released on its own, so exactly the leases still live are reported (a healthy
        # step never takes this path; a dead shard fails each of them again).
        retry = [
            (at, shard, lease_id)
            for shard, answer in zip(shards, answers, strict=True)
            if isinstance(answer, BaseException)
            for at, lease_id in by_shard[shard]
        ]
        out: list[BaseException | None] = [None] * len(leases)
        if retry:
            singles = [shard_call(shard, ShardApi.release, lid) for _, shard, lid in retry]
            again = yield from self._core.send_and_wait(
                singles, "end leases one by one", each=True, ends=True
            )
            for (at, _, _), answer in zip(retry, again, strict=True):
                if isinstance(answer, BaseException):
                    out[at] = out[at] or answer
        return out

    def repin_blocks(self, payload_ids: Sequence[str]) -> tuple[str, ...]:
        """Count one more local lease on block references pinned here (a clone's);
        returns the payloads that were pinned."""
        return self._core.pins.repin(payload_ids)

    def unpin_blocks(self, payload_ids: Sequence[str]) -> None:
        """One local lease less on these payloads' pinned block references (a lease
        released, pickled or collected); the last one drops them."""
        self._core.pins.unpin(payload_ids)

    def _grant_all(self, calls: Sequence[ShardCall[R]], what: str) -> Flow[list[R]]:
        """Per-call grants, or none at all: a shard that fails rolls the others back,
        so a half-granted lease can never be left behind with nobody to release it (nor
        can a wait abandoned in flight: each grant is revoked when it lands)."""

        def revoke(index: int, granted: Any) -> list[ShardCall[list[str]]]:
            return [shard_call(calls[index].shard, ShardApi.revoke_many, granted_ids(granted))]

        results = yield from self._core.send_and_wait(calls, what, each=True, undo=revoke)
        granted: list[R] = []
        failures: list[BaseException] = []
        undo: list[ShardCall[list[str]]] = []
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                failures.append(result)
            else:
                granted.append(result)
                undo += revoke(index, result)
        if failures:
            yield from self._core.send_and_wait(undo, "roll back")
            raise failures[0]
        return granted


def _named(holders: Sequence[str]) -> str:
    """The holders of a batched call, for its error messages (the first three)."""
    names = sorted(set(holders))
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
