"""``Lease``: one holder's claim on the stored payloads of a handle.

Releasing is idempotent and only ever ends *this* lease: other holders of the same
payloads (a trace session, a sibling sample, a training batch) are untouched, which is
what makes "owned vs borrowed" guesswork unnecessary. A lease is a context manager, so
an exception inside ``with`` still releases it. Copies of a lease (pickled into another
process) name the same lease ids, and releasing any copy twice is still a no-op.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from routeplay.core.handle import Handle
from routeplay.errors import AlreadyReleased

if TYPE_CHECKING:
    from routeplay.store.client import RouteStore

__all__ = ["Lease"]


class Lease:
    """A holder's lease over a handle's stored payloads (one lease id per store shard)."""

    __slots__ = ("_parts", "_released", "_store", "handle", "holder")

    def __init__(
        self, store: RouteStore, handle: Handle, holder: str, parts: dict[int, str]
    ) -> None:
        self._store = store
        self.handle = handle
        self.holder = holder
        self._parts = parts
        self._released = False

    @property
    def released(self) -> bool:
        """True once this lease object was released or transferred away."""
        return self._released

    @property
    def lease_ids(self) -> tuple[str, ...]:
        """The per-shard lease ids (for accounting and logs)."""
        return tuple(self._parts.values())

    def read(self, start: int = 0, stop: int | None = None) -> npt.NDArray[Any]:
        """Rows ``[start, stop)`` of the leased handle, copied out (errors name this holder)."""
        self._check_live("read through")
        return self._store.read(self.handle, start, stop, holder=self.holder)

    def release(self) -> None:
        """End this lease (idempotent). Payloads whose last lease this was are dropped."""
        if self._released:
            return
        self._store._release_parts(self._parts)  # may raise: then a retry releases for real
        self._released = True

    def clone(self, holder: str) -> Lease:
        """A new lease over the same payloads for ``holder``; this one stays valid."""
        self._check_live("clone")
        return Lease(
            self._store, self.handle, holder, self._store._clone_parts(self._parts, holder)
        )

    def transfer(self, holder: str) -> Lease:
        """Hand this lease to ``holder`` (no data moves; payloads never reach zero leases)."""
        self._check_live("transfer")
        moved = self._store._transfer_parts(self._parts, holder)
        self._released = True
        return Lease(self._store, self.handle, holder, moved)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"Lease(holder={self.holder!r}, rows={self.handle.rows}, {state})"

    def _check_live(self, action: str) -> None:
        if self._released:
            raise AlreadyReleased(
                f"cannot {action} a released lease",
                where=f"holder {self.holder}",
                hint="Clone or transfer before releasing.",
            )
