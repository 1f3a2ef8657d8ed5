"""``Lease``: one holder's claim on the stored payloads of a handle.

Releasing is idempotent and only ever ends *this* lease: other holders of the same
payloads (a trace session, a sibling sample, a training batch) are untouched, which is
what makes "owned vs borrowed" guesswork unnecessary. A lease is a context manager, so
an exception inside ``with`` still releases it. Copies of a lease (pickled into another
process) name the same lease ids, and releasing any copy twice is still a no-op.

A lease granted in this process pins its payloads' block references in its client (so
its rows read without a shard call); releasing it unpins them at once. ``release`` waits
for the shard (a holder's lifecycle must know the outcome); ``release_all`` sends many
releases without waiting (the reader's path: its errors surface at the next call).
Pins are only a shortcut, never needed for correctness, so they go early whenever their
lifetime could be in doubt: when the lease is pickled (its copy elsewhere may be the one
released) and when the lease object is garbage collected. A pickled copy carries no
references: it locates what it reads. So no reference handed out with a lease keeps an
object alive past its release.

Every waited step has an awaitable twin (``arelease``, ``aclone``, ``atransfer``,
``async with lease``), over the client's awaitable lease calls (no thread, no
``ray.get``). Cancelled in flight: ``arelease``'s release still lands (the lease stays
unmarked, so releasing again is safe); ``aclone``'s and ``atransfer``'s new lease is
revoked when it lands, and the lease they started from is untouched.

A lease talks to the client that granted it only through ``LeaseOwner``, the client's
public lease methods (``RouteStore`` implements it): never through its internals.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

import numpy.typing as npt

from routeplay.core.handle import Handle
from routeplay.errors import AlreadyReleased, MisuseError

__all__ = ["Holders", "Lease", "LeaseOwner", "holders_of"]

Holders = str | Sequence[str]
"""The holder of every lease of a batched step, or one holder per lease, in order (a
buffer taking many groups over at once: ``buffer/<group>`` for each group's members)."""


def holders_of(holder: Holders, count: int) -> list[str]:
    """One holder per lease of a batched step of ``count`` leases.

    Example:
        >>> holders_of("buffer/g-1", 2), holders_of(["a", "b"], 2)
        (['buffer/g-1', 'buffer/g-1'], ['a', 'b'])
    """
    if isinstance(holder, str):
        return [holder] * count
    holders = list(holder)
    if len(holders) != count or not all(isinstance(h, str) for h in holders):
        raise MisuseError(
            "a batched lease step names one holder, or one per lease",
            expected=f"a str, or {count} str",
            found=f"{len(holders)} holders",
        )
    return holders


class LeaseOwner(Protocol):
    """What a lease needs from the client that granted it (``RouteStore`` is one).

    ``parts`` are a lease's ids per store shard; ``payload_ids`` name the payloads whose
    block references the client pinned for the lease in this process.
    """

    @property
    def identity(self) -> Hashable:
        """The same for every client of one store (leases of several move together)."""
        ...

    def read(
        self, handle: Handle, start: int = 0, stop: int | None = None, *, holder: str = ""
    ) -> npt.NDArray[Any]:
        """Rows ``[start, stop)`` of a handle, copied out."""
        ...

    def release_lease(self, parts: Mapping[int, str]) -> None:
        """End one lease, waited for (raises if a shard failed: a retry may succeed)."""
        ...

    def release_many(self, leases: Sequence[Lease]) -> None:
        """End many leases with one call per shard, not waited for."""
        ...

    def clone_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """A new lease over the same payloads for ``holder``; returns its parts."""
        ...

    def transfer_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Move a lease to ``holder`` (the payloads never reach zero leases)."""
        ...

    def clone_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """A new lease of ``holder`` (or each its own) for each lease, one call per
        shard, all or none."""
        ...

    def release_leases(self, leases: Sequence[Mapping[int, str]]) -> list[BaseException | None]:
        """End many leases, one call per shard, waited for: per lease None or the error."""
        ...

    def transfer_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """Move leases of one shard to ``holder`` (or each to its own) in one call (all
        or none)."""
        ...

    async def atransfer_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """Awaitable ``transfer_leases``."""
        ...

    async def aclone_leases(
        self, leases: Sequence[Mapping[int, str]], holder: Holders
    ) -> list[dict[int, str]]:
        """Awaitable ``clone_leases``."""
        ...

    async def arelease_leases(
        self, leases: Sequence[Mapping[int, str]]
    ) -> list[BaseException | None]:
        """Awaitable ``release_leases``."""
        ...

    async def arelease_lease(self, parts: Mapping[int, str]) -> None:
        """Awaitable ``release_lease``."""
        ...

    async def aclone_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Awaitable ``clone_lease``."""
        ...

    async def atransfer_lease(self, parts: Mapping[int, str], holder: str) -> dict[int, str]:
        """Awaitable ``transfer_lease``."""
        ...

    def repin_blocks(self, payload_ids: Sequence[str]) -> tuple[str, ...]:
        """One more local lease on pinned block references; returns those pinned."""
        ...

    def unpin_blocks(self, payload_ids: Sequence[str]) -> None:
        """One local lease less on pinned block references."""
        ...


class Lease:
    """A holder's lease over a handle's stored payloads (one lease id per store shard).

    Example:
        with store.acquire(handle, "buffer/s-1") as lease:         # released on exit
            rows = lease.read(0, 64)
        async with await store.aacquire(handle, "buffer/s-2"):     # awaited release
            ...
    """

    __slots__ = (
        "__weakref__",
        "_parts",
        "_pinned",
        "_released",
        "_store",
        "_unpin_once",
        "handle",
        "holder",
    )

    def __init__(
        self,
        store: LeaseOwner,
        handle: Handle,
        holder: str,
        parts: dict[int, str],
        *,
        pinned: tuple[str, ...] = (),
    ) -> None:
        self._store = store
        self.handle = handle
        self.holder = holder
        self._parts = parts
        self._pinned = pinned
        self._released = False
        # Runs once: on release, pickling, or when this object is collected unreleased.
        # Most leases pin nothing (a buffer's, a batch's): a finalizer each, thousands a
        # step, cost the driver more than the moves themselves.
        self._unpin_once: weakref.finalize[Any, Any] | _NoPins = (
            weakref.finalize(self, store.unpin_blocks, pinned) if pinned else _NO_PINS
        )

    def __reduce__(self) -> tuple[object, ...]:
        self._unpin()  # the copy may be the one that gets released: pin nothing here
        return (_restored, (self._store, self.handle, self.holder, self._parts, self._released))

    @property
    def released(self) -> bool:
        """True once this lease object was released or transferred away."""
        return self._released

    @property
    def pinned(self) -> tuple[str, ...]:
        """Payloads whose block references this lease pinned in this process."""
        return self._pinned

    @property
    def lease_ids(self) -> tuple[str, ...]:
        """The per-shard lease ids (for accounting and logs)."""
        return tuple(self._parts.values())

    @property
    def parts(self) -> dict[int, str]:
        """Lease id per store shard (a copy: what a batched release sends)."""
        return dict(self._parts)

    def mark_released(self) -> None:
        """Record that this lease's release was sent (``RouteStore.release_many`` does
        it for many leases at once); drops the block references it pinned here."""
        if not self._released:
            self._released = True
            self._unpin()

    def read(self, start: int = 0, stop: int | None = None) -> npt.NDArray[Any]:
        """Rows ``[start, stop)`` of the leased handle, copied out (errors name this holder)."""
        self._check_live("read through")
        return self._store.read(self.handle, start, stop, holder=self.holder)

    def release(self) -> None:
        """End this lease (idempotent). Payloads whose last lease this was are dropped."""
        if self._released:
            return
        self._store.release_lease(self._parts)  # may raise: then a retry releases for real
        self.mark_released()

    async def arelease(self) -> None:
        """Awaitable ``release``.

        Example:
            await lease.arelease()
        """
        if self._released:
            return
        await self._store.arelease_lease(self._parts)
        self.mark_released()

    @staticmethod
    def release_all(leases: Iterable[Lease]) -> None:
        """Release many leases with one call per shard of each store (idempotent), not
        waited for; a failure at a shard is raised by that store's next call, never lost.

        Example:
            Lease.release_all(finished.values())
        """
        by_store: dict[int, tuple[LeaseOwner, list[Lease]]] = {}
        for lease in leases:
            by_store.setdefault(id(lease._store), (lease._store, []))[1].append(lease)
        for store, group in by_store.values():
            store.release_many(group)

    @staticmethod
    def clone_all(leases: Sequence[Lease], holder: Holders) -> list[Lease]:
        """A new lease of ``holder`` (or of each lease's own, one per lease) for each
        lease (one call per shard of each store, all or none: a failure leaves no clone
        behind); these stay valid.

        Example:
            mine = Lease.clone_all(group_leases, "buffer/g-7")
        """
        holders = holders_of(holder, len(leases))
        out: list[Lease | None] = [None] * len(leases)
        try:
            for store, group in _by_store(leases, "clone"):
                mine = [holders[at] for at, _ in group]
                parts = store.clone_leases([lease._parts for _, lease in group], mine)
                for (at, lease), cloned in zip(group, parts, strict=True):
                    out[at] = lease._cloned(holders[at], cloned)
        except BaseException:  # another store's clones exist already: end them (all or none)
            Lease.release_each([lease for lease in out if lease is not None])
            raise
        return [lease for lease in out if lease is not None]

    @staticmethod
    async def aclone_all(leases: Sequence[Lease], holder: Holders) -> list[Lease]:
        """Awaitable ``clone_all``.

        Example:
            mine = await Lease.aclone_all(group_leases, "buffer/g-7")
        """
        holders = holders_of(holder, len(leases))
        out: list[Lease | None] = [None] * len(leases)
        try:
            for store, group in _by_store(leases, "clone"):
                mine = [holders[at] for at, _ in group]
                parts = await store.aclone_leases([lease._parts for _, lease in group], mine)
                for (at, lease), cloned in zip(group, parts, strict=True):
                    out[at] = lease._cloned(holders[at], cloned)
        except BaseException:  # another store's clones exist already: end them (all or none)
            await Lease.arelease_each([lease for lease in out if lease is not None])
            raise
        return [lease for lease in out if lease is not None]

    @staticmethod
    def one_shard(leases: Sequence[Lease]) -> bool:
        """Whether the leases all live on one and the same shard of one store (what
        ``transfer_all`` moves in one call).

        Example:
            fast = Lease.one_shard(group_leases)
        """
        stores = {store.identity for store in {id(x._store): x._store for x in leases}.values()}
        shards = {shard for lease in leases for shard in lease._parts}
        return len(stores) == 1 and len(shards) == 1 and all(len(x._parts) == 1 for x in leases)

    @staticmethod
    def transfer_all(leases: Sequence[Lease], holder: Holders) -> list[Lease]:
        """Move leases of one shard (``one_shard``) to ``holder`` (or each to its own,
        one per lease) in one call, all or none; these are then released (moved away).

        Example:
            taken = Lease.transfer_all(group_leases, "buffer/g-7")
        """
        holders = holders_of(holder, len(leases))
        [(store, group)] = _by_store(leases, "transfer")
        moved = store.transfer_leases([lease._parts for _, lease in group], holders)
        return [
            lease._moved(holders[at], parts)
            for (at, lease), parts in zip(group, moved, strict=True)
        ]

    @staticmethod
    async def atransfer_all(leases: Sequence[Lease], holder: Holders) -> list[Lease]:
        """Awaitable ``transfer_all``.

        Example:
            taken = await Lease.atransfer_all(group_leases, "buffer/g-7")
        """
        holders = holders_of(holder, len(leases))
        [(store, group)] = _by_store(leases, "transfer")
        moved = await store.atransfer_leases([lease._parts for _, lease in group], holders)
        return [
            lease._moved(holders[at], parts)
            for (at, lease), parts in zip(group, moved, strict=True)
        ]

    @staticmethod
    def release_each(leases: Sequence[Lease]) -> list[BaseException | None]:
        """Release many leases (one call per shard of each store), waited for: per lease
        None, or the error that left it live (it stays unmarked: releasing it again is a
        retry). Released leases are skipped.

        Example:
            failures = Lease.release_each(batch_leases)
        """
        out: list[BaseException | None] = [None] * len(leases)
        live = [lease for lease in leases if not lease._released]
        for store, group in _by_store(live, None):
            errors = store.release_leases([lease._parts for _, lease in group])
            _settled_releases(group, errors, out, leases)
        return out

    @staticmethod
    async def arelease_each(leases: Sequence[Lease]) -> list[BaseException | None]:
        """Awaitable ``release_each``.

        Example:
            failures = await Lease.arelease_each(batch_leases)
        """
        out: list[BaseException | None] = [None] * len(leases)
        live = [lease for lease in leases if not lease._released]
        for store, group in _by_store(live, None):
            errors = await store.arelease_leases([lease._parts for _, lease in group])
            _settled_releases(group, errors, out, leases)
        return out

    def clone(self, holder: str) -> Lease:
        """A new lease over the same payloads for ``holder``; this one stays valid."""
        self._check_live("clone")
        return self._cloned(holder, self._store.clone_lease(self._parts, holder))

    async def aclone(self, holder: str) -> Lease:
        """Awaitable ``clone``.

        Example:
            mine = await lease.aclone("rollout/a")
        """
        self._check_live("clone")
        return self._cloned(holder, await self._store.aclone_lease(self._parts, holder))

    def transfer(self, holder: str) -> Lease:
        """Hand this lease to ``holder`` (no data moves; payloads never reach zero leases)."""
        self._check_live("transfer")
        return self._moved(holder, self._store.transfer_lease(self._parts, holder))

    async def atransfer(self, holder: str) -> Lease:
        """Awaitable ``transfer``.

        Example:
            taken = await lease.atransfer("buffer/g-2")
        """
        self._check_live("transfer")
        return self._moved(holder, await self._store.atransfer_lease(self._parts, holder))

    def _cloned(self, holder: str, parts: dict[int, str]) -> Lease:
        pinned = self._store.repin_blocks(self._pinned)
        return Lease(self._store, self.handle, holder, parts, pinned=pinned)

    def _moved(self, holder: str, moved: dict[int, str]) -> Lease:
        pinned, self._pinned = self._pinned, ()  # the pins move with the lease
        self._unpin_once.detach()
        self._released = True
        return Lease(self._store, self.handle, holder, moved, pinned=pinned)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.arelease()

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"Lease(holder={self.holder!r}, rows={self.handle.rows}, {state})"

    def _unpin(self) -> None:
        self._pinned = ()
        self._unpin_once()

    def _check_live(self, action: str) -> None:
        if self._released:
            raise AlreadyReleased(
                f"cannot {action} a released lease",
                where=f"holder {self.holder}",
                hint="Clone or transfer before releasing.",
            )


class _NoPins:
    """The finalizer of a lease that pinned nothing: nothing to run, nothing to detach."""

    __slots__ = ()

    def __call__(self) -> None:
        return None

    def detach(self) -> None:
        return None


_NO_PINS = _NoPins()


def _by_store(
    leases: Sequence[Lease], action: str | None
) -> list[tuple[LeaseOwner, list[tuple[int, Lease]]]]:
    """Leases grouped by the client that granted them, with their positions; ``action``
    (e.g. "clone") refuses a released one first."""
    by_store: dict[Hashable, tuple[LeaseOwner, list[tuple[int, Lease]]]] = {}
    identities: dict[int, Hashable] = {}  # a store's identity, asked once per client object
    for at, lease in enumerate(leases):
        if action is not None:
            lease._check_live(action)
        store = lease._store
        identity = identities.get(id(store))
        if identity is None:
            identity = identities[id(store)] = store.identity
        by_store.setdefault(identity, (store, []))[1].append((at, lease))
    return list(by_store.values())


def _settled_releases(
    group: Sequence[tuple[int, Lease]],
    errors: Sequence[BaseException | None],
    out: list[BaseException | None],
    leases: Sequence[Lease],
) -> None:
    """Mark the released leases of ``group`` (positions into the live list); put each
    failure at its lease's position in ``leases``."""
    position = {id(lease): at for at, lease in enumerate(leases)}
    for (_, lease), error in zip(group, errors, strict=True):
        if error is None:
            lease.mark_released()
        else:
            out[position[id(lease)]] = error


def _restored(
    store: LeaseOwner, handle: Handle, holder: str, parts: dict[int, str], released: bool
) -> Lease:
    lease = Lease(store, handle, holder, parts)
    lease._released = released
    return lease
