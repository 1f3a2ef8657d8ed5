"""The terms ``SampleRouting`` and its continuation share: where a sample's rows came
from (``Origin``), which versions its staleness counts (``StalenessBasis``), the holder
names of its leases, and what each lifecycle step needs from a store or a trace
session (the protocols: ``RouteStore``, ``TraceStore`` and ``TraceStoreClient`` are
their faces).

Example:
    >>> sample_holder("a"), prefix_holder("a")
    ('rollout/a', 'rollout/a/prefix')
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy.typing as npt

from routeplay.core.handle import Handle
from routeplay.rollout.steps import Call
from routeplay.store.client.lease import Lease

if TYPE_CHECKING:
    from routeplay.core.routes import Routes
    from routeplay.rollout.trace_store import Exported

__all__ = [
    "AsyncLeaseSource",
    "AsyncPrefixSource",
    "AsyncSessionSink",
    "LeaseSource",
    "Origin",
    "PrefixSource",
    "RoutesPutter",
    "RowReader",
    "SessionSink",
    "StalenessBasis",
    "acquiring",
    "prefix_holder",
    "sample_holder",
]


class Origin(Enum):
    """Who produced the routing rows a sample points at (informational)."""

    NONE = "none"
    PRODUCED = "produced"
    BORROWED = "borrowed"
    RESTORED = "restored"


class StalenessBasis(Enum):
    """Which weight versions a sample's staleness counts."""

    EVERY_ROW = "every_row"
    """The response tokens' and every routing row's, prompt rows borrowed from a trace
    session included (routeplay's default: replayed rows must match the policy)."""
    RESPONSE_TOKENS = "response_tokens"
    """The response tokens' only (XTuner's rule): borrowed prompt rows never age a
    sample."""


def sample_holder(sample_id: str) -> str:
    """The holder name of a sample's own lease (``rollout/<id>``)."""
    return f"rollout/{sample_id}"


def prefix_holder(sample_id: str) -> str:
    """The holder name of the lease a sample borrows a session prefix under."""
    return f"rollout/{sample_id}/prefix"


class LeaseSource(Protocol):
    """What ``finish`` and ``claim`` need from a store: ``RouteStore.acquire``."""

    def acquire(self, handle: Handle, holder: str, *, pin: bool = ...) -> Lease: ...


class AsyncLeaseSource(Protocol):
    """What ``afinish`` and ``aclaim`` need: ``RouteStore.aacquire``."""

    async def aacquire(self, handle: Handle, holder: str, *, pin: bool = ...) -> Lease: ...


class PrefixSource(Protocol):
    """What ``borrow_prefix`` needs: ``TraceStore.export`` (or ``TraceStoreClient``'s)."""

    def export(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None: ...


class AsyncPrefixSource(Protocol):
    """What ``aborrow_prefix`` needs: ``TraceStoreClient.aexport`` (the in-process
    ``TraceStore`` has no awaitable face: it makes no call worth awaiting but the
    store's, and a process with an event loop reaches its traces through the actor)."""

    async def aexport(
        self, session: str, token_ids: Iterable[int], holder: str
    ) -> Exported | None: ...


class SessionSink(Protocol):
    """What ``store_turn`` needs: ``TraceStore.insert`` (or ``TraceStoreClient``'s)."""

    def insert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None: ...


class AsyncSessionSink(Protocol):
    """What ``astore_turn`` needs: ``TraceStoreClient.ainsert`` (see
    ``AsyncPrefixSource`` for the in-process ``TraceStore``)."""

    async def ainsert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None: ...


def acquiring(store: LeaseSource | AsyncLeaseSource, handle: Handle, holder: str) -> Call[Lease]:
    """``store.acquire`` / ``store.aacquire`` as a step's call (each face calls only its
    own half: a blocking step's store needs no awaitable method). Unpinned: a sample's
    lease keeps its rows alive for the trainer, nobody reads through it here, so no
    block references cross to this process (a rollout worker's thousands of samples)."""
    blocking, awaited = cast("LeaseSource", store), cast("AsyncLeaseSource", store)
    return Call(
        lambda: blocking.acquire(handle, holder, pin=False),
        lambda: awaited.aacquire(handle, holder, pin=False),
    )


class RowReader(Protocol):
    """What ``record`` needs: ``RouteStore.read_many``."""

    def read_many(self, requests: Sequence[tuple[Handle, int, int]]) -> list[npt.NDArray[Any]]: ...


class RoutesPutter(LeaseSource, Protocol):
    """What ``RoutingRecord.restore`` needs: ``RouteStore.put`` and ``acquire``."""

    def put(self, routes: Routes, *, weight_version: int = 0) -> Handle: ...
