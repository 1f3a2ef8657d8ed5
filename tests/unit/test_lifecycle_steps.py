"""A ``RolloutState``'s routing steps (its embedded ``SampleRouting``: ``continuation``,
``ingest``, ``finish``, ``borrow_prefix``, ``store_turn``) on the in-process store.

Each ownership rule has a test that fails if the rule is broken. The central one (take
the new lease before releasing the borrowed one) is observed through the store's own
lease tables: ``WatchedBackend`` snapshots every shard's ``TableStats`` after each store
call, so a payload that dropped to zero leases at any moment (``released_payloads``
going up) is seen even if it was never read afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from faults import faulty_store

from routeplay.core import Handle, RouteSpec, StoreRef, canonicalize
from routeplay.errors import EngineUnavailable, HandleError, MisuseError, RoutesLost, RunMismatch
from routeplay.rollout import ADAPTERS, Origin, RolloutState, Status, TraceStore
from routeplay.rollout.fake_engines import FakeLmdeployKey, FakeSglang
from routeplay.rollout.routing_terms import prefix_holder, sample_holder
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend
from routeplay.store.shard.api import ShardApi, ShardCall, shard_call
from routeplay.store.shard.lease_table import TableStats

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
PROMPT, FIRST, SECOND = 6, 5, 4  # prompt tokens, generated before and after a resume


class WatchedBackend:
    """A ``LocalBackend`` that snapshots every shard's table after each store call."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.snapshots: list[TableStats] = []

    def _watch(self) -> None:
        shards = range(self.inner.shard_count)
        calls = [shard_call(i, ShardApi.stats) for i in shards]
        self.snapshots.extend(self.inner.call(calls, "watch"))

    def most_released(self) -> int:
        """The most payloads any shard had dropped at any snapshot."""
        return max((s.released_payloads for s in self.snapshots), default=0)

    @property
    def shard_count(self) -> int:
        return self.inner.shard_count

    def call(
        self, calls: Sequence[ShardCall[Any]], what: str, *, timeout_s: float | None = None
    ) -> list[Any]:
        try:
            return self.inner.call(calls, what, timeout_s=timeout_s)
        finally:
            self._watch()

    def put_blocks(self, blocks: Sequence[Any]) -> list[Any]:
        return self.inner.put_blocks(blocks)

    def fetch(self, refs: Sequence[Any], what: str) -> list[Any]:
        return self.inner.fetch(refs, what)

    def fetch_as_created(
        self, refs: Sequence[Any], what: str
    ) -> Iterator[tuple[list[int], list[Any]]]:
        return self.inner.fetch_as_created(refs, what)

    def lost_index(self, refs: Sequence[Any], error: BaseException) -> int | None:
        return None

    def __getattr__(self, name: str) -> Any:
        # Every other backend call (batched acquires, async releases, borrows) goes to the
        # real backend and is watched too, so no store path escapes the snapshots.
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self._watch()

        return watched

    def shutdown(self) -> None:
        self.inner.shutdown()


@pytest.fixture
def watched() -> tuple[RouteStore, WatchedBackend]:
    config = StoreConfig(run="steps")
    backend = WatchedBackend(LocalBackend(config.run, shards=config.shards, ttl_s=config.ttl_s))
    return RouteStore(config, backend), backend


def truth(rows: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


def holders(store: RouteStore) -> dict[str, int]:
    return dict(store.stats().leases_by_holder)


def generate(
    store: RouteStore, state: RolloutState, full: npt.NDArray[Any], new_tokens: int, version: int
) -> RolloutState:
    """One SGLang request through the steps, as a rollout worker makes it (no traces)."""
    return _request(store, None, state, full, new_tokens, version)


def _request(
    store: RouteStore,
    traces: TraceStore | None,
    state: RolloutState,
    full: npt.NDArray[Any],
    new_tokens: int,
    version: int,
) -> RolloutState:
    with state.routing.continuation(traces, state.prompt_ids) as cont:
        body = FakeSglang(spec=SPEC).respond(
            full, prompt_tokens=state.tokens, completion_tokens=new_tokens, start_row=cont.rows
        )
        handle = cont.ingest(
            ADAPTERS["sglang"],
            body,
            spec=SPEC,
            writer=store,
            weight_version=version,
            start_row=cont.rows,
        )
        routed = state.with_sample_routing(cont.finish(store, handle))
    tokens = tuple(range(1000, 1000 + new_tokens))
    return routed.extend(tokens, (0.0,) * new_tokens, version)


def store_turn(traces: TraceStore, state: RolloutState) -> RolloutState:
    """``state``'s finished turn handed to its session (the routing's ``store_turn``)."""
    turn = state.routing.store_turn(traces, state.prompt_ids + state.response_ids)
    return state.with_sample_routing(turn)


def fresh(sid: str = "a", session: str | None = None) -> RolloutState:
    return RolloutState(
        sample_id=sid, group_id="g", prompt_ids=tuple(range(PROMPT)), session_id=session
    )


# -- take the new lease, then release the replaced one -------------------------------------
def test_a_resume_keeps_its_history_rows_leased_throughout(
    watched: tuple[RouteStore, WatchedBackend],
) -> None:
    store, backend = watched
    full = truth(PROMPT + FIRST + SECOND - 1)
    first = generate(store, fresh(), full, FIRST, version=0).with_status(Status.ABORTED, "abort")
    assert first.routing.origin is Origin.PRODUCED
    resumed = generate(store, first, full, SECOND, version=1)

    assert backend.most_released() == 0  # the first payload never reached zero leases
    assert holders(store) == {sample_holder("a"): 1}  # the input's lease ended, once
    assert resumed.routing.handle is not None
    assert resumed.routing.holds_lease
    np.testing.assert_array_equal(store.read(resumed.routing.handle), full)
    # the resume stored only the rows its history lacked, under the new version
    assert [s.weight_version for s in resumed.routing.handle.segments] == [0, 1]
    assert store.stats().live_bytes == SPEC.nbytes(full.shape[0])
    assert resumed.routing.origin is Origin.PRODUCED  # a resume keeps its origin
    resumed.release()
    assert store.leaks() == []


def test_a_borrowed_prefix_that_is_its_only_lease_survives_finish(
    watched: tuple[RouteStore, WatchedBackend],
) -> None:
    # The session goes while turn 2 is being generated: the borrowed lease is then the
    # only lease on turn 1's rows. Releasing it before taking the new one would drop them.
    store, backend = watched
    traces = TraceStore(store)
    turn1 = generate(store, fresh("t1", session="s"), truth(PROMPT + FIRST - 1), FIRST, 0)
    store_turn(traces, turn1)
    full = np.concatenate([truth(PROMPT + FIRST - 1), truth(7, seed=5)])
    turn2 = RolloutState(
        sample_id="b",
        group_id="g",
        prompt_ids=turn1.prompt_ids + turn1.response_ids + (7, 8),
        session_id="s",
    )
    with turn2.routing.continuation(traces, turn2.prompt_ids) as cont:
        assert cont.borrowed is not None
        assert cont.borrowed.holder == prefix_holder("b")
        traces.release_session("s")
        assert holders(store) == {prefix_holder("b"): 1}
        body = FakeSglang(spec=SPEC).respond(
            full, prompt_tokens=turn2.tokens, completion_tokens=SECOND, start_row=cont.rows
        )
        handle = cont.ingest(
            ADAPTERS["sglang"],
            body,
            spec=SPEC,
            writer=store,
            weight_version=1,
            start_row=cont.rows,
        )
        routed = turn2.with_sample_routing(cont.finish(store, handle))

    assert backend.most_released() == 0
    assert holders(store) == {sample_holder("b"): 1}
    assert routed.routing.origin is Origin.BORROWED
    np.testing.assert_array_equal(store.read(handle), full[: turn2.tokens + SECOND - 1])
    routed.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def test_the_watch_sees_a_payload_dropped_by_the_wrong_order(
    watched: tuple[RouteStore, WatchedBackend],
) -> None:
    # The control of the tests above: release first, then lease, and the watch sees it.
    store, backend = watched
    first = generate(store, fresh(), truth(PROMPT + FIRST - 1), FIRST, version=0)
    assert first.routing.handle is not None
    first.release()
    assert backend.most_released() == 1
    with pytest.raises(RoutesLost, match="last lease was released"):
        store.acquire(first.routing.handle, sample_holder("a"))


# -- a trace session's export is the sample's own lease ------------------------------------
def test_an_export_and_the_session_release_independently() -> None:
    store = RouteStore.local(StoreConfig(run="export"))
    traces = TraceStore(store)
    turn1 = generate(store, fresh("t1", session="s"), truth(PROMPT + FIRST - 1), FIRST, 0)
    after = store_turn(traces, turn1)
    assert not after.routing.holds_lease
    assert holders(store) == {"session/s": 1}

    turn2 = RolloutState(
        sample_id="b",
        group_id="g",
        prompt_ids=turn1.prompt_ids + turn1.response_ids,
        session_id="s",
    )
    exported = turn2.routing.borrow_prefix(traces, turn2.prompt_ids)
    assert exported is not None
    assert exported.lease.holder == prefix_holder("b")
    traces.release_session("s")  # the sample's lease keeps the rows
    np.testing.assert_array_equal(
        store.read(exported.handle), truth(PROMPT + FIRST - 1)[: exported.rows]
    )
    traces.insert("s", turn2.prompt_ids, turn1.routing.handle)  # type: ignore[arg-type]
    exported.lease.release()  # and releasing the sample leaves the session alone
    assert holders(store) == {"session/s": 1}
    traces.close()
    no_session = fresh("c")
    assert no_session.routing.borrow_prefix(traces, no_session.prompt_ids) is None
    assert store.leaks() == []


# -- failures keep every lease named --------------------------------------------------------
def test_a_failed_request_ends_the_borrowed_lease_and_leaves_the_input_to_the_caller() -> None:
    store = RouteStore.local(StoreConfig(run="fail"))
    traces = TraceStore(store)
    turn1 = generate(store, fresh("t1", session="s"), truth(PROMPT + FIRST - 1), FIRST, 0)
    store_turn(traces, turn1)
    turn2 = RolloutState(
        sample_id="b",
        group_id="g",
        prompt_ids=turn1.prompt_ids + turn1.response_ids,
        session_id="s",
    )
    cont = turn2.routing.continuation(traces, turn2.prompt_ids)
    assert holders(store) == {"session/s": 1, prefix_holder("b"): 1}
    with pytest.raises(EngineUnavailable), cont:
        raise EngineUnavailable("the engine could not be reached")
    assert cont.borrowed is not None
    assert cont.borrowed.released
    assert holders(store) == {"session/s": 1}

    interrupted = generate(store, fresh("a"), truth(PROMPT + FIRST - 1), FIRST, 0)
    with pytest.raises(EngineUnavailable), interrupted.routing.continuation() as cont:
        raise EngineUnavailable("the engine could not be reached")
    assert interrupted.routing.holds_lease  # the caller still holds (and releases) its input
    assert holders(store) == {"session/s": 1, sample_holder("a"): 1}
    interrupted.release()
    traces.close()
    assert store.leaks() == []


def test_a_refused_new_lease_ends_the_borrowed_one_and_not_the_input() -> None:
    store = RouteStore.local(StoreConfig(run="mine"))
    other = RouteStore.local(StoreConfig(run="theirs"))
    traces = TraceStore(store)
    turn1 = generate(store, fresh("t1", session="s"), truth(PROMPT + FIRST - 1), FIRST, 0)
    store_turn(traces, turn1)
    foreign = other.put(canonicalize(truth(3), SPEC))  # acquire refuses it: another run's payload
    turn2 = RolloutState(
        sample_id="b",
        group_id="g",
        prompt_ids=turn1.prompt_ids + turn1.response_ids,
        session_id="s",
    )
    with pytest.raises(RunMismatch), turn2.routing.continuation(traces, turn2.prompt_ids) as cont:
        cont.finish(store, foreign)
    assert holders(store) == {"session/s": 1}

    interrupted = generate(store, fresh("a"), truth(PROMPT + FIRST - 1), FIRST, 0)
    with pytest.raises(RunMismatch), interrupted.routing.continuation() as cont:
        cont.finish(store, foreign)
    assert interrupted.routing.holds_lease
    assert holders(store)[sample_holder("a")] == 1
    interrupted.release()
    traces.close()
    assert store.leaks() == []


def test_a_replaced_lease_that_cannot_be_released_rides_along() -> None:
    store, faults = faulty_store("stuck")
    traces = TraceStore(store)
    turn1 = generate(store, fresh("t1", session="s"), truth(PROMPT + FIRST - 1), FIRST, 0)
    store_turn(traces, turn1)
    full = np.concatenate([truth(PROMPT + FIRST - 1), truth(3, seed=2)])
    turn2 = RolloutState(
        sample_id="b",
        group_id="g",
        prompt_ids=turn1.prompt_ids + turn1.response_ids + (1,),
        session_id="s",
    )
    with turn2.routing.continuation(traces, turn2.prompt_ids) as cont:
        assert cont.borrowed is not None
        faults.lose_releases(cont.borrowed)
        body = FakeSglang(spec=SPEC).respond(
            full, prompt_tokens=turn2.tokens, completion_tokens=2, start_row=cont.rows
        )
        handle = cont.ingest(
            ADAPTERS["sglang"],
            body,
            spec=SPEC,
            writer=store,
            weight_version=1,
            start_row=cont.rows,
        )
        routed = turn2.with_sample_routing(cont.finish(store, handle))  # the new lease is kept
    assert routed.routing.holds_lease
    assert routed.routing.stuck
    assert [lease.holder for lease in routed.routing.unreleased] == [prefix_holder("b")]
    faults.heal()
    routed.release()
    traces.close()
    assert store.leaks() == []


# -- adopt or put ---------------------------------------------------------------------------
def test_an_engine_key_is_adopted_unread_and_a_resume_keeps_its_history() -> None:
    backend = LocalBackend("keys", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="keys"), backend)
    engine = backend.engine_store()
    fake = FakeLmdeployKey(spec=SPEC, put=engine.put)
    full = truth(PROMPT + FIRST + SECOND - 1)

    def request(state: RolloutState, new: int, version: int) -> RolloutState:
        with state.routing.continuation() as cont:
            body = fake.respond(full, prompt_tokens=state.tokens, completion_tokens=new)
            handle = cont.ingest(
                ADAPTERS["lmdeploy"], body, spec=SPEC, writer=store, weight_version=version
            )
            routed = state.with_sample_routing(cont.finish(store, handle))
        return routed.extend(tuple(range(new)), (0.0,) * new, version)

    first = request(fresh(), FIRST, 0)
    assert first.routing.handle is not None
    [source] = first.routing.handle.sources()
    assert isinstance(source, StoreRef)  # adopted: validated once, now a store payload
    assert engine.stats().live_keys == 0  # the key was consumed by the adoption
    resumed = request(first, SECOND, 1)
    assert resumed.routing.handle is not None
    assert [s.weight_version for s in resumed.routing.handle.segments] == [0, 1]
    np.testing.assert_array_equal(store.read(resumed.routing.handle), full)
    resumed.release()
    assert store.leaks() == []


# -- a turn goes to its session -------------------------------------------------------------
def test_store_turn_leases_for_the_session_before_ending_the_sample(
    watched: tuple[RouteStore, WatchedBackend],
) -> None:
    store, backend = watched
    traces = TraceStore(store)
    turn1 = generate(store, fresh("t1", session="s"), truth(PROMPT + FIRST - 1), FIRST, 0)
    after = store_turn(traces, turn1)
    assert backend.most_released() == 0
    assert not after.routing.holds_lease
    assert holders(store) == {"session/s": 1}
    traces.close()
    assert backend.most_released() == 1  # the session's release was the last one


def test_store_turn_ends_the_sample_even_when_the_insert_is_refused() -> None:
    store = RouteStore.local(StoreConfig(run="refused"))
    traces = TraceStore(store)
    sample = generate(store, fresh("t1", session="s"), truth(PROMPT + FIRST - 1), FIRST, 0)
    released = sample.release()
    empty = Handle(SPEC)
    lease = store.acquire(empty, "rollout/t1")
    short = released.with_sample_routing(released.routing.attach(empty, lease, Origin.PRODUCED))
    with pytest.raises(HandleError):  # 0 rows for 11 tokens
        store_turn(traces, short)
    assert store.leaks() == []
    with pytest.raises(MisuseError):
        store_turn(traces, fresh("x"))  # no session, no routing


# -- one continuation, one request ----------------------------------------------------------
def test_a_continuation_is_single_use() -> None:
    store = RouteStore.local(StoreConfig(run="once"))
    sample = generate(store, fresh(), truth(PROMPT + FIRST - 1), FIRST, 0)
    cont = sample.routing.continuation()
    assert cont.rows == PROMPT + FIRST - 1
    assert sample.routing.handle is not None
    resumed = sample.with_sample_routing(cont.finish(store, sample.routing.handle))  # a new lease
    with pytest.raises(MisuseError):
        cont.finish(store, sample.routing.handle)
    with pytest.raises(MisuseError):
        cont.ingest(ADAPTERS["sglang"], {}, spec=SPEC, writer=store, weight_version=0)
    resumed.release()
    with fresh("b").routing.continuation() as unused:
        assert (unused.rows, unused.history, unused.origin) == (0, None, Origin.PRODUCED)
    assert store.leaks() == []


def test_a_lost_store_call_inside_finish_leaves_nothing_unnamed() -> None:
    # The input's own lease cannot be released (a dead shard): the result names it.
    store, faults = faulty_store("lost-input")
    interrupted = generate(store, fresh(), truth(PROMPT + FIRST - 1), FIRST, 0)
    assert interrupted.routing.lease is not None
    assert interrupted.routing.handle is not None
    faults.lose_releases(interrupted.routing.lease)
    with interrupted.routing.continuation() as cont:
        routed = interrupted.with_sample_routing(cont.finish(store, interrupted.routing.handle))
    assert routed.routing.holds_lease
    assert routed.routing.stuck
    with pytest.raises(RoutesLost):
        routed.release()
    faults.heal()
    routed.release()
    assert store.leaks() == []
