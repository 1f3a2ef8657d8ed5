"""Adopting engine-store keys: the decisions, the waits and the raw fallback, written once.

A shard that adopts keys (``RouteStore.adopt_keys`` and its twins) runs ``adopt_keys``,
a flow (``routeplay.store.flow``): it sends the remote steps through ``AdoptionSteps``
(the Ray shard's: engine-store and validator actors; the local backend's: plain objects),
yields a ``Wait`` for the answers it needs and decides on them. Plain Python, no Ray: the
decisions are unit-tested with in-process steps.

Fail closed: an adopted key gets a ``StoreRef`` only for rows whose validation *ended*
accepting them, so the trainer's read never meets a row that was not validated. A bad
capture is refused here, on the rollout side, where its sample can be set aside:

1. Take: one call per engine store consumes its keys; a key refused by its metadata
   (shape, dtype, rows, another run, consumed, expired) is freed there and refused.
2. Keys validated at ingest (``routeplay.store.engine.ingest``): the engine store hands over
   the canonical block of a validation that ended valid; for one still running, or
   refused, it sends the raw payload and the validation's status, and the adopter waits
   for the status (up to half the deadline). Valid: the block. Refused, and it covered
   exactly the key's rows: that refusal (``refuse_after_ingest``). Refused elsewhere (a
   trailing row, a history the key leaves out), lost or late: the raw path.
3. Raw path: each payload's rows from its start row are validated and narrowed near the
   engine (all sent at once, pipelined on the node's validator), and the adopter waits
   for every verdict (up to half the deadline): a refusal or a ``StoreTimeout`` is that
   key's alone, its block dropped.
4. Groups (``shared_prefix`` or ``pack``): step 2 first, then the members are laid out
   together near the engine, each validated there unless its block validated at ingest
   stands for it (then taken as it is); a refused member is set aside with its error.
   Many groups of one engine store (a rollout worker's coroutines adopting at once:
   ``adopt_key_batches``) go in rounds of ``GROUP_ROUND`` (``key_rounds``,
   ``adopt_round``): one take, one wait, one layout call and one hand-over a round.

A refused key is consumed: its raw payload goes with the last reference the flow drops.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Protocol

from routeplay.core.handle import EngineKey, StoreRef
from routeplay.core.spec import RouteSpec
from routeplay.errors import RouteplayError, RoutesDataError, RoutesLost, StoreTimeout
from routeplay.store.engine.ingest import Prepared, Validated
from routeplay.store.engine.key_check import key_where
from routeplay.store.flow import Flow, Wait, awaiting
from routeplay.store.shard.group_answers import GroupAnswer, GroupRequest
from routeplay.store.shard.shard import StoredPayload

__all__ = [
    "GROUP_ROUND",
    "AdoptionSteps",
    "IngestVerdict",
    "KeyBatch",
    "adopt_batch",
    "adopt_in_rounds",
    "adopt_keys",
    "adopt_round",
    "in_batch_order",
    "key_rounds",
    "refuse_after_ingest",
]

Where = tuple[str, str]
"""An engine store: ``(actor name, namespace)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyBatch:
    """One caller's keys in a batched adoption (``adopt_key_batches``: the groups an
    asyncio rollout worker's coroutines adopt at once), adopted as one ``adopt_keys``."""

    keys: tuple[EngineKey, ...]
    """The keys, in the caller's order."""
    spec: RouteSpec
    """Their geometry."""
    shared_prefix: int = 0
    """Rows the keys share (a group's prompt), as ``adopt_keys``'."""
    starts: tuple[int, ...] | None = None
    """Per key, the first row stored; None: every row."""
    pack: bool = False
    """The keys laid out as one payload (a group)."""

    @property
    def grouped(self) -> bool:
        """The keys are a group's (laid out together near the engine)."""
        return self.shared_prefix > 0 or self.pack

    def start_rows(self) -> list[int]:
        """Per key, the first row stored (0 where ``starts`` is None)."""
        return list(self.starts) if self.starts is not None else [0] * len(self.keys)


class AdoptionSteps(Protocol):
    """The remote steps of an adoption; the flow decides, these only send or store.

    A ``send_*`` returns a pending result (what a ``Wait`` of the flow's resolver takes);
    ``adopt`` and ``adopt_many`` store blocks in the shard at once (they cannot fail but
    for a bug)."""

    def engines(self, wheres: Sequence[Where], *, fresh: bool = False) -> Flow[dict[Where, Any]]:
        """The engine stores' handles, each asked once for its protocol (``fresh``: looked
        up again by name, as after a restart of the store)."""
        ...

    def send_take(
        self, engine: Any, keys: list[EngineKey], spec: RouteSpec, starts: list[int]
    ) -> Any:
        """Consume keys: answers ``(taken, node, waits)``, per key its wrapped raw
        reference ``[ref]``, its ``Validated`` block or its refusal, the node holding
        the bytes, and per key the ``Prepared`` to wait for, or None."""
        ...

    def send_validate(
        self, node: str, raw: Any, key: EngineKey, spec: RouteSpec, start: int
    ) -> tuple[Any, Any]:
        """Validate and narrow ``raw``'s rows ``[start, key.rows)`` near it: the pending
        status (None once valid; the refusal otherwise) and the block's reference."""
        ...

    def send_rows_of(self, node: str, canonical: Any, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of a validated block, as a block of their own."""
        ...

    def send_groups(
        self, node: str, spec: RouteSpec, requests: list[GroupRequest], payloads: list[Any]
    ) -> Any:
        """Validate and lay out groups near the engine, in one call: answers a
        ``LaidOut``. ``payloads``: every group's members in order, each its raw
        reference, or its block validated at ingest where its request says so (taken as
        it is, not validated again)."""
        ...

    def take_group(self, node: str, token: Any, count: int) -> list[Any]:
        """The laid-out arrays staged under ``token``, as block references the shard owns."""
        ...

    def adopt(self, blocks: list[Any], rows: int, nbytes: int) -> StoreRef:
        """Store one payload's blocks in the shard."""
        ...

    def adopt_many(
        self, blocks: list[Any], payloads: list[StoredPayload], saved_bytes: int
    ) -> list[StoreRef]:
        """Store several payloads' blocks in the shard."""
        ...


class IngestVerdict(Enum):
    """What a waited validation at ingest means for one key."""

    VALID = "valid"
    """It accepted the payload: its block stands for the key's rows."""
    REFUSED = "refused"
    """It refused rows the key adopts: the key is refused with that error."""
    RAW = "raw"
    """It says nothing about the key's own rows: validate them from the raw payload."""


def refuse_after_ingest(answer: Any, ready: Prepared, key: EngineKey, start: int) -> IngestVerdict:
    """The verdict of a validation at ingest on the key it was made for.

    ``answer``: the status the adopter waited for (None: valid, or the error). A data
    refusal stands for the key only when the validation covered exactly the key's rows
    (from row 0, no trailing row): otherwise the bad row may lie in rows the key leaves
    out. A lost or late validation (any other error) proves nothing either way.

    Example:
        >>> refuse_after_ingest(None, ready, key, 0)  # doctest: +SKIP
        <IngestVerdict.VALID: 'valid'>
    """
    if answer is None:
        return IngestVerdict.VALID
    exact = start == 0 and key.rows == ready.rows
    if exact and isinstance(answer, RoutesDataError):
        return IngestVerdict.REFUSED
    return IngestVerdict.RAW


@dataclass(frozen=True, slots=True, kw_only=True)
class _Call:
    """What one ``adopt_keys`` call holds fixed."""

    spec: RouteSpec
    steps: AdoptionSteps
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _Taken:
    """One engine store's keys, as its take answered them."""

    keys: list[EngineKey]
    starts: list[int]
    taken: list[Any]
    """Per key: its wrapped raw reference ``[ref]``, its ``Validated`` block or its refusal."""
    waits: list[Any]
    """Per key: the ``Prepared`` validation to wait for, or None."""
    node: str
    """The node holding the store's bytes."""


def adopt_keys(
    keys: Sequence[EngineKey],
    spec: RouteSpec,
    starts: Sequence[int],
    *,
    shared_prefix: int,
    pack: bool,
    steps: AdoptionSteps,
    timeout_s: float,
) -> Flow[list[Any]]:
    """Per key, in order: a ``StoreRef`` (all its rows), a tuple of ``(StoreRef, start,
    stop)`` row ranges (a group's member, or rows of a longer block), or the typed error
    that refused it (the module docstring's steps). One take per engine store; every
    engine store is asked for its protocol before any key is taken, so a refused store
    leaves no key of another consumed with no caller to hand it to.

    Example:
        results = drive(adopt_keys(keys, spec, starts, shared_prefix=0, pack=False,
                                   steps=steps, timeout_s=60.0), ray_calls.RAY)
    """
    call = _Call(spec=spec, steps=steps, timeout_s=timeout_s)
    out: list[Any] = [None] * len(keys)
    by_engine: dict[Where, list[int]] = {}
    for index, key in enumerate(keys):
        by_engine.setdefault((key.actor, key.namespace), []).append(index)
    engines = yield from steps.engines(list(by_engine))
    grouped = shared_prefix > 0 or pack
    for where, indices in by_engine.items():
        picked = [keys[i] for i in indices]
        begin = [starts[i] for i in indices]
        batch = yield from _take(call, engines, where, picked, begin)
        if grouped:
            adopted = yield from _group(call, batch, shared_prefix, pack)
        else:
            adopted = yield from _singles(call, batch)
        for index, result in zip(indices, adopted, strict=True):
            out[index] = result
    return out


def adopt_batch(batch: KeyBatch, *, steps: AdoptionSteps, timeout_s: float) -> Flow[list[Any]]:
    """``adopt_keys`` of one caller's ``KeyBatch`` (its keys, spec, start rows and layout).

    Example:
        answers = drive(adopt_batch(batch, steps=steps, timeout_s=60.0), ray_calls.RAY)
    """
    flow = adopt_keys(
        list(batch.keys),
        batch.spec,
        batch.start_rows(),
        shared_prefix=batch.shared_prefix,
        pack=batch.pack,
        steps=steps,
        timeout_s=timeout_s,
    )
    return (yield from flow)


def _take(
    call: _Call,
    engines: dict[Where, Any],
    where: Where,
    keys: list[EngineKey],
    starts: list[int],
) -> Flow[_Taken]:
    """One engine store's take. A store that died since its handle was looked up (it was
    restarted, as ``ENGINE_STORE_HINT`` tells users to) is looked up again and asked once
    more: the dead actor consumed nothing that outlived it."""
    what = f"{where[1]}/{where[0]}: take {len(keys)} keys"
    sent = call.steps.send_take(engines[where], keys, call.spec, starts)
    try:
        [answer] = yield from awaiting([sent], what, timeout_s=call.timeout_s)
    except RoutesLost:
        found = yield from call.steps.engines([where], fresh=True)
        sent = call.steps.send_take(found[where], keys, call.spec, starts)
        [answer] = yield from awaiting([sent], what, timeout_s=call.timeout_s)
    taken, node, waits = answer
    return _Taken(keys=keys, starts=starts, taken=list(taken), waits=list(waits), node=node)


def _decide_ingest(call: _Call, batch: _Taken) -> Flow[bool]:
    """Step 2: the validations at ingest still open are waited for (up to half the
    deadline) and decide, in ``batch.taken``: valid, the block; refused for the key's own
    rows, the refusal; anything else, the raw payload stays. Whether it waited."""
    keys, starts, out = batch.keys, batch.starts, batch.taken
    opened = [(i, ready) for i, ready in enumerate(batch.waits) if isinstance(ready, Prepared)]
    if not opened:
        return False
    statuses = tuple(ready.status for _, ready in opened)
    answers = yield Wait(statuses, "validations at ingest", call.timeout_s / 2, each=True)
    for (i, ready), answer in zip(opened, answers, strict=True):
        verdict = refuse_after_ingest(answer, ready, keys[i], starts[i])
        if verdict is IngestVerdict.VALID:
            out[i] = ready.as_validated()
        elif verdict is IngestVerdict.REFUSED:
            out[i] = answer
    return True


def _singles(call: _Call, batch: _Taken) -> Flow[list[Any]]:
    """Keys adopted one by one (steps 2 and 3): the validations at ingest still open
    decide first, then every key left on the raw path is validated and waited for."""
    keys, starts, out = batch.keys, batch.starts, batch.taken
    half = call.timeout_s / 2
    yield from _decide_ingest(call, batch)
    raw = [i for i, one in enumerate(out) if isinstance(one, list)]  # wrapped raw refs
    sent = [
        call.steps.send_validate(batch.node, out[i][0], keys[i], call.spec, starts[i]) for i in raw
    ]
    if sent:
        what = f"validate {len(sent)} engine keys"
        answers = yield Wait(tuple(status for status, _ in sent), what, half, each=True)
        for i, (_, block), answer in zip(raw, sent, answers, strict=True):
            out[i] = _verdict(call, answer, block, keys[i], starts[i])
    return [
        _adopt_validated(call, one, keys[i], starts[i], batch.node)
        if isinstance(one, Validated)
        else one
        for i, one in enumerate(out)
    ]


def _verdict(call: _Call, answer: Any, block: Any, key: EngineKey, start: int) -> Any:
    """A raw validation's answer: the stored block, or the key's refusal."""
    if isinstance(answer, StoreTimeout):
        return StoreTimeout(
            "the validation of an adopted engine key did not end in time",
            where=key_where(key),
            expected=f"a verdict within {call.timeout_s / 2}s",
            hint="Its sample is set aside (the key is consumed, its payload dropped). Is "
            "the engine node's validator overloaded or hung?",
        )
    if isinstance(answer, RouteplayError):
        return answer
    rows = key.rows - start
    return call.steps.adopt([block], rows, call.spec.nbytes(rows))


def _adopt_validated(call: _Call, ready: Validated, key: EngineKey, start: int, node: str) -> Any:
    """A block validated at ingest, for the key's rows ``[start, rows)``: rows past a
    history copied out of it (nothing validated again), a trailing row left unread."""
    [canonical] = ready.canonical
    if start:  # a resume or a later turn: only the new rows are stored
        rows = key.rows - start
        block = call.steps.send_rows_of(node, canonical, start, key.rows)
        return call.steps.adopt([block], rows, call.spec.nbytes(rows))
    stored = call.steps.adopt([canonical], ready.rows, call.spec.nbytes(ready.rows))
    return stored if ready.rows == key.rows else ((stored, 0, key.rows),)


def _group(call: _Call, batch: _Taken, shared_prefix: int, pack: bool) -> Flow[list[Any]]:
    """One group's keys of one engine store (``adopt_keys``): ``_lay_out`` for one group;
    a group its validator failed as a whole raises that error."""
    [answers] = yield from _lay_out(call, batch, [_Shape(len(batch.keys), shared_prefix, pack)])
    if isinstance(answers, RouteplayError):
        raise answers
    return answers


@dataclass(frozen=True, slots=True)
class _Shape:
    """One group of a take: its member count (consecutive keys) and its layout."""

    members: int
    shared_prefix: int
    pack: bool


def _lay_out(
    call: _Call, batch: _Taken, shapes: Sequence[_Shape]
) -> Flow[list[list[Any] | RouteplayError]]:
    """Groups of one take (consecutive keys, ``shapes`` in order), laid out near the
    engine in one call and handed over in one: a member validated at ingest by its block,
    any other validated there from its raw payload. Per group, each member's rows as
    ``(StoreRef, start, stop)`` ranges or the refusal of that member only, or the typed
    error that failed the group alone. After a wait for validations at ingest, the
    layout gets the other half of the deadline (the adopter's caller waits for two)."""
    waited = yield from _decide_ingest(call, batch)
    out = batch.taken
    spans: list[range] = []
    goods: list[list[int]] = []
    requests: list[GroupRequest] = []
    payloads: list[Any] = []
    at = 0
    for shape in shapes:
        span = range(at, at + shape.members)
        at += shape.members
        good = [i for i in span if not isinstance(out[i], BaseException)]
        spans.append(span)
        goods.append(good)
        if good:
            requests.append(_request(batch, good, shape))
            payloads.extend(_payload(out[i]) for i in good)
    answers: list[GroupAnswer | RouteplayError] = []
    stored: list[list[StoreRef]] = []
    if requests:
        sent = call.steps.send_groups(batch.node, call.spec, requests, payloads)
        payloads.clear()
        for good in goods:
            for i in good:
                out[i] = None  # the raw payloads go once the validator is done with them
        what = _layout_what(requests)
        budget = call.timeout_s / 2 if waited else call.timeout_s
        [laid] = yield from awaiting([sent], what, timeout_s=budget)
        answers = list(laid.groups)
        stored = _hand_over(call, batch.node, laid.token, answers)
    results: list[list[Any] | RouteplayError] = []
    asked = iter(zip(answers, stored, strict=True)) if requests else iter(())
    for span, good in zip(spans, goods, strict=True):
        if good:
            answer, refs = next(asked)
            if isinstance(answer, RouteplayError):
                results.append(answer)
                continue
            for i, outcome in zip(good, answer.outcomes, strict=True):
                out[i] = _member_rows(outcome, answer, refs)
        results.append([out[i] for i in span])
    return results


def _request(batch: _Taken, good: list[int], shape: _Shape) -> GroupRequest:
    return GroupRequest(
        keys=tuple(batch.keys[i] for i in good),
        starts=tuple(batch.starts[i] for i in good),
        shared_prefix=shape.shared_prefix,
        pack=shape.pack,
        validated=tuple(isinstance(batch.taken[i], Validated) for i in good),
    )


def _payload(taken: Any) -> Any:
    """What a member's layout reads: its block validated at ingest, or its raw payload."""
    return taken.canonical[0] if isinstance(taken, Validated) else taken[0]


def _layout_what(requests: Sequence[GroupRequest]) -> str:
    members = sum(len(request.keys) for request in requests)
    if len(requests) == 1:
        return f"validate a group of {members} engine keys"
    return f"validate {len(requests)} groups of {members} engine keys"


def _hand_over(
    call: _Call, node: str, token: Any, answers: Sequence[GroupAnswer | RouteplayError]
) -> list[list[StoreRef]]:
    """Every accepted group's arrays taken by the shard in one call and stored in one
    step; per answer, its stored payloads (none for a failed group)."""
    accepted = [a for a in answers if isinstance(a, GroupAnswer)]
    payloads = [p for answer in accepted for p in answer.payloads]
    count = sum(p.blocks for p in payloads)
    stored: list[StoreRef] = []
    if count:
        blocks = call.steps.take_group(node, token, count)
        saved = sum(answer.saved_bytes for answer in accepted)
        stored = call.steps.adopt_many(blocks, payloads, saved)
    out: list[list[StoreRef]] = []
    at = 0
    for answer in answers:
        mine = len(answer.payloads) if isinstance(answer, GroupAnswer) else 0
        out.append(stored[at : at + mine])
        at += mine
    return out


def _member_rows(outcome: Any, answer: GroupAnswer, stored: Sequence[StoreRef]) -> Any:
    """A member's rows as ``(StoreRef, start, stop)`` ranges, or its refusal."""
    if isinstance(outcome, BaseException):
        return outcome
    return tuple((stored[p.array], p.start, p.stop) for p in answer.samples[outcome])


# -- many groups at once -------------------------------------------------------------------

GROUP_ROUND: Final = 16
"""Groups adopted together at most (one take, one layout call, one hand-over): enough to
share the calls, few enough that a round's payloads pinned in the engine node's object
store stay small and the next round's layout overlaps this one's hand-over."""


def key_rounds(batches: Sequence[KeyBatch], size: int = GROUP_ROUND) -> list[list[int]]:
    """A batched adoption's batches in rounds (positions into ``batches``, each once):
    groups of one engine store and one spec, ``size`` at most to a round, adopted
    together (``adopt_round``); any other batch (single keys, a group over several
    engine stores) a round of its own.

    Example:
        >>> key_rounds([group_a, group_b, single_keys])  # doctest: +SKIP
        [[2], [0, 1]]
    """
    rounds: list[list[int]] = []
    filling: dict[tuple[Where, RouteSpec, object], list[int]] = {}
    for index, batch in enumerate(batches):
        wheres = {(key.actor, key.namespace) for key in batch.keys}
        if not batch.grouped or len(wheres) != 1:
            rounds.append([index])
            continue
        # The spec's equality leaves out its degenerate-capture thresholds, which the
        # validation applies: a round shares its first batch's spec, all of it.
        current = filling.setdefault((wheres.pop(), batch.spec, batch.spec.degenerate), [])
        current.append(index)
        if len(current) == size:
            rounds.append(current.copy())
            current.clear()
    rounds.extend(current for current in filling.values() if current)
    return rounds


def adopt_round(
    batches: Sequence[KeyBatch], *, steps: AdoptionSteps, timeout_s: float
) -> Flow[list[list[Any] | RouteplayError]]:
    """One round of ``key_rounds``: per batch the answers ``adopt_keys`` gives it, or the
    typed error that failed it. A round of several groups of one engine store shares one
    take, one wait for validations at ingest, one layout call near the engine and one
    hand-over, where each group on its own costs three calls to other actors; an error
    of a call they share (the engine store or the validator lost, a deadline) fails every
    group of the round, as it would have failed each alone.

    Example:
        answers = drive(adopt_round([batches[i] for i in round_], steps=steps,
                                    timeout_s=60.0), ray_calls.RAY)
    """
    try:
        if len(batches) == 1:
            return [(yield from adopt_batch(batches[0], steps=steps, timeout_s=timeout_s))]
        return (yield from _adopt_groups(batches, steps, timeout_s))
    except RouteplayError as exc:  # without its frames, which hold the round's references
        # A copy each: every caller raises its own, and a raised error collects frames.
        return [copy.copy(exc.with_traceback(None)) for _ in batches]


def _adopt_groups(
    batches: Sequence[KeyBatch], steps: AdoptionSteps, timeout_s: float
) -> Flow[list[list[Any] | RouteplayError]]:
    first = batches[0].keys[0]
    where = (first.actor, first.namespace)
    call = _Call(spec=batches[0].spec, steps=steps, timeout_s=timeout_s)
    keys = [key for batch in batches for key in batch.keys]
    starts = [start for batch in batches for start in batch.start_rows()]
    engines = yield from steps.engines([where])
    taken = yield from _take(call, engines, where, keys, starts)
    shapes = [_Shape(len(b.keys), b.shared_prefix, b.pack) for b in batches]
    return (yield from _lay_out(call, taken, shapes))


def adopt_in_rounds(
    batches: Sequence[KeyBatch],
    adopt: Callable[[list[KeyBatch]], list[Any]],
    *,
    threads: int = 1,
) -> list[Any]:
    """Every batch of a batched adoption, by ``key_rounds``: ``adopt`` runs one round
    (``adopt_round`` driven on a backend), up to ``threads`` rounds at once; per batch,
    in order, what its round answered for it.

    Example:
        answers = adopt_in_rounds(batches, lambda picked: drive(adopt_round(
            picked, steps=steps, timeout_s=60.0), ray_calls.RAY), threads=4)
    """
    rounds = key_rounds(batches)
    picked = [[batches[i] for i in round_] for round_ in rounds]
    if threads <= 1 or len(picked) <= 1:
        return in_batch_order(len(batches), rounds, [adopt(one) for one in picked])
    workers = min(len(picked), threads)
    with ThreadPoolExecutor(workers, thread_name_prefix="routeplay-adopt") as pool:
        return in_batch_order(len(batches), rounds, pool.map(adopt, picked))


def in_batch_order(
    count: int, rounds: Sequence[Sequence[int]], answered: Iterable[Sequence[Any]]
) -> list[Any]:
    """Each round's answers put back at their batches' positions.

    Example:
        >>> in_batch_order(3, [[2], [0, 1]], [["c"], ["a", "b"]])
        ['a', 'b', 'c']
    """
    out: list[Any] = [None] * count
    for round_, answers in zip(rounds, answered, strict=True):
        for index, answer in zip(round_, answers, strict=True):
            out[index] = answer
    return out
