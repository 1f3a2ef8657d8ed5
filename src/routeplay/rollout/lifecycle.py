"""The sample lifecycle as library steps: what a rollout worker does with routing and leases.

A rollout worker turns one ``RolloutState`` into the next. Each step is one call with one
ownership rule, so a worker (``pipeline/rollout_worker.py``, or a framework's own) only
calls them and never re-derives the order of leases:

1. ``continuation(state, traces)``: what the request continues. An interrupted sample
   continues its own routing (its own lease covers those rows); a turn of a trace
   session borrows the session's prefix through ``borrow_prefix`` (a lease of the
   sample's own, ``rollout/<id>/prefix``; the session keeps its lease); anything else
   starts from nothing.
2. ``Continuation.ingest``: the engine's answer becomes the sample's handle: an
   engine-store key is adopted without being read, inline routing is put once, and only
   the rows the history lacks are stored (``stitch``: a resume keeps its history rows and
   their weight versions). The new payload has no lease yet.
3. ``Continuation.finish``: the sample's new lease (``rollout/<id>``) is taken *first*;
   only then do the leases it replaces end (the borrowed export's and the interrupted
   input's own), so a payload they share never reaches zero leases on the way. The
   routing is attached to the state; a replaced lease whose release fails rides along in
   the state's ``unreleased`` instead of costing the new lease.
4. ``store_turn(traces, state)``: a finished turn goes to its session (the session takes
   its own lease), then the sample's lease ends.

The members of one GRPO group (fresh, resumed or next turns alike) can replace step 2
with one ``ingest_group``: their new rows are written together as *one* payload (the
group's verified-equal prompt rows once), then each member finishes on its own. Engine
keys (LMDeploy, XTuner's SGLang) are adopted together the same way (only the rows past
each history, the prompt once); a member whose answer or key is refused gets its typed
error in its place and costs only itself.

Failure paths: leaving a ``Continuation`` without ``finish`` (an engine error, a bad
body) ends the borrowed lease only. The input state's own lease is never touched before
the new lease exists: the caller, who still holds its copy of the input, releases it.

Example:
    >>> with continuation(state, traces) as cont:  # doctest: +SKIP
    ...     answer = engine(state.prompt_ids + state.response_ids, start_row=cont.rows)
    ...     handle = cont.ingest(adapter, answer, spec=spec, writer=store, weight_version=v)
    ...     routed = cont.finish(store, handle)
    >>> sample = routed.extend(tokens, logprobs, v).with_status(Status.COMPLETED, "stop")
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError, RouteplayError
from routeplay.rollout.adapters import EngineAdapter, RoutesWriter
from routeplay.rollout.group_ingest import BatchWriter, ingest_routing_group
from routeplay.rollout.routing_continuation import RoutingContinuation
from routeplay.rollout.routing_terms import (
    LeaseSource,
    PrefixSource,
    SessionSink,
    prefix_holder,
    sample_holder,
)
from routeplay.rollout.state import Origin, RolloutState, RoutingKind

if TYPE_CHECKING:
    from collections.abc import Sequence

    from routeplay.core.spec import RouteSpec
    from routeplay.core.wires import EngineRouting
    from routeplay.rollout.trace_store import Exported
    from routeplay.store.lease import Lease

__all__ = [
    "BatchWriter",
    "Continuation",
    "LeaseSource",
    "PrefixSource",
    "SessionSink",
    "borrow_prefix",
    "continuation",
    "ingest_group",
    "prefix_holder",
    "sample_holder",
    "store_turn",
]


def borrow_prefix(traces: PrefixSource, state: RolloutState) -> Exported | None:
    """Hand the longest stored prefix of ``state``'s prompt in its trace session to the
    sample, under a lease of the sample's own (``prefix_holder``); None when the sample
    has no session or nothing is reusable (``SampleRouting.borrow_prefix``).

    Ownership: the sample's lease and the session's are separate. Releasing the session
    never invalidates the borrowed rows; releasing the borrowed lease never touches the
    session. The caller ends the borrowed lease (``Continuation.finish`` does, once the
    sample's own lease exists).

    Example:
        >>> exported = borrow_prefix(traces, turn2)  # doctest: +SKIP
        >>> exported.lease.holder
        'rollout/c/prefix'
    """
    return state.sample_routing.borrow_prefix(traces, state.prompt_ids)


def continuation(state: RolloutState, traces: PrefixSource | None = None) -> Continuation:
    """What a request for ``state`` continues: the state's own routing (a resume of an
    interrupted sample), a borrowed session prefix (a turn of a trace session), or
    nothing (a fresh sample).

    Ownership: a resume borrows nothing (the input's own lease covers its rows until
    ``finish``); a session turn holds the borrowed lease in the returned continuation.
    Use it as a context manager so a failure before ``finish`` ends that lease.

    Example:
        >>> with continuation(interrupted) as cont:  # doctest: +SKIP
        ...     cont.rows == interrupted.routing.rows
        True
    """
    inner = state.sample_routing.continuation(traces, state.prompt_ids)
    return Continuation(state, history=inner.history, borrowed=inner.borrowed)


class Continuation:
    """One request of one ``RolloutState``: a ``RoutingContinuation`` (the history it
    continues, the lease it borrowed) whose ``finish`` returns the next state.

    Made by ``continuation()``. ``ingest`` stores the answer's new rows, ``finish`` swaps
    the leases in the safe order and attaches the routing; leaving the ``with`` block
    without ``finish`` ends the borrowed lease (and only that one).
    """

    __slots__ = ("routing", "state")

    def __init__(
        self, state: RolloutState, *, history: Handle | None, borrowed: Lease | None
    ) -> None:
        self.state = state
        """The input sample (its own lease, if any, ends in ``finish``)."""
        self.routing = RoutingContinuation(
            state.sample_routing, history=history, borrowed=borrowed, prompt_ids=state.prompt_ids
        )
        """The request on the sample's ``SampleRouting`` (the steps live there)."""

    @property
    def history(self) -> Handle | None:
        """Rows the request continues (None: none)."""
        return self.routing.history

    @property
    def borrowed(self) -> Lease | None:
        """The sample's lease on a borrowed session prefix, ended by ``finish``."""
        return self.routing.borrowed

    @property
    def rows(self) -> int:
        """History rows the answer must not store again (the request's start row where
        the engine takes one)."""
        return self.routing.rows

    @property
    def origin(self) -> Origin:
        """Who produced the rows of the finished sample: a resume keeps its origin, a
        session turn is ``BORROWED``, a fresh sample ``PRODUCED``."""
        return self.routing.origin

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
        they lack, adopted (an engine-store key, not read) or put (inline routing) through
        ``writer`` under ``weight_version``. ``start_row`` is the request's own (engines
        never echo it).

        Ownership: the returned handle holds no lease yet; ``finish`` takes one (an
        unleased payload is dropped when the store's TTL runs out).

        Example:
            >>> handle = cont.ingest(ADAPTERS["sglang"], body, spec=spec,  # doctest: +SKIP
            ...                      writer=store, weight_version=1, start_row=cont.rows)
        """
        return self.routing.ingest(
            adapter,
            response,
            spec=spec,
            writer=writer,
            weight_version=weight_version,
            start_row=start_row,
            where=where,
        )

    def finish(self, store: LeaseSource, handle: Handle) -> RolloutState:
        """Lease ``handle`` for the sample, *then* end the leases it replaces (the
        borrowed prefix's and the input's own), and attach the routing to the state
        (``RoutingContinuation.finish``).

        Ownership: the new lease exists before any replaced lease ends, so rows shared
        with the history never reach zero leases. If the new lease cannot be taken, the
        borrowed lease ends and the input's own lease is left to the caller; if a replaced
        lease cannot be released, it rides along in the result's ``unreleased``.

        Example:
            >>> routed = cont.finish(store, handle)  # doctest: +SKIP
            >>> routed.lease.holder, routed.holds_lease
            ('rollout/a', True)
        """
        if self.state.routing_kind is RoutingKind.DENSE:
            raise MisuseError(
                "a dense-model state cannot carry routing", where=self.state.sample_id
            )
        return self.state.with_sample_routing(self.routing.finish(store, handle))

    def abandon(self) -> None:
        """End the borrowed lease without finishing (idempotent; the input's own lease
        stays with the caller)."""
        self.routing.abandon()

    def __enter__(self) -> Continuation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.routing.__exit__(exc_type, exc, tb)

    def _check_open(self, action: str) -> None:
        self.routing.check_open(action)


def ingest_group(
    conts: Sequence[Continuation],
    routings: Sequence[EngineRouting],
    *,
    writer: BatchWriter,
    weight_version: int,
    spec: RouteSpec | None = None,
) -> list[Handle | RouteplayError]:
    """``ingest_routing_group`` for ``RolloutState`` continuations: each member's
    routing after its answer, or the typed error that refused it; the rows each history
    lacks are written in one call as one payload, a fresh group's verified-equal prompt
    rows once (the state's ``prompt_ids`` say which members share one prompt).

    Ownership: as for ``ingest``, the handles hold no lease yet; finish each member (a
    set-aside member's continuation is for the caller to abandon).

    Example:
        >>> out = ingest_group(conts, answers, writer=w, weight_version=3, spec=s)  # doctest: +SKIP
        >>> routed = [c.finish(store, h) for c, h in zip(conts, out) if isinstance(h, Handle)]
    """
    return ingest_routing_group(
        [cont.routing for cont in conts],
        routings,
        writer=writer,
        weight_version=weight_version,
        spec=spec,
    )


def store_turn(traces: SessionSink, state: RolloutState) -> RolloutState:
    """Hand a finished turn to its trace session, then end the sample's own lease.

    Ownership: the session takes its own lease on the turn's routing (``insert``) before
    the sample's lease ends, so the rows never reach zero leases. The sample's lease ends
    whether or not the insert succeeds (the turn is done either way); returns the
    released state.

    Example:
        >>> first = store_turn(traces, first)  # doctest: +SKIP
        >>> first.holds_lease
        False
    """
    return state.with_sample_routing(
        state.sample_routing.store_turn(traces, state.prompt_ids + state.response_ids)
    )
