"""``SampleRouting``: the lifecycle steps on the embeddable routing value.

Three kinds of test: the step order is pinned through a store that records every lease
call, through the blocking steps and their awaitable twins alike (and a deliberately
swapped ``finish`` written here must fail the same check, so the check can fail); a
hypothesis state machine drives random steps, stale copies included, against the real
in-process store's lease tables; and an XTuner-shaped
mutable pydantic sample runs ingest -> partial -> resume -> finish -> buffer take-over
-> expire retryably -> train -> release without routeplay's ``RolloutState``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pydantic
import pytest
from faults import faulty_store
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.errors import (
    DuplicateExperts,
    HandleError,
    MalformedPayload,
    MisuseError,
    RoutesLost,
    RowCountMismatch,
    RunMismatch,
)
from routeplay.rollout import (
    ADAPTERS,
    BufferConfig,
    Group,
    Origin,
    ReplayBuffer,
    RolloutState,
    RoutingContinuation,
    RoutingRecord,
    SampleRouting,
    SessionLedger,
    StalenessBasis,
    Status,
    TraceStore,
    TrainingBatch,
    load_buffer,
    record_routings,
    record_sample,
    restore_sample,
    save_buffer,
)
from routeplay.rollout.fake_engines import FakeSglang
from routeplay.rollout.sample_routing import prefix_holder, sample_holder
from routeplay.rollout.trace_store import Exported
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.client.lease import Lease

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
PROMPT, FIRST, SECOND = 5, 4, 3


def truth(rows: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


def holders(store: RouteStore) -> dict[str, int]:
    return dict(store.stats().leases_by_holder)


@pytest.fixture
def store() -> RouteStore:
    return RouteStore.local(StoreConfig(run="routing"))


class LeaseLog:
    """Records every lease call, in order, as ``(call, holder)``: the store fake the order
    tests read (the real in-process store still does the work)."""

    def __init__(self, store: RouteStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        self.pins: list[bool] = []  # each acquire's pin (a rollout's leases pin nothing)
        acquire, clone, release = store.acquire, Lease.clone, Lease.release
        aacquire, aclone, arelease = store.aacquire, Lease.aclone, Lease.arelease

        def logged_acquire(handle: Handle, holder: str, *, pin: bool = True) -> Lease:
            self.calls.append(("acquire", holder))
            self.pins.append(pin)
            return acquire(handle, holder, pin=pin)

        def logged_clone(lease: Lease, holder: str) -> Lease:
            self.calls.append(("clone", holder))
            return clone(lease, holder)

        def logged_release(lease: Lease) -> None:
            if not lease.released:
                self.calls.append(("release", lease.holder))
            release(lease)

        async def logged_aacquire(handle: Handle, holder: str, *, pin: bool = True) -> Lease:
            self.calls.append(("acquire", holder))
            self.pins.append(pin)
            return await aacquire(handle, holder, pin=pin)

        async def logged_aclone(lease: Lease, holder: str) -> Lease:
            self.calls.append(("clone", holder))
            return await aclone(lease, holder)

        async def logged_arelease(lease: Lease) -> None:
            if not lease.released:
                self.calls.append(("release", lease.holder))
            await arelease(lease)

        monkeypatch.setattr(store, "acquire", logged_acquire)
        monkeypatch.setattr(Lease, "clone", logged_clone)
        monkeypatch.setattr(Lease, "release", logged_release)
        # the awaitable twins log the same names: their order must be the same
        monkeypatch.setattr(store, "aacquire", logged_aacquire)
        monkeypatch.setattr(Lease, "aclone", logged_aclone)
        monkeypatch.setattr(Lease, "arelease", logged_arelease)

    def clear(self) -> None:
        self.calls.clear()


FACES = pytest.mark.parametrize("face", ["blocking", "awaited"])
"""Run a test through the blocking steps and through their awaitable twins."""


def step(face: str, target: Any, name: str, *args: Any) -> Any:
    """The step ``name`` of ``target`` through ``face``: the blocking method, or its
    ``a``-twin awaited on an event loop of its own."""
    if face == "blocking":
        return getattr(target, name)(*args)
    return asyncio.run(getattr(target, f"a{name}")(*args))


class AwaitableTraces:
    """The in-process ``TraceStore`` behind the awaitable faces the async steps call
    (``TraceStoreClient``'s, on Ray: tests/ray/test_async_steps.py)."""

    def __init__(self, traces: TraceStore) -> None:
        self.traces = traces

    async def aexport(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None:
        return self.traces.export(session, token_ids, holder)

    async def ainsert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None:
        self.traces.insert(session, token_ids, handle)


def request(
    store: RouteStore,
    routing: SampleRouting,
    full: npt.NDArray[Any],
    input_tokens: int,
    new_tokens: int,
    version: int,
    traces: TraceStore | None = None,
    prompt_ids: tuple[int, ...] = (),
    finish: Callable[[RoutingContinuation, RouteStore, Handle], SampleRouting] | None = None,
    face: str = "blocking",
) -> SampleRouting:
    """One SGLang request of a sample, through the routing's own steps (``face``: the
    blocking ones or their awaitable twins)."""
    if face == "awaited":
        assert finish is None
        args = (store, routing, full, input_tokens, new_tokens, version, traces, prompt_ids)
        return asyncio.run(arequest(*args))
    with routing.continuation(traces, prompt_ids) as cont:
        body = FakeSglang(spec=SPEC).respond(
            full, prompt_tokens=input_tokens, completion_tokens=new_tokens, start_row=cont.rows
        )
        handle = cont.ingest(
            ADAPTERS["sglang"],
            body,
            spec=SPEC,
            writer=store,
            weight_version=version,
            start_row=cont.rows,
        )
        return (finish or RoutingContinuation.finish)(cont, store, handle)


async def arequest(
    store: RouteStore,
    routing: SampleRouting,
    full: npt.NDArray[Any],
    input_tokens: int,
    new_tokens: int,
    version: int,
    traces: TraceStore | None,
    prompt_ids: tuple[int, ...],
) -> SampleRouting:
    """``request`` through the awaitable twins."""
    source = AwaitableTraces(traces) if traces is not None else None
    async with await routing.acontinuation(source, prompt_ids) as cont:
        body = FakeSglang(spec=SPEC).respond(
            full, prompt_tokens=input_tokens, completion_tokens=new_tokens, start_row=cont.rows
        )
        handle = await cont.aingest(
            ADAPTERS["sglang"],
            body,
            spec=SPEC,
            writer=store,
            weight_version=version,
            start_row=cont.rows,
        )
        return await cont.afinish(store, handle)


def swapped_finish(cont: RoutingContinuation, store: RouteStore, handle: Handle) -> SampleRouting:
    """``finish`` with two steps swapped (the replaced lease released before the new one
    is acquired): the order check below must fail on it."""
    cont.check_open("finish")
    after, _ = cont.routing.try_release()
    if cont.borrowed is not None:
        after, _ = dataclasses.replace(after, lease=cont.borrowed).try_release()
    lease = store.acquire(handle, sample_holder(cont.routing.sample_id))
    cont.abandon()
    return after.attach(handle, lease, cont.origin)


# -- the step order, pinned -----------------------------------------------------------
def resume_order(
    store: RouteStore,
    log: LeaseLog,
    finish: Callable[[RoutingContinuation, RouteStore, Handle], SampleRouting] | None,
    face: str = "blocking",
) -> SampleRouting:
    """A partial rollout resumed; asserts finish's order: acquire, then release."""
    full = truth(PROMPT + FIRST + SECOND - 1)
    partial = request(store, SampleRouting(sample_id="a"), full, PROMPT, FIRST, 0, face=face)
    log.clear()
    resumed = request(store, partial, full, PROMPT + FIRST, SECOND, 1, finish=finish, face=face)
    assert log.calls == [("acquire", "rollout/a"), ("release", "rollout/a")]
    return resumed


@FACES
def test_finish_acquires_the_new_lease_before_releasing_the_replaced_one(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    log = LeaseLog(store, monkeypatch)
    resumed = resume_order(store, log, None, face)
    assert resumed.holds_lease
    assert resumed.rows == PROMPT + FIRST + SECOND - 1
    assert log.pins  # the sample's leases were acquired, pinning nothing in this process
    assert not any(log.pins)
    np.testing.assert_array_equal(store.read(resumed.handle), truth(resumed.rows))  # type: ignore[arg-type]
    step(face, resumed, "release")
    assert store.leaks() == []


def test_the_order_check_fails_when_finish_releases_first(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = LeaseLog(store, monkeypatch)
    with pytest.raises(RoutesLost):  # the history rows reached zero leases in between
        resume_order(store, log, swapped_finish)
    assert log.calls == [("release", "rollout/a"), ("acquire", "rollout/a")]  # != the pinned order


@FACES
def test_finish_on_a_borrowed_prefix_acquires_then_releases_the_borrowed_lease(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    traces = TraceStore(store)
    turn1_tokens = tuple(range(PROMPT + FIRST))
    first = SampleRouting(sample_id="t1", session_id="s")
    turn1 = request(store, first, truth(8), 5, 4, 0, face=face)
    turn1 = turn1.complete(prompt_tokens=PROMPT, response_tokens=FIRST)
    log = LeaseLog(store, monkeypatch)
    sink = traces if face == "blocking" else AwaitableTraces(traces)
    turn1 = step(face, turn1, "store_turn", sink, turn1_tokens)
    assert log.calls == [("acquire", "session/s"), ("release", "rollout/t1")]  # insert first
    prompt2 = (*turn1_tokens, 50, 51)
    full = np.concatenate([truth(8), truth(5, seed=3)])
    log.clear()
    second = SampleRouting(sample_id="b", session_id="s")
    turn2 = request(store, second, full, 11, 3, 1, traces, prompt2, face=face)
    assert log.calls == [
        ("acquire", prefix_holder("b")),  # borrow
        ("acquire", sample_holder("b")),  # finish: the new lease first
        ("release", prefix_holder("b")),  # then the borrowed one
    ]
    assert turn2.origin is Origin.BORROWED
    assert [seg.weight_version for seg in turn2.handle.segments] == [0, 1]  # type: ignore[union-attr]
    step(face, turn2, "release")
    traces.close()
    assert store.leaks() == []


@FACES
def test_take_over_clones_before_it_releases_and_expire_releases_before_reset(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    done = request(store, SampleRouting(sample_id="a"), truth(8), PROMPT, FIRST, 0, face=face)
    log = LeaseLog(store, monkeypatch)
    taken = step(face, done, "take_over", "buffer/g")
    assert log.calls == [("clone", "buffer/g"), ("release", "rollout/a")]
    assert taken.lease is not None
    assert taken.lease.holder == "buffer/g"
    with pytest.raises(MisuseError, match="live lease"):
        taken.reset()  # a reset before the release would drop a live lease: refused
    log.clear()
    retry, stuck, error = step(face, taken, "expire_retryably")
    assert log.calls == [("release", "buffer/g")]
    assert (retry.handle, retry.lease, retry.retries, stuck, error) == (None, None, 1, None, None)
    assert store.leaks() == []


@FACES
def test_claim_clones_or_acquires_and_hand_over_releases_after(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    done = request(store, SampleRouting(sample_id="a"), truth(8), PROMPT, FIRST, 0, face=face)
    log = LeaseLog(store, monkeypatch)
    unleased = dataclasses.replace(done, lease=None)
    fresh = step(face, unleased, "claim", "batch/1", store)  # no own lease: acquire
    cloned = step(face, done, "claim", "batch/2")  # a live lease: clone it
    assert step(face, unleased, "claim", "batch/3") is None  # nothing to clone, no store
    moved = step(face, done, "hand_over", cloned)
    assert step(face, moved, "hand_over", None) is moved
    gone, error = step(face, moved, "discard")
    ended, failure = step(face, dataclasses.replace(unleased, lease=fresh), "try_release")
    assert log.calls == [
        ("acquire", "batch/1"),
        ("clone", "batch/2"),
        ("release", "rollout/a"),  # hand_over: after the new lease exists
        ("release", "batch/2"),
        ("release", "batch/1"),
    ]
    assert (gone.lease, error, ended.lease, failure) == (None, None, None, None)
    assert store.leaks() == []


@FACES
def test_a_refused_new_lease_ends_the_borrowed_one_and_a_stuck_one_rides_along(
    store: RouteStore, face: str
) -> None:
    traces = TraceStore(store)
    turn1 = request(store, SampleRouting(sample_id="t1", session_id="s"), truth(8), 5, 4, 0)
    turn1 = turn1.store_turn(traces, tuple(range(PROMPT + FIRST)))
    other = RouteStore.local(StoreConfig(run="theirs"))
    foreign = other.put(canonicalize(truth(3), SPEC))  # another run's payload: refused
    turn2 = SampleRouting(sample_id="b", session_id="s")
    prompt = (*range(PROMPT + FIRST), 7)
    source = traces if face == "blocking" else AwaitableTraces(traces)
    cont = step(face, turn2, "continuation", source, prompt)
    assert cont.borrowed is not None
    with pytest.raises(RunMismatch):
        step(face, cont, "finish", store, foreign)
    assert cont.borrowed.released
    assert holders(store) == {"session/s": 1}
    traces.close()
    assert store.leaks() == []


@FACES
def test_store_turn_ends_the_own_lease_even_when_the_insert_is_refused(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    traces = TraceStore(store)
    sink = traces if face == "blocking" else AwaitableTraces(traces)
    empty = Handle(SPEC)
    short = SampleRouting(sample_id="t1", session_id="s").attach(
        empty, store.acquire(empty, "rollout/t1"), Origin.PRODUCED
    )
    log = LeaseLog(store, monkeypatch)
    with pytest.raises(HandleError):  # 0 rows for 11 tokens: the session refuses it
        step(face, short, "store_turn", sink, tuple(range(11)))
    assert log.calls == [("release", "rollout/t1")]
    with pytest.raises(MisuseError):  # no session, no routing: nothing is called
        step(face, SampleRouting(sample_id="x"), "store_turn", sink, ())
    assert store.leaks() == []


# -- completion checks rows against tokens ----------------------------------------------
def test_complete_refuses_rows_that_disagree_with_the_tokens(store: RouteStore) -> None:
    done = request(store, SampleRouting(sample_id="a"), truth(8), PROMPT, FIRST, 0)
    assert done.complete(prompt_tokens=PROMPT, response_tokens=FIRST).prompt_tokens == PROMPT
    with pytest.raises(RowCountMismatch, match="8 rows") as bad:
        done.complete(prompt_tokens=PROMPT, response_tokens=FIRST + 1)
    assert "sample a" in str(bad.value)
    with pytest.raises(RowCountMismatch, match="no routing"):
        SampleRouting(sample_id="b").complete(prompt_tokens=2, response_tokens=1)
    done.release()


def test_rolloutstate_completes_through_its_routing(store: RouteStore) -> None:
    state = RolloutState(sample_id="a", group_id="g", prompt_ids=tuple(range(PROMPT)))
    routing = request(store, state.sample_routing, truth(8), PROMPT, FIRST, 2)
    state = state.with_sample_routing(routing).extend((9,) * FIRST, (0.0,) * FIRST, 2)
    assert state.complete("stop").status is Status.COMPLETED
    with pytest.raises(RowCountMismatch):
        state.extend((9,), (0.0,), 2).complete("stop")
    assert state.staleness(5, StalenessBasis.RESPONSE_TOKENS) == 3
    with pytest.raises(MisuseError, match="routing of sample a"):
        state.with_sample_routing(SampleRouting(sample_id="b"))
    state.release()
    assert store.leaks() == []


# -- stale values -----------------------------------------------------------------------
def test_a_stale_value_or_copy_never_releases_a_later_holders_lease(store: RouteStore) -> None:
    first = request(store, SampleRouting(sample_id="a"), truth(8), PROMPT, FIRST, 0)
    assert first.lease is not None
    restore, args = first.lease.__reduce__()  # what pickling to another actor sends
    shipped = dataclasses.replace(first, lease=restore(*args))  # type: ignore[operator]
    buffered = first.take_over("buffer/g")
    trained = buffered.take_over("train/step-1")
    for stale in (first, shipped, buffered, first, shipped):  # each twice or more
        stale.release()
    assert holders(store) == {"train/step-1": 1}
    assert trained.holds_lease
    np.testing.assert_array_equal(store.read(trained.handle), truth(8))  # type: ignore[arg-type]
    trained.release()
    assert store.leaks() == []


def test_steps_never_change_the_value_they_are_called_on(store: RouteStore) -> None:
    first = request(store, SampleRouting(sample_id="a"), truth(8), PROMPT, FIRST, 0)
    before = copy.copy(first)
    first.take_over("buffer/g").release()
    assert first == before  # frozen: the same value
    assert first.lease is before.lease  # naming the same Lease object
    assert not first.holds_lease  # the shared Lease object remembers it ended


# -- staleness bases ----------------------------------------------------------------------
def test_the_two_staleness_bases_differ_on_borrowed_prompt_rows(store: RouteStore) -> None:
    traces = TraceStore(store)
    turn1_tokens = tuple(range(PROMPT + FIRST))
    turn1 = request(store, SampleRouting(sample_id="t1", session_id="s"), truth(8), 5, 4, 0)
    turn1.store_turn(traces, turn1_tokens)
    prompt2 = (*turn1_tokens, 50, 51)
    full = np.concatenate([truth(8), truth(5, seed=3)])
    turn2 = request(
        store, SampleRouting(sample_id="b", session_id="s"), full, 11, 3, 2, traces, prompt2
    ).complete(prompt_tokens=len(prompt2), response_tokens=3)
    assert turn2.staleness(2, StalenessBasis.EVERY_ROW) == 2  # prompt rows from version 0
    assert turn2.staleness(2, StalenessBasis.RESPONSE_TOKENS) == 0  # XTuner's rule
    with pytest.raises(MisuseError, match="prompt length"):
        dataclasses.replace(turn2, prompt_tokens=None).staleness(2, StalenessBasis.RESPONSE_TOKENS)
    for basis, kept in ((StalenessBasis.RESPONSE_TOKENS, 1), (StalenessBasis.EVERY_ROW, 0)):
        buffer: ReplayBuffer[SampleRouting] = ReplayBuffer(
            store, BufferConfig(max_staleness=1, staleness=basis)
        )
        extra = dataclasses.replace(turn2, lease=turn2.claim("rollout/b/extra"))
        buffer.add("g", [extra])  # turn2 keeps its own lease
        buffer.refresh(current_version=2)
        assert len(buffer) == kept
        buffer.close()
    turn2.release()
    traces.close()
    assert store.leaks() == []


# -- checkpoint record and restore of one sample ------------------------------------------
def test_one_routing_records_and_restores_by_value(store: RouteStore) -> None:
    full = truth(PROMPT + FIRST + SECOND - 1)
    partial = request(store, SampleRouting(sample_id="a", session_id="s"), full, 5, 4, 0)
    resumed = request(store, partial, full, PROMPT + FIRST, SECOND, 3)
    resumed = resumed.complete(prompt_tokens=PROMPT, response_tokens=FIRST + SECOND)
    record = RoutingRecord.of(resumed, store)
    resumed.release()
    assert store.stats().live_payloads == 0
    again = RoutingRecord.from_json(record.to_json(), record.array)
    back = again.restore(store, SPEC)
    assert (back.origin, back.session_id, back.prompt_tokens) == (Origin.RESTORED, "s", PROMPT)
    assert [(s.rows, s.weight_version) for s in back.handle.segments] == [(8, 0), (3, 3)]  # type: ignore[union-attr]
    np.testing.assert_array_equal(store.read(back.handle), full)  # type: ignore[arg-type]
    assert holders(store) == {"rollout/a": 1}
    back.release()
    bad = np.array(record.array)
    bad[1] = 0  # duplicate experts: a checkpoint is outside data
    with pytest.raises(DuplicateExperts, match="row 1"):
        RoutingRecord.from_json(record.to_json(), bad).restore(store, SPEC)
    with pytest.raises(MalformedPayload):
        RoutingRecord.from_json({"segments": [[1, 0]]}, None)
    [empty] = record_routings([SampleRouting(sample_id="e")], store)
    assert empty.restore(store, SPEC) == SampleRouting(sample_id="e")
    assert store.leaks() == []


def test_one_sample_of_any_type_records_and_restores(store: RouteStore) -> None:
    state = RolloutState(sample_id="a", group_id="g", prompt_ids=tuple(range(PROMPT)))
    routing = request(store, state.sample_routing, truth(8), PROMPT, FIRST, 2)
    state = state.with_sample_routing(routing).extend((9,) * FIRST, (0.0,) * FIRST, 2)
    record, rows = record_sample(state, store)
    state.release()
    back = restore_sample(json.loads(json.dumps(record)), rows, store, SPEC)
    assert (back.response_ids, back.weight_versions, back.routing.origin) == (
        state.response_ids,
        state.weight_versions,
        Origin.RESTORED,
    )
    assert back.routing.response_versions == state.weight_versions
    np.testing.assert_array_equal(store.read(back.routing.handle), truth(8))  # type: ignore[arg-type]
    assert holders(store) == {"rollout/a": 1}
    back.release()
    sample = XSample(uid=3, group_uid=1, prompt_ids=[1, 2], routing=SampleRouting(sample_id="3"))
    record, rows = record_sample(sample, store, codec=XCodec())
    assert rows is None
    again = restore_sample(record, rows, store, SPEC, codec=XCodec())
    assert (type(again), again.uid, again.routing.handle) == (XSample, 3, None)
    assert store.leaks() == []


# -- the state machine --------------------------------------------------------------------
class RoutingMachine(RuleBasedStateMachine):
    """Random steps on one sample, dead-shard releases, and releases of every stale value
    it left behind.

    Invariant: the store's live leases are exactly those the current value names (its own
    lease under its holder, and its stuck leases), whatever stale values released; at the
    end, after the shard heals, one release leaves none.
    """

    def __init__(self) -> None:
        super().__init__()
        self.store, self.faults = faulty_store("machine")
        self.current = SampleRouting(sample_id="m")
        self.stale: list[SampleRouting] = []
        self.holder = ""
        self.tokens = 0  # input tokens so far (prompt + response)
        self.version = 0

    def _step(self, nxt: SampleRouting) -> None:
        self.stale.append(self.current)
        self.current = nxt

    @precondition(lambda self: self.current.handle is None and not self.current.holds_lease)
    @rule(new=st.integers(1, 4))
    def generate(self, new: int) -> None:
        self.tokens = PROMPT + new
        self._step(request(self.store, self.current, truth(64), PROMPT, new, self.version))
        self.holder = sample_holder("m")

    @precondition(lambda self: self.current.holds_lease and self.tokens < 40)
    @rule(new=st.integers(1, 4))
    def resume(self, new: int) -> None:
        nxt = request(self.store, self.current, truth(64), self.tokens, new, self.version)
        self.tokens += new
        self._step(nxt)
        self.holder = sample_holder("m")

    @precondition(lambda self: self.current.holds_lease)
    @rule(holder=st.sampled_from(["buffer/g", "train/step-1", "buffer/h"]))
    def take_over(self, holder: str) -> None:
        self._step(self.current.take_over(holder))
        self.holder = holder

    @precondition(lambda self: self.current.holds_lease)
    @rule()
    def the_shard_of_the_own_lease_dies(self) -> None:
        assert self.current.lease is not None
        self.faults.lose_releases(self.current.lease)

    @rule()
    def the_shard_heals(self) -> None:
        self.faults.heal()

    @precondition(lambda self: self.current.handle is not None)
    @rule()
    def expire_retryably(self) -> None:
        retry, stuck, error = self.current.expire_retryably()
        assert (stuck is None) == (error is None)
        assert retry.retries == self.current.retries + 1
        assert not retry.holds_lease
        assert retry.unreleased == ()
        if stuck is not None:  # the stuck leases stay visible: keep them on the value
            retry = dataclasses.replace(retry, unreleased=stuck.unreleased)
        self._step(retry)

    @rule()
    def discard(self) -> None:
        after, _ = self.current.discard()
        self._step(after)

    @rule(data=st.data())
    def release_a_stale_value(self, data: st.DataObject) -> None:
        if self.stale:
            data.draw(st.sampled_from(self.stale)).try_release()

    @rule()
    def bump_version(self) -> None:
        self.version += 1

    @invariant()
    def the_store_holds_exactly_what_the_value_names(self) -> None:
        named: dict[str, int] = {}
        for lease in (self.current.lease, *self.current.unreleased):
            if lease is not None and not lease.released:
                named[lease.holder] = named.get(lease.holder, 0) + 1
        assert holders(self.store) == named
        if self.current.holds_lease:
            assert self.current.lease is not None
            assert self.current.lease.holder == self.holder
            assert self.store.read(self.current.handle).shape[0] == self.current.rows  # type: ignore[arg-type]

    def teardown(self) -> None:
        self.faults.heal()
        self.current.release()
        assert self.store.leaks() == []
        assert self.store.stats().live_payloads == 0


TestRoutingMachine = RoutingMachine.TestCase
TestRoutingMachine.settings = settings(
    max_examples=50,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)


# -- an XTuner-shaped mutable sample, never RolloutState ----------------------------------
class XStatus(str, Enum):
    INIT = "init"
    ABORTED = "aborted"
    COMPLETED = "completed"


class XSample(pydantic.BaseModel):
    """Shaped like XTuner's pydantic ``RolloutState``: mutable, int ids, its own status."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    uid: int
    group_uid: int
    prompt_ids: list[int]
    response_ids: list[int] = []
    status: XStatus = XStatus.INIT
    routing: SampleRouting

    @property
    def sample_routing(self) -> SampleRouting:
        return self.routing

    def with_sample_routing(self, routing: SampleRouting) -> XSample:
        self.routing = routing
        return self

    def reset_for_retry(self, routing: SampleRouting) -> XSample:
        self.response_ids, self.status = [], XStatus.INIT
        return self.with_sample_routing(routing)


def xrequest(store: RouteStore, sample: XSample, full: npt.NDArray[Any], new: int, v: int) -> None:
    """What an XTuner rollout worker would do for one request, mutating the sample."""
    inputs = len(sample.prompt_ids) + len(sample.response_ids)
    sample.routing = request(store, sample.routing, full, inputs, new, v)
    sample.response_ids += list(range(100, 100 + new))


def test_a_mutable_pydantic_sample_runs_the_whole_lifecycle_without_rolloutstate(
    store: RouteStore, tmp_path: Path
) -> None:
    full = truth(PROMPT + FIRST + SECOND - 1, seed=9)
    samples = [
        XSample(
            uid=i,
            group_uid=7,
            prompt_ids=list(range(PROMPT)),
            routing=SampleRouting(sample_id=str(i), session_id="sess"),
        )
        for i in range(2)
    ]
    ledger = SessionLedger(lambda sid: None)
    ledger.hold(*samples)
    for sample in samples:
        xrequest(store, sample, full, FIRST, 0)  # ingest
        sample.status = XStatus.ABORTED  # partial rollout: interrupted
        xrequest(store, sample, full, SECOND, 1)  # resume, then finish
        sample.routing = sample.routing.complete(
            prompt_tokens=len(sample.prompt_ids), response_tokens=len(sample.response_ids)
        )
        sample.status = XStatus.COMPLETED
    assert holders(store) == {"rollout/0": 1, "rollout/1": 1}
    buffer: ReplayBuffer[XSample] = ReplayBuffer(
        store, BufferConfig(max_staleness=1, staleness=StalenessBasis.RESPONSE_TOKENS)
    )
    buffer.add("7", samples)  # take-over: the buffer's leases, the rollout's end
    assert holders(store) == {"buffer/7": 2}
    assert all(s.routing.lease.holder == "buffer/7" for s in samples)  # type: ignore[union-attr]
    retried, _ = buffer.refresh(current_version=3)  # response tokens at 0 and 1: stale
    assert sorted(retried) == ["0", "1"]
    assert holders(store) == {}
    again = buffer.take_retries()
    assert [(s.status, s.response_ids, s.routing.retries) for s in again] == [
        (XStatus.INIT, [], 1)
    ] * 2
    for sample in again:
        xrequest(store, sample, full, FIRST + SECOND, 3)
        sample.routing = sample.routing.complete(prompt_tokens=PROMPT, response_tokens=7)
    buffer.add("7", again)
    with pytest.raises(RowCountMismatch):  # a sample whose tokens drifted from its rows
        again[0].routing.complete(prompt_tokens=PROMPT, response_tokens=6)
    save_buffer(buffer, tmp_path, SPEC, codec=XCodec())
    groups: list[Group[XSample]] = buffer.sample(1, current_version=3)
    with TrainingBatch(3, groups, sessions=ledger) as batch:
        assert holders(store) == {"train/step-3": 2}
        for sample in batch.states:
            np.testing.assert_array_equal(store.read(sample.routing.handle), full)  # type: ignore[arg-type]
    assert ledger.sessions() == []
    restored = load_buffer(tmp_path, store, BufferConfig(), codec=XCodec())
    [back] = restored.groups()
    assert [type(s) for s in back.states] == [XSample, XSample]
    assert back.states[1].uid == 1
    assert back.states[1].routing.origin is Origin.RESTORED
    np.testing.assert_array_equal(store.read(back.states[1].routing.handle), full)  # type: ignore[arg-type]
    restored.close()
    buffer.close()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


class XCodec:
    """The sample's own fields for a buffer checkpoint (what XTuner would serialize)."""

    def to_record(self, sample: XSample) -> dict[str, Any]:
        return {
            "uid": sample.uid,
            "group_uid": sample.group_uid,
            "prompt_ids": sample.prompt_ids,
            "response_ids": sample.response_ids,
            "status": sample.status.value,
        }

    def from_record(self, record: dict[str, Any], routing: SampleRouting) -> XSample:
        return XSample(
            uid=record["uid"],
            group_uid=record["group_uid"],
            prompt_ids=record["prompt_ids"],
            response_ids=record["response_ids"],
            status=XStatus(record["status"]),
            routing=routing,
        )
