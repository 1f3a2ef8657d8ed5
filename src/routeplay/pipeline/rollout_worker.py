"""Rollout workers: Ray actors that talk to the engine over HTTP and return leased samples.

A worker is a ``producer_actor`` (so its routing puts are one-write, owned by a store
shard; LMDeploy keys stay lazy and are adopted without being read). It turns one
``RolloutState`` into the next with the library's lifecycle steps
(``routeplay.rollout.lifecycle``), and owns only the HTTP side:

- a fresh sample is generated (``stop_after`` interrupts it: status ``ABORTED``);
- an interrupted sample is resumed with prompt + partial completion, its routing as the
  history, so only the rows the history lacks are stored, under the new weight version
  (the request's start row = the history's rows where the engine has one, SGLang and
  vLLM: the engine sends only those rows; LMDeploy sends all of them);
- a turn of a trace session borrows the session's prefix rows (the sample's own lease)
  and appends the rest;
- fresh members of one GRPO group (``rollout_group``, wires that carry the rows) are
  stored in one batched put whose verified-equal prompt rows are written once.

Lease order (``Continuation.finish``): the new lease first, then the input's. If
anything fails, the input state still holds its lease and the caller (who keeps a copy
of it) releases it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import httpx

from routeplay.core import read_response
from routeplay.core.spec import RouteSpec
from routeplay.core.wires import wire as wire_format
from routeplay.errors import EngineUnavailable, MalformedPayload
from routeplay.rollout import ADAPTERS, Origin, RolloutState, Status
from routeplay.rollout.adapters import ProducerWriter
from routeplay.rollout.lifecycle import continuation, store_turn
from routeplay.rollout.releasing import attach_notes
from routeplay.rollout.state import release_states
from routeplay.rollout.trace_actor import TraceStoreClient
from routeplay.store import RoutesProducer, RouteStore, producer_actor

__all__ = ["RolloutWorker", "Sampling", "WorkerShell"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How one request samples."""

    max_new_tokens: int
    """Generated tokens a sample has in total (a resume asks for the rest)."""
    temperature: float = 1.0
    """Sampling temperature (1.0: log-probabilities are the policy's own)."""
    seed: int = 0
    """Sampling seed of this request."""
    stop_after: int | None = None
    """Interrupt after this many new tokens (a partial rollout); None: run to the end."""


class WorkerShell(RoutesProducer):
    """One rollout worker: an HTTP client of the engine and a routing producer."""

    def __init__(
        self,
        store: RouteStore,
        traces: TraceStoreClient,
        url: str,
        wire: str,
        spec: RouteSpec,
        timeout_s: float = 60.0,
    ) -> None:
        self._store = store
        self._traces = traces
        self._wire = wire_format(wire)
        self._spec = spec
        self._adapter = ADAPTERS[self._wire.engine.value]
        self._writer = ProducerWriter(producer=self, store=store)
        self._client = httpx.Client(base_url=url, timeout=timeout_s)

    def rollout(self, state: RolloutState, sampling: Sampling, version: int) -> RolloutState:
        """Generate (or resume) ``state`` once; returns it COMPLETED or ABORTED, leased."""
        where = f"sample {state.sample_id}"
        with continuation(state, self._traces) as cont:
            start = self._wire.routing_start(cont.rows)
            path, body = self._wire.request(
                state.prompt_ids + state.response_ids,
                max_new_tokens=sampling.max_new_tokens - len(state.response_ids),
                temperature=sampling.temperature,
                seed=sampling.seed,
                stop_after=sampling.stop_after,
                start_row=start,
            )
            answer = self._post(path, body, where)
            completion = self._wire.read_completion(answer, where=where)
            handle = cont.ingest(
                self._adapter,
                answer,
                spec=self._spec,
                writer=self._writer,
                weight_version=version,
                start_row=start,
                where=where,
            )
            routed = cont.finish(self._store, handle)
        return routed.extend(completion.token_ids, completion.logprobs, version).with_status(
            _status(completion.finish_reason), completion.finish_reason
        )

    def rollout_group(
        self, states: list[RolloutState], samplings: list[Sampling], version: int
    ) -> list[RolloutState]:
        """Generate fresh members of one GRPO group (same prompt, no routing, no session)
        and store their routing in one put: the prompt's rows once, when verified equal
        (``put_routes_many(shared_prefix=...)``); each sample gets its own handle and lease.
        Key-store wires (the engine stores whole arrays) run the members one by one."""
        if self._wire.key_store:
            return self._one_by_one(states, samplings, version)
        prompt = states[0].prompt_ids
        assert all(s.prompt_ids == prompt and s.routing is None for s in states)
        answers = []
        for state, sampling in zip(states, samplings, strict=True):
            path, body = self._wire.request(
                prompt,
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                seed=sampling.seed,
                stop_after=sampling.stop_after,
                start_row=0,
            )
            where = f"sample {state.sample_id}"
            answer = self._post(path, body, where)
            routing = read_response(self._wire.engine, answer, self._spec, where=where)
            if routing.routes is None or routing.routes.start_row != 0:
                raise MalformedPayload(
                    "a fresh sample's routing must start at row 0",
                    expected="routing rows from 0",
                    found="a key" if routing.routes is None else routing.routes.start_row,
                    where=where,
                )
            answers.append((self._wire.read_completion(answer, where=where), routing.routes))
        handles = self.put_routes_many(
            self._store,
            [routes for _, routes in answers],
            weight_version=version,
            shared_prefix=len(prompt),
        )
        holders = [f"rollout/{s.sample_id}" for s in states]
        leases = self._store.acquire_many(list(zip(handles, holders, strict=True)))
        return [
            state.extend(completion.token_ids, completion.logprobs, version)
            .with_routing(handle, lease, Origin.PRODUCED)
            .with_status(_status(completion.finish_reason), completion.finish_reason)
            for state, (completion, _), handle, lease in zip(
                states, answers, handles, leases, strict=True
            )
        ]

    def _one_by_one(
        self, states: list[RolloutState], samplings: list[Sampling], version: int
    ) -> list[RolloutState]:
        """Members one by one. The group fails as a whole (the pool counts every member
        failed), so the members already done release their new leases first: nobody
        else will ever see those states (the soak found that leak)."""
        done: list[RolloutState] = []
        try:
            for state, sampling in zip(states, samplings, strict=True):
                done.append(self.rollout(state, sampling, version))
        except Exception as exc:
            _, errors = release_states(done)
            attach_notes(exc, errors, "releasing the group's finished members")
            raise
        return done

    def converse(
        self, state: RolloutState, user_turn: tuple[int, ...], sampling: Sampling, version: int
    ) -> RolloutState:
        """A two-turn conversation in ``state.session_id``: turn 1 is stored in the session,
        turn 2 (prompt = turn 1 + ``user_turn``) borrows its rows and is the sample returned."""
        assert state.session_id is not None, "a conversation needs a session"
        opening = dataclasses.replace(state, session_id=None)  # nothing to borrow yet
        first = self.rollout(opening, dataclasses.replace(sampling, stop_after=None), version)
        first = store_turn(self._traces, dataclasses.replace(first, session_id=state.session_id))
        second = RolloutState(
            sample_id=state.sample_id,
            group_id=state.group_id,
            prompt_ids=first.prompt_ids + first.response_ids + user_turn,
            session_id=state.session_id,
        )
        return self.rollout(second, sampling, version)

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()

    def _post(self, path: str, body: dict[str, Any], where: str) -> Any:
        try:
            response = self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(
                "the engine could not be reached",
                expected=f"an answer to POST {path}",
                found=f"{type(exc).__name__}: {exc}",
                where=where,
            ) from exc
        if response.is_error:
            raise EngineUnavailable(
                "the engine refused the request",
                expected=f"200 from POST {path}",
                found=f"HTTP {response.status_code}: {response.text[:300]}",
                where=where,
            )
        try:
            return response.json()
        except ValueError as exc:
            raise MalformedPayload(
                "the engine did not answer with a JSON body",
                expected=f"JSON from POST {path}",
                found=f"{type(exc).__name__}: {exc}",
                where=where,
            ) from exc


def _status(finish_reason: str) -> Status:
    return Status.ABORTED if finish_reason == "abort" else Status.COMPLETED


# The Ray actor class (typed Any: ray.remote's result has no useful static type).
RolloutWorker: Any = producer_actor(WorkerShell, num_cpus=0)
