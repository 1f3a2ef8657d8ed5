"""The actors of the multi-turn bytes workloads: an engine and a rollout worker.

The rollout worker (on the rollout node) runs a session's turns and a partial rollout
through the steps of routeplay's routing holder (``continuation`` -> ``ingest`` ->
``finish`` -> ``store_turn``, a resume continuing the sample's own routing), over a
trace-store actor, writing through its producer (one write per payload, owned by a
store shard). Every answer is the engine's wire body as that engine sends it, built by
the fake engines of ``routeplay.rollout.fake_engines`` (the wire modules' body
builders): vLLM and SGLang answer in the worker's memory (an HTTP body never passes the
object store) with rows from the request's start row; LMDeploy's key comes from the
engine actor on the engine node, which puts every row of the context into
``shared_store`` (LMDeploy has no start field) and answers with the key.

Routing rows are synthetic and causal: row ``i`` is the routing of token ``i``, drawn
per turn (``Blocks``: one ``(tokens, seed)`` per turn, a row for each token the turn
added), and a context of ``n`` tokens has the first ``n - 1`` of them. So two branches
share exactly the rows of their common tokens, the trunk's last token included (its row
is computed by the first branch's turn, and the second branch reuses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import ray

from routeplay.bench.roles import sample_routing
from routeplay.bench.workloads import SessionShape
from routeplay.core import RouteSpec, canonicalize, preset
from routeplay.core.handle import Handle
from routeplay.core.routes import Routes
from routeplay.core.wires import wire
from routeplay.rollout import ADAPTERS, RolloutState, Status
from routeplay.rollout.adapters import ProducerWriter
from routeplay.rollout.fake_engines import FakeLmdeployKey, FakeSglang, FakeVllmHttp
from routeplay.rollout.routing_terms import sample_holder
from routeplay.rollout.trace_actor import TraceStoreClient
from routeplay.store import RoutesProducer, RouteStore, producer_actor

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

__all__ = ["SESSION_WIRES", "SessionEngine", "SessionWorker"]

SESSION_WIRES = ("vllm", "sglang", "lmdeploy-key")
"""The wires measured: vLLM (``routed_experts_prompt_start``), SGLang
(``routed_experts_start_len``), LMDeploy keys (adopted from the history's end)."""

Blocks = tuple[tuple[int, int], ...]
"""A context's tokens as the turns that added them: ``(tokens, seed)`` each; the routing
row of every one of those tokens comes from its turn's seed."""


class _Rows:
    """The engine's routing of every block (uint16, every decoder layer), cached."""

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec
        self._blocks: dict[int, npt.NDArray[Any]] = {}

    def of(self, blocks: Blocks) -> npt.NDArray[Any]:
        """The row of every token of ``blocks`` (a context's rows are all but the last)."""
        for rows, seed in blocks:
            if seed not in self._blocks:
                self._blocks[seed] = sample_routing(self.spec, rows, seed)
        return np.concatenate([self._blocks[seed] for _, seed in blocks])


class _SessionEngine(RoutesProducer):
    """LMDeploy on Ray: each answer's rows into ``shared_store`` (one write), the key in
    its ``/generate`` body."""

    def __init__(self, spec: RouteSpec) -> None:
        self._rows = _Rows(spec)
        self._fake = FakeLmdeployKey(spec=spec, put=self._put)

    def answer(self, blocks: Blocks, prompt_tokens: int, completion_tokens: int) -> Any:
        """LMDeploy's body for a context of ``blocks`` (every row: no start field)."""
        truth = self._rows.of(blocks)
        return self._fake.respond(
            truth, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )

    def _put(self, payload: npt.NDArray[Any]) -> str:
        engine_store = ray.get_actor("shared_store", namespace="lmdeploy")
        token, _ = self.stage_routes(payload, block_rows=0)
        me = ray.get_runtime_context().current_actor
        shape, dtype = payload.shape, str(payload.dtype)
        put = engine_store.put_from.remote(me, token, shape, dtype)
        return str(ray.get(put, timeout=_DEADLINE_S))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Context:
    """A token sequence a turn ends with, and the blocks its routing rows are made of."""

    tokens: tuple[int, ...] = ()
    blocks: Blocks = ()
    versions: tuple[int, ...] = ()
    """The weight version of each turn: the version its new rows are stored with (a
    turn computes the rows from its context's last row, which had none, to its own
    second-last token)."""

    def row_versions(self) -> npt.NDArray[np.int64]:
        """The weight version of each routing row."""
        tokens = np.cumsum([n for n, _ in self.blocks])
        new_rows = np.diff(tokens - 1, prepend=0)
        return np.repeat(np.asarray(self.versions, dtype=np.int64), new_rows)


class _SessionWorker(RoutesProducer):
    """A rollout worker that runs the session and the partial rollout on one wire."""

    def __init__(
        self, store: RouteStore, traces: TraceStoreClient, engine: Any, shape: SessionShape
    ) -> None:
        self.store = store
        self.traces = traces
        self.engine = engine
        self.shape = shape
        self.spec = preset(shape.model)
        self._rows = _Rows(self.spec)
        self._writer = ProducerWriter(producer=self, store=store)
        self._leaves: dict[str, _Context] = {}
        self._partial: RolloutState | None = None
        self._partial_blocks: Blocks = ()

    # -- the session ----------------------------------------------------------------
    def converse(self, wire_name: str, session: str) -> dict[str, Any]:
        """A trunk of turns, then two branches continuing its last turn (each with its
        own user message: the trunk is their shared prefix); every turn goes to the
        trace session and the sample's lease ends. Returns the rows the session has."""
        shape, seeds = self.shape, iter(range(1, 10_000))
        trunk = _Context()
        for turn in range(shape.trunk_turns):
            trunk = self._turn(wire_name, session, trunk, f"t{turn}", next(seeds), version=0)
        for branch in ("a", "b"):
            leaf = trunk
            for turn in range(shape.branch_turns):  # a weight update before the branches
                name = f"{branch}{turn}"
                leaf = self._turn(wire_name, session, leaf, name, next(seeds), version=1)
            self._leaves[branch] = leaf
        blocks = {block for leaf in self._leaves.values() for block in leaf.blocks}
        tokens = sum(n for n, _ in blocks)  # every token has a row but each leaf's last
        return {"turns": shape.turns, "unique_rows": tokens - len(self._leaves)}

    def session_layout(self, session: str) -> dict[str, Any]:
        """Segments of the longest stored handle and the session's stored payloads."""
        handles = [self._stored(session, leaf) for leaf in self._leaves.values()]
        return _layout(handles)

    def check_session(self, session: str) -> bool:
        """Each branch reads exactly its rows (as the engine routed them), at the weight
        versions its turns were generated with."""
        exact = True
        for leaf in self._leaves.values():
            exported = self.traces.export(session, leaf.tokens, "bench/check")
            assert exported is not None  # the leaf's own tokens: every row matches
            with exported.lease:
                rows = self.store.read(exported.handle)
                exact &= np.array_equal(rows, self._canonical(leaf.blocks)[:-1])
                exact &= np.array_equal(exported.handle.weight_versions(), leaf.row_versions())
        return exact

    def end_session(self, session: str) -> int:
        """Release the session (its leases are the only ones left on its rows)."""
        self._leaves = {}
        return self.traces.release_session(session)

    def _turn(
        self, wire_name: str, session: str, before: _Context, name: str, seed: int, version: int
    ) -> _Context:
        """One turn: the context so far plus a user message, answered and stored."""
        user = self.shape.user_tokens + (0 if before.tokens else self.shape.system_tokens)
        prompt = before.tokens + _token_ids(seed, user)
        state = RolloutState(
            sample_id=f"{session}/{name}", group_id=session, prompt_ids=prompt, session_id=session
        )
        blocks = (*before.blocks, (user + self.shape.answer_tokens, seed))
        done = self._generate(wire_name, state, blocks, self.shape.answer_tokens, version)
        done = done.complete("length")
        tokens = done.prompt_ids + done.response_ids
        stored = done.with_sample_routing(done.routing.store_turn(self.traces, tokens))
        tokens = stored.prompt_ids + stored.response_ids
        return _Context(tokens=tokens, blocks=blocks, versions=(*before.versions, version))

    def _stored(self, session: str, leaf: _Context) -> Handle:
        match = self.traces.longest_prefix(session, leaf.tokens)
        assert match.handle is not None  # the leaf's own tokens: every row matches
        return match.handle

    # -- the partial rollout ----------------------------------------------------------
    def resume_rollout(self, wire_name: str, sample_id: str) -> dict[str, Any]:
        """One sample generated in ``pieces``: interrupted after each but the last and
        resumed with its own routing as the history, the weights one version newer at
        every resume. The worker keeps the sample's lease. Returns its rows."""
        shape = self.shape
        prompt = _token_ids(50_000, shape.rollout_prompt_tokens)
        state = RolloutState(sample_id=sample_id, group_id=sample_id, prompt_ids=prompt)
        blocks: Blocks = ()
        for piece in range(shape.pieces):
            added = shape.piece_tokens + (len(prompt) if piece == 0 else 0)
            blocks = (*blocks, (added, 50_001 + piece))
            state = self._generate(wire_name, state, blocks, shape.piece_tokens, version=piece)
            last = piece == shape.pieces - 1
            state = state.complete("length") if last else state.with_status(Status.ABORTED, "abort")
        self._partial, self._partial_blocks = state, blocks
        return {"turns": shape.pieces, "unique_rows": state.tokens - 1}

    def partial_layout(self) -> dict[str, Any]:
        """Segments and payloads of the resumed sample's handle."""
        return _layout([self._partial_state().routing.handle or Handle(self.spec)])

    def compact_partial(self) -> dict[str, Any]:
        """The sample's rows copied once into one payload (``RouteStore.compact``,
        written through this producer: a shard owns them); the sample's new lease
        exists before its old one ends."""
        state = self._partial_state()
        routing = state.sample_routing
        assert routing.handle is not None
        holder = sample_holder(state.sample_id)
        done = self.store.compact([routing.handle], holder, write=self._write)
        [handle], [lease] = done.handles, done.leases
        if lease is not None:
            moved = routing.release().attach(handle, lease, routing.origin)
            self._partial = state.with_sample_routing(moved)
        report = done.report
        return {"rows_copied": report.rows_copied, "payloads_written": report.payloads_written}

    def _write(self, batch: Sequence[Routes]) -> list[Handle]:
        return self.put_routes_many(self.store, batch)

    def check_partial(self) -> bool:
        """The resumed sample reads exactly its rows at each piece's weight version."""
        state = self._partial_state()
        handle = state.routing.handle
        assert handle is not None
        rows = self.store.read(handle)
        pieces = _Context(blocks=self._partial_blocks, versions=tuple(range(self.shape.pieces)))
        return bool(
            np.array_equal(rows, self._canonical(self._partial_blocks)[:-1])
            and np.array_equal(handle.weight_versions(), pieces.row_versions())
        )

    def end_partial(self) -> None:
        """The sample is trained and dropped: its lease ends."""
        self._partial = self._partial_state().release()
        self._partial = None

    def _partial_state(self) -> RolloutState:
        assert self._partial is not None, "resume_rollout first"
        return self._partial

    # -- one request ------------------------------------------------------------------
    def _generate(
        self, wire_name: str, state: RolloutState, blocks: Blocks, new_tokens: int, version: int
    ) -> RolloutState:
        """The engine continues ``state`` by ``new_tokens``; only the rows its routing
        (a borrowed session prefix, or its own history) lacks are stored."""
        engine = wire(wire_name)
        traces = self.traces if state.session_id else None
        with state.routing.continuation(traces, state.prompt_ids) as cont:
            start = engine.routing_start(cont.rows)  # the request's start field, if any
            body = self._answer(wire_name, blocks, state.tokens, new_tokens, start)
            completion = engine.read_completion(body)
            handle = cont.ingest(
                ADAPTERS[engine.engine.value],
                body,
                spec=self.spec,
                writer=self._writer,
                weight_version=version,
                start_row=start,
            )
            routed = state.with_sample_routing(cont.finish(self.store, handle))
        return routed.extend(completion.token_ids, completion.logprobs, version)

    def _answer(
        self, wire_name: str, blocks: Blocks, prompt_tokens: int, new_tokens: int, start: int
    ) -> Any:
        if wire(wire_name).key_store:
            pending = self.engine.answer.remote(blocks, prompt_tokens, new_tokens)
            return ray.get(pending, timeout=_DEADLINE_S)
        fake = FakeVllmHttp(spec=self.spec) if wire_name == "vllm" else FakeSglang(spec=self.spec)
        truth = self._rows.of(blocks)
        return fake.respond(
            truth, prompt_tokens=prompt_tokens, completion_tokens=new_tokens, start_row=start
        )

    def _canonical(self, blocks: Blocks) -> npt.NDArray[Any]:
        return canonicalize(self._rows.of(blocks), self.spec).array


def _token_ids(seed: int, count: int) -> tuple[int, ...]:
    """A user message (or prompt) of ``count`` token ids, distinct per seed."""
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(1_000, 150_000, size=count))


def _layout(handles: Sequence[Handle]) -> dict[str, Any]:
    """The longest handle's segments and the stored payloads of all of them."""
    payloads = {source for handle in handles for source in handle.sources()}
    return {
        "segments": max((len(h.segments) for h in handles), default=0),
        "payloads": len(payloads),
    }


SessionEngine: Any = producer_actor(_SessionEngine, num_cpus=0)
SessionWorker: Any = producer_actor(_SessionWorker, num_cpus=0)
