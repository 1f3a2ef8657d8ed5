"""Ownership regressions: one test per routing-lifetime failure XTuner shipped (DESIGN.md §2).

Every test runs the same scenario twice:

- ``routeplay``: the lease-based lifecycle (``ReplayBuffer``, ``TraceStore``,
  ``TrainingBatch``, checkpoints): every holder ends only its own lease. It must pass.
- ``naive``: a few lines in this file that behave like XTuner's cleanup helpers: they
  *free every reference they see* (borrowed ones included), or never release at all.
  "Free" is modelled on the same ``RouteStore``: ``force_free`` ends every lease that
  names a payload of the handle, which is what ``ray.internal.free`` did to an object
  whoever else still held it. The naive run must show the failure: a ``RoutesLost`` on a
  later read, or a lease (or an owner-less payload) still alive at the end.

So each test proves both that the failure is real and that routeplay does not have it.
The tests at the end (``test_bug_*``) pin bugs that were found (and fixed) while
writing these.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.core.handle import StoreRef
from routeplay.errors import DuplicateExperts, LifetimeError, RoutesLost
from routeplay.rollout import (
    ADAPTERS,
    BufferConfig,
    Group,
    Origin,
    ReplayBuffer,
    RolloutState,
    SampleRouting,
    SessionLedger,
    Status,
    TraceStore,
    TrainingBatch,
    load_buffer,
    save_buffer,
    session_holder,
)
from routeplay.rollout.fake_engines import (
    FAKE_ENGINES,
    FakeEngine,
    FakeLmdeployInline,
    FakeLmdeployKey,
    FakeSglang,
    FakeVllmHttp,
    FakeVllmInProcess,
)
from routeplay.rollout.token_trie import TokenTrie
from routeplay.rollout.trace_store import TraceEntry
from routeplay.store import Lease, RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend
from routeplay.store.shard.api import ShardApi, shard_call
from routeplay.store.shard.shard import shard_of

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
TURN = tuple(range(100, 110))  # 10 tokens: prompt 6 + response 4 -> rows [0, 9)
PROMPT = 6
IMPLS = ("routeplay", "naive")


# -- ground truth and engines ---------------------------------------------------------
def truth(rows: int, seed: int) -> npt.NDArray[np.uint8]:
    """Valid routing rows (distinct experts per row and layer) the fake engine is given."""
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


def engine(name: str, store: RouteStore) -> FakeEngine:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    fakes: dict[str, Any] = {
        "vllm": FakeVllmHttp(spec=SPEC),
        "vllm-inprocess": FakeVllmInProcess(spec=SPEC),
        "sglang": FakeSglang(spec=SPEC),
        "lmdeploy-inline": FakeLmdeployInline(spec=SPEC),
        "lmdeploy-key": FakeLmdeployKey(spec=SPEC, put=backend.engine_store().put),
    }
    return fakes[name]  # type: ignore[no-any-return]


def ingest(
    store: RouteStore,
    full: npt.NDArray[np.uint8],
    *,
    prompt: int,
    completion: int,
    version: int = 0,
    history: Handle | None = None,
    name: str = "sglang",
) -> Handle:
    """One engine response for ``prompt + completion`` tokens, through its adapter."""
    fake = engine(name, store)
    start = history.rows if history is not None and fake.supports_start else 0
    response = fake.respond(
        full, prompt_tokens=prompt, completion_tokens=completion, start_row=start
    )
    return ADAPTERS[fake.adapter].ingest(
        response, spec=SPEC, writer=store, weight_version=version, history=history, start_row=start
    )


def completed(
    sid: str,
    tokens: Sequence[int],
    *,
    group: str = "g",
    version: int = 0,
    session: str | None = None,
    status: Status = Status.COMPLETED,
) -> RolloutState:
    """A sample of ``tokens`` (the first ``PROMPT`` are the prompt), without routing yet."""
    response = tuple(tokens[PROMPT:])
    state = RolloutState(
        sample_id=sid, group_id=group, prompt_ids=tuple(tokens[:PROMPT]), session_id=session
    )
    return state.extend(response, (-0.5,) * len(response), version).with_status(status, "stop")


def attached(state: RolloutState, handle: Handle, lease: Lease, origin: Origin) -> RolloutState:
    """``state`` holding ``handle`` under ``lease`` (its routing's ``attach`` step)."""
    return state.with_sample_routing(state.routing.attach(handle, lease, origin))


def attempt(read: Callable[[], npt.NDArray[Any]]) -> npt.NDArray[Any] | str:
    """The rows a read returns, or the name of the lifetime error it raised."""
    try:
        return read()
    except LifetimeError as exc:
        return type(exc).__name__


def assert_rows(result: npt.NDArray[Any] | str, rows: npt.NDArray[Any]) -> None:
    assert not isinstance(result, str), f"the read failed with {result}"
    np.testing.assert_array_equal(result, rows)


def holders(store: RouteStore) -> dict[str, int]:
    return dict(store.stats().leases_by_holder)


def leaked(store: RouteStore) -> list[str]:
    return sorted(record.holder for record in store.leaks())


@pytest.fixture
def store() -> RouteStore:
    # One shard: each Lease is one lease id, so per-holder counts are lease counts.
    return RouteStore.local(StoreConfig(run="regressions", shards=1))


# -- the naive lifecycle: XTuner's cleanup helpers ------------------------------------
def force_free(store: RouteStore, handle: Handle | None) -> None:
    """``ray.internal.free`` on every ref reachable from ``handle``: each payload goes,
    whoever else holds it (every lease naming it ends, the session's and siblings' too)."""
    if handle is None:
        return
    payloads = {src.payload_id for src in handle.sources() if isinstance(src, StoreRef)}
    for record in store.leaks():
        if payloads & set(record.payloads):
            shard = shard_of(record.payloads[0])
            store.backend.call([shard_call(shard, ShardApi.release, record.lease_id)], "naive free")


def unleased(state: RolloutState) -> RolloutState:
    """The state with its lease reference dropped (naive code never asks who holds it)."""
    return state.with_sample_routing(dataclasses.replace(state.routing, lease=None))


class NaiveBuffer:
    """A replay buffer whose reset, discard and close free every ref a sample points at."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self._groups: dict[str, list[RolloutState]] = {}
        self.retry_queue: list[RolloutState] = []

    def add(self, group_id: str, states: Sequence[RolloutState]) -> None:
        self._groups[group_id] = list(states)  # no lease of its own: it "has the refs"

    def refresh(self, current_version: int) -> tuple[list[str], list[str]]:
        retried: list[str] = []
        for group_id, states in list(self._groups.items()):
            if max(s.staleness(current_version) for s in states) > 1:
                del self._groups[group_id]
                for state in states:
                    force_free(self.store, state.routing.handle)  # "the old response is garbage"
                    self.retry_queue.append(unleased(state).reset_response())
                    retried.append(state.sample_id)
        return retried, []

    def discard(self, group_id: str) -> bool:
        states = self._groups.pop(group_id, None)
        for state in states or ():
            force_free(self.store, state.routing.handle)
        return states is not None

    def groups(self) -> list[Group]:
        return [Group(group_id=g, states=tuple(s)) for g, s in self._groups.items()]

    def close(self) -> None:
        for group_id in list(self._groups):
            self.discard(group_id)


class NaiveTraces(TraceStore):
    """A trace store whose overwrite either drops the old value (XTuner: leaked) or frees
    every ref of it (the obvious fix of that leak: breaks samples exported from it)."""

    def __init__(self, store: RouteStore, on_overwrite: str) -> None:
        super().__init__(store)
        self._on_overwrite = on_overwrite

    def insert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None:
        lease = self._store.acquire(handle, session_holder(session))
        trie = self._tries.setdefault(session, TokenTrie())
        old = trie.insert(token_ids, TraceEntry(handle, lease))
        if old is not None and self._on_overwrite == "free":
            force_free(self._store, old.handle)
        # on_overwrite == "drop": the old entry and its lease are simply forgotten


class Routeplay:
    """The lifecycle under test."""

    name = "routeplay"

    @staticmethod
    def buffer(store: RouteStore) -> ReplayBuffer | NaiveBuffer:
        return BufferConfig(max_staleness=1, max_retries=1).build(store)

    @staticmethod
    def traces(store: RouteStore, on_overwrite: str = "drop") -> TraceStore:
        return TraceStore(store)

    @staticmethod
    def resume(store: RouteStore, state: RolloutState, resumed: Handle) -> RolloutState:
        """Partial-rollout post-processing: lease the new handle, end only our old lease."""
        lease = store.acquire(resumed, f"rollout/{state.sample_id}")
        return attached(state.release(), resumed, lease, state.routing.origin)

    @staticmethod
    def train(
        step: int,
        groups: Sequence[Group],
        traces: TraceStore,
        run_step: Callable[[Sequence[RolloutState]], None],
    ) -> None:
        with TrainingBatch(step, groups, release_session=traces.release_session) as batch:
            run_step(batch.states)

    @staticmethod
    def restore(folder: Path, store: RouteStore) -> ReplayBuffer | NaiveBuffer:
        return load_buffer(folder, store, BufferConfig())

    @staticmethod
    def batch(
        step: int, groups: Sequence[Group], ledger: SessionLedger, traces: TraceStore
    ) -> TrainingBatch:
        """The batch tells the ledger its samples are done; the last one ends a session."""
        return TrainingBatch(step, groups, sessions=ledger)


class Naive:
    """XTuner's lifecycle, in the smallest form that shows each failure."""

    name = "naive"

    @staticmethod
    def buffer(store: RouteStore) -> ReplayBuffer | NaiveBuffer:
        return NaiveBuffer(store)

    @staticmethod
    def traces(store: RouteStore, on_overwrite: str = "drop") -> TraceStore:
        return NaiveTraces(store, on_overwrite)

    @staticmethod
    def resume(store: RouteStore, state: RolloutState, resumed: Handle) -> RolloutState:
        """Materialize history + new rows as a fresh object, then free the input routing."""
        fresh = store.put(canonicalize(store.read(resumed), SPEC))
        lease = store.acquire(fresh, f"rollout/{state.sample_id}")
        force_free(store, state.routing.handle)  # "the input is not needed any more"
        return attached(unleased(state), fresh, lease, Origin.PRODUCED)

    @staticmethod
    def train(
        step: int,
        groups: Sequence[Group],
        traces: TraceStore,
        run_step: Callable[[Sequence[RolloutState]], None],
    ) -> None:
        holder = f"train/step-{step}"
        states = [
            s.with_sample_routing(
                dataclasses.replace(s.routing, lease=s.routing.lease.transfer(holder))
            )
            for g in groups
            for s in g.states
            if s.routing.lease
        ]
        run_step(states)  # releases below only run when the step succeeds
        for state in states:
            state.release()
        for session in {s.session_id for s in states if s.session_id is not None}:
            traces.release_session(session)

    @staticmethod
    def restore(folder: Path, store: RouteStore) -> ReplayBuffer | NaiveBuffer:
        """Put every checkpointed array back; nobody leases it (refs without an owner)."""
        meta = json.loads((folder / "buffer.json").read_text(encoding="utf-8"))
        buffer = NaiveBuffer(store)
        with np.load(folder / "routing.npz", allow_pickle=False) as arrays:
            for group in meta["groups"]:
                states = []
                for rec in group["states"]:
                    routing = store.put(canonicalize(arrays[rec["routing"]["array"]], SPEC))
                    states.append(
                        RolloutState(
                            sample_id=rec["sample_id"],
                            group_id=rec["group_id"],
                            prompt_ids=tuple(rec["prompt_ids"]),
                            response_ids=tuple(rec["response_ids"]),
                            logprobs=tuple(rec["logprobs"]),
                            weight_versions=tuple(rec["weight_versions"]),
                            status=Status(rec["status"]),
                            routing=SampleRouting(
                                sample_id=rec["sample_id"], handle=routing, origin=Origin.RESTORED
                            ),
                        )
                    )
                buffer.add(group["group_id"], states)
        return buffer

    @staticmethod
    def batch(
        step: int, groups: Sequence[Group], ledger: SessionLedger, traces: TraceStore
    ) -> TrainingBatch:
        """Release every session the batch's samples consumed (routeplay before the
        ledger: right only when no other waiting sample shares a session)."""
        return TrainingBatch(step, groups, release_session=traces.release_session)


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> type[Routeplay] | type[Naive]:
    return Routeplay if request.param == "routeplay" else Naive


def session_with_turn(
    store: RouteStore, traces: TraceStore, seed: int = 1
) -> tuple[Handle, npt.NDArray[np.uint8]]:
    """Session "s" holds the routing of ``TURN`` (ingested from a fake SGLang)."""
    rows = truth(len(TURN) - 1, seed)
    handle = ingest(store, rows, prompt=PROMPT, completion=len(TURN) - PROMPT)
    traces.insert("s", TURN, handle)
    return handle, rows


def borrowed(traces: TraceStore, sid: str, *, group: str = "g", version: int = 0) -> RolloutState:
    """A sample whose routing is exported from session "s" (its own lease, BORROWED)."""
    exported = traces.export("s", TURN, f"rollout/{sid}")
    assert exported is not None
    assert exported.rows == len(TURN) - 1
    state = completed(sid, TURN, group=group, version=version, session="s")
    return attached(state, exported.handle, exported.lease, Origin.BORROWED)


# -- (a) ------------------------------------------------------------------------------
def test_a_stale_retry_keeps_routing_borrowed_from_a_trace_session(
    impl: type[Routeplay] | type[Naive], store: RouteStore
) -> None:
    """A stale group selected for retry must not free routing the session's trie still
    holds: a later export of the session (the retry's history) and its read still work."""
    traces = TraceStore(store)
    _, rows = session_with_turn(store, traces)
    buffer = impl.buffer(store)
    buffer.add("g", [borrowed(traces, "a", version=0)])

    retried, discarded = buffer.refresh(current_version=3)  # staleness 3 > 1: retry
    assert (retried, discarded) == (["a"], [])

    def export_again() -> npt.NDArray[Any]:
        exported = traces.export("s", TURN, "rollout/a-retry")
        assert exported is not None
        with exported.lease:
            return exported.lease.read()

    result = attempt(export_again)
    if impl is Naive:
        assert result == "RoutesLost"  # XTuner: the retry freed the trie's routing
        return
    assert_rows(result, rows)
    assert holders(store) == {"session/s": 1}  # the buffer ended only its own lease
    traces.close()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


# -- (b) ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAKE_ENGINES)
def test_b_partial_resume_does_not_free_the_borrowed_history(
    impl: type[Routeplay] | type[Naive], store: RouteStore, name: str
) -> None:
    """Resuming an aborted sample whose history is borrowed from a session: the new
    routing keeps the history rows and appends the new ones, and post-processing must not
    free the history, which the session and a sibling sample still use."""
    traces = TraceStore(store)
    full = truth(len(TURN) - 1 + 3, seed=2)  # the resume adds 3 tokens
    history = ingest(store, full, prompt=PROMPT, completion=len(TURN) - PROMPT, name=name)
    traces.insert("s", TURN, history)
    sibling = traces.export("s", TURN, "rollout/sibling")
    assert sibling is not None
    aborted = borrowed(traces, "a").with_status(Status.ABORTED, "abort")

    resumed = ingest(
        store, full, prompt=PROMPT, completion=len(TURN) - PROMPT + 3, version=1,
        history=aborted.routing.handle, name=name,
    )  # fmt: skip
    assert aborted.routing.handle is not None
    assert resumed[: aborted.routing.rows] == aborted.routing.handle  # history segments kept
    done = impl.resume(store, aborted, resumed)
    done = done.extend((1, 2, 3), (-0.1, -0.2, -0.3), 1).with_status(Status.COMPLETED, "stop")

    handle = done.routing.handle
    assert handle is not None
    assert_rows(attempt(lambda: store.read(handle)), full)  # its own rows: fine in both
    sibling_rows = attempt(sibling.lease.read)
    session_rows = attempt(lambda: store.read(traces.longest_prefix("s", TURN).handle))
    if impl is Naive:
        assert (sibling_rows, session_rows) == ("RoutesLost", "RoutesLost")
        return
    assert_rows(sibling_rows, full[: len(TURN) - 1])
    assert_rows(session_rows, full[: len(TURN) - 1])
    assert holders(store) == {"rollout/a": 1, "rollout/sibling": 1, "session/s": 1}
    done.release()
    sibling.lease.release()
    traces.close()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


# -- (c) ------------------------------------------------------------------------------
def test_c_discard_after_session_release_frees_nothing_of_others(
    impl: type[Routeplay] | type[Naive], store: RouteStore
) -> None:
    """Generic discard of a sample whose session was already released: no double free
    (releases stay idempotent), and a sibling exported from that session still reads."""
    traces = TraceStore(store)
    _, rows = session_with_turn(store, traces)
    sibling = traces.export("s", TURN, "rollout/sibling")
    assert sibling is not None
    buffer = impl.buffer(store)
    buffer.add("g", [borrowed(traces, "a")])

    assert traces.release_session("s") == 1
    assert buffer.discard("g") is True
    assert buffer.discard("g") is False  # a second discard is a no-op
    assert traces.release_session("s") == 0  # and so is a second session release
    released_so_far = store.stats().released_payloads
    result = attempt(sibling.lease.read)
    if impl is Naive:
        assert (result, released_so_far) == ("RoutesLost", 1)
        return
    assert_rows(result, rows)
    assert released_so_far == 0  # the sibling's lease keeps the payload
    assert leaked(store) == ["rollout/sibling"]
    sibling.lease.release()
    sibling.lease.release()
    assert store.leaks() == []
    assert store.stats().released_payloads == 1  # dropped exactly once
    assert store.stats().live_payloads == 0


# -- (d) ------------------------------------------------------------------------------
def test_d_a_step_that_raises_still_releases_leases_and_sessions(
    impl: type[Routeplay] | type[Naive], store: RouteStore
) -> None:
    """The trainer releases its leases and the consumed sessions even when the step
    raises (XTuner released sessions only after a successful step)."""
    traces = TraceStore(store)
    _, rows = session_with_turn(store, traces)
    buffer = BufferConfig().build(store)
    buffer.add("g", [borrowed(traces, "a"), borrowed(traces, "b")])
    groups = buffer.sample(1, current_version=0)
    seen: list[npt.NDArray[Any]] = []

    def failing_step(states: Sequence[RolloutState]) -> None:
        assert holders(store) == {"session/s": 1, "train/step-1": 2}
        seen.extend(store.read(s.routing.handle) for s in states if s.routing.handle is not None)
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        impl.train(1, groups, traces, failing_step)
    assert len(seen) == 2
    for got in seen:
        np.testing.assert_array_equal(got, rows)
    if impl is Naive:
        assert leaked(store) == ["session/s", "train/step-1", "train/step-1"]
        assert traces.sessions() == ["s"]
        return
    assert store.leaks() == []
    assert traces.sessions() == []
    assert store.stats().live_payloads == 0


# -- (e) ------------------------------------------------------------------------------
def test_e_overwriting_a_trie_value_releases_the_overwritten_lease_once(
    impl: type[Routeplay] | type[Naive], store: RouteStore
) -> None:
    """Overwriting a session's value releases the session's lease on the old value,
    exactly once; re-inserting the same handle keeps it alive (acquired first)."""
    traces = impl.traces(store, on_overwrite="drop")  # XTuner: the old value was dropped
    rows = truth(len(TURN) - 1, seed=3)
    old = ingest(store, rows, prompt=PROMPT, completion=len(TURN) - PROMPT, version=0)
    new = ingest(store, rows, prompt=PROMPT, completion=len(TURN) - PROMPT, version=1)
    traces.insert("s", TURN, old)
    traces.insert("s", TURN, new)
    traces.insert("s", TURN, new)  # same handle again
    after_overwrite = (holders(store), store.stats().released_payloads)
    match = traces.longest_prefix("s", TURN)
    assert match.handle == new
    assert_rows(attempt(lambda: store.read(new)), rows)
    assert traces.release_session("s") == 1
    observed = (after_overwrite, leaked(store), store.stats().live_payloads)
    if impl is Naive:
        assert observed == (({"session/s": 3}, 0), ["session/s", "session/s"], 2)
        return
    assert observed == (({"session/s": 1}, 1), [], 0)
    assert store.stats().released_payloads == 2  # old at overwrite, new at release: once each


# -- (f) ------------------------------------------------------------------------------
def downgrade_to_v1(folder: Path) -> None:
    """Rewrite a checkpoint as format version 1: no origin, retries, routing_kind or
    per-segment weight versions (one ``weight_version`` per routed sample)."""
    meta = json.loads((folder / "buffer.json").read_text(encoding="utf-8"))
    meta["version"] = 1
    for record in [s for g in meta["groups"] for s in g["states"]] + meta["retries"]:
        for key in ("origin", "retries", "routing_kind"):
            record.pop(key)
        if record["routing"] is not None:
            versions = [version for _, version in record["routing"].pop("segments")]
            record["routing"]["weight_version"] = min(versions)
    (folder / "buffer.json").write_text(json.dumps(meta), encoding="utf-8")


@pytest.mark.parametrize("version", [2, 1])
def test_f_checkpoint_restored_routing_is_owned_by_the_buffer(
    impl: type[Routeplay] | type[Naive], store: RouteStore, tmp_path: Path, version: int
) -> None:
    """Routing restored from a checkpoint (v2, or v1 without ownership fields) is leased
    by the buffer and released by ``close()``: zero leaks, zero live payloads."""
    traces = TraceStore(store)
    _, session_rows = session_with_turn(store, traces)
    buffer = BufferConfig().build(store)
    full = truth(len(TURN) - 1 + 2, seed=4)
    first = ingest(store, full, prompt=PROMPT, completion=len(TURN) - PROMPT, version=0)
    resumed = ingest(
        store, full, prompt=PROMPT, completion=len(TURN) - PROMPT + 2, version=1, history=first
    )
    partial = completed("p", (*TURN, 1, 2), group="g2", version=1)
    partial = attached(partial, resumed, store.acquire(resumed, "rollout/p"), Origin.PRODUCED)
    buffer.add("g1", [borrowed(traces, "a", group="g1"), borrowed(traces, "b", group="g1")])
    buffer.add("g2", [partial])
    buffer.requeue([completed("r", TURN, group="g3")])  # a queued retry: no routing
    save_buffer(buffer, tmp_path, SPEC)
    if version == 1:
        downgrade_to_v1(tmp_path)
    buffer.close()
    traces.close()
    assert store.stats().live_payloads == 0  # only the checkpoint has the rows now

    restored = impl.restore(tmp_path, store)
    expect = {"a": session_rows, "b": session_rows, "p": full}
    for group in restored.groups():
        for state in group.states:
            assert state.routing.origin is Origin.RESTORED
            handle = state.routing.handle
            assert handle is not None
            assert_rows(attempt(lambda h=handle: store.read(h)), expect[state.sample_id])
    owners = holders(store)
    restored.close()
    observed = (owners, store.leaks(), store.stats().live_payloads)
    if impl is Naive:
        assert observed == ({}, [], 3)  # owner-less: invisible to leaks(), never released
        return
    assert observed == ({"buffer/g1": 2, "buffer/g2": 1}, [], 0)


# -- (g) ------------------------------------------------------------------------------
def test_g_overwrite_release_keeps_routing_exported_to_siblings(
    impl: type[Routeplay] | type[Naive], store: RouteStore
) -> None:
    """The release an overwrite does must not free data already exported to sibling
    samples: their handles still read (the naive "fix" of (e) frees them)."""
    traces = impl.traces(store, on_overwrite="free")
    old_rows, new_rows = truth(len(TURN) - 1, seed=5), truth(len(TURN) - 1, seed=6)
    old = ingest(store, old_rows, prompt=PROMPT, completion=len(TURN) - PROMPT, version=0)
    traces.insert("s", TURN, old)
    siblings = [traces.export("s", TURN[:8], f"rollout/sib-{i}") for i in range(2)]
    new = ingest(store, new_rows, prompt=PROMPT, completion=len(TURN) - PROMPT, version=1)
    traces.insert("s", TURN, new)

    assert_rows(attempt(lambda: store.read(new)), new_rows)
    results = [attempt(sib.lease.read) for sib in siblings if sib is not None]
    assert len(results) == 2
    if impl is Naive:
        assert results == ["RoutesLost", "RoutesLost"]
        return
    for result in results:
        assert_rows(result, old_rows[:8])  # the old rows they were given, not the new ones
    assert holders(store) == {"rollout/sib-0": 1, "rollout/sib-1": 1, "session/s": 1}
    for sib in siblings:
        assert sib is not None
        sib.lease.release()
    traces.close()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


# -- (h) ------------------------------------------------------------------------------
def test_h_a_session_outlives_the_first_batch_while_another_sample_waits(
    impl: type[Routeplay] | type[Naive], store: RouteStore
) -> None:
    """Two samples of one session land in different batches; the second goes stale.
    Training the first must not release the session: the retry's prefix is still there."""
    traces = TraceStore(store)
    _, rows = session_with_turn(store, traces)
    ledger = SessionLedger(traces.release_session)
    buffer = BufferConfig(max_staleness=1, max_retries=1).build(store, sessions=ledger)
    a, b = borrowed(traces, "a", group="g1", version=0), borrowed(traces, "b", group="g2")
    ledger.hold(a, b)
    buffer.add("g1", [a])
    buffer.add("g2", [b])
    with impl.batch(1, buffer.sample(1, current_version=0), ledger, traces):
        pass
    assert buffer.refresh(current_version=2) == (["b"], [])  # b is stale: retried

    [retry] = buffer.take_retries()
    again = traces.export("s", TURN, f"rollout/{retry.sample_id}")  # the retry's history
    if impl is Naive:
        assert (again, traces.sessions()) == (None, [])  # the first batch took it along
        return
    assert again is not None
    assert_rows(attempt(again.lease.read), rows)
    redo = completed("b", TURN, group="g2", version=2, session="s")
    redo = redo.with_sample_routing(
        dataclasses.replace(redo.routing, retries=retry.routing.retries)
    )
    buffer.add("g2", [attached(redo, again.handle, again.lease, Origin.BORROWED)])
    # Its prompt rows were routed by version 0's weights: the retry is 2 versions stale.
    assert buffer.groups()[0].staleness(2) == 2
    assert traces.sessions() == ["s"]
    assert buffer.refresh(current_version=2) == ([], ["g2"])  # out of retries: discarded
    assert traces.sessions() == []  # b was the last sample waiting on the session
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


# -- bugs found while writing the tests above (fixed; kept as regressions) ------------
def test_bug_a_checkpoint_that_fails_to_load_leaves_no_lease(
    store: RouteStore, tmp_path: Path
) -> None:
    buffer = BufferConfig().build(store)
    for i, gid in enumerate(("g1", "g2")):
        handle = store.put(canonicalize(truth(len(TURN) - 1, seed=10 + i), SPEC))
        lease = store.acquire(handle, f"rollout/s{i}")
        state = attached(completed(f"s{i}", TURN, group=gid), handle, lease, Origin.PRODUCED)
        buffer.add(gid, [state])
    save_buffer(buffer, tmp_path, SPEC)
    buffer.close()
    arrays = dict(np.load(tmp_path / "routing.npz", allow_pickle=False))
    arrays["r1"] = arrays["r1"].copy()
    arrays["r1"][2] = 0  # duplicate expert ids in g2's sample: a corrupt checkpoint
    np.savez(tmp_path / "routing.npz", **arrays)
    with pytest.raises(DuplicateExperts, match="row 2"):
        load_buffer(tmp_path, store, BufferConfig())
    assert store.leaks() == []


def test_bug_a_group_that_fails_to_enter_the_buffer_leaves_no_lease(store: RouteStore) -> None:
    """Pins ``ReplayBuffer.add``'s rollback: the buffer's lease on the sample it claimed
    before the failing one is released, the caller's own lease stays with the caller."""
    rows = truth(len(TURN) - 1, seed=20)
    good_handle = store.put(canonicalize(rows, SPEC))
    good_lease = store.acquire(good_handle, "rollout/good")
    good = attached(completed("good", TURN), good_handle, good_lease, Origin.PRODUCED)
    lost_handle = store.put(canonicalize(truth(len(TURN) - 1, seed=21), SPEC))
    store.acquire(lost_handle, "rollout/lost").release()  # its payload is gone
    # Routing without a lease: the buffer acquires one for it, and that raises.
    unrouted = completed("lost", TURN)
    lost = unrouted.with_sample_routing(dataclasses.replace(unrouted.routing, handle=lost_handle))
    buffer = BufferConfig().build(store)
    with pytest.raises(RoutesLost):
        buffer.add("g", [good, lost])
    # The buffer holds nothing (its claim on "good" was rolled back); the caller keeps its own.
    assert holders(store) == {"rollout/good": 1}
    assert len(buffer) == 0
    assert good.routing.holds_lease
    good.release()
    assert store.leaks() == []


def test_bug_a_zero_row_routing_checkpoint_round_trips(store: RouteStore, tmp_path: Path) -> None:
    empty = Handle(SPEC)
    state = RolloutState(sample_id="z", group_id="g", prompt_ids=(1,)).with_status(
        Status.ABORTED, "abort"
    )
    state = attached(state, empty, store.acquire(empty, "rollout/z"), Origin.PRODUCED)
    buffer = BufferConfig().build(store)
    buffer.add("g", [state])
    save_buffer(buffer, tmp_path, SPEC)
    buffer.close()
    restored = load_buffer(tmp_path, store, BufferConfig())
    [back] = restored.groups()[0].states
    assert back.routing.handle is not None
    assert back.routing.handle.rows == 0
    restored.close()
    assert store.stats().live_payloads == 0


def test_bug_an_engine_key_that_adds_no_rows_is_not_left_behind() -> None:
    store = RouteStore.local(StoreConfig(run="regressions", shards=1, ttl_s=None))
    traces = TraceStore(store)
    rows = truth(len(TURN) - 1, seed=30)
    traces.insert("s", TURN, ingest(store, rows, prompt=PROMPT, completion=len(TURN) - PROMPT))
    # The next turn's prompt is a strict prefix of the stored sequence and it generates
    # one token: the exported history already holds every row of the response.
    prompt = TURN[:8]
    history = traces.export("s", prompt, "rollout/next")
    assert history is not None
    assert history.rows == len(prompt)
    resumed = ingest(
        store, rows[: len(prompt)], prompt=len(prompt), completion=1, version=1,
        history=history.handle, name="lmdeploy-key",
    )  # fmt: skip
    assert resumed == history.handle
    with store.acquire(resumed, "rollout/next-turn"):
        history.lease.release()
        assert_rows(attempt(lambda: store.read(resumed)), rows[: len(prompt)])
    traces.close()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0  # fails: the adopted key's payload is left
