"""``SampleRouting``: one sample's routing and its leases, embeddable in any sample type.

A framework's own sample (XTuner's pydantic ``RolloutState`` with int ids, slime's
``Sample``, verl's ``DataProto`` row) keeps its tokens, rewards and statuses, and embeds
one ``SampleRouting`` as a field: the routing handle, the lease that keeps it alive,
the leases whose release failed, the weight versions, and the lifecycle steps as
methods. routeplay's own ``RolloutState`` embeds it the same way (``sample_routing``),
and the containers (``ReplayBuffer``, ``TrainingBatch``, ``SessionLedger``, the
checkpoint) take any ``RoutedSample``: a sample that exposes its ``SampleRouting``, can
return itself with a new one, and can drop its response for a retry (three members).
Its parts live next to it: one request between ``continuation()`` and ``finish`` in
``routeplay.rollout.routing_continuation``, the checkpoint's record
(``RoutingRecord.of(routing, store)``) in ``routeplay.rollout.checkpoint``, the terms
and store protocols both share in ``routeplay.rollout.routing_terms``.

**Immutable.** A ``SampleRouting`` is a frozen value: every step returns the next value
and never changes the one it was called on. A mutable sample stores the result
(``sample.routing = sample.routing.finish(store, handle)``). Chosen over in-place
mutation because lease ownership is about *who else can see the object*:

- a mutable routing object shared by two samples (a shallow ``model_copy``, a group
  built by copying a prompt) would move one sample's lease whenever the other is taken
  over; a value cannot be aliased that way;
- a failed step leaves its input value intact, naming every lease it named (a half
  applied mutation could lose one);
- a stale value (an older step's result, a pickled copy in another actor) names only
  ``Lease`` objects and lease ids its sample held at some point. Lease ids are minted
  per grant and never reused (a take-over is clone-then-release: a *new* id for the new
  holder), a ``Lease`` object remembers that it was released, and the store treats an
  ended id as a no-op. So releasing a stale value ends nothing (or its own old lease
  once), never the lease a later holder took: a stale copy cannot release someone
  else's lease, twice or at all.

The cost: a result the caller drops after ``finish`` (or ``take_over``) leaks one lease
until the store's lease TTL; ``RouteStore.leaks()`` names it by its holder.

Step order (each row is one method; the order inside a step is the rule)::

    step                      does, in this order                       on failure
    ------------------------  ----------------------------------------  -------------------------
    attach(h, lease, origin)  refuse a live lease; hold ``lease``       MisuseError, value unchanged
    borrow_prefix(traces, p)  export the session prefix under           (nothing borrowed)
                              ``rollout/<id>/prefix``
    continuation(traces, p)   own handle as history (partial rollout),  (nothing borrowed)
                              else borrow_prefix, else nothing
    cont.ingest(...)          store only the rows the history lacks     the borrowed lease ends
    cont.finish(store, h)     1 acquire ``rollout/<id>`` on h           1 fails: borrowed ends,
                              2 release the own (replaced) lease          own left to the caller
                              3 release the borrowed lease              2, 3 fail: in unreleased
    complete(p, r)            rows == p + r - 1, record p               RowCountMismatch
    claim(holder, store)      clone the live lease (or acquire h)       value unchanged
    hand_over(lease)          release the own lease, hold ``lease``     own rides in unreleased
    take_over(holder, store)  claim, then hand_over                     claim fails: unchanged
    store_turn(traces, ids)   session inserts (its own lease), then     own lease ends either way
                              the own lease ends
    expire_retryably()        release (own + unreleased), then reset    retry starts clean; the
                                                                        stuck leases in ``stuck``
    discard()                 release (own + unreleased)                stuck leases ride along
    release()/try_release()   own lease, then every unreleased          raise / ride along
    reset()                   refuse a live lease; forget the handle    MisuseError
    take_unreleased()         hand the stuck leases to the caller       -
    RoutingRecord.of(r, s)    read the rows by value (no refs)          -
    RoutingRecord.restore     put the rows, acquire ``rollout/<id>``    payload dropped

Awaitable twins: every step that makes a store call has one, the same name with an
``a`` in front, the same arguments and order (``aborrow_prefix``, ``acontinuation``,
``cont.aingest``, ``cont.afinish``, ``cont.aabandon`` and ``async with``, ``aclaim``,
``ahand_over``, ``atake_over``, ``astore_turn``, ``aexpire_retryably``, ``adiscard``,
``arelease``, ``atry_release``). Each step is written once, as a step generator
(``routeplay.rollout.steps``) that yields its store calls in the order above;
``run_step`` makes them blocking, ``arun_step`` awaits the store's awaitable calls
(``aacquire``, ``Lease.aclone``/``arelease``, ``aadopt_key``/``aput``,
``TraceStoreClient.aexport``/``ainsert``): no thread, no ``ray.get``. The awaitable
steps take the awaitable protocols (``AsyncLeaseSource``, ``AsyncPrefixSource``,
``AsyncSessionSink``, ``AsyncRoutesWriter``): ``RouteStore`` and ``TraceStoreClient``
are both faces; the in-process ``TraceStore`` is blocking only. ``complete``, ``reset``,
``take_unreleased`` and ``attach`` make no call and have no twin; ``RoutingRecord.of``
and ``RoutingRecord.restore`` are the checkpoint's (blocking).

Why the orders: a new lease exists before the lease it replaces ends, so rows shared
by the two (a resume's history, a session prefix) never reach zero leases on the way;
a reset forgets routing only after its lease ended, so it can neither leak nor free
routing; a lease whose release failed (a dead shard) is never dropped: it moves to
``unreleased`` and rides along until a release succeeds or ``take_unreleased`` hands it
to someone who can revoke it.

Staleness (``StalenessBasis``): ``EVERY_ROW`` (routeplay's default) counts the oldest
weight version of the response tokens *and* of every routing row, prompt rows borrowed
from a trace session included; ``RESPONSE_TOKENS`` (XTuner's rule) counts the response
tokens only: ``response_versions`` when the sample keeps them here, else the rows that
generated them (rows ``[prompt_tokens - 1, rows)``: row ``i`` is the forward pass that
produced token ``i + 1``), which needs ``complete()`` to have recorded the prompt length.
The two pick different samples to expire when a session turn reuses old prompt rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, cast

from routeplay.core.handle import Handle
from routeplay.core.records import fast_state, fields_reduced, replaced
from routeplay.errors import MisuseError, RowCountMismatch
from routeplay.rollout.releasing import attach_notes, first_error
from routeplay.rollout.routing_continuation import RoutingContinuation
from routeplay.rollout.routing_pickle import routing_reduced
from routeplay.rollout.routing_terms import (
    AsyncLeaseSource,
    AsyncPrefixSource,
    AsyncSessionSink,
    LeaseSource,
    Origin,
    PrefixSource,
    SessionSink,
    StalenessBasis,
    acquiring,
    prefix_holder,
    sample_holder,
)
from routeplay.rollout.steps import Call, Step, arun_step, cloning, releasing, run_step
from routeplay.store.client.lease import Lease

if TYPE_CHECKING:
    from routeplay.rollout.trace_store import Exported

__all__ = [
    "AsyncLeaseSource",
    "AsyncPrefixSource",
    "AsyncSessionSink",
    "Expiry",
    "LeaseSource",
    "Origin",
    "PrefixSource",
    "RoutedSample",
    "RoutingContinuation",
    "SampleRouting",
    "SessionSink",
    "StalenessBasis",
    "prefix_holder",
    "sample_holder",
]


def _exporting(
    traces: PrefixSource | AsyncPrefixSource, session: str, ids: list[int], holder: str
) -> Call[Exported | None]:
    blocking, awaited = cast("PrefixSource", traces), cast("AsyncPrefixSource", traces)
    return Call(
        lambda: blocking.export(session, ids, holder),
        lambda: awaited.aexport(session, ids, holder),
    )


def _inserting(
    traces: SessionSink | AsyncSessionSink, session: str, ids: list[int], handle: Handle
) -> Call[None]:
    blocking, awaited = cast("SessionSink", traces), cast("AsyncSessionSink", traces)
    return Call(
        lambda: blocking.insert(session, ids, handle),
        lambda: awaited.ainsert(session, ids, handle),
    )


def _release_each(leases: Sequence[Lease]) -> Step[list[tuple[Lease, Exception]]]:
    """Release every lease, whatever the earlier ones raised (``attempt_each`` as a
    step); the failures, in order."""
    failures: list[tuple[Lease, Exception]] = []
    for lease in leases:
        try:
            yield releasing(lease)
        except Exception as exc:  # keep going: the rest must still be released
            failures.append((lease, exc))
    return failures


_S = TypeVar("_S", bound="RoutedSample")


class RoutedSample(Protocol):
    """Any sample the containers can hold: it exposes its ``SampleRouting`` and returns
    itself (or a copy) carrying a new one; for a retry, with its response dropped too. A
    mutable sample sets its fields and returns ``self``; a frozen one returns a replaced
    copy. ``SampleRouting`` is one itself.

    Example:
        >>> class Sample(pydantic.BaseModel):  # doctest: +SKIP
        ...     model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        ...     id: int
        ...     routing: SampleRouting
        ...     @property
        ...     def sample_routing(self) -> SampleRouting:
        ...         return self.routing
        ...     def with_sample_routing(self, routing: SampleRouting) -> "Sample":
        ...         self.routing = routing
        ...         return self
        ...     def reset_for_retry(self, routing: SampleRouting) -> "Sample":
        ...         self.response_ids, self.status = [], Status.INIT
        ...         return self.with_sample_routing(routing)
    """

    @property
    def sample_routing(self) -> SampleRouting:
        """The sample's routing and leases."""
        ...

    def with_sample_routing(self: _S, routing: SampleRouting) -> _S:
        """The sample carrying ``routing`` instead."""
        ...

    def reset_for_retry(self: _S, routing: SampleRouting) -> _S:
        """The sample with its response dropped (pending regeneration), carrying
        ``routing`` (already reset: ``expire_retryably().retry``)."""
        ...


class Expiry(NamedTuple):
    """What ``expire_retryably`` leaves: the retry and, if a release failed, the rest."""

    retry: SampleRouting
    """The sample reset for regeneration: no handle, no lease, no stuck lease."""
    stuck: SampleRouting | None
    """The released sample still naming the leases whose release failed (keep it
    visible: retry its release or revoke them); None when every release succeeded."""
    error: Exception | None
    """The first release failure, or None."""


@fast_state
@dataclass(frozen=True, slots=True, kw_only=True)
class SampleRouting:
    """One sample's routing handle, its own lease, its stuck leases and weight versions,
    with the lifecycle steps (see the module docstring for their order).

    Example:
        >>> routing = SampleRouting(sample_id="7", session_id="s")
        >>> routing.holds_lease, routing.rows
        (False, 0)
        >>> with routing.continuation(traces, prompt_ids) as cont:  # doctest: +SKIP
        ...     handle = cont.ingest(adapter, body, spec=spec, writer=store, weight_version=3)
        ...     routing = cont.finish(store, handle).complete(prompt_tokens=4, response_tokens=6)
    """

    sample_id: str
    """The sample's id (holder names ``rollout/<id>``); ``str()`` of an int id."""
    session_id: str | None = None
    """Trace session of a multi-turn task, if any (the ``SessionLedger`` counts it)."""
    handle: Handle | None = None
    """Routing rows ``[0, tokens - 1)`` of prompt + response, when present."""
    lease: Lease | None = field(default=None, compare=False)
    """This sample's own lease on ``handle``'s payloads."""
    origin: Origin = Origin.NONE
    """Who produced the routing rows (informational; release never looks at it)."""
    unreleased: tuple[Lease, ...] = field(default=(), compare=False)
    """Leases whose release failed (a dead shard): still counted by the store, retried
    by every release, never dropped by a step."""
    response_versions: tuple[int, ...] = ()
    """Weight version of each response token, when the sample keeps them here (empty:
    the row versions stand in for them)."""
    prompt_tokens: int | None = None
    """Prompt length recorded by ``complete()`` (None until then, and after a step that
    changes the rows)."""
    retries: int = 0
    """Times this sample was reset for regeneration."""

    def __reduce__(self) -> tuple[Any, ...]:
        # One flat tuple, rebuilt by one call (``routing_pickle``: a driver takes
        # thousands a step from its rollout workers). A subclass may add fields.
        if type(self) is not SampleRouting:
            return fields_reduced(self)
        return routing_reduced(self)

    def __copy__(self) -> SampleRouting:
        # The same value, naming the same Lease object (not a pickled twin of it).
        return replaced(self)

    # -- reading ----------------------------------------------------------------------
    @property
    def sample_routing(self) -> SampleRouting:
        """This value (a ``SampleRouting`` is a ``RoutedSample`` of its own)."""
        return self

    def with_sample_routing(self, routing: SampleRouting) -> SampleRouting:
        """``routing`` (the ``RoutedSample`` protocol for a bare ``SampleRouting``)."""
        return routing

    def reset_for_retry(self, routing: SampleRouting) -> SampleRouting:
        """``routing`` (a bare ``SampleRouting`` has no response of its own)."""
        return routing

    @property
    def rows(self) -> int:
        """Routing rows the handle covers (0 without one)."""
        return self.handle.rows if self.handle is not None else 0

    @property
    def holds_lease(self) -> bool:
        """True while the own lease is live."""
        return self.lease is not None and not self.lease.released

    @property
    def stuck(self) -> bool:
        """True while a lease whose release failed is still live (see ``unreleased``)."""
        return any(not lease.released for lease in self.unreleased)

    def row_versions(self) -> tuple[int, ...]:
        """The weight version of each routing row (one entry per row)."""
        if self.handle is None:
            return ()
        return tuple(v for seg in self.handle.segments for v in (seg.weight_version,) * seg.rows)

    def oldest_version(self, basis: StalenessBasis = StalenessBasis.EVERY_ROW) -> int | None:
        """The oldest weight version the sample depends on under ``basis``; None when it
        has no version yet."""
        if basis is StalenessBasis.RESPONSE_TOKENS:
            return min(self._response_row_versions(), default=None)
        versions = list(self.response_versions)
        if self.handle is not None and self.handle.segments:
            versions.append(min(seg.weight_version for seg in self.handle.segments))
        return min(versions, default=None)

    def staleness(
        self, current_version: int, basis: StalenessBasis = StalenessBasis.EVERY_ROW
    ) -> int:
        """How many versions behind the oldest weights the sample depends on are (0 with
        none).

        Example:
            >>> SampleRouting(sample_id="a", response_versions=(1, 2)).staleness(3)
            2
        """
        oldest = self.oldest_version(basis)
        return 0 if oldest is None else current_version - oldest

    def _response_row_versions(self) -> Sequence[int]:
        if self.response_versions:
            return self.response_versions
        if self.handle is None:
            return ()
        if self.prompt_tokens is None:
            raise MisuseError(
                "response-token staleness needs the prompt length",
                where=f"sample {self.sample_id}",
                hint="Call complete(prompt_tokens=..., response_tokens=...) first, or keep"
                " response_versions on the SampleRouting.",
            )
        return self.row_versions()[max(self.prompt_tokens - 1, 0) :]

    # -- routing and leases -----------------------------------------------------------
    def attach(self, handle: Handle, lease: Lease, origin: Origin) -> SampleRouting:
        """Hold ``handle`` under ``lease``; refuses while the own lease is live (it would
        be dropped)."""
        self._check_no_live_lease("attach new routing")
        return replaced(self, handle=handle, lease=lease, origin=origin, prompt_tokens=None)

    def complete(self, *, prompt_tokens: int, response_tokens: int) -> SampleRouting:
        """Check the rows against the sample's token counts (rows == prompt + response -
        1) and record the prompt length; ``RowCountMismatch`` otherwise.

        Example:
            >>> done = routing.complete(prompt_tokens=4, response_tokens=3)  # doctest: +SKIP
            >>> done.rows
            6
        """
        expected = prompt_tokens + response_tokens - 1
        if self.handle is None or self.handle.rows != expected:
            raise RowCountMismatch(
                "a completed sample's routing rows disagree with its tokens",
                expected=f"{expected} rows ({prompt_tokens} prompt + {response_tokens}"
                " response tokens - 1)",
                found=f"{self.rows} rows" if self.handle is not None else "no routing",
                where=f"sample {self.sample_id}",
                hint="Keep the sample's tokens and its routing from the same answer (the"
                " handle finish() returned, after the tokens that answer added).",
            )
        return replaced(self, prompt_tokens=prompt_tokens)

    def claim(self, holder: str, store: LeaseSource | None = None) -> Lease | None:
        """Phase 1 of a take-over: ``holder``'s own lease on the rows (a clone of the
        live lease, else, with ``store``, a fresh acquire of the handle); None when there
        is nothing to hold. This value is unchanged.

        Example:
            >>> mine = sample.routing.claim("batch/3", store)  # doctest: +SKIP
        """
        return run_step(self._claim(holder, store))

    async def aclaim(self, holder: str, store: AsyncLeaseSource | None = None) -> Lease | None:
        """Awaitable ``claim``.

        Example:
            >>> mine = await sample.routing.aclaim("batch/3", store)  # doctest: +SKIP
        """
        return await arun_step(self._claim(holder, store))

    def _claim(
        self, holder: str, store: LeaseSource | AsyncLeaseSource | None
    ) -> Step[Lease | None]:
        if self.lease is not None and not self.lease.released:
            cloned: Lease = yield cloning(self.lease, holder)
            return cloned
        if self.handle is not None and store is not None:
            acquired: Lease = yield acquiring(store, self.handle, holder)
            return acquired
        return None

    def hand_over(self, lease: Lease | None) -> SampleRouting:
        """Phase 2 of a take-over: the own lease ends, ``lease`` (from ``claim``) takes
        its place; a release that fails rides along in ``unreleased`` (the second half
        of a transfer must not lose the new lease by raising).

        Example:
            >>> sample.routing = sample.routing.hand_over(mine)  # doctest: +SKIP
        """
        return run_step(self._hand_over(lease))

    async def ahand_over(self, lease: Lease | None) -> SampleRouting:
        """Awaitable ``hand_over``.

        Example:
            >>> sample.routing = await sample.routing.ahand_over(mine)  # doctest: +SKIP
        """
        return await arun_step(self._hand_over(lease))

    def _hand_over(self, lease: Lease | None) -> Step[SampleRouting]:
        if lease is None:
            return self
        after, _ = yield from self._try_release()
        return replaced(after, lease=lease)

    def take_over(self, holder: str, store: LeaseSource | None = None) -> SampleRouting:
        """``holder`` takes the sample over: its lease first, then the old one ends.

        Example:
            >>> sample.routing = sample.routing.take_over("buffer/g", store)  # doctest: +SKIP
        """
        return run_step(self._take_over(holder, store))

    async def atake_over(self, holder: str, store: AsyncLeaseSource | None = None) -> SampleRouting:
        """Awaitable ``take_over``.

        Example:
            >>> routing = await sample.routing.atake_over("buffer/g", store)  # doctest: +SKIP
        """
        return await arun_step(self._take_over(holder, store))

    def _take_over(
        self, holder: str, store: LeaseSource | AsyncLeaseSource | None
    ) -> Step[SampleRouting]:
        lease = yield from self._claim(holder, store)
        return (yield from self._hand_over(lease))

    def release(self) -> SampleRouting:
        """End the own lease and retry the ``unreleased`` ones (idempotent); raises the
        first failure, this value still naming every lease.

        Example:
            >>> sample.routing = sample.routing.release()  # doctest: +SKIP
        """
        return run_step(self._release())

    async def arelease(self) -> SampleRouting:
        """Awaitable ``release``.

        Example:
            >>> sample.routing = await sample.routing.arelease()  # doctest: +SKIP
        """
        return await arun_step(self._release())

    def _release(self) -> Step[SampleRouting]:
        after, error = yield from self._try_release()
        if error is not None:
            raise error
        return after

    def try_release(self) -> tuple[SampleRouting, Exception | None]:
        """``release()`` that never raises: the next value (no own lease; leases whose
        release failed in ``unreleased``) and the first error, or None.

        Example:
            >>> routing, error = sample.routing.try_release()  # doctest: +SKIP
        """
        return run_step(self._try_release())

    async def atry_release(self) -> tuple[SampleRouting, Exception | None]:
        """Awaitable ``try_release``.

        Example:
            >>> routing, error = await sample.routing.atry_release()  # doctest: +SKIP
        """
        return await arun_step(self._try_release())

    def _try_release(self) -> Step[tuple[SampleRouting, Exception | None]]:
        leases = [lease for lease in (self.lease, *self.unreleased) if lease is not None]
        failures = yield from _release_each(leases)
        stuck = tuple(lease for lease, _ in failures)
        error = first_error([exc for _, exc in failures], f"releasing sample {self.sample_id}")
        return replaced(self, lease=None, unreleased=stuck), error

    def discard(self) -> tuple[SampleRouting, Exception | None]:
        """The sample is dropped for good (trained, discarded, failed): every lease it
        names is released; one whose release fails rides along (keep the value visible).

        Example:
            >>> gone, error = sample.routing.discard()  # doctest: +SKIP
        """
        return run_step(self._try_release())

    async def adiscard(self) -> tuple[SampleRouting, Exception | None]:
        """Awaitable ``discard``.

        Example:
            >>> gone, error = await sample.routing.adiscard()  # doctest: +SKIP
        """
        return await arun_step(self._try_release())

    def finish_step(
        self, lease: Lease, handle: Handle, borrowed: Lease | None, origin: Origin
    ) -> Step[SampleRouting]:
        """A continuation's finish once its new ``lease`` exists: the own lease ends,
        then ``borrowed`` (a failure rides along in ``unreleased``), and the value holds
        ``handle`` under ``lease`` (``RoutingContinuation.finish`` runs it)."""
        after, _ = yield from self._try_release()
        if borrowed is not None:
            after, _ = yield from replaced(after, lease=borrowed)._try_release()
        return after.attach(handle, lease, origin)

    def take_unreleased(self) -> tuple[SampleRouting, tuple[Lease, ...]]:
        """This value without its stuck leases, and those leases (still live in the
        store), for a caller that can revoke them; the caller then owns them."""
        stuck = tuple(lease for lease in self.unreleased if not lease.released)
        return replaced(self, unreleased=()), stuck

    def reset(self) -> SampleRouting:
        """Forget the routing for regeneration (pure: releases nothing; refuses while the
        own lease is live; stuck leases stay in ``unreleased``)."""
        self._check_no_live_lease("reset the routing")
        return replaced(
            self,
            handle=None,
            lease=None,
            origin=Origin.NONE,
            response_versions=(),
            prompt_tokens=None,
            retries=self.retries + 1,
        )

    def expire_retryably(self) -> Expiry:
        """A stale sample goes back for regeneration: release first, then reset. The
        retry starts clean; leases whose release failed stay visible in ``stuck``.

        Example:
            >>> retry, stuck, error = sample.routing.expire_retryably()  # doctest: +SKIP
        """
        return run_step(self._expire_retryably())

    async def aexpire_retryably(self) -> Expiry:
        """Awaitable ``expire_retryably``.

        Example:
            >>> retry, stuck, error = await sample.routing.aexpire_retryably()  # doctest: +SKIP
        """
        return await arun_step(self._expire_retryably())

    def _expire_retryably(self) -> Step[Expiry]:
        after, error = yield from self._try_release()
        if error is None:
            return Expiry(retry=after.reset(), stuck=None, error=None)
        clean, _ = after.take_unreleased()
        return Expiry(retry=clean.reset(), stuck=after, error=error)

    # -- requests ---------------------------------------------------------------------
    def borrow_prefix(self, traces: PrefixSource, prompt_ids: Iterable[int]) -> Exported | None:
        """The longest stored prefix of ``prompt_ids`` in the sample's trace session,
        under a lease of the sample's own (``prefix_holder``); None without a session or
        a reusable row. The session keeps its own lease.

        Example:
            >>> exported = sample.routing.borrow_prefix(traces, prompt_ids)  # doctest: +SKIP
        """
        return run_step(self._borrow_prefix(traces, prompt_ids))

    async def aborrow_prefix(
        self, traces: AsyncPrefixSource, prompt_ids: Iterable[int]
    ) -> Exported | None:
        """Awaitable ``borrow_prefix``.

        Example:
            >>> exported = await sample.routing.aborrow_prefix(traces, ids)  # doctest: +SKIP
        """
        return await arun_step(self._borrow_prefix(traces, prompt_ids))

    def _borrow_prefix(
        self, traces: PrefixSource | AsyncPrefixSource, prompt_ids: Iterable[int]
    ) -> Step[Exported | None]:
        if self.session_id is None:
            return None
        holder = prefix_holder(self.sample_id)
        exported: Exported | None = yield _exporting(
            traces, self.session_id, list(prompt_ids), holder
        )
        return exported

    def continuation(
        self, traces: PrefixSource | None = None, prompt_ids: Iterable[int] = ()
    ) -> RoutingContinuation[SampleRouting]:
        """What the next request continues: the own routing (a partial rollout resumes;
        the own lease covers those rows until ``finish``), else a borrowed session prefix
        of ``prompt_ids``, else nothing.

        Example:
            >>> with sample.routing.continuation() as cont:  # doctest: +SKIP
            ...     cont.rows == sample.routing.rows
            True
        """
        return run_step(self._continuation(traces, prompt_ids))

    async def acontinuation(
        self, traces: AsyncPrefixSource | None = None, prompt_ids: Iterable[int] = ()
    ) -> RoutingContinuation[SampleRouting]:
        """Awaitable ``continuation`` (its only call: a session prefix's export).

        Example:
            >>> with await sample.routing.acontinuation(traces, ids) as cont:  # doctest: +SKIP
            ...     handle = await cont.aingest(adapter, body, spec=spec, writer=store,
            ...                                 weight_version=3)
        """
        return await arun_step(self._continuation(traces, prompt_ids))

    def _continuation(
        self, traces: PrefixSource | AsyncPrefixSource | None, prompt_ids: Iterable[int]
    ) -> Step[RoutingContinuation[SampleRouting]]:
        prompt = tuple(prompt_ids)
        if self.handle is not None:
            return RoutingContinuation(self, history=self.handle, borrowed=None, prompt_ids=prompt)
        exported = None
        if traces is not None:
            exported = yield from self._borrow_prefix(traces, prompt)
        if exported is None:
            return RoutingContinuation(self, history=None, borrowed=None, prompt_ids=prompt)
        return RoutingContinuation(
            self, history=exported.handle, borrowed=exported.lease, prompt_ids=prompt
        )

    def store_turn(self, traces: SessionSink, token_ids: Iterable[int]) -> SampleRouting:
        """Hand a finished turn (``token_ids``: prompt + response) to its trace session,
        then end the own lease. The session's lease exists before the own one ends; the
        own lease ends whether or not the insert succeeds.

        Example:
            >>> sample.routing = sample.routing.store_turn(traces, ids)  # doctest: +SKIP
        """
        return run_step(self._store_turn(traces, token_ids))

    async def astore_turn(
        self, traces: AsyncSessionSink, token_ids: Iterable[int]
    ) -> SampleRouting:
        """Awaitable ``store_turn`` (``TraceStoreClient.ainsert``).

        Example:
            >>> sample.routing = await sample.routing.astore_turn(traces, ids)  # doctest: +SKIP
        """
        return await arun_step(self._store_turn(traces, token_ids))

    def _store_turn(
        self, traces: SessionSink | AsyncSessionSink, token_ids: Iterable[int]
    ) -> Step[SampleRouting]:
        if self.session_id is None or self.handle is None:
            raise MisuseError(
                "only a routed sample of a trace session can be stored as a turn",
                expected="session_id and routing set",
                found=f"session_id={self.session_id!r}, routing={self.handle is not None}",
                where=f"sample {self.sample_id}",
            )
        try:
            yield _inserting(traces, self.session_id, list(token_ids), self.handle)
        except BaseException as exc:
            _, error = yield from self._try_release()
            if error is not None:
                attach_notes(exc, [error], f"releasing sample {self.sample_id}")
            raise
        return (yield from self._release())

    def _check_no_live_lease(self, action: str) -> None:
        if self.holds_lease:
            raise MisuseError(
                f"cannot {action} while the sample holds a live lease",
                where=f"sample {self.sample_id}",
                hint=(
                    "Call release() first (try_release() if it may fail: a stuck lease"
                    " rides along): resets never release, releases never guess."
                ),
            )
