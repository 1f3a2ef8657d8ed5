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

import dataclasses
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError, RouteplayError
from routeplay.rollout.adapters import EngineAdapter, RoutesWriter, check_continues, new_rows
from routeplay.rollout.releasing import attach_notes
from routeplay.rollout.state import Origin, RolloutState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from routeplay.core.handle import EngineKey
    from routeplay.core.routes import Routes
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


class LeaseSource(Protocol):
    """What ``finish`` needs from a store: ``RouteStore.acquire``."""

    def acquire(self, handle: Handle, holder: str) -> Lease: ...


class BatchWriter(Protocol):
    """What ``ingest_group`` writes through: ``RouteStore`` (or a producer's
    ``ProducerWriter``): ``put_many`` for rows carried in the answers, ``adopt_keys_each``
    and ``free_key`` for engine-store keys."""

    def put_many(
        self,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]: ...

    def adopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle | RouteplayError]: ...

    def free_key(self, key: EngineKey) -> bool: ...


class PrefixSource(Protocol):
    """What ``borrow_prefix`` needs: ``TraceStore.export`` (or ``TraceStoreClient``'s)."""

    def export(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None: ...


class SessionSink(Protocol):
    """What ``store_turn`` needs: ``TraceStore.insert`` (or ``TraceStoreClient``'s)."""

    def insert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None: ...


def sample_holder(sample_id: str) -> str:
    """The holder name of a sample's own lease (``rollout/<id>``)."""
    return f"rollout/{sample_id}"


def prefix_holder(sample_id: str) -> str:
    """The holder name of the lease a sample borrows a session prefix under."""
    return f"rollout/{sample_id}/prefix"


def borrow_prefix(traces: PrefixSource, state: RolloutState) -> Exported | None:
    """Hand the longest stored prefix of ``state``'s prompt in its trace session to the
    sample, under a lease of the sample's own (``prefix_holder``); None when the sample
    has no session or nothing is reusable.

    Ownership: the sample's lease and the session's are separate. Releasing the session
    never invalidates the borrowed rows; releasing the borrowed lease never touches the
    session. The caller ends the borrowed lease (``Continuation.finish`` does, once the
    sample's own lease exists).

    Example:
        >>> exported = borrow_prefix(traces, turn2)  # doctest: +SKIP
        >>> exported.lease.holder
        'rollout/c/prefix'
    """
    if state.session_id is None:
        return None
    return traces.export(state.session_id, state.prompt_ids, prefix_holder(state.sample_id))


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
    if state.routing is not None:
        return Continuation(state, history=state.routing, borrowed=None)
    exported = borrow_prefix(traces, state) if traces is not None else None
    if exported is None:
        return Continuation(state, history=None, borrowed=None)
    return Continuation(state, history=exported.handle, borrowed=exported.lease)


class Continuation:
    """One request of one sample: the history it continues and the lease it borrowed.

    Made by ``continuation()``. ``ingest`` stores the answer's new rows, ``finish`` swaps
    the leases in the safe order and attaches the routing; leaving the ``with`` block
    without ``finish`` ends the borrowed lease (and only that one).
    """

    __slots__ = ("_done", "borrowed", "history", "state")

    def __init__(
        self, state: RolloutState, *, history: Handle | None, borrowed: Lease | None
    ) -> None:
        self.state = state
        """The input sample (its own lease, if any, ends in ``finish``)."""
        self.history = history
        """Rows the request continues (None: none)."""
        self.borrowed = borrowed
        """The sample's lease on a borrowed session prefix, ended by ``finish``."""
        self._done = False

    @property
    def rows(self) -> int:
        """History rows the answer must not store again (the request's start row where
        the engine takes one)."""
        return self.history.rows if self.history is not None else 0

    @property
    def origin(self) -> Origin:
        """Who produced the rows of the finished sample: a resume keeps its origin, a
        session turn is ``BORROWED``, a fresh sample ``PRODUCED``."""
        if self.state.routing is not None:
            return self.state.origin
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
        they lack, adopted (an engine-store key, not read) or put (inline routing) through
        ``writer`` under ``weight_version``. ``start_row`` is the request's own (engines
        never echo it).

        Ownership: the returned handle holds no lease yet; ``finish`` takes one (an
        unleased payload is dropped when the store's TTL runs out).

        Example:
            >>> handle = cont.ingest(ADAPTERS["sglang"], body, spec=spec,  # doctest: +SKIP
            ...                      writer=store, weight_version=1, start_row=cont.rows)
        """
        self._check_open("ingest an answer")
        return adapter.ingest(
            response,
            spec=spec,
            writer=writer,
            weight_version=weight_version,
            history=self.history,
            where=where or f"sample {self.state.sample_id}",
            start_row=start_row,
        )

    def finish(self, store: LeaseSource, handle: Handle) -> RolloutState:
        """Lease ``handle`` for the sample, *then* end the leases it replaces (the
        borrowed prefix's and the input's own), and attach the routing to the state.

        Ownership: the new lease exists before any replaced lease ends, so rows shared
        with the history never reach zero leases. If the new lease cannot be taken, the
        borrowed lease ends and the input's own lease is left to the caller; if a replaced
        lease cannot be released, it rides along in the result's ``unreleased``.

        Example:
            >>> routed = cont.finish(store, handle)  # doctest: +SKIP
            >>> routed.lease.holder, routed.holds_lease
            ('rollout/a', True)
        """
        self._check_open("finish")
        self._done = True
        try:
            lease = store.acquire(handle, sample_holder(self.state.sample_id))
        except BaseException as exc:
            self._end_borrowed(exc)
            raise
        after, _ = self.state.try_release()  # a failure keeps the lease in unreleased
        if self.borrowed is not None:
            stuck, _ = dataclasses.replace(after, lease=self.borrowed).try_release()
            after = stuck  # the borrowed lease ended, or rides along in unreleased
        return after.with_routing(handle, lease, self.origin)

    def abandon(self) -> None:
        """End the borrowed lease without finishing (idempotent; the input's own lease
        stays with the caller)."""
        if self._done:
            return
        self._done = True
        if self.borrowed is not None:
            self.borrowed.release()

    def __enter__(self) -> Continuation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.abandon()
            return
        if not self._done:
            self._done = True
            self._end_borrowed(exc)

    def _end_borrowed(self, cause: BaseException) -> None:
        """Release the borrowed lease while ``cause`` propagates (a failed release is
        named in a note on ``cause``, never raised over it)."""
        if self.borrowed is None:
            return
        try:
            self.borrowed.release()
        except Exception as failure:
            attach_notes(cause, [failure], f"releasing {self.borrowed.holder}")

    def _check_open(self, action: str) -> None:
        if self._done:
            raise MisuseError(
                f"cannot {action}: this continuation is finished or abandoned",
                where=f"sample {self.state.sample_id}",
                hint="Make a new continuation() for the next request of the sample.",
            )


def ingest_group(
    conts: Sequence[Continuation],
    routings: Sequence[EngineRouting],
    *,
    writer: BatchWriter,
    weight_version: int,
    spec: RouteSpec | None = None,
) -> list[Handle | RouteplayError]:
    """Each member's routing after its answer (``Continuation.ingest`` for a whole
    group), or the typed error that refused the member's answer: the rows each history
    lacks are written in one call as one payload. When every member is fresh (no
    history) and has the same prompt, the prompt's rows are shared where verified equal
    (stored once, the saving counted).

    Rows carried in the answers go through one ``put_many``; engine-store keys through
    one ``adopt_keys_each`` (``spec`` required), each key from its history's end, so a
    resume or a later turn stores only its new rows. A member whose answer cannot
    continue its history, or whose key is refused (metadata, rows, run, consumed,
    expired), is set aside with its error; the others are written together.

    Ownership: as for ``ingest``, the handles hold no lease yet; finish each member (a
    set-aside member's continuation is for the caller to abandon).

    Example:
        >>> out = ingest_group(conts, answers, writer=w, weight_version=3, spec=s)  # doctest: +SKIP
        >>> routed = [c.finish(store, h) for c, h in zip(conts, out) if isinstance(h, Handle)]
    """
    for cont in conts:
        cont._check_open("ingest an answer")
    pairs = list(zip(conts, routings, strict=True))
    out: list[Handle | RouteplayError | None] = [None] * len(pairs)
    carried: list[tuple[int, Routes]] = []
    keyed: list[tuple[int, EngineKey]] = []
    for index, (cont, routing) in enumerate(pairs):
        try:
            check_continues(routing, cont.history)
            if routing.key is None:
                rows = new_rows(routing, cont.history)
                if rows is None:
                    out[index] = _kept(cont, routing, spec)
                else:
                    carried.append((index, rows))
            elif routing.key.rows <= cont.rows:  # nothing new: never adopt what none keeps
                writer.free_key(routing.key)
                out[index] = _kept(cont, routing, spec)
            else:
                keyed.append((index, routing.key))
        except RouteplayError as exc:
            out[index] = exc
    if carried:
        written = writer.put_many(
            [rows for _, rows in carried],
            weight_version=weight_version,
            shared_prefix=_shared_prompt([conts[i] for i, _ in carried]),
            pack=True,
        )
        for (index, _), handle in zip(carried, written, strict=True):
            out[index] = _kept(conts[index], routings[index], spec) + handle
    if keyed:
        adopted = writer.adopt_keys_each(
            [key for _, key in keyed],
            _key_spec(conts, spec),
            weight_version=weight_version,
            shared_prefix=_shared_prompt([conts[i] for i, _ in keyed]),
            start_rows=[conts[i].rows for i, _ in keyed],
            pack=True,
        )
        for (index, _), result in zip(keyed, adopted, strict=True):
            kept = _kept(conts[index], routings[index], spec)
            out[index] = kept + result if isinstance(result, Handle) else result
    return [result for result in out if result is not None]


def _kept(cont: Continuation, routing: EngineRouting, spec: RouteSpec | None) -> Handle:
    """The member's history, or an empty handle of its spec."""
    if cont.history is not None:
        return cont.history
    if routing.routes is not None:
        return Handle(routing.routes.spec)
    return Handle(_key_spec([cont], spec))


def _key_spec(conts: Sequence[Continuation], spec: RouteSpec | None) -> RouteSpec:
    if spec is not None:
        return spec
    raise MisuseError(
        "adopting engine-store keys in a group needs the model's spec",
        expected="ingest_group(..., spec=spec)",
        found="spec=None",
        where=f"group of {', '.join(c.state.sample_id for c in conts[:3])}",
    )


def _shared_prompt(conts: Sequence[Continuation]) -> int:
    """Prompt rows fresh members of one group may share (0 unless all are fresh with
    one prompt); ``put_many`` shares only rows it verified equal."""
    prompts = {cont.state.prompt_ids for cont in conts}
    if len(prompts) != 1 or any(cont.history is not None for cont in conts):
        return 0
    return len(next(iter(prompts)))


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
    if state.session_id is None or state.routing is None:
        raise MisuseError(
            "only a routed sample of a trace session can be stored as a turn",
            expected="session_id and routing set",
            found=f"session_id={state.session_id!r}, routing={state.routing is not None}",
            where=f"sample {state.sample_id}",
        )
    try:
        traces.insert(state.session_id, state.prompt_ids + state.response_ids, state.routing)
    except BaseException as exc:
        _, error = state.try_release()
        if error is not None:
            attach_notes(exc, [error], f"releasing sample {state.sample_id}")
        raise
    return state.release()
