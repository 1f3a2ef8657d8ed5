"""XTuner's RL flow on routeplay, across Ray actors, each XTuner part in its own shape.

The parts are XTuner-shaped stand-ins written here (read at XTuner commit ``b934f462``;
no XTuner code copied; ``docs/xtuner.md`` runs the same recipe on XTuner's own classes),
each its own Ray actor, the samples crossing between them pickled as XTuner's do:

- ``XtunerRolloutState``: XTuner's pydantic sample with its field names and
  ``extra="forbid"`` (it gains no field: its ``routed_experts`` carries the
  ``SampleRouting``), and XTuner's statuses (EXPIRED apart from ABORTED);
- ``RolloutWorker`` (an asyncio actor): XTuner's rollout worker with partial rollout and
  its SessionServer, in front of an LMDeploy stand-in that answers the real
  ``/generate`` and chat bodies from a deterministic toy model (``true_routing``: row
  ``i`` depends on the tokens only, so every check knows the exact rows), its captures
  put into ``shared_store`` (routeplay's engine store) and named by key. The tokenizer
  is a byte-level BPE trained here (no download), and the model emits one byte token
  per character: its token ids are not the tokenizer's encoding of its own text;
- ``TraceTrie`` (an actor): XTuner's trace store, a trie per session keyed by rendered
  **text**, each node holding its text, token ids, labels and the session's lease on its
  rows (a slice of one adopted key; a node of tokens ``[a, b)`` holds rows
  ``[a - 1, b - 1)``); the worker builds a turn's request from the nodes' own token ids
  plus the new text tokenized alone, adopts the key from the first row the prefix lacks
  (``start_row``), and the export is by exact text;
- ``ReplayBuffer`` (an asyncio actor): XTuner's buffer shape, groups per task queried by
  status; ``put`` takes each group over, stamps the model step on the new tokens *and*
  their rows (XTuner's version source: the worker never knows it), and applies XTuner's
  staleness formula (``current_train_step - model_step - 1``), resetting expired
  members (EXPIRED) after their release;
- ``TrainerRank`` (one actor per SP rank): XTuner's trainer worker: its own packs,
  XTuner's padding (a pad sequence of random expert ids, zero rows for the SP split) in
  the tensor it replays, accepted as padding (``ReplaySource(mask=...)``), three passes
  over one ``Materializer``, a model with a dense layer, three MoE layers and an MTP
  layer, its routers fed by ``ReplaySource.decoder_ids`` (the MTP layer gets None and
  routes itself, as XTuner's guard does).

The driver kills one trainer rank mid-step: its leases are named by ``leaks()``,
revoked, and a fresh rank redoes its share. A stale copy of the samples (the driver's,
after the buffer took them over) releases nothing. It ends with exact rows on every
rank and zero leases, payloads, engine keys and trie leases.

Run: ``.venv/bin/python examples/xtuner_flow.py`` (starts a local Ray instance).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt
import pydantic
import ray

from routeplay.core import Handle, RouteSpec
from routeplay.core.wires import Answer, BodyOptions, wire_layers
from routeplay.core.wires import lmdeploy as lmdeploy_wire
from routeplay.errors import DuplicateExperts, RowCountMismatch
from routeplay.rollout import (
    ADAPTERS,
    Group,
    Origin,
    SampleRouting,
    StalenessBasis,
    TrainingBatch,
    sample_holder,
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

# A tiny MoE model: decoder layer 0 is dense (first_k_dense_replace=1), 1-3 route, and
# one MTP layer follows (XTuner numbers it 4: num_hidden_layers + 0).
SPEC = RouteSpec(
    num_layers=3, top_k=2, num_experts=8, layer_map=(1, 2, 3), total_layers=4, mtp_layers=1
)
HIDDEN = 16
MAX_TOKENS = 12
SP = 2
RUN = "xtuner-flow"
MATH = "What is 2+2?"
SPECIAL = ("<|im_start|>", "<|im_end|>")


# ----------------------------------------------------------------- tokens and the toy model


def build_tokenizer() -> Any:
    """A byte-level BPE of 300 ids trained on a few chat lines: tokens span several
    characters, so a text's encoding is not its characters one by one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [
        render([{"role": "user", "content": MATH}, {"role": "assistant", "content": "4."}]),
        render([{"role": "user", "content": "And 7*6?"}, {"role": "assistant", "content": "42"}]),
        "The answer is four. The sum of two and two is four. More please, one more time.",
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 4, trainer)
    return tokenizer


def render(messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> str:
    """The chat template (Qwen's shape), as XTuner's SessionServer renders a request."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def true_routing(tokens: Sequence[int]) -> npt.NDArray[np.uint8]:
    """What the toy engine routes for ``tokens``: row ``i`` depends on the tokens only, so
    a resume or a later turn routes its shared rows the same way. Ids in a row are
    distinct."""
    ids = np.asarray(tokens[:-1], dtype=np.int64)
    base = (np.arange(len(ids)) * 7 + ids * 3)[:, None, None]
    layers = 5 * np.arange(SPEC.num_layers)[None, :, None]
    return ((base + layers + np.arange(SPEC.top_k)) % SPEC.num_experts).astype(np.uint8)


# ----------------------------------------------------------------- XTuner's sample


class Status(str, Enum):
    """XTuner's statuses: EXPIRED (stale, reset for regeneration) apart from ABORTED
    (stopped mid-answer, resumed by partial rollout)."""

    INIT = "init"
    COMPLETED = "completed"
    ABORTED = "aborted"
    EXPIRED = "expired"
    FAILED = "failed"


class XtunerRolloutState(pydantic.BaseModel):
    """XTuner's ``RolloutState`` (``data_proto/rl_data.py``), trimmed to the fields this
    flow uses, under their names and with ``extra="forbid"``: no field is added, its
    ``routed_experts`` carries the sample's ``SampleRouting``."""

    model_config = pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    group_id: int | None = None
    message: list[dict[str, Any]]
    prompt_ids: list[int] | None = None
    session_id: int | None = None
    tokens: list[int] | None = None
    response_ids: list[int] | None = None
    logprobs: list[float] | None = None
    routed_experts: Any = None
    finish_reason: str | None = None
    response_model_steps: list[int] | None = None
    seq_staleness: int = 0
    input_ids: list[int] | None = None
    labels: list[int] | None = None
    rollout_id: int | None = None
    task_name: str | None = None
    status: Status = Status.INIT
    extra_fields: dict[str, Any] = {}


def routing_of(state: XtunerRolloutState) -> SampleRouting:
    """The sample's routing: what its ``routed_experts`` carries, or a fresh one named
    after XTuner's ``rollout_id`` (and trace session) before its first answer."""
    if isinstance(state.routed_experts, SampleRouting):
        return state.routed_experts
    session = None if state.session_id is None else str(state.session_id)
    return SampleRouting(sample_id=str(state.rollout_id), session_id=session)


def tokens_of(state: XtunerRolloutState) -> list[int]:
    """What the trainer packs: a trace's ``input_ids``, else prompt + response."""
    return state.input_ids or (state.prompt_ids or []) + (state.response_ids or [])


@dataclass
class Routed:
    """The state as routeplay's ``TrainingBatch`` holds it (a ``RoutedSample``)."""

    state: XtunerRolloutState

    @property
    def sample_routing(self) -> SampleRouting:
        return routing_of(self.state)

    def with_sample_routing(self, routing: SampleRouting) -> Routed:
        self.state.routed_experts = routing
        return self

    def reset_for_retry(self, routing: SampleRouting) -> Routed:
        self.state.response_ids, self.state.status = [], Status.EXPIRED
        return self.with_sample_routing(routing)


def new_state(rollout_id: int, group_id: int, task: str, question: str) -> XtunerRolloutState:
    return XtunerRolloutState(
        message=[{"role": "user", "content": question}],
        rollout_id=rollout_id,
        group_id=group_id,
        task_name=task,
    )


def seq_staleness(model_step: int, current_train_step: int) -> int:
    """XTuner's formula (``calculate_seq_staleness``): model step ``m`` is the weights
    after train step ``m``, so a fully synchronous step is 1 ahead."""
    return current_train_step - model_step - 1


# ----------------------------------------------------------------- the trace trie actor


@dataclass
class TrieNode:
    """One segment of a conversation: its text, the engine's token ids, labels, and the
    session's lease on the rows that produced its tokens."""

    text: str
    token_ids: list[int]
    labels: list[int]
    lease: Lease | None = None
    children: dict[str, TrieNode] = field(default_factory=dict)


@ray.remote(num_cpus=0)
class TraceTrie:
    """XTuner's ``RolloutTraceStore``: per session, a trie keyed by rendered text. A node
    keeps its session's lease (pickled in with ``insert``); ``release_sessions`` is the
    one place those leases end; reads hand out handles, never the session's leases."""

    def __init__(self) -> None:
        self.sessions: dict[str, TrieNode] = {}

    def search(self, session: str, text: str) -> tuple[str, list[tuple[list[int], Handle]]]:
        """The longest stored prefix of ``text``: its key and each node's tokens and rows."""
        node, matched, path = self.sessions.get(session), "", []
        while node is not None:
            rest = text[len(matched) :]
            node = next((c for t, c in node.children.items() if rest.startswith(t)), None)
            if node is None or node.lease is None:
                break
            matched += node.text
            path.append((node.token_ids, node.lease.handle))
        return matched, path

    def insert(self, session: str, parent_key: str, node: TrieNode) -> None:
        """``node`` under the stored path ``parent_key`` (a node replaced there ends its
        lease after the new one holds the rows)."""
        parent, matched = self.sessions.setdefault(session, TrieNode("", [], [])), ""
        while matched != parent_key:
            rest = parent_key[len(matched) :]
            parent = next(c for t, c in parent.children.items() if rest.startswith(t))
            matched += parent.text
        replaced = parent.children.get(node.text)
        parent.children[node.text] = node
        if replaced is not None and replaced.lease is not None:
            replaced.lease.release()

    def export_training_trace(self, session: str, text: str) -> dict[str, Any]:
        """The trace of ``text``, by exact text (XTuner refuses anything else)."""
        matched, path = self.search(session, text)
        if matched != text:
            raise ValueError(f"text is not a whole path of session {session}")
        ids = [t for tokens, _ in path for t in tokens]
        return {"input_ids": ids, "handles": [handle for _, handle in path]}

    def release_sessions(self, sessions: list[str]) -> list[str]:
        """End every lease of these sessions' nodes; drop the sessions."""
        released = []
        for session in sessions:
            stack = [self.sessions.pop(session)] if session in self.sessions else []
            released += [session] if stack else []
            while stack:
                node = stack.pop()
                if node.lease is not None:
                    node.lease.release()
                stack.extend(node.children.values())
        return released

    def leases(self) -> int:
        stack, count = list(self.sessions.values()), 0
        while stack:
            node = stack.pop()
            count += node.lease is not None and not node.lease.released
            stack.extend(node.children.values())
        return count


# ----------------------------------------------------------------- the rollout worker actor


class LmdeployEngine:
    """LMDeploy's API server on the Ray executor: ``/generate`` and the chat route answer
    their real bodies; every decoder layer's routing goes into ``shared_store`` and the
    body names its key. ``abort_after`` aborts what still runs after that many new
    tokens (XTuner's partial rollout). It emits one byte token per character: a sampled
    sequence need not be the tokenizer's own encoding of its text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = int(tokenizer.token_to_id(SPECIAL[1]))
        self.abort_after: int | None = None
        self.shared_store = ray.get_actor("shared_store", namespace="lmdeploy")

    def byte_tokens(self, text: str) -> list[int]:
        """One byte token per character (a sampled sequence, not the BPE encoding)."""
        return [t for ch in text for t in self.tokenizer.encode(ch).ids]

    def decode(self, context: list[int], seed: int) -> tuple[list[int], str]:
        ids: list[int] = []
        while len(ids) < MAX_TOKENS:
            if self.abort_after is not None and len(ids) == self.abort_after:
                return ids, "abort"
            last = ids[-1] if ids else context[-1]
            h = (seed * 1_000_004 + (len(context) + len(ids)) * 7_919 + last * 31) % 2**31
            ids.append(self.eos if h % 5 == 0 and ids else 30 + h % 60)
            if ids[-1] == self.eos:
                return ids, "stop"
        return ids, "length"

    async def answer(self, context: list[int], ids: list[int], reason: str, chat: bool) -> Any:
        answer = Answer(
            prompt_tokens=len(context),
            token_ids=tuple(ids),
            logprobs=tuple([-0.5] * len(ids)),
            finish_reason=reason,
            routing=true_routing(context + ids),
        )
        key = await self.shared_store.put.remote(wire_layers(answer.routing, SPEC, "uint16"))
        options = BodyOptions(endpoint="chat" if chat else "generate", put=lambda _: str(key))
        body = lmdeploy_wire.WIRE.build_body([answer], SPEC, options)
        return json.loads(json.dumps(body))  # what crosses HTTP


@ray.remote(num_cpus=0)
class RolloutWorker:
    """XTuner's rollout worker (``generate`` with ``PartialRolloutHandler``) and its
    SessionServer, asyncio: every store call awaited."""

    def __init__(self, store: RouteStore, traces: Any) -> None:
        self.store, self.traces = store, traces
        self.tokenizer = build_tokenizer()
        self.engine = LmdeployEngine(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def set_abort_after(self, tokens: int | None) -> None:
        self.engine.abort_after = tokens

    async def generate_group(self, group: list[XtunerRolloutState]) -> list[XtunerRolloutState]:
        todo = [s for s in group if s.status is not Status.COMPLETED]
        await asyncio.gather(*(self.generate(s) for s in todo))
        return group

    async def generate(self, state: XtunerRolloutState) -> XtunerRolloutState:
        """One request: a fresh sample, or an ABORTED one resumed (partial rollout: the
        request is the prompt and the response so far; only the new rows are stored)."""
        if state.prompt_ids is None:
            state.prompt_ids = self.encode(render(state.message, True))
        context = state.prompt_ids + (state.response_ids or [])
        ids, reason = self.engine.decode(context, seed=state.rollout_id or 0)
        body = await self.engine.answer(context, ids, reason, chat=False)
        state.routed_experts = await self.ingest_answer(state, body, len(ids))
        state.response_ids = (state.response_ids or []) + ids
        state.logprobs = (state.logprobs or []) + [-0.5] * len(ids)
        state.finish_reason = reason
        state.status = Status.ABORTED if reason == "abort" else Status.COMPLETED
        return state

    async def ingest_answer(self, state: XtunerRolloutState, body: Any, new: int) -> Any:
        """The answer's rows: LMDeploy's key adopted (never read here) from the first row
        the sample lacks, leased for the sample; no start row (LMDeploy has none) and no
        weight version (the buffer stamps it)."""
        routing = routing_of(state)
        async with await routing.acontinuation() as cont:
            adapter = ADAPTERS["lmdeploy"]
            unstamped = Handle.UNSTAMPED
            handle = await cont.aingest(
                adapter, body, spec=SPEC, writer=self.store, weight_version=unstamped
            )
            routing = await cont.afinish(self.store, handle)
        if body["meta_info"]["finish_reason"]["type"] != "abort":
            response = len(state.response_ids or []) + new
            routing = routing.complete(
                prompt_tokens=len(state.prompt_ids or []), response_tokens=response
            )
        return routing

    async def converse(
        self, rollout_id: int, session: int, turns: list[tuple[str, str]]
    ) -> XtunerRolloutState:
        """A session of several turns through the SessionServer, then its trace exported
        by exact text as a training sample (XTuner's agent loop)."""
        messages: list[dict[str, Any]] = []
        for question, reply in turns:
            messages.append({"role": "user", "content": question})
            await self.session_turn(str(session), messages, reply)
            messages.append({"role": "assistant", "content": reply})
        text = render(messages).rstrip()
        trace = await self.traces.export_training_trace.remote(str(session), text)
        state = XtunerRolloutState(
            message=messages,
            rollout_id=rollout_id,
            group_id=3,
            session_id=session,
            task_name="chat",
            input_ids=trace["input_ids"],
            status=Status.COMPLETED,
        )
        # BPE: the engine's tokens are not the tokenizer's encoding of the same text.
        state.extra_fields["bpe_differs"] = self.encode(text) != trace["input_ids"]
        handle = Handle.concat(SPEC, trace["handles"])
        if handle.rows != len(trace["input_ids"]) - 1:
            raise RowCountMismatch(
                "an exported trace's rows disagree with its tokens",
                expected=f"{len(trace['input_ids']) - 1} rows",
                found=f"{handle.rows} rows",
                where=f"session {session}",
            )
        lease = await self.store.aacquire(handle, sample_holder(str(rollout_id)))
        state.routed_experts = routing_of(state).attach(handle, lease, Origin.BORROWED)
        return state

    async def session_turn(
        self, session: str, messages: list[dict[str, Any]], reply: str
    ) -> tuple[int, int]:
        """XTuner's SessionServer: the request from the trie (the nodes' own tokens, then
        the new text tokenized alone), the answer's rows as two new nodes, slices of one
        key adopted from the first row the prefix lacks, leased by the session."""
        prompt = render(messages, True)
        matched, path = await self.traces.search.remote(session, prompt)
        delta_text = prompt[len(matched) :]
        delta_ids = self.encode(delta_text)
        prefix_ids = [t for tokens, _ in path for t in tokens]
        context = prefix_ids + delta_ids
        ids = [*self.engine.byte_tokens(reply), self.engine.eos]
        body = await self.engine.answer(context, ids, "stop", chat=True)
        history = Handle.concat(SPEC, [handle for _, handle in path])
        answer = ADAPTERS["lmdeploy"].read(body, spec=SPEC, where=f"session {session}")
        new = await self.store.aadopt_key(
            answer.key, SPEC, weight_version=Handle.UNSTAMPED, start_row=history.rows
        )
        turn, prefix, cut = history + new, len(prefix_ids), len(context) - 1
        holder = session_holder(session)
        delta, response = await self.store.aacquire_many(
            [(turn[max(prefix - 1, 0) : cut], holder), (turn[cut:], holder)]
        )
        # The session's leases travel pickled into the trie, which alone ends them.
        await self.traces.insert.remote(
            session, matched, TrieNode(delta_text, delta_ids, [-100] * len(delta_ids), delta)
        )
        reply_text = render([*messages, {"role": "assistant", "content": reply}]).rstrip()
        await self.traces.insert.remote(
            session, prompt, TrieNode(reply_text[len(prompt) :], ids, ids, response)
        )
        return len(context), new.rows


# ----------------------------------------------------------------- the replay buffer actor


@ray.remote(num_cpus=0)
class ReplayBuffer:
    """XTuner's ``ReplayBuffer`` shape: groups per task, queried by status. ``put`` takes
    each group over (``buffer/<task>/<group>``), stamps the model step on the new tokens
    and on their rows, and applies XTuner's staleness lifecycle."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self.groups: list[tuple[str, list[XtunerRolloutState]]] = []
        self.expired: list[int] = []

    async def put(
        self,
        items: list[XtunerRolloutState],
        task: str,
        *,
        model_step: int,
        current_train_step: int,
        stale_threshold: int,
    ) -> None:
        holder = f"buffer/{task}/{items[0].group_id}"
        for item in items:
            if routing_of(item).holds_lease:
                item.routed_experts = await routing_of(item).atake_over(holder, self.store)
            self.update_sample_version(item, model_step)
        await self.refresh(items, current_train_step, stale_threshold)
        self.groups.append((task, items))

    def update_sample_version(self, item: XtunerRolloutState, model_step: int) -> None:
        """XTuner's stamp on the tokens generated since the last put, and on their rows."""
        steps = list(item.response_model_steps or [])
        steps += [model_step] * (len(item.response_ids or []) - len(steps))
        item.response_model_steps = steps
        routing = routing_of(item)
        if routing.handle is not None and routing.handle.unstamped:
            handle = routing.handle.stamped(model_step)
            item.routed_experts = dataclasses.replace(routing, handle=handle)

    async def refresh(self, group: list[XtunerRolloutState], current: int, threshold: int) -> None:
        """XTuner's rule: a member whose oldest response step is ``threshold`` or more
        steps stale is expired and (retryable) reset, after its release."""
        for item in group:
            steps = item.response_model_steps or []
            item.seq_staleness = seq_staleness(min(steps), current) if steps else 0
            if (
                item.status is Status.COMPLETED
                and item.response_ids
                and item.seq_staleness >= threshold
            ):
                basis = StalenessBasis.RESPONSE_TOKENS
                assert routing_of(item).staleness(current - 1, basis) == item.seq_staleness
                retry, stuck, error = await routing_of(item).aexpire_retryably()
                if stuck is not None:
                    raise RuntimeError("a release failed") from error
                item.routed_experts = retry
                item.response_ids, item.logprobs, item.response_model_steps = [], [], []
                item.status, item.finish_reason = Status.EXPIRED, None
                self.expired.append(item.rollout_id or 0)

    async def refresh_staleness(self, thresholds: dict[str, int], current_train_step: int) -> None:
        for task, group in self.groups:
            if task in thresholds:
                await self.refresh(group, current_train_step, thresholds[task])

    def get(self, task: str, status: Status) -> list[list[XtunerRolloutState]]:
        """Take out the groups of ``task`` whose status is ``status`` (XTuner's group
        status: any EXPIRED member makes the group EXPIRED, else any ABORTED)."""
        taken = [g for t, g in self.groups if t == task and group_status(g) is status]
        self.groups = [(t, g) for t, g in self.groups if not any(g is x for x in taken)]
        return taken

    def expired_ids(self) -> list[int]:
        return self.expired


def group_status(group: Sequence[XtunerRolloutState]) -> Status:
    statuses = {s.status for s in group}
    if statuses == {Status.COMPLETED}:
        return Status.COMPLETED
    return Status.EXPIRED if Status.EXPIRED in statuses else Status.ABORTED


# ----------------------------------------------------------------- the trainer rank actor


class Router:
    """XTuner's ``GreedyRouter`` choice: the replayed ids, or its own top-k (an MTP
    layer, which gets None); the weights are the trainer's own, so it learns."""

    def __init__(self, torch: Any) -> None:
        self.gate = torch.nn.Linear(HIDDEN, SPEC.num_experts, bias=False)

    def __call__(self, hidden: Any, topk_ids: Any) -> Any:
        scores = self.gate(hidden).softmax(-1)
        ids = topk_ids if topk_ids is not None else scores.topk(SPEC.top_k, -1).indices
        return ids, scores.gather(-1, ids)


@ray.remote(num_cpus=0)
class TrainerRank:
    """XTuner's ``TrainingWorker`` on one SP rank: its leases (one ``acquire_many``) and
    three passes over one ``Materializer``, which ends them once after the last pass;
    ``start`` takes the leases, ``train`` runs the passes."""

    PASSES = ("old_logprobs", "reference", "update")

    def __init__(self, store: RouteStore, sp_rank: int) -> None:
        import torch

        torch.manual_seed(0)
        self.torch, self.store, self.sp_rank = torch, store, sp_rank
        self.noise = torch.Generator().manual_seed(sp_rank)
        # decoder layers 0 (dense), 1-3 (MoE), then the MTP layer 4 (MoE).
        self.routers = {i: Router(torch) for i in range(1, SPEC.decoder_layers + SPEC.mtp_layers)}
        self.held = contextlib.ExitStack()
        self.reader: Any = None

    def start(self, step: int, plan: PackingPlan, tokens: dict[str, list[int]]) -> int:
        """Take this rank's leases for the step (then hold them: mid-step)."""
        coords = RankCoords(sp_rank=self.sp_rank, sp_size=SP, sp_split="pad_to_multiple")
        holder = f"train/step-{step}/sp{self.sp_rank}"
        self.reader = self.held.enter_context(
            Materializer.leasing(self.store, plan, coords, holder=holder, passes=3)
        )
        self.plan, self.tokens = plan, tokens
        return len(self.plan.packs)

    def train(self) -> dict[str, int]:
        report = {"rows_checked": 0, "forwards": 0, "padding_rows": 0, "refused": 0}
        with self.held:
            for name in self.PASSES:
                for item in self.reader.next_pass():
                    [pack] = item.packs
                    ids = [s.sample_id for s in self.plan.packs[pack].samples]
                    self.step(name, item, pack, ids, report)
        # The materializer's release is sent, not waited for: settle it (and surface its
        # error) before the step is reported done, or the driver may count it as held.
        self.store.flush()
        return report

    def xtuner_rows(self, pack: int, sample_ids: list[str]) -> Any:
        """XTuner's own tensor for this rank: the samples' rows, a pad sequence of random
        ids up to the pack length (``_packing``), zero rows to a multiple of SP
        (``SequenceContext.split``), this rank's slice."""
        torch = self.torch
        rows = [torch.from_numpy(true_routing(self.tokens[s])) for s in sample_ids]
        pad = self.plan.packs[pack].length - sum(len(r) for r in rows)
        shape = (pad, SPEC.num_layers, SPEC.top_k)
        packed = torch.cat([*rows, torch.randint(0, SPEC.num_experts, shape, dtype=torch.uint8)])
        zeros = torch.zeros((-len(packed) % SP, *packed.shape[1:]), dtype=torch.uint8)
        return torch.cat([packed, zeros]).chunk(SP)[self.sp_rank]

    def step(
        self, name: str, item: Any, pack: int, sample_ids: list[str], report: dict[str, int]
    ) -> None:
        torch = self.torch
        mask = torch.from_numpy(item.mask)
        xtuner = self.xtuner_rows(pack, sample_ids)
        # Exact rows: routeplay's read equals XTuner's layout of the engine's routing.
        assert torch.equal(torch.from_numpy(item.routes)[mask], xtuner[mask])
        report["rows_checked"] += int(mask.sum())
        report["padding_rows"] += int((~mask).sum())
        source = ReplaySource(xtuner, SPEC, mask=mask)  # XTuner's padding, accepted
        if name == "old_logprobs" and bool(mask.any()):
            bad = xtuner.clone()
            bad[int(mask.nonzero()[0])] = 0
            with contextlib.suppress(DuplicateExperts):
                ReplaySource(bad, SPEC, mask=mask)
                raise AssertionError("a zero row of routing was accepted")
            report["refused"] += 1
        hidden = torch.randn(len(mask), HIDDEN, generator=self.noise)
        with torch.set_grad_enabled(name == "update"):
            out = hidden
            for layer_idx, router in self.routers.items():  # MoE decoder layers, then MTP
                ids = source.decoder_ids(layer_idx, device=out.device, rows=len(mask))
                chosen, weights = router(out, ids)
                if SPEC.is_mtp_layer(layer_idx):
                    assert ids is None  # the MTP layer routes itself, as in XTuner
                else:
                    column = xtuner[:, SPEC.moe_layer(layer_idx)].long()
                    assert torch.equal(chosen[mask], column[mask])  # replayed as the engine chose
                out = out + weights.sum(-1, keepdim=True) * torch.tanh(out)
            if name == "update":
                out.pow(2).mean().backward()
                assert all(r.gate.weight.grad is not None for r in self.routers.values())
        report["forwards"] += 1


# ----------------------------------------------------------------- the flow


@dataclass
class FlowReport:
    """What the run did, and what it left behind (every count that must be 0 is)."""

    resumed_new_rows: int
    resumed_bytes: int
    expired: list[int]
    stale_copy_released: int
    bpe_differs: bool
    turn_two_bytes: int
    turn_two_tokens: int
    killed_rank_leaks: list[str]
    revoked: int
    samples_trained: int
    ranks: int
    rows_checked: int
    padding_rows: int
    refused: int
    forwards: int
    leases: int
    live_payloads: int
    engine_keys: int
    trie_leases: int


@dataclass
class Trainers:
    """The driver's side of the trainer ranks (one actor per SP rank)."""

    store: RouteStore
    ranks: list[Any] = field(default_factory=list)
    reports: list[dict[str, int]] = field(default_factory=list)
    samples: int = 0

    def __post_init__(self) -> None:
        self.ranks = [TrainerRank.remote(self.store, r) for r in range(SP)]

    def step(
        self,
        step: int,
        groups: list[list[XtunerRolloutState]],
        traces: Any,
        kill: int | None = None,
    ) -> tuple[list[str], int]:
        wrapped = [
            Group(group_id=str(g[0].group_id), states=tuple(Routed(s) for s in g)) for g in groups
        ]
        released: list[Any] = []  # the sessions' releases, sent as the batch closes

        def release(session: str) -> None:
            released.append(traces.release_sessions.remote([session]))

        leaks: list[str] = []
        revoked = 0
        with TrainingBatch(step, wrapped, release_session=release) as batch:
            states = [r.state for r in batch.states]
            self.samples += len(states)
            rows = sum(len(tokens_of(s)) - 1 for s in states)
            pack = [(str(s.rollout_id), routing_of(s).handle, len(tokens_of(s))) for s in states]
            # XTuner's pack length; odd, so its SP split adds a zero row.
            plan = PackingPlan.from_packs([pack], pack_max_length=rows + 5 + rows % 2, dp_size=1)
            tokens = {str(s.rollout_id): tokens_of(s) for s in states}
            ray.get([rank.start.remote(step, plan, tokens) for rank in self.ranks])
            if kill is not None:  # a rank dies mid-step, holding its leases
                ray.kill(self.ranks[kill])
                holder = f"train/step-{step}/sp{kill}"
                dead = self.wait_for_leaks(holder)  # leaks() names them by holder
                leaks = [leak.holder for leak in dead]
                revoked = self.store.revoke(dead)
                self.ranks[kill] = TrainerRank.remote(self.store, kill)
                ray.get(self.ranks[kill].start.remote(step, plan, tokens))
            self.reports += ray.get([rank.train.remote() for rank in self.ranks])
        ray.get(released)
        return leaks, revoked

    def wait_for_leaks(self, holder: str) -> list[Any]:
        for _ in range(200):
            leaks = [leak for leak in self.store.leaks() if leak.holder == holder]
            if leaks:
                return leaks
            time.sleep(0.05)
        raise AssertionError(f"no lease of {holder} left behind")


def flow(store: RouteStore, shared_store: Any) -> FlowReport:
    traces = TraceTrie.remote()
    worker = RolloutWorker.remote(store, traces)
    buffer = ReplayBuffer.remote(store)
    trainers = Trainers(store)

    # Model step 0: a GRPO group the controller aborts after four tokens (one member is
    # still running then), a group that will go stale, and two sessions of two turns.
    ray.get(worker.set_abort_after.remote(4))
    math = ray.get(
        worker.generate_group.remote([new_state(10 + i, 1, "math", MATH) for i in range(3)])
    )
    assert sorted(s.status.value for s in math) == ["aborted", "completed", "completed"]
    ray.get(worker.set_abort_after.remote(None))
    stale = ray.get(
        worker.generate_group.remote([new_state(20 + i, 2, "stale", "And 7*6?") for i in range(2)])
    )
    turns = [(MATH, "It is 4."), ("And 7*6?", "That is 42.")]
    chat = ray.get([worker.converse.remote(30 + s, s, turns) for s in (1, 2)])
    # A session's second turn stores only the rows its prefix lacks (start_row adoption).
    ray.get(worker.session_turn.remote("9", [{"role": "user", "content": MATH}], "It is 4."))
    before = store.stats().live_bytes
    second = [
        {"role": "user", "content": MATH},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 7*6?"},
    ]
    request_tokens, stored_rows = ray.get(worker.session_turn.remote("9", second, "That is 42."))
    turn_two_bytes = store.stats().live_bytes - before
    assert turn_two_bytes == SPEC.nbytes(stored_rows)
    ray.get(traces.release_sessions.remote(["9"]))

    ray.get(buffer.put.remote(math, "math", model_step=0, current_train_step=0, stale_threshold=4))
    ray.get(
        buffer.put.remote(stale, "stale", model_step=0, current_train_step=0, stale_threshold=4)
    )
    ray.get(buffer.put.remote(chat, "chat", model_step=0, current_train_step=0, stale_threshold=4))
    # The driver's copies are stale now (the buffer took the samples over): releasing
    # one ends nothing, whatever lease it names.
    leases = store.stats().leases
    math[0].routed_experts = routing_of(math[0]).release()
    store.flush()
    stale_copy_released = leases - store.stats().leases

    # Step 1: the chat samples; one trainer rank is killed mid-step.
    [chat_group] = ray.get(buffer.get.remote("chat", Status.COMPLETED))
    leaks, revoked = trainers.step(1, [chat_group], traces, kill=1)

    # Model step 1: the ABORTED group resumes; only its aborted member generates, storing
    # only its new rows. At train step 3 the stale group is 2 steps stale: expired.
    [math] = ray.get(buffer.get.remote("math", Status.ABORTED))
    before, rows_before = store.stats().live_bytes, sum(routing_of(s).rows for s in math)
    math = ray.get(worker.generate_group.remote(math))
    resumed_bytes = store.stats().live_bytes - before
    new_rows = sum(routing_of(s).rows for s in math) - rows_before
    ray.get(buffer.put.remote(math, "math", model_step=1, current_train_step=1, stale_threshold=4))
    ray.get(buffer.refresh_staleness.remote({"stale": 2}, current_train_step=3))
    [stale] = ray.get(buffer.get.remote("stale", Status.EXPIRED))
    stale = ray.get(worker.generate_group.remote(stale))
    ray.get(
        buffer.put.remote(stale, "stale", model_step=2, current_train_step=3, stale_threshold=4)
    )

    # Step 3: the math group and the regenerated one.
    [math] = ray.get(buffer.get.remote("math", Status.COMPLETED))
    [stale] = ray.get(buffer.get.remote("stale", Status.COMPLETED))
    trainers.step(3, [math, stale], traces)

    store.flush()
    stats = store.stats()
    reports = trainers.reports
    return FlowReport(
        resumed_new_rows=new_rows,
        resumed_bytes=resumed_bytes,
        expired=ray.get(buffer.expired_ids.remote()),
        stale_copy_released=stale_copy_released,
        bpe_differs=all(s.extra_fields["bpe_differs"] for s in chat),
        turn_two_bytes=turn_two_bytes,
        turn_two_tokens=request_tokens,
        killed_rank_leaks=leaks,
        revoked=revoked,
        samples_trained=trainers.samples,
        ranks=len(reports),
        rows_checked=sum(r["rows_checked"] for r in reports),
        padding_rows=sum(r["padding_rows"] for r in reports),
        refused=sum(r["refused"] for r in reports),
        forwards=sum(r["forwards"] for r in reports),
        leases=stats.leases,
        live_payloads=stats.live_payloads,
        engine_keys=ray.get(shared_store.stats.remote()).live_keys,
        trie_leases=ray.get(traces.leases.remote()),
    )


def main() -> FlowReport:
    """Run the flow on the local Ray instance (one is started if none is up)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=RUN)
    # Before any engine starts: routeplay's engine store under LMDeploy's name; then the
    # run's route store, whose client every actor gets pickled.
    shared_store = start_engine_store(ttl_s=120, spec=SPEC, user=RUN)
    store = StoreConfig(run=RUN, timeout_s=30).build()
    try:
        report = flow(store, shared_store)
    finally:
        leave_engine_store(shared_store, RUN, end_if_last=True)
        store.shutdown()
        if started:
            ray.shutdown()
    assert report.resumed_bytes == SPEC.nbytes(report.resumed_new_rows) > 0, report
    assert report.stale_copy_released == 0, report
    assert report.killed_rank_leaks, report
    assert report.revoked == len(report.killed_rank_leaks), report
    assert report.rows_checked > 0, report
    assert report.refused == report.ranks, report
    assert (report.leases, report.live_payloads, report.engine_keys, report.trie_leases) == (
        0,
        0,
        0,
        0,
    ), report
    return report


if __name__ == "__main__":
    print(main())
