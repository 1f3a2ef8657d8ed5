"""``RoutingContinuation``: one request of one sample, between
``SampleRouting.continuation()`` and ``finish`` (the history the request continues, the
session prefix it borrowed, the order in which the leases change hands).

Example:
    >>> with sample.routing.continuation(traces, prompt_ids) as cont:  # doctest: +SKIP
    ...     handle = cont.ingest(adapter, body, spec=spec, writer=store,
    ...                          weight_version=3, start_row=cont.rows)
    ...     sample.routing = cont.finish(store, handle)
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.rollout.adapters import stitch_step
from routeplay.rollout.releasing import attach_notes
from routeplay.rollout.routing_terms import (
    AsyncLeaseSource,
    LeaseSource,
    Origin,
    acquiring,
    sample_holder,
)
from routeplay.rollout.steps import Step, arun_step, releasing, run_step
from routeplay.store.client.lease import Lease

if TYPE_CHECKING:
    from routeplay.core.spec import RouteSpec
    from routeplay.rollout.adapters import AsyncRoutesWriter, EngineAdapter, RoutesWriter

__all__ = ["ContinuedRouting", "RoutingContinuation"]

_R = TypeVar("_R", bound="ContinuedRouting")


class ContinuedRouting(Protocol):
    """What a continuation needs of the routing it continues (``SampleRouting`` is one).
    Typed by these members, not by ``SampleRouting``, so this module does not import the
    holder that makes continuations (no import circle)."""

    @property
    def sample_id(self) -> str:
        """The sample's id (its lease holder is ``rollout/<id>``)."""
        ...

    @property
    def handle(self) -> Handle | None:
        """The sample's own routing, if any (a resume's history)."""
        ...

    @property
    def origin(self) -> Origin:
        """Who produced the routing rows."""
        ...

    def finish_step(
        self: _R, lease: Lease, handle: Handle, borrowed: Lease | None, origin: Origin
    ) -> Step[_R]:
        """The finish once ``lease`` (the new one) exists: end the own lease, then
        ``borrowed``, and hold ``handle`` under ``lease``."""
        ...


class RoutingContinuation(Generic[_R]):
    """One request of one sample: the history it continues and the lease it borrowed.

    Made by ``SampleRouting.continuation()``. ``ingest`` stores the answer's new rows,
    ``finish`` swaps the leases in the safe order and returns the next ``SampleRouting``;
    leaving the ``with`` block without ``finish`` ends the borrowed lease (only that one).
    """

    __slots__ = ("_done", "borrowed", "history", "prompt_ids", "routing")

    def __init__(
        self,
        routing: _R,
        *,
        history: Handle | None,
        borrowed: Lease | None,
        prompt_ids: Iterable[int] = (),
    ) -> None:
        self.routing = routing
        """The input (its own lease, if any, ends in ``finish``)."""
        self.history = history
        """Rows the request continues (None: none)."""
        self.borrowed = borrowed
        """The sample's lease on a borrowed session prefix, ended by ``finish``."""
        self.prompt_ids = tuple(prompt_ids)
        """The request's prompt, as given to ``continuation`` (a group ingest shares
        the rows of one prompt common to its fresh members; empty: none given)."""
        self._done = False

    @property
    def rows(self) -> int:
        """History rows the answer must not store again (the request's start row)."""
        return self.history.rows if self.history is not None else 0

    @property
    def origin(self) -> Origin:
        """A resume keeps its origin, a session turn is ``BORROWED``, a fresh sample
        ``PRODUCED``."""
        if self.routing.handle is not None:
            return self.routing.origin
        return Origin.BORROWED if self.borrowed is not None else Origin.PRODUCED

    def ingest(
        self,
        adapter: EngineAdapter,
        response: Any,
        *,
        spec: RouteSpec,
        writer: RoutesWriter,
        weight_version: int,
        start_row: int = 0,
        where: str = "",
    ) -> Handle:
        """The sample's routing after ``response``: the history rows, then only the rows
        they lack, adopted (an engine-store key) or put (inline routing) under
        ``weight_version``. The handle holds no lease yet: ``finish`` takes one.

        Example:
            >>> handle = cont.ingest(adapter, body, spec=spec, writer=store,  # doctest: +SKIP
            ...                      weight_version=3, start_row=cont.rows)
        """
        return run_step(
            self._ingest(adapter, response, spec, writer, weight_version, start_row, where)
        )

    async def aingest(
        self,
        adapter: EngineAdapter,
        response: Any,
        *,
        spec: RouteSpec,
        writer: AsyncRoutesWriter,
        weight_version: int,
        start_row: int = 0,
        where: str = "",
    ) -> Handle:
        """Awaitable ``ingest`` (``writer.aadopt_key`` / ``aput``: ``RouteStore``'s).

        Example:
            >>> handle = await cont.aingest(adapter, body, spec=spec,  # doctest: +SKIP
            ...     writer=store, weight_version=3, start_row=cont.rows)
        """
        step = self._ingest(adapter, response, spec, writer, weight_version, start_row, where)
        return await arun_step(step)

    def _ingest(
        self,
        adapter: EngineAdapter,
        response: Any,
        spec: RouteSpec,
        writer: RoutesWriter | AsyncRoutesWriter,
        weight_version: int,
        start_row: int,
        where: str,
    ) -> Step[Handle]:
        self.check_open("ingest an answer")
        # A refusal names the sample and the engine wire it came over.
        where = where or f"sample {self.routing.sample_id} ({adapter.name} answer)"
        routing = adapter.read(response, spec=spec, where=where, start_row=start_row)
        return (yield from stitch_step(routing, spec, writer, weight_version, self.history))

    def finish(self, store: LeaseSource, handle: Handle) -> _R:
        """Lease ``handle`` for the sample (``rollout/<id>``), *then* end the own lease it
        replaces, *then* the borrowed one; returns the routing holding the new lease.

        If the new lease cannot be taken, the borrowed lease ends and the input's own
        lease is left to the caller; a replaced lease whose release fails rides along in
        the result's ``unreleased``.

        Example:
            >>> routing = cont.finish(store, handle)  # doctest: +SKIP
            >>> routing.lease.holder
            'rollout/a'
        """
        return run_step(self._finish(store, handle))

    async def afinish(self, store: AsyncLeaseSource, handle: Handle) -> _R:
        """Awaitable ``finish``.

        Example:
            >>> routing = await cont.afinish(store, handle)  # doctest: +SKIP
        """
        return await arun_step(self._finish(store, handle))

    def _finish(self, store: LeaseSource | AsyncLeaseSource, handle: Handle) -> Step[_R]:
        self.check_open("finish")
        self._done = True
        try:
            lease: Lease = yield acquiring(store, handle, sample_holder(self.routing.sample_id))
        except BaseException as exc:
            yield from self._end_borrowed(exc)
            raise
        return (yield from self.routing.finish_step(lease, handle, self.borrowed, self.origin))

    def finishing(self) -> tuple[_R, Lease | None, Origin]:
        """Close this continuation for a finish made elsewhere, many at once
        (``routeplay.rollout.routing_groups.finish_all``): its routing, the borrowed lease
        the finish must end, and the origin of the routing it finishes with.

        Example:
            >>> routing, borrowed, origin = cont.finishing()  # doctest: +SKIP
        """
        self.check_open("finish")
        self._done = True
        return self.routing, self.borrowed, self.origin

    def abandon(self) -> None:
        """End the borrowed lease without finishing (idempotent; the input's own lease
        stays with the caller).

        Example:
            >>> cont.abandon()  # doctest: +SKIP
        """
        run_step(self._abandon())

    async def aabandon(self) -> None:
        """Awaitable ``abandon``.

        Example:
            >>> await cont.aabandon()  # doctest: +SKIP
        """
        await arun_step(self._abandon())

    def _abandon(self) -> Step[None]:
        if self._done:
            return
        self._done = True
        if self.borrowed is not None:
            yield releasing(self.borrowed)

    def __enter__(self) -> RoutingContinuation[_R]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run_step(self._exit(exc))

    async def __aenter__(self) -> RoutingContinuation[_R]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await arun_step(self._exit(exc))

    def _exit(self, exc: BaseException | None) -> Step[None]:
        if exc is None:
            yield from self._abandon()
        elif not self._done:
            self._done = True
            yield from self._end_borrowed(exc)

    def check_open(self, action: str) -> None:
        """Refuse ``action`` once finished or abandoned (``MisuseError``)."""
        if self._done:
            raise MisuseError(
                f"cannot {action}: this continuation is finished or abandoned",
                where=f"sample {self.routing.sample_id}",
                hint="Make a new continuation() for the next request of the sample.",
            )

    def _end_borrowed(self, cause: BaseException) -> Step[None]:
        """Release the borrowed lease while ``cause`` propagates (a failed release is
        named in a note on ``cause``, never raised over it)."""
        if self.borrowed is None:
            return
        try:
            yield releasing(self.borrowed)
        except Exception as failure:
            attach_notes(cause, [failure], f"releasing {self.borrowed.holder}")
