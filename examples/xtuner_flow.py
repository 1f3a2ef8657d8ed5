"""XTuner's RL flow on routeplay, end to end, each XTuner part written here in its own shape.

The classes below are XTuner-shaped stand-ins written for this example (read at XTuner
commit ``b934f462``; no XTuner code copied), each calling routeplay's public API where
XTuner handles ``ObjectRef``s by hand today (``docs/xtuner.md`` maps every call site):

- ``XtunerRolloutState``: XTuner's own mutable pydantic sample (int ids), carrying one
  ``SampleRouting`` field in place of ``routed_experts`` (routeplay's ``RolloutState`` is
  never used: a test pins it);
- ``LmdeployServer``: answers LMDeploy's real ``/generate`` body (``output_ids``,
  ``meta_info.output_token_logprobs`` as ``[[logprob, id], ...]``,
  ``meta_info.finish_reason.type``, ``meta_info.routed_experts`` = a key of the
  ``shared_store`` actor, which is routeplay's engine store) from a deterministic toy
  model: the routing of row ``i`` depends on the tokens only (``true_routing``), so the
  final check knows every sample's exact rows;
- ``RolloutWorker``: asyncio, adopts the key without reading it, resumes ABORTED samples
  (only the new rows are stored), borrows a session's prefix for a second turn, checks
  rows at completion (``complete()``);
- ``MultiTaskBuffer``: tasks, groups queried by status, ABORTED groups kept for partial
  rollout, one member expired inside its group (XTuner's tail-batch rule: aborted more
  than ``max_aborts`` times) while the others wait;
- ``TraceTrie``: XTuner's text-keyed trace store, a node per message holding its labels
  and log-probabilities, routing as slices of the turn's handle leased by the session;
- ``Trainer``: packs its own way (greedy packs, whole empty padding packs for DP) into a
  ``PackingPlan.from_packs``, splits SP by zero-padding to a multiple of ``sp``
  (``RankCoords(sp_split="pad_to_multiple")``), and runs three passes (old log-probs,
  reference, update) per rank over one ``Materializer(passes=3)``, its MoE layers using
  an XTuner-style ``GreedyRouter`` fed by ``ReplaySource.decoder_ids``.

It ends by checking exact rows on every rank, zero leases, zero live payloads and zero
engine keys. The rollout side awaits every store call (``acontinuation``, ``aingest``,
``afinish``, ``atake_over``, ``aexpire_retryably``, ``astore_turn``, ``aacquire``,
``arelease``): no ``ray.get`` on its event loop. The trainer is blocking, as XTuner's is.

Run: ``.venv/bin/python examples/xtuner_flow.py`` (starts a local Ray instance).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt
import pydantic
import ray
import torch

from routeplay.core import Handle, RouteSpec
from routeplay.core.wires import Answer, BodyOptions, wire_layers
from routeplay.core.wires import lmdeploy as lmdeploy_wire
from routeplay.errors import RouteplayError
from routeplay.rollout import (
    ADAPTERS,
    Exported,
    Group,
    RoutingContinuation,
    SampleRouting,
    StalenessBasis,
    TrainingBatch,
    afinish_all,
    aingest_routing_group,
    session_holder,
)
from routeplay.store import (
    Lease,
    RouteStore,
    StoreConfig,
    leave_engine_store,
    start_engine_store,
)
from routeplay.train import Materializer, PackingPlan, RankCoords, ReplaySource

# A tiny MoE model: decoder layer 0 is dense (XTuner's first_k_dense_replace), 1-3 route.
SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=8, layer_map=(1, 2, 3), total_layers=4)
HIDDEN = 16
MAX_TOKENS = 16
PACK_MAX_LENGTH = 45  # odd: SP=2 zero-pads every pack by one position
DP, SP = 2, 2
RUN = "xtuner-flow"
GROUP = 3  # GRPO group size
MATH_A = "Q: 2+2="


# ----------------------------------------------------------------- tokens and the toy model


def encode(text: str) -> list[int]:
    """A byte-level toy tokenizer: printable ASCII, id = code point - 32."""
    return [ord(ch) - 32 for ch in text]


def decode(ids: Iterable[int]) -> str:
    return "".join(chr(i + 32) for i in ids)


VOCAB = 95
EOS = encode("|")[0]  # never generated except as the stop token


def true_routing(tokens: Sequence[int]) -> npt.NDArray[np.uint8]:
    """What the toy engine routes for ``tokens``: row ``i`` (input token ``i``) depends only
    on the tokens, so a resume or a later turn routes its history rows the same way and
    the final checks know each sample's exact rows. Ids in a row are distinct."""
    ids = np.asarray(tokens[:-1], dtype=np.int64)
    base = (np.arange(len(ids)) * 7 + ids * 3)[:, None, None]
    layers = 5 * np.arange(SPEC.num_layers)[None, :, None]
    return ((base + layers + np.arange(SPEC.top_k)) % SPEC.num_experts).astype(np.uint8)


def next_token(context: Sequence[int], seed: int) -> tuple[int, float]:
    """The toy policy: a deterministic function of the context and the sampling seed, so a
    resumed request continues exactly where the aborted one stopped."""
    h = (seed * 1_000_003 + len(context) * 7_919 + context[-1] * 31) % 2**31
    token = EOS if h % 6 == 0 else 65 + h % 26  # lower-case letters, or the stop
    return token, -((h >> 8) % 100) / 50


# ----------------------------------------------------------------- the LMDeploy-shaped server


class LmdeployServer:
    """LMDeploy's API server on the Ray executor, as XTuner drives it: ``/generate`` answers
    with the real body, the routing put into the ``shared_store`` actor (routeplay's
    engine store, started in its place) and named by its key.

    ``abort_after`` plays XTuner's partial rollout: when the controller has enough samples
    it aborts what is still generating (``finish_reason.type == "abort"``); here every
    request still running after that many new tokens is aborted."""

    def __init__(self, shared_store: Any) -> None:
        self.shared_store = shared_store
        self.abort_after: int | None = None

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """POST /generate (``GenerateReqInput`` in, ``GenerateReqOutput`` out, as JSON)."""
        context = list(request["input_ids"])
        prompt_tokens = len(context)
        ids: list[int] = []
        logprobs: list[float] = []
        reason = "length"
        while len(ids) < request["max_tokens"]:
            if self.abort_after is not None and len(ids) == self.abort_after:
                reason = "abort"
                break
            token, logprob = next_token(context, request["seed"])
            context.append(token)
            ids.append(token)
            logprobs.append(logprob)
            await asyncio.sleep(0)  # one decoding step: other requests run in between
            if token == EOS:
                reason = "stop"
                break
        answer = Answer(
            prompt_tokens=prompt_tokens,
            token_ids=tuple(ids),
            logprobs=tuple(logprobs),
            finish_reason=reason,
            routing=true_routing(context),
        )
        # The engine writes every row (uint16, every decoder layer) into shared_store; the
        # API server only names the key in the body.
        key = await self.shared_store.put.remote(wire_layers(answer.routing, SPEC, "uint16"))
        options = BodyOptions(endpoint="generate", put=lambda _rows: str(key))
        body = lmdeploy_wire.WIRE.build_body([answer], SPEC, options)
        return dict(json.loads(json.dumps(body)))  # what crosses HTTP


# ----------------------------------------------------------------- XTuner's sample


class Status(str, Enum):
    INIT = "init"
    COMPLETED = "completed"
    ABORTED = "aborted"
    EXPIRED = "expired"


class XtunerRolloutState(pydantic.BaseModel):
    """XTuner's own mutable sample (``data_proto/rl_data.py``, trimmed to what this flow
    uses), with ``routing: SampleRouting`` where XTuner keeps ``routed_experts``. The
    three members under it make it a ``RoutedSample`` for routeplay's containers."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    id: int
    task: str
    group_id: int
    prompt_ids: list[int]
    seed: int
    session: str | None = None
    response_ids: list[int] = []
    logprobs: list[float] = []
    response_model_steps: list[int] = []
    status: Status = Status.INIT
    finish_reason: str | None = None
    aborts: int = 0
    routing: SampleRouting

    @property
    def sample_routing(self) -> SampleRouting:
        return self.routing

    def with_sample_routing(self, routing: SampleRouting) -> XtunerRolloutState:
        self.routing = routing
        return self

    def reset_for_retry(self, routing: SampleRouting) -> XtunerRolloutState:
        """XTuner's ``reset_rollout_response`` minus the frees: the routing was released
        and reset by ``expire_retryably`` before this runs."""
        self.response_ids, self.logprobs, self.response_model_steps = [], [], []
        self.status, self.finish_reason, self.aborts = Status.EXPIRED, None, 0
        return self.with_sample_routing(routing)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def new_state(
    sample_id: int, task: str, group_id: int, prompt: str, *, session: str | None = None
) -> XtunerRolloutState:
    """A fresh sample (its sampling seed is its id); ids are XTuner's ints, routeplay's
    holder names take ``str(id)``."""
    return XtunerRolloutState(
        id=sample_id,
        task=task,
        group_id=group_id,
        prompt_ids=encode(prompt),
        seed=sample_id,
        session=session,
        routing=SampleRouting(sample_id=str(sample_id), session_id=session),
    )


def lmdeploy_request(state: XtunerRolloutState) -> dict[str, Any]:
    """The ``/generate`` request for the sample's next tokens (LMDeploy always answers
    every row, so the start row is 0)."""
    _, request = lmdeploy_wire.WIRE.request(
        state.tokens,
        max_new_tokens=MAX_TOKENS - len(state.response_ids),
        temperature=1.0,
        seed=state.seed,
        extra={},
        start_row=0,
    )
    return dict(request)


def record_answer(state: XtunerRolloutState, body: Any, version: int) -> XtunerRolloutState:
    """The answer's tokens onto the sample; a finished sample's rows are checked against
    its tokens (rows == prompt + response - 1, else ``RowCountMismatch`` here, not at
    packing)."""
    answer = lmdeploy_wire.WIRE.read_completion(body, where=f"sample {state.id}")
    state.response_ids += answer.token_ids
    state.logprobs += answer.logprobs
    state.response_model_steps += [version] * len(answer.token_ids)
    state.finish_reason = answer.finish_reason
    if answer.finish_reason == "abort":
        state.status, state.aborts = Status.ABORTED, state.aborts + 1
        return state
    state.status = Status.COMPLETED
    state.routing = state.routing.complete(
        prompt_tokens=len(state.prompt_ids), response_tokens=len(state.response_ids)
    )
    return state


# ----------------------------------------------------------------- the awaitable store calls


async def adopt_answer(cont: RoutingContinuation, body: Any, store: RouteStore, v: int) -> Handle:
    """The answer's routing: the history, then only the rows it lacks (the key adopted
    without reading it, sliced on the engine store's node)."""
    adapter = ADAPTERS["lmdeploy"]
    return await cont.aingest(adapter, body, spec=SPEC, writer=store, weight_version=v)


async def finish(cont: RoutingContinuation, store: RouteStore, handle: Handle) -> SampleRouting:
    """The sample's new lease first, then the leases it replaces (own, borrowed)."""
    return await cont.afinish(store, handle)


async def take_over(routing: SampleRouting, holder: str, store: RouteStore) -> SampleRouting:
    """A clone for ``holder`` first, then the previous holder's lease ends."""
    return await routing.atake_over(holder, store)


async def expire(routing: SampleRouting) -> SampleRouting:
    """Release first, then reset (a lease whose release failed would stay visible)."""
    expiry = await routing.aexpire_retryably()
    assert expiry.stuck is None, expiry.error
    return expiry.retry


# ----------------------------------------------------------------- the text-keyed trace trie


@dataclass
class TraceNode:
    """One message of a conversation: its text, tokens, labels, log-probabilities, and the
    session's lease on its routing rows (a slice of the turn's handle)."""

    text: str
    token_ids: list[int]
    labels: list[int]
    logprobs: list[float]
    routing: Lease | None = None
    children: dict[str, TraceNode] = field(default_factory=dict)


@dataclass(frozen=True)
class Message:
    role: str
    text: str
    logprobs: tuple[float, ...] = ()


class TraceTrie:
    """XTuner's ``RolloutTraceStore`` shape: per session, a trie keyed by message text.

    ``aexport`` is what ``SampleRouting.acontinuation`` awaits to borrow a session's
    prefix (``AsyncPrefixSource``), ``turn_sink(...)`` what ``astore_turn`` inserts
    through (``AsyncSessionSink``). Each node's routing is a slice of its turn's handle under the
    session's own lease; overwriting a node leases the new slice before the old lease
    ends; ``release_session`` is the one place the session's leases end."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self.sessions: dict[str, TraceNode] = {}

    async def ainsert(self, session: str, messages: Sequence[Message], handle: Handle) -> None:
        node = self.sessions.setdefault(session, TraceNode("", [], [], []))
        start = 0
        for message in messages:
            ids = encode(message.text)
            child = node.children.get(message.text)
            if child is None:
                labels = [int(message.role == "assistant")] * len(ids)
                logprobs = list(message.logprobs) or [0.0] * len(ids)
                child = TraceNode(message.text, ids, labels, logprobs)
                node.children[message.text] = child
            rows = handle[start : start + len(ids)]
            if child.routing is None or child.routing.handle.rows < rows.rows:
                replaced = child.routing
                child.routing = await self.store.aacquire(rows, session_holder(session))
                if replaced is not None:
                    await replaced.arelease()
            node, start = child, start + len(ids)

    def turn_sink(self, messages: Sequence[Message]) -> TurnSink:
        return TurnSink(self, messages)

    async def aexport(self, session: str, token_ids: Iterable[int], holder: str) -> Exported | None:
        """The longest stored prefix of ``token_ids`` in the session, matched message by
        message on the text, under a lease of ``holder``'s own."""
        text, node, matched, slices = decode(token_ids), self.sessions.get(session), 0, []
        while node is not None:
            node = next((c for t, c in node.children.items() if text.startswith(t, matched)), None)
            if node is None or node.routing is None:
                break
            slices.append(node.routing.handle)
            matched += len(node.token_ids)
            if node.routing.handle.rows < len(node.token_ids):
                break  # a turn ended here: its last token has no row yet
        handle = Handle.concat(SPEC, slices)[: len(text) - 1]
        if handle.rows == 0:
            return None
        lease = await self.store.aacquire(handle, holder)
        return Exported(matched=matched, rows=handle.rows, lease=lease)

    def release_session(self, session: str) -> None:
        # The trainer's (TrainingBatch's release_session): blocking, as the trainer is.
        stack = [self.sessions.pop(session)] if session in self.sessions else []
        while stack:
            node = stack.pop()
            if node.routing is not None:
                node.routing.release()
            stack.extend(node.children.values())

    def leases(self) -> int:
        """Session leases still live, over every session."""
        stack, count = list(self.sessions.values()), 0
        while stack:
            node = stack.pop()
            count += node.routing is not None and not node.routing.released
            stack.extend(node.children.values())
        return count


@dataclass
class TurnSink:
    """A finished turn's messages on their way into the trie (``SessionSink``)."""

    trie: TraceTrie
    messages: Sequence[Message]

    async def ainsert(self, session: str, token_ids: Iterable[int], handle: Handle) -> None:
        assert decode(token_ids) == "".join(m.text for m in self.messages)
        await self.trie.ainsert(session, self.messages, handle)


# ----------------------------------------------------------------- the rollout worker


class RolloutWorker:
    """XTuner's ``RolloutWorker`` (``generate`` + ``_safe_handle_response``) with the
    ``PartialRolloutHandler``: one coroutine per sample, many in flight."""

    def __init__(self, server: LmdeployServer, store: RouteStore, traces: TraceTrie) -> None:
        self.server, self.store, self.traces = server, store, traces

    async def generate(self, state: XtunerRolloutState, version: int) -> XtunerRolloutState:
        """One request: a fresh sample, an ABORTED one resumed (its own rows are the
        history) or a session's next turn (the session's rows borrowed)."""
        async with await state.routing.acontinuation(self.traces, state.prompt_ids) as cont:
            body = await self.server.generate(lmdeploy_request(state))
            handle = await adopt_answer(cont, body, self.store, version)
            state.routing = await finish(cont, self.store, handle)
        return record_answer(state, body, version)

    async def generate_group(self, group: list[XtunerRolloutState], version: int) -> None:
        """A fresh GRPO group (one prompt, one answer per member): the requests run
        together, then the group's keys are adopted in *one* write, the prompt's rows
        stored once (``aingest_routing_group``); the members then finish together
        (``afinish_all``: one call per shard for the group). A
        member whose key is refused is set aside as ABORTED (its continuation ends with
        the block) and costs only itself."""
        async with contextlib.AsyncExitStack() as stack:
            conts = [
                await stack.enter_async_context(
                    await s.routing.acontinuation(self.traces, s.prompt_ids)
                )
                for s in group
            ]
            requests = [lmdeploy_request(s) for s in group]
            bodies = await asyncio.gather(*(self.server.generate(r) for r in requests))
            adapter = ADAPTERS["lmdeploy"]
            answers = [
                adapter.read(body, spec=SPEC, where=f"sample {s.id}", start_row=0)
                for s, body in zip(group, bodies, strict=True)
            ]
            handles = await aingest_routing_group(
                conts, answers, writer=self.store, weight_version=version, spec=SPEC
            )
            kept = [
                (state, cont, handle, body)
                for state, cont, handle, body in zip(group, conts, handles, bodies, strict=True)
                if not isinstance(handle, RouteplayError)
            ]
            for state, handle in zip(group, handles, strict=True):
                if isinstance(handle, RouteplayError):
                    state.status, state.aborts = Status.ABORTED, state.aborts + 1
            # The members' leases together: one acquire_many, then one release per shard.
            routings = await afinish_all(
                [cont for _, cont, _, _ in kept], self.store, [h for _, _, h, _ in kept]
            )
            for (state, _, _, body), routing in zip(kept, routings, strict=True):
                state.routing = routing
                record_answer(state, body, version)

    async def converse(
        self, state: XtunerRolloutState, user: str, version: int
    ) -> XtunerRolloutState:
        """Two turns of a session: turn 1 goes to the trace trie (the session leases it,
        then the sample's lease ends); turn 2 borrows its rows and stores only its own."""
        first = await self.generate(state, version)
        messages = [
            Message("user", decode(first.prompt_ids)),
            Message("assistant", decode(first.response_ids), tuple(first.logprobs)),
        ]
        sink = self.traces.turn_sink(messages)
        first.routing = await first.routing.astore_turn(sink, first.tokens)
        prompt = "".join(m.text for m in messages) + user
        second = new_state(
            state.id + 100, state.task, state.group_id, prompt, session=state.session
        )
        second = await self.generate(second, version)
        turn = [*messages, Message("user", user)]
        turn.append(Message("assistant", decode(second.response_ids), tuple(second.logprobs)))
        assert second.session is not None
        assert second.routing.handle is not None
        # The session records turn 2 too (its own leases); the sample keeps its lease to train.
        await self.traces.ainsert(second.session, turn, second.routing.handle)
        return second


# ----------------------------------------------------------------- the multi-task buffer


class MultiTaskBuffer:
    """XTuner's ``ReplayBuffer`` shape: groups per task, queried by status; a group with a
    member still to generate (ABORTED, or EXPIRED and reset) waits as ABORTED for partial
    rollout. ``refresh`` expires single members inside their group."""

    def __init__(self, store: RouteStore, *, max_aborts: int, max_staleness: int) -> None:
        self.store = store
        self.max_aborts, self.max_staleness = max_aborts, max_staleness
        self.groups: dict[tuple[str, int], list[XtunerRolloutState]] = {}
        self.expired: list[int] = []

    async def put(self, group: list[XtunerRolloutState], version: int) -> None:
        """Take each member over (``buffer/<task>/<group>``), then refresh the group."""
        holder = f"buffer/{group[0].task}/{group[0].group_id}"
        for state in group:
            lease = state.routing.lease
            if lease is not None and not lease.released and lease.holder != holder:
                state.routing = await take_over(state.routing, holder, self.store)
        self.groups[(group[0].task, group[0].group_id)] = await self.refresh(group, version)

    async def refresh(self, group: list[XtunerRolloutState], version: int) -> list[Any]:
        """Expire the members past XTuner's limits (too many aborts: the tail-batch rule;
        response tokens too old), each alone; the rest of the group waits as it is."""
        for state in group:
            stale = state.status is Status.COMPLETED and (
                state.routing.staleness(version, StalenessBasis.RESPONSE_TOKENS)
                > self.max_staleness
            )
            if state.aborts > self.max_aborts or stale:
                state.reset_for_retry(await expire(state.routing))
                self.expired.append(state.id)
        return group

    def status(self, group: list[XtunerRolloutState]) -> Status:
        done = all(s.status is Status.COMPLETED for s in group)
        return Status.COMPLETED if done else Status.ABORTED

    def get(self, task: str, status: Status) -> list[list[XtunerRolloutState]]:
        """Take out every group of ``task`` in ``status`` (their leases stay the buffer's
        until the next holder takes them over)."""
        keys = [k for k, g in self.groups.items() if k[0] == task and self.status(g) is status]
        return [self.groups.pop(key) for key in keys]


# ----------------------------------------------------------------- the trainer


class GreedyRouter(torch.nn.Module):
    """XTuner's ``GreedyRouter``: softmax top-k, or the given ``topk_ids`` (replay); the
    gate weights are recomputed from the trainer's own logits, so the router learns."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, SPEC.num_experts, bias=False)
        self.used: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor | None) -> Any:
        scores = self.gate(hidden).softmax(-1)
        ids = topk_ids if topk_ids is not None else scores.topk(SPEC.top_k, -1).indices
        self.used = ids
        return ids, scores.gather(-1, ids)


class DecoderLayer(torch.nn.Module):
    """XTuner's ``MoEDecoderLayer`` (or a dense one): it asks for its routing by its
    decoder-layer index, over all ``num_hidden_layers``."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.router = GreedyRouter() if SPEC.moe_layer(layer_idx) is not None else None
        self.experts = torch.nn.Parameter(torch.randn(SPEC.num_experts, HIDDEN) * 0.1)

    def forward(self, hidden: torch.Tensor, routes: ReplaySource) -> torch.Tensor:
        if self.router is None:
            return hidden + torch.tanh(hidden)
        ids = routes.decoder_ids(self.layer_idx, device=hidden.device, rows=hidden.shape[0])
        ids, weights = self.router(hidden, ids)
        return hidden + (weights.unsqueeze(-1) * self.experts[ids]).sum(-2)


class TinyMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(DecoderLayer(i) for i in range(SPEC.decoder_layers))

    def forward(self, input_ids: torch.Tensor, routes: ReplaySource) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, routes)
        return hidden


def xtuner_layout(
    pack: list[tuple[Any, int]], fill: npt.NDArray[Any], rank: int
) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """XTuner's ``_packing`` then ``SequenceContext.split``: the samples' rows back to
    back, the tail filled up to ``PACK_MAX_LENGTH``, zero-padded to a multiple of ``SP``,
    and SP rank ``rank``'s slice. ``pack`` is ``(rows, rows)`` pairs of one array each."""
    length = -(-PACK_MAX_LENGTH // SP) * SP
    out = np.broadcast_to(fill, (length, *fill.shape)).copy()
    mask = np.zeros(length, bool)
    at = 0
    for rows, count in pack:
        out[at : at + count], mask[at : at + count] = rows, True
        at += count
    split = length // SP
    return out[rank * split : (rank + 1) * split], mask[rank * split : (rank + 1) * split]


@dataclass
class StepReport:
    samples: int = 0
    packs: int = 0
    padding_packs: int = 0
    ranks: int = 0
    rows_checked: int = 0
    forwards: int = 0


class Trainer:
    """XTuner's ``RLTrainer`` + ``TrainingController._packing`` + ``TrainingWorker``:
    its own packs, DP x SP ranks (played one after another here), three passes each."""

    PASSES = ("old_logprobs", "reference", "update")

    def __init__(self, store: RouteStore, traces: TraceTrie) -> None:
        self.store, self.traces = store, traces
        self.model = TinyMoE()
        self.report = StepReport()

    def pack(self, samples: Sequence[XtunerRolloutState]) -> list[list[Any]]:
        """Greedy packs of ``input_ids = prompt + response[:-1]`` (one routing row per
        position), then whole empty padding packs up to a multiple of ``DP`` (XTuner's fit)."""
        packs: list[list[Any]] = [[]]
        for s in sorted(samples, key=lambda s: s.id):
            if sum(t - 1 for _, _, t in packs[-1]) + len(s.tokens) - 1 > PACK_MAX_LENGTH:
                packs.append([])
            packs[-1].append((str(s.id), s.routing.handle, len(s.tokens)))
        packs += [[] for _ in range(-len(packs) % DP)]
        return packs

    def step(self, step: int, groups: Sequence[list[XtunerRolloutState]]) -> None:
        wrapped = [Group(group_id=str(g[0].group_id), states=tuple(g)) for g in groups]
        # The batch takes the step's leases over (train/step-<n>); on exit, normal or not,
        # it ends them and then releases the sessions its samples consumed.
        with TrainingBatch(step, wrapped, release_session=self.traces.release_session) as batch:
            self.report.samples += len(batch.states)
            packs = self.pack(batch.states)
            plan = PackingPlan.from_packs(packs, pack_max_length=PACK_MAX_LENGTH, dp_size=DP)
            self.report.packs += len(plan.packs)
            self.report.padding_packs += sum(not p.samples for p in plan.packs)
            by_id = {str(s.id): s for s in batch.states}
            for dp_rank in range(DP):
                for sp_rank in range(SP):
                    self.rank(step, plan, by_id, dp_rank, sp_rank)

    def rank(self, step: int, plan: PackingPlan, by_id: Any, dp_rank: int, sp_rank: int) -> None:
        """One DP x SP rank: its own leases (one acquire_many), three passes over one
        materializer, which ends the leases once, after the last pass."""
        coords = RankCoords(
            dp_rank=dp_rank, sp_rank=sp_rank, sp_size=SP, sp_split="pad_to_multiple"
        )
        holder = f"train/step-{step}/dp{dp_rank}-sp{sp_rank}"
        # The rank's leases in one acquire_many; the materializer ends them after the last pass.
        with Materializer.leasing(
            self.store, plan, coords, holder=holder, passes=3
        ) as materializer:
            for name in self.PASSES:
                for item in materializer.next_pass():
                    [pack] = item.packs
                    samples = [by_id[s.sample_id] for s in plan.packs[pack].samples]
                    self.check_rows(item.routes, item.mask, samples, sp_rank)
                    self.forward(name, item.routes, samples, sp_rank)
        self.report.ranks += 1

    def forward(self, name: str, routes: Any, samples: Any, sp_rank: int) -> None:
        pad_token = np.zeros((), np.int64)
        packed = [(np.asarray(s.tokens[:-1]), len(s.tokens) - 1) for s in samples]
        input_ids, _ = xtuner_layout(packed, pad_token, sp_rank)
        source = ReplaySource(routes, SPEC)  # range and distinct ids checked here
        with torch.set_grad_enabled(name == "update"):
            out = self.model(torch.from_numpy(input_ids), source)
        for layer in self.model.layers:
            if layer.router is not None:  # the router ran on exactly the replayed ids
                column = SPEC.moe_layer(layer.layer_idx)
                assert torch.equal(layer.router.used, torch.from_numpy(routes[:, column]).long())
        if name == "update":
            out.pow(2).mean().backward()
            assert all(
                layer.router.gate.weight.grad is not None
                for layer in self.model.layers
                if layer.router is not None
            ), "replayed routers keep their gradient"
            self.model.zero_grad()
        self.report.forwards += 1

    def check_rows(self, routes: Any, mask: Any, samples: Any, sp_rank: int) -> None:
        """Exact rows: what this rank got equals XTuner's layout of the engine's routing."""
        pad_row = (np.arange(SPEC.top_k) % SPEC.num_experts).astype(SPEC.dtype)
        fill = np.broadcast_to(pad_row, SPEC.row_shape)
        truth = [(true_routing(s.tokens), len(s.tokens) - 1) for s in samples]
        want, want_mask = xtuner_layout(truth, fill, sp_rank)
        np.testing.assert_array_equal(routes, want)
        np.testing.assert_array_equal(mask, want_mask)
        self.report.rows_checked += int(mask.sum())


# ----------------------------------------------------------------- the flow


@dataclass
class FlowReport:
    """What the run did, and what it left behind (every count that must be 0 is)."""

    resumed_bytes: int
    resumed_new_rows: int
    group_prompt_bytes_saved: int
    expired: list[int]
    step: StepReport
    leases: int
    live_payloads: int
    engine_keys: int
    trie_leases: int


async def rollout(worker: RolloutWorker, group: list[Any], version: int) -> list[Any]:
    todo = [s for s in group if s.status is not Status.COMPLETED]
    await asyncio.gather(*(worker.generate(s, version) for s in todo))
    return group


async def flow(store: RouteStore, shared_store: Any) -> tuple[int, int, int, list[int], Trainer]:
    server = LmdeployServer(shared_store)
    traces = TraceTrie(store)
    worker = RolloutWorker(server, store, traces)
    buffer = MultiTaskBuffer(store, max_aborts=1, max_staleness=2)
    trainer = Trainer(store, traces)

    # Version 0: a math group the controller aborts half-way (two members have stopped by
    # then), then a math group and a chat group of two-turn sessions, concurrently.
    math_a = [new_state(i, "math", 0, MATH_A) for i in range(GROUP)]
    math_b = [new_state(i, "math", 1, "Q: 7*6=?") for i in (12, 13, 14)]
    chat = [new_state(i, "chat", 2, "Hi! ", session=f"s{i}") for i in (20, 21)]
    server.abort_after = 4
    await rollout(worker, math_b, 0)
    server.abort_after = None
    saved_before = store.stats().shared_prefix_bytes_saved
    seconds, _ = await asyncio.gather(
        asyncio.gather(*(worker.converse(s, "More? ", 0) for s in chat)),
        worker.generate_group(math_a, 0),
    )
    group_saved = store.stats().shared_prefix_bytes_saved - saved_before
    for group in (math_a, math_b, list(seconds)):
        await buffer.put(group, version=0)
    trainer.step(1, buffer.get("math", Status.COMPLETED) + buffer.get("chat", Status.COMPLETED))

    # Version 1: the ABORTED group resumes; only its aborted member generates, storing only
    # its new rows, and is aborted again: past max_aborts it is expired inside its group.
    [group_b] = buffer.get("math", Status.ABORTED)
    before, rows_before = store.stats().live_bytes, sum(s.routing.rows for s in group_b)
    server.abort_after = 4
    await rollout(worker, group_b, 1)
    resumed_bytes = store.stats().live_bytes - before
    new_rows = sum(s.routing.rows for s in group_b) - rows_before
    await buffer.put(group_b, version=1)

    # Version 2: the expired member regenerates from scratch; its group trains.
    server.abort_after = None
    [group_b] = buffer.get("math", Status.ABORTED)
    await buffer.put(await rollout(worker, group_b, 2), version=2)
    trainer.step(2, buffer.get("math", Status.COMPLETED))
    return resumed_bytes, new_rows, group_saved, buffer.expired, trainer


def main() -> FlowReport:
    """Run the flow on the local Ray instance (one is started if none is up)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=RUN)
    store = StoreConfig(run=RUN, timeout_s=30).build()
    shared_store = start_engine_store(ttl_s=120, user=RUN)
    try:
        resumed_bytes, new_rows, saved, expired, trainer = asyncio.run(flow(store, shared_store))
        store.flush()
        stats = store.stats()
        report = FlowReport(
            resumed_bytes=resumed_bytes,
            resumed_new_rows=new_rows,
            group_prompt_bytes_saved=saved,
            expired=expired,
            step=trainer.report,
            leases=stats.leases,
            live_payloads=stats.live_payloads,
            engine_keys=ray.get(shared_store.stats.remote()).live_keys,
            trie_leases=trainer.traces.leases(),
        )
    finally:
        leave_engine_store(shared_store, RUN, end_if_last=True)
        store.shutdown()
        if started:
            ray.shutdown()
    assert report.resumed_bytes == SPEC.nbytes(report.resumed_new_rows) > 0, report
    # One write for the fresh GRPO group: its prompt's rows stored once, not per member.
    assert report.group_prompt_bytes_saved == (GROUP - 1) * SPEC.nbytes(len(encode(MATH_A))), report
    assert report.step.rows_checked > 0, report
    assert report.step.padding_packs > 0, report
    assert (report.leases, report.live_payloads, report.engine_keys, report.trie_leases) == (
        0,
        0,
        0,
        0,
    ), report
    return report


if __name__ == "__main__":
    print(main())
