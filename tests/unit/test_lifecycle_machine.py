"""The rollout lifecycle as a hypothesis state machine over the in-process route store.

Rules produce samples through the fake engines and ``ADAPTERS`` (every engine format),
resume partial rollouts with ``stitch`` (history kept, only new rows appended), run
multi-turn sessions through a ``TraceStore`` (history exported from the session's trie,
each turn inserted), insert and overwrite trie values (fresh payloads, payloads shared
with the session's older entries, the very same handle), export prefixes to holders and
to borrowed samples, add groups to a ``ReplayBuffer``, advance the weight version and
``refresh`` (stale groups retried or discarded), regenerate retries, discard groups,
sample groups into ``TrainingBatch``es that stay in flight and finish with ``with``
(the step raising or not), release sessions, drop samples, and checkpoint the buffer
(``save_buffer`` -> close -> ``load_buffer`` into the same store). The store runs behind
``faults.FaultyBackend``: one rule discards a group while one sample's shard "died"
(its release answers ``RoutesLost``), so the buffer must release the others, keep that
sample in its release-failed set (still leased, still readable) and hand it over or
retry it on ``close()``.

The model keeps the ground truth: every routing row is a pure function of the token
prefix (and a per-sample or per-session salt), so a fake engine is always given rows
that agree with whatever a session already stored. After every step:

- every live sample's routing (pending and partial samples, buffer entries, batches in
  flight, exports still held, the session's stored entries) reads back with
  ``store.read`` and equals the ground-truth rows;
- ``store.stats().leases_by_holder`` equals the leases the model expects per holder
  (one lease id per store shard a leased handle touches), the live payloads are exactly
  those the model's leased handles name, and no payload is stored without a lease;
- the trace store and the buffer report the sessions, entries, groups and queued
  retries the model has.

At teardown (batches closed, buffer closed, sessions and samples released):
``store.leaks() == []`` and ``store.stats().live_payloads == 0``.

Settings: the CI default is ``max_examples=100, stateful_step_count=30`` (about 3 s,
some 2,500 rule steps). Set ``ROUTEPLAY_SOAK=1`` for a soak run: ``max_examples=2000,
stateful_step_count=60`` (about 2-4 minutes, some 90,000 rule steps). ``pytest -s`` prints
how many rule steps ran (per rule, plus the operations rules ran inside other rules).
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from faults import FaultyBackend
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from routeplay.core import Handle, RouteSpec
from routeplay.core.handle import StoreRef
from routeplay.errors import RoutesLost
from routeplay.rollout import (
    ADAPTERS,
    BufferConfig,
    Exported,
    Origin,
    RolloutState,
    Status,
    TraceStore,
    TrainingBatch,
    load_buffer,
    save_buffer,
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
from routeplay.store import Lease, RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend
from routeplay.store.shard.shard import shard_of

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
CONFIG = BufferConfig(max_staleness=1, max_retries=1)
SOAK = os.environ.get("ROUTEPLAY_SOAK") == "1"
SETTINGS = settings(
    max_examples=2000 if SOAK else 100,
    stateful_step_count=60 if SOAK else 30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

STEPS: Counter[str] = Counter()
"""Rule steps hypothesis executed in this process, per rule (``pytest -s`` prints them)."""
OPS: Counter[str] = Counter()
"""Operations run inside other rules (the training steps, nested rule calls)."""
Rule = TypeVar("Rule", bound=Callable[..., None])

ENGINES = st.sampled_from(FAKE_ENGINES)
TOKENS = st.integers(min_value=0, max_value=9)  # a small alphabet: sessions branch often


def tokens(min_size: int, max_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(TOKENS, min_size=min_size, max_size=max_size).map(tuple)


# -- ground truth ---------------------------------------------------------------------
_MASK = (1 << 64) - 1


def prefix_rows(salt: int, token_ids: tuple[int, ...], rows: int) -> npt.NDArray[np.uint8]:
    """Ground-truth routing rows ``[0, rows)``: row ``i`` depends only on the salt and
    ``token_ids[: i + 1]`` (causal), with ``top_k`` distinct experts per layer."""
    assert rows <= len(token_ids)
    out = np.empty((rows, SPEC.num_layers, SPEC.top_k), dtype=SPEC.dtype)
    h = salt & _MASK
    for i in range(rows):
        h = ((h ^ (token_ids[i] + 0x9E37)) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK
        h ^= h >> 31
        for layer in range(SPEC.num_layers):
            bits = h >> (8 * layer)
            first, step = bits % SPEC.num_experts, 2 * ((bits >> 3) % 4) + 1  # odd: distinct
            out[i, layer] = [(first + j * step) % SPEC.num_experts for j in range(SPEC.top_k)]
    return out


def sample_rows(salt: int, token_ids: tuple[int, ...]) -> npt.NDArray[np.uint8]:
    """Ground truth of a whole sample: one row per token but the last."""
    return prefix_rows(salt, token_ids, len(token_ids) - 1)


def payloads(handle: Handle) -> set[str]:
    return {src.payload_id for src in handle.sources() if isinstance(src, StoreRef)}


def lease_ids(handle: Handle) -> int:
    """Lease ids one Lease over ``handle`` holds: one per store shard it touches."""
    return len({shard_of(pid) for pid in payloads(handle)})


def attached(state: RolloutState, handle: Handle, lease: Lease, origin: Origin) -> RolloutState:
    """``state`` holding ``handle`` under ``lease`` (its routing's ``attach`` step)."""
    return state.with_sample_routing(state.routing.attach(handle, lease, origin))


def counted(method: Rule) -> Rule:
    """Count a rule step in ``STEPS`` when hypothesis runs it, in ``OPS`` when another
    rule calls it (``start``, ``refresh`` then regenerate, ``sample_batch`` then train)."""

    @functools.wraps(method)
    def run(self: LifecycleMachine, *args: Any, **kwargs: Any) -> None:
        (OPS if self.depth else STEPS)[method.__name__] += 1
        self.depth += 1
        try:
            method(self, *args, **kwargs)
        finally:
            self.depth -= 1

    return run  # type: ignore[return-value]


class StepFailed(Exception):
    """A training step that raised."""


@dataclass
class Session:
    """The model of one trace session: its salt and the handle stored per token key."""

    salt: int
    keys: dict[tuple[int, ...], Handle] = field(default_factory=dict)


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.faults = FaultyBackend(LocalBackend("machine", shards=2, ttl_s=600.0))
        self.store = RouteStore(StoreConfig(run="machine", shards=2), self.faults)
        self.engine_store = self.faults.inner.engine_store()
        self.engines: dict[str, FakeEngine] = {
            "vllm": FakeVllmHttp(spec=SPEC),
            "vllm-inprocess": FakeVllmInProcess(spec=SPEC),
            "sglang": FakeSglang(spec=SPEC),
            "lmdeploy-inline": FakeLmdeployInline(spec=SPEC),
            "lmdeploy-key": FakeLmdeployKey(spec=SPEC, put=self.engine_store.put),
        }
        self.traces = TraceStore(self.store)
        self.buffer = CONFIG.build(self.store)
        self.tmp: Path | None = None  # checkpoint folders, made on first use
        self.ids = itertools.count()
        self.version = 0
        # The model: per sample ...
        self.expected: dict[str, npt.NDArray[np.uint8]] = {}  # ground-truth rows
        self.salt: dict[str, int] = {}
        self.versions: dict[str, tuple[int, ...]] = {}  # response tokens' weight versions
        self.row_versions: dict[str, int] = {}  # oldest weight version of its routing rows
        self.retries: dict[str, int] = {}
        self.leased: dict[str, Handle] = {}  # the handle the sample's own lease covers
        # ... and where each sample is (who holds its lease).
        self.pending: dict[str, RolloutState] = {}  # completed, "rollout/<sid>"
        self.partials: dict[str, RolloutState] = {}  # aborted, "rollout/<sid>"
        self.groups: dict[str, list[str]] = {}  # buffer groups in order, "buffer/<gid>"
        self.retry_queue: list[str] = []  # reset, no lease
        self.release_failed: dict[str, str] = {}  # sid -> its holder, "buffer/<gid>"
        self.batches: dict[int, tuple[TrainingBatch, list[str]]] = {}  # "train/step-<n>"
        self.exports: dict[str, tuple[Exported, npt.NDArray[np.uint8]]] = {}  # "export/<n>"
        self.sessions: dict[str, Session] = {}  # "session/<id>"
        self.depth = 0  # rule calls in progress (for the step counters)

    # -- helpers ----------------------------------------------------------------------
    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self.ids)}"

    def ingest(
        self,
        name: str,
        full: npt.NDArray[np.uint8],
        prompt: int,
        completion: int,
        history: Handle | None,
        use_start: bool,
    ) -> Handle:
        """One engine response for ``prompt + completion`` tokens, stitched onto history."""
        assert full.shape[0] == prompt + completion - 1
        fake = self.engines[name]
        start = history.rows if history is not None and use_start and fake.supports_start else 0
        response = fake.respond(
            full, prompt_tokens=prompt, completion_tokens=completion, start_row=start
        )
        handle = ADAPTERS[fake.adapter].ingest(
            response,
            spec=SPEC,
            writer=self.store,
            weight_version=self.version,
            history=history,
            start_row=start,
        )
        assert handle.rows == full.shape[0]
        if history is not None:  # partial-resume rule: history kept, only new rows appended
            assert handle[: history.rows] == history
            new = handle.weight_versions()[history.rows :].tolist()
            assert set(new) <= {self.version}
        return handle

    def make_state(
        self,
        sid: str,
        prompt: tuple[int, ...],
        response: tuple[int, ...],
        *,
        session: str | None = None,
        status: Status = Status.COMPLETED,
    ) -> RolloutState:
        state = RolloutState(sample_id=sid, group_id=sid, prompt_ids=prompt, session_id=session)
        logprobs = (-0.25,) * len(response)
        return state.extend(response, logprobs, self.version).with_status(status, "stop")

    def keep(self, state: RolloutState, leased: Handle, full: npt.NDArray[np.uint8]) -> None:
        """Record a sample that holds its own ``rollout/<sid>`` lease."""
        sid = state.sample_id
        routing = state.routing
        assert routing.holds_lease
        assert routing.lease is not None
        assert routing.lease.holder == f"rollout/{sid}"
        self.expected[sid] = full
        self.versions[sid] = state.weight_versions
        assert routing.response_versions == state.weight_versions
        assert routing.handle is not None
        if routing.handle.segments:  # prompt rows borrowed from a session count as well
            self.row_versions[sid] = min(seg.weight_version for seg in routing.handle.segments)
        self.retries.setdefault(sid, 0)
        self.leased[sid] = leased
        (self.pending if state.status is Status.COMPLETED else self.partials)[sid] = state

    def forget(self, sid: str) -> None:
        tables = (self.expected, self.versions, self.row_versions, self.leased, self.salt)
        for table in (*tables, self.retries):
            table.pop(sid, None)

    def predict_refresh(self) -> tuple[list[str], list[str]]:
        """What ``buffer.refresh(self.version)`` must do; applies it to the model."""
        retried: list[str] = []
        discarded: list[str] = []
        for gid, sids in list(self.groups.items()):
            staleness = max((self.staleness(s) for s in sids), default=0)
            if staleness <= CONFIG.max_staleness:
                continue
            del self.groups[gid]
            if all(self.retries[s] < CONFIG.max_retries for s in sids):
                retried.extend(sids)
                self.retry_queue.extend(sids)
                for sid in sids:
                    self.retries[sid] += 1
                    self.expected.pop(sid)
                    self.leased.pop(sid)
                    self.row_versions.pop(sid, None)
            else:
                discarded.append(gid)
                for sid in sids:
                    self.forget(sid)
        return retried, discarded

    def staleness(self, sid: str) -> int:
        """Versions behind the oldest weights of a sample: response tokens and routing
        rows (prompt rows exported from a session at an older version count too)."""
        versions = [
            *self.versions[sid],
            *([self.row_versions[sid]] if sid in self.row_versions else []),
        ]
        return self.version - min(versions) if versions else 0

    def history_from_session(
        self, session: str | None, prompt: tuple[int, ...], holder: str
    ) -> Exported | None:
        """The prompt's stored rows exported from its session (checked against the truth)."""
        model = self.sessions.get(session) if session is not None else None
        if model is None or not model.keys:
            return None
        exported = self.traces.export(session, prompt, holder)  # type: ignore[arg-type]
        if exported is not None:
            assert 1 <= exported.rows <= len(prompt)
            assert exported.lease.holder == holder
            truth = prefix_rows(model.salt, prompt, exported.rows)
            np.testing.assert_array_equal(self.store.read(exported.handle), truth)
        return exported

    # -- producing samples ------------------------------------------------------------
    @initialize(names=st.lists(ENGINES, min_size=3, max_size=3), user=tokens(1, 4))
    @counted
    def start(self, names: list[str], user: tuple[int, ...]) -> None:
        """Begin with a completed sample, a partial one and a session's first turn, so
        most rules can run from the first step."""
        self.produce(names[0], user, (1, 2), partial=False)
        self.produce(names[1], (3, *user), (4,), partial=True)
        self.turn(None, names[2], user, (5, 6), new_session=True, use_start=False)  # type: ignore[arg-type]

    @rule(
        name=ENGINES,
        prompt=tokens(1, 5),
        response=tokens(1, 4),
        partial=st.booleans(),
    )
    @counted
    def produce(
        self, name: str, prompt: tuple[int, ...], response: tuple[int, ...], partial: bool
    ) -> None:
        """A fresh single-turn sample, completed or aborted (a partial rollout)."""
        sid = self.new_id("s")
        self.salt[sid] = next(self.ids) * 7919 + 17
        full = sample_rows(self.salt[sid], prompt + response)
        handle = self.ingest(name, full, len(prompt), len(response), None, use_start=False)
        status = Status.ABORTED if partial else Status.COMPLETED
        state = self.make_state(sid, prompt, response, status=status)
        lease = self.store.acquire(handle, f"rollout/{sid}")
        self.keep(attached(state, handle, lease, Origin.PRODUCED), handle, full)

    @precondition(lambda self: bool(self.partials))
    @rule(
        data=st.data(),
        name=ENGINES,
        more=tokens(1, 3),
        use_start=st.booleans(),
        finish=st.booleans(),
    )
    @counted
    def resume(
        self, data: st.DataObject, name: str, more: tuple[int, ...], use_start: bool, finish: bool
    ) -> None:
        """Resume a partial rollout: stitch onto its history, then lease the new handle
        before ending the old lease (the post-processing must not free the history)."""
        sid = data.draw(st.sampled_from(sorted(self.partials)))
        state = self.partials.pop(sid)
        history = state.routing.handle
        assert history is not None
        token_ids = state.prompt_ids + state.response_ids + more
        full = sample_rows(self.salt[sid], token_ids)
        completion = len(state.response_ids) + len(more)
        handle = self.ingest(name, full, len(state.prompt_ids), completion, history, use_start)
        lease = self.store.acquire(handle, f"rollout/{sid}")
        state = attached(state.release(), handle, lease, state.routing.origin)
        state = state.extend(more, (-0.5,) * len(more), self.version)
        if finish:
            state = state.with_status(Status.COMPLETED, "stop")
        self.keep(state, handle, full)

    @rule(
        data=st.data(),
        name=ENGINES,
        user=tokens(1, 3),
        response=tokens(1, 3),
        new_session=st.booleans(),
        use_start=st.booleans(),
    )
    @counted
    def turn(
        self,
        data: st.DataObject,
        name: str,
        user: tuple[int, ...],
        response: tuple[int, ...],
        new_session: bool,
        use_start: bool,
    ) -> None:
        """One turn of a multi-turn session: history exported from the session (a prefix
        of any stored sequence, so the trie branches), new rows stitched on, the whole
        sequence inserted into the session, the turn's sample leased on its own."""
        if new_session or not self.sessions:
            session = self.new_id("t")
            self.sessions[session] = Session(salt=next(self.ids) * 104729 + 3)
        else:
            session = data.draw(st.sampled_from(sorted(self.sessions)))
        model = self.sessions[session]
        prefix: tuple[int, ...] = ()
        if model.keys:
            key = data.draw(st.sampled_from(sorted(model.keys)))
            prefix = key[: data.draw(st.integers(min_value=1, max_value=len(key)))]
        prompt = prefix + user
        sid = self.new_id("s")
        self.salt[sid] = model.salt
        full = sample_rows(model.salt, prompt + response)
        exported = self.history_from_session(session, prompt, f"rollout/{sid}")
        assert (exported is None) == (not model.keys)
        history = exported.handle if exported is not None else None
        handle = self.ingest(name, full, len(prompt), len(response), history, use_start)
        lease = self.store.acquire(handle, f"rollout/{sid}")
        if exported is not None:
            exported.lease.release()  # our own export lease; the session keeps its own
        self.traces.insert(session, prompt + response, handle)
        model.keys[prompt + response] = handle
        origin = Origin.BORROWED if exported is not None else Origin.PRODUCED
        state = self.make_state(sid, prompt, response, session=session)
        self.keep(attached(state, handle, lease, origin), handle, full)

    # -- the trace store --------------------------------------------------------------
    @precondition(lambda self: any(s.keys for s in self.sessions.values()))
    @rule(data=st.data(), name=ENGINES, mode=st.sampled_from(["fresh", "shared", "same"]))
    @counted
    def overwrite(self, data: st.DataObject, name: str, mode: str) -> None:
        """Insert again under a stored key: a fresh payload, a handle sharing payloads
        with the session's entries (the only lease on them may be the overwritten one),
        or the very same handle. Only the session's old lease may end."""
        session = data.draw(st.sampled_from(sorted(s for s, m in self.sessions.items() if m.keys)))
        model = self.sessions[session]
        key = data.draw(st.sampled_from(sorted(model.keys)))
        full = sample_rows(model.salt, key)
        prompt = max(1, len(key) // 2)
        if mode == "same":
            handle = model.keys[key]
        else:
            history = None
            if mode == "shared" and len(key) >= 3:
                exported = self.history_from_session(session, key[:-1], "overwrite/tmp")
                assert exported is not None
                rows = min(exported.rows, len(key) - 2)  # leave at least one new row
                history = exported.handle[:rows]
                exported.lease.release()  # before the insert: acquire must come first there
            handle = self.ingest(name, full, prompt, len(key) - prompt, history, use_start=True)
        self.traces.insert(session, key, handle)
        model.keys[key] = handle

    @precondition(lambda self: any(s.keys for s in self.sessions.values()))
    @rule(data=st.data(), extra=tokens(0, 2), as_sample=st.booleans())
    @counted
    def export(self, data: st.DataObject, extra: tuple[int, ...], as_sample: bool) -> None:
        """Export a prefix of a stored sequence to a holder of its own, or as a sample
        whose routing is borrowed from the session (it still holds its own lease)."""
        session = data.draw(st.sampled_from(sorted(s for s, m in self.sessions.items() if m.keys)))
        model = self.sessions[session]
        key = data.draw(st.sampled_from(sorted(model.keys)))
        cut = data.draw(st.integers(min_value=2 if as_sample else 1, max_value=len(key)))
        if as_sample:
            query = key[:cut]
            sid = self.new_id("s")
            exported = self.history_from_session(session, query, f"rollout/{sid}")
            assert exported is not None
            assert exported.rows >= cut - 1
            routing = exported.handle[: cut - 1]
            split = data.draw(st.integers(min_value=1, max_value=cut - 1))
            state = self.make_state(sid, query[:split], query[split:], session=session)
            self.salt[sid] = model.salt
            full = sample_rows(model.salt, query)
            borrowed = attached(state, routing, exported.lease, Origin.BORROWED)
            self.keep(borrowed, exported.handle, full)
            return
        query = key[:cut] + extra
        name = self.new_id("export/")
        exported = self.history_from_session(session, query, name)
        assert exported is not None  # at least one token matches, so a row is reusable
        self.exports[name] = (exported, prefix_rows(model.salt, query, exported.rows))

    @precondition(lambda self: bool(self.exports))
    @rule(data=st.data())
    @counted
    def release_export(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.exports)))
        exported, _ = self.exports.pop(name)
        exported.lease.release()
        exported.lease.release()  # idempotent

    @precondition(lambda self: bool(self.sessions))
    @rule(data=st.data())
    @counted
    def release_session(self, data: st.DataObject) -> None:
        """Release a session: its leases only; samples and exports from it stay valid."""
        session = data.draw(st.sampled_from(sorted(self.sessions)))
        model = self.sessions.pop(session)
        assert self.traces.release_session(session) == len(model.keys)
        assert self.traces.release_session(session) == 0

    # -- the buffer -------------------------------------------------------------------
    @precondition(lambda self: bool(self.pending))
    @rule(size=st.integers(min_value=1, max_value=3))
    @counted
    def add_group(self, size: int) -> None:
        sids = list(self.pending)[:size]
        states = [self.pending.pop(sid) for sid in sids]
        gid = self.new_id("g")
        self.buffer.add(gid, states)
        assert not any(s.routing.holds_lease for s in states)  # transferred, not copied
        self.groups[gid] = sids

    @rule(
        data=st.data(),
        step=st.integers(min_value=0, max_value=3),
        name=ENGINES,
        then_regenerate=st.booleans(),
    )
    @counted
    def refresh(self, data: st.DataObject, step: int, name: str, then_regenerate: bool) -> None:
        """Advance the weight version; stale groups are retried (reset) or discarded.
        ``then_regenerate`` regenerates the retries right away."""
        self.version += step
        expected = self.predict_refresh()
        assert self.buffer.refresh(self.version) == expected
        if then_regenerate and self.retry_queue:
            self.regenerate(data, name, use_start=data.draw(st.booleans()))

    @precondition(lambda self: bool(self.retry_queue))
    @rule(data=st.data(), name=ENGINES, use_start=st.booleans())
    @counted
    def regenerate(self, data: st.DataObject, name: str, use_start: bool) -> None:
        """Regenerate reset samples; a session sample takes its history from the session
        again (which the retry must not have freed)."""
        states = self.buffer.take_retries()
        assert [s.sample_id for s in states] == self.retry_queue
        self.retry_queue = []
        for state in states:
            sid = state.sample_id
            assert not state.routing.holds_lease
            assert state.routing.handle is None
            assert state.status is Status.PENDING
            assert state.routing.retries == self.retries[sid]
            response = data.draw(tokens(1, 3))
            token_ids = state.prompt_ids + response
            full = sample_rows(self.salt[sid], token_ids)
            exported = self.history_from_session(
                state.session_id, state.prompt_ids, f"rollout/{sid}"
            )
            history = exported.handle if exported is not None else None
            handle = self.ingest(
                name, full, len(state.prompt_ids), len(response), history, use_start
            )
            lease = self.store.acquire(handle, f"rollout/{sid}")
            if exported is not None:
                exported.lease.release()
            origin = Origin.BORROWED if exported is not None else Origin.PRODUCED
            state = state.extend(response, (-1.0,) * len(response), self.version)
            state = attached(state.with_status(Status.COMPLETED, "stop"), handle, lease, origin)
            self.keep(state, handle, full)

    @precondition(lambda self: bool(self.groups))
    @rule(data=st.data())
    @counted
    def discard(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(list(self.groups)))
        assert self.buffer.discard(gid) is True
        assert self.buffer.discard(gid) is False
        for sid in self.groups.pop(gid):
            self.forget(sid)

    @precondition(lambda self: bool(self.groups))
    @rule(data=st.data())
    @counted
    def discard_on_a_dead_shard(self, data: st.DataObject) -> None:
        """Discard a group while one sample's release fails: every other sample is
        released, that one stays in the buffer's release-failed set, leased."""
        gid = data.draw(st.sampled_from(list(self.groups)))
        [group] = [g for g in self.buffer.groups() if g.group_id == gid]
        doomed = data.draw(st.sampled_from(group.states))
        assert doomed.routing.lease is not None
        self.faults.lose_releases(doomed.routing.lease)
        try:
            self.buffer.discard(gid)
        except RoutesLost:
            pass
        else:
            raise AssertionError("a release that failed must be raised")
        finally:
            self.faults.heal()  # the shard is back; the buffer retries on close()
        for sid in self.groups.pop(gid):
            if sid == doomed.sample_id:
                self.release_failed[sid] = f"buffer/{gid}"
            else:
                self.forget(sid)
        assert [s.sample_id for s in self.buffer.release_failed()] == list(self.release_failed)

    @precondition(lambda self: bool(self.release_failed))
    @rule()
    @counted
    def take_release_failed(self) -> None:
        """Whoever can revoke them takes the release-failed samples over and ends them."""
        taken = self.buffer.take_release_failed()
        assert [s.sample_id for s in taken] == list(self.release_failed)
        for state in taken:
            assert state.routing.stuck
            assert not state.routing.holds_lease
            state.release()
            self.forget(state.sample_id)
        self.release_failed.clear()

    @precondition(lambda self: bool(self.groups) or bool(self.retry_queue))
    @rule()
    @counted
    def checkpoint(self) -> None:
        """save_buffer -> close the old buffer -> load_buffer into the same store."""
        if self.tmp is None:
            self.tmp = Path(tempfile.mkdtemp(prefix="routeplay-machine-"))
        folder = self.tmp / self.new_id("ckpt-")
        before = {
            s.sample_id: (s.routing.handle.weight_versions().tolist() if s.routing.handle else None)
            for g in self.buffer.groups()
            for s in g.states
        }
        save_buffer(self.buffer, folder, SPEC)
        self.buffer.close()  # also retries the release-failed samples (the shard is back)
        for sid in self.release_failed:
            self.forget(sid)
        self.release_failed.clear()
        held = dict(self.store.stats().leases_by_holder)
        assert not any(h.startswith("buffer/") for h in held)
        self.buffer = load_buffer(folder, self.store, CONFIG)
        assert [g.group_id for g in self.buffer.groups()] == list(self.groups)
        assert [s.sample_id for s in self.buffer.pending_retries()] == self.retry_queue
        for group in self.buffer.groups():
            assert [s.sample_id for s in group.states] == self.groups[group.group_id]
            for state in group.states:
                sid = state.sample_id
                routing = state.routing
                assert routing.handle is not None
                assert routing.origin is Origin.RESTORED
                assert routing.lease is not None
                assert routing.lease.holder == f"buffer/{group.group_id}"
                assert routing.handle.weight_versions().tolist() == before[sid]
                assert state.weight_versions == self.versions[sid]
                assert routing.retries == self.retries[sid]
                self.leased[sid] = routing.handle

    # -- training ---------------------------------------------------------------------
    @precondition(lambda self: bool(self.groups))
    @rule(count=st.integers(min_value=0, max_value=3), finish=st.sampled_from([None, False, True]))
    @counted
    def sample_batch(self, count: int, finish: bool | None) -> None:
        """Sample groups (refresh first) into a TrainingBatch that stays in flight, or
        (``finish`` set) runs its step right away, raising when ``finish`` is True."""
        self.predict_refresh()
        picked = list(self.groups)[:count]
        groups = self.buffer.sample(count, self.version)
        assert [g.group_id for g in groups] == picked
        step = next(self.ids)
        batch = TrainingBatch(step, groups, release_session=self.traces.release_session)
        assert batch.__enter__() is batch
        sids = [sid for gid in picked for sid in self.groups.pop(gid)]
        assert [s.sample_id for s in batch.states] == sids
        sessions = {s.session_id for s in batch.states if s.session_id is not None}
        assert batch.sessions == sorted(sessions)
        self.batches[step] = (batch, sids)
        if finish is not None:
            self.run_step(step, fail=finish)

    @precondition(lambda self: bool(self.batches))
    @rule(data=st.data(), fail=st.booleans())
    @counted
    def finish_batch(self, data: st.DataObject, fail: bool) -> None:
        """Finish a batch in flight (its step may raise)."""
        self.run_step(data.draw(st.sampled_from(sorted(self.batches))), fail=fail)

    def run_step(self, step: int, *, fail: bool) -> None:
        """Run the step inside ``with batch``; it may raise. Either way the batch's
        leases and its samples' sessions are released."""
        OPS["train step raised" if fail else "train step ok"] += 1
        batch, sids = self.batches.pop(step)
        try:
            with batch:
                for state in batch.states:
                    assert state.routing.handle is not None
                    rows = self.store.read(state.routing.handle, holder=batch.holder)
                    np.testing.assert_array_equal(rows, self.expected[state.sample_id])
                if fail:
                    raise StepFailed(f"step {step}")
        except StepFailed:
            pass
        # Released by the ``with`` exit itself (checked before anything else can).
        assert batch.holder not in dict(self.store.stats().leases_by_holder)
        assert not set(batch.sessions) & set(self.traces.sessions())
        for session in batch.sessions:
            self.sessions.pop(session, None)
        for sid in sids:
            self.forget(sid)
        batch.close()  # idempotent

    @precondition(lambda self: bool(self.pending) or bool(self.partials))
    @rule(data=st.data())
    @counted
    def drop_sample(self, data: st.DataObject) -> None:
        """Abandon a sample: it ends its own lease, nothing else."""
        sid = data.draw(st.sampled_from(sorted([*self.pending, *self.partials])))
        state = self.pending.pop(sid, None) or self.partials.pop(sid)
        state.release()
        state.release()
        self.forget(sid)

    # -- invariants -------------------------------------------------------------------
    def live(self) -> list[tuple[str, str, Handle, Handle, npt.NDArray[np.uint8]]]:
        """(holder, what, routing, leased handle, truth) of everything the model holds."""
        out = []

        def held(holder: str, state: RolloutState) -> None:
            sid = state.sample_id
            assert state.routing.handle is not None
            out.append((holder, sid, state.routing.handle, self.leased[sid], self.expected[sid]))

        for sid, state in [*self.pending.items(), *self.partials.items()]:
            held(f"rollout/{sid}", state)
        for group in self.buffer.groups():
            for state in group.states:
                held(f"buffer/{group.group_id}", state)
        for batch, _ in self.batches.values():
            for state in batch.states:
                held(batch.holder, state)
        for state in self.buffer.release_failed():
            held(self.release_failed[state.sample_id], state)
        for name, (exported, truth) in self.exports.items():
            out.append((name, name, exported.handle, exported.handle, truth))
        for session, model in self.sessions.items():
            for key, handle in model.keys.items():
                truth = sample_rows(model.salt, key)
                out.append((f"session/{session}", f"{session}:{key}", handle, handle, truth))
        return out

    @invariant()
    def every_live_routing_reads_its_ground_truth(self) -> None:
        expected_leases: Counter[str] = Counter()
        expected_payloads: set[str] = set()
        for holder, what, routing, leased, truth in self.live():
            assert payloads(routing) <= payloads(leased), f"{what}: routing outside its lease"
            rows = self.store.read(routing, holder=holder)  # RoutesLost/Expired fail here
            np.testing.assert_array_equal(rows, truth, err_msg=f"{what} held by {holder}")
            expected_leases[holder] += lease_ids(leased)
            expected_payloads |= payloads(leased)
        stats = self.store.stats()
        assert dict(stats.leases_by_holder) == dict(+expected_leases)
        assert stats.leases == sum(expected_leases.values())
        assert stats.live_payloads == len(expected_payloads)
        assert stats.unleased_payloads == 0

    @invariant()
    def trace_store_and_buffer_agree_with_the_model(self) -> None:
        traces = self.traces.stats()
        assert sorted(self.traces.sessions()) == sorted(self.sessions)
        assert traces.leases == sum(len(m.keys) for m in self.sessions.values())
        buffer = self.buffer.stats()
        assert [g.group_id for g in self.buffer.groups()] == list(self.groups)
        assert buffer.samples == sum(len(sids) for sids in self.groups.values())
        assert buffer.waiting_retries == len(self.retry_queue)
        assert buffer.release_failed == len(self.release_failed)
        assert self.engine_store.stats().live_keys == 0  # every engine key was consumed

    def teardown(self) -> None:
        try:
            for batch, _ in self.batches.values():
                batch.close()
            self.buffer.close()
            self.traces.close()
            for state in [*self.pending.values(), *self.partials.values()]:
                state.release()
            for exported, _ in self.exports.values():
                exported.lease.release()
            assert self.store.leaks() == []
            assert self.store.stats().live_payloads == 0
            OPS["examples"] += 1
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


def test_lifecycle_machine() -> None:
    steps_before, ops_before = Counter(STEPS), Counter(OPS)
    run_state_machine_as_test(LifecycleMachine, settings=SETTINGS)
    steps, ops = Counter(STEPS), Counter(OPS)
    steps.subtract(steps_before)
    ops.subtract(ops_before)
    examples = ops.pop("examples", 0)
    total = sum(steps.values())
    mode = "soak" if SOAK else "ci"
    print(f"\nlifecycle machine ({mode}): {total} rule steps executed in {examples} examples")
    print("  per rule: " + ", ".join(f"{k}={v}" for k, v in sorted(steps.items()) if v))
    print("  nested:   " + ", ".join(f"{k}={v}" for k, v in sorted(ops.items()) if v))
    assert examples > 0
    assert total >= examples  # at least the initialize step of every example ran
