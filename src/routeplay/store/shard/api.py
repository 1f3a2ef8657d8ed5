"""The store shard's operations, typed: the one place that names them.

``ShardApi`` lists every operation a client may call on a shard, with its argument and
result types. Both shards implement it, and mypy checks both against it: the plain
``StoreShard`` (what ``LocalBackend`` runs in process) and ``StoreShardShell`` (the Ray
actor; see ``routeplay.store.remote.actors``). A client builds a call from the operation
itself, never from a method name::

    calls = [shard_call(i, ShardApi.release_many, ids) for i, ids in by_shard.items()]
    dropped = backend.call(calls, "release")      # list[list[str]], checked by mypy

so mypy checks the arguments against the operation's signature and types the result,
and a backend dispatches on the name taken from the operation (``ShardCall.method``).
A test pins that no store module outside this one passes a method name as a string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, NamedTuple, ParamSpec, Protocol, TypeVar

from routeplay.core.handle import StoreRef
from routeplay.store.shard.lease_table import LeakRecord, TableStats
from routeplay.store.shard.shard import Grant, StoredPayload

__all__ = ["ShardApi", "ShardCall", "shard_call"]

P = ParamSpec("P")
R = TypeVar("R")


class ShardApi(Protocol):
    """Every operation of one store shard (payload records and leases of one run)."""

    def adopt(self, refs: list[Any], rows: int, nbytes: int, block_rows: int) -> StoreRef:
        """Keep references to one stored payload's blocks."""
        ...

    def adopt_many(
        self, refs: list[Any], payloads: list[StoredPayload], saved_bytes: int = 0
    ) -> list[StoreRef]:
        """Record a batch of payloads (``refs`` are their blocks, in order)."""
        ...

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
        """``adopt_many`` and a lease per sample (its holder in ``holders``), in one
        step."""
        ...

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
        """``adopt_from_many`` and a lease per sample, in one call."""
        ...

    def adopt_from(
        self, producer: Any, token: str, blocks: int, rows: int, nbytes: int, block_rows: int
    ) -> StoreRef:
        """Take a producer's staged blocks, so the shard owns them (one write)."""
        ...

    def adopt_from_many(
        self, producer: Any, token: str, payloads: list[StoredPayload], saved_bytes: int = 0
    ) -> list[StoreRef]:
        """``adopt_from`` for every staged block of a batch."""
        ...

    def lease_many(
        self, requests: list[tuple[list[str], str]], run: str, *, with_blocks: bool = True
    ) -> Grant:
        """Leases for many ``(payload_ids, holder)`` requests, all or none, with the
        block references of every payload leased (none without ``with_blocks``)."""
        ...

    def acquire(self, payload_ids: list[str], holder: str, run: str) -> str:
        """One lease of ``holder``; returns its id."""
        ...

    def release(self, lease_id: str) -> list[str]:
        """End a lease (idempotent); returns the payloads it dropped."""
        ...

    def release_many(self, lease_ids: list[str]) -> list[str]:
        """End many leases; returns the payloads they dropped."""
        ...

    def revoke(self, lease_id: str) -> list[str]:
        """Undo a lease of a multi-shard grant that failed elsewhere."""
        ...

    def revoke_many(self, lease_ids: list[str]) -> list[str]:
        """Undo many leases of a multi-shard grant that failed elsewhere."""
        ...

    def revoke_leases(self, lease_ids: list[str]) -> list[str]:
        """End leases of a dead holder; returns those that were live."""
        ...

    def discard(self, payload_ids: list[str]) -> list[str]:
        """Drop payloads nobody leased yet (a cancelled write's); returns them."""
        ...

    def revoke_holder(self, holder: str) -> list[str]:
        """End every lease of a dead holder; returns the lease ids ended."""
        ...

    def clone(self, lease_id: str, holder: str) -> str:
        """Another lease over the same payloads."""
        ...

    def clone_many(self, lease_ids: list[str], holders: list[str]) -> list[str]:
        """Another lease over each lease's payloads, of its holder (one per lease), all
        or none."""
        ...

    def transfer_many(self, lease_ids: list[str], holders: list[str]) -> list[str]:
        """Move many leases, each to its holder: new ones first (all or none), then the
        old end."""
        ...

    def transfer(self, lease_id: str, holder: str) -> str:
        """Move a lease to another holder (the payloads never reach zero leases)."""
        ...

    def locate(self, wanted: list[tuple[str, list[int]]], run: str) -> list[list[Any]]:
        """Block references for ``(payload_id, block indices)`` requests, in order."""
        ...

    def stats(self) -> TableStats:
        """Snapshot of the shard's table."""
        ...

    def leaks(self) -> list[LeakRecord]:
        """Leases still held on the shard."""
        ...


class ShardCall(NamedTuple, Generic[R]):
    """One operation on one shard, built by ``shard_call`` (its result type is ``R``)."""

    shard: int
    """Index of the shard that runs it."""
    method: str
    """Name of the ``ShardApi`` operation (taken from the operation, never spelled)."""
    args: tuple[Any, ...]
    """Positional arguments."""
    kwargs: dict[str, Any]
    """Keyword arguments."""

    def run_on(self, shard: ShardApi) -> R:
        """Run on a shard object in this process (``LocalBackend``)."""
        result: R = getattr(shard, self.method)(*self.args, **self.kwargs)
        return result

    def send_to(self, actor: Any) -> Any:
        """Send to a shard actor; returns Ray's reference to the result (``RayBackend``)."""
        return getattr(actor, self.method).remote(*self.args, **self.kwargs)


def shard_call(
    shard: int, op: Callable[Concatenate[ShardApi, P], R], *args: P.args, **kwargs: P.kwargs
) -> ShardCall[R]:
    """A call of ``op`` (a ``ShardApi`` operation) on shard ``shard``, its arguments
    checked by mypy against the operation's signature.

    Example:
        shard_call(0, ShardApi.lease_many, [(["0.ab"], "train/step-1")], "run-7")
    """
    return ShardCall(shard, op.__name__, args, kwargs)
