"""Rollout workers: Ray actors that talk to the engine over HTTP and return leased samples.

A worker is a ``producer_actor`` (so its routing puts are one-write, owned by a store
shard; LMDeploy keys stay lazy and are adopted without being read). It turns one
``RolloutState`` into the next with the steps of the state's routing holder
(``state.routing``: a ``SampleRouting``), and owns only the HTTP side:

- a fresh sample is generated (``stop_after`` interrupts it: status ``ABORTED``);
- an interrupted sample is resumed with prompt + partial completion, its routing as the
  history, so only the rows the history lacks are stored, under the new weight version
  (the request's start row = the history's rows where the engine has one, SGLang and
  vLLM: the engine sends only those rows; LMDeploy sends all of them);
- a turn of a trace session borrows the session's prefix rows (the sample's own lease)
  and appends the rest;
- the members of one group (``rollout_group``: fresh ones, resumes, retries or next
  turns; ``converse_group``: both turns of a group's conversations) write their new rows
  as one payload, fresh members' verified-equal prompt rows once (wires that carry the
  rows put them; key-store wires adopt the members' keys together, each from its
  history's end);
- a member whose request or answer fails is set aside with its error in its place, and
  the rest of its group goes on.

Lease order (``RoutingContinuation.finish``): the new lease first, then the input's. If
anything fails, the input state still holds its lease and the caller (who keeps a copy
of it) releases it. A completed answer is checked against the sample's tokens
(``RolloutState.complete``: rows == prompt + response - 1); one that disagrees is
refused with ``RowCountMismatch`` like any other per-sample refusal (its new lease
ended; in a group, the error takes the member's place).
"""

from __future__ import annotations

import dataclasses
import pickle  # only to test that our own errors can travel back (never unpickled here)
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx

from routeplay.core import read_response
from routeplay.core.handle import EngineKey
from routeplay.core.spec import RouteSpec
from routeplay.core.wires import EngineRouting
from routeplay.core.wires import wire as wire_format
from routeplay.core.wires.base import Completion
from routeplay.errors import (
    EngineUnavailable,
    MalformedPayload,
    MisuseError,
    RowCountMismatch,
)
from routeplay.rollout import (
    ADAPTERS,
    RolloutState,
    RoutingContinuation,
    RoutingKind,
    SampleRouting,
    Status,
    ingest_and_finish_group,
)
from routeplay.rollout.adapters import ProducerWriter, check_continues
from routeplay.rollout.releasing import attach_notes
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
        _refuse_dense(state)  # before any store call: a finish would lease, then refuse
        with state.routing.continuation(self._traces, state.prompt_ids) as cont:
            start = self._wire.routing_start(cont.rows)
            answer = self._post(*self._request(state, sampling, start), where)
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
            routed = state.with_sample_routing(cont.finish(self._store, handle))
        return _finished(routed, completion, version)

    def rollout_group(
        self, states: list[RolloutState], samplings: list[Sampling], version: int
    ) -> list[RolloutState | Exception]:
        """Generate (or resume, or run the next turn of) the members of one group and
        write their new rows as one payload (``ingest_and_finish_group``: fresh members'
        verified-equal prompt rows once, their leases granted by the write's call). On
        key-store wires (the engine stores whole arrays) the members' keys are adopted
        together the same way, each from its history's end, then leased.

        A member whose continuation, request or answer fails is set aside with its error
        in its place (its input keeps its lease for the caller to release); the others
        go on. If the call fails as a whole, members already finished end their new
        leases first (nobody else will ever see those states).

        Example:
            >>> out = ray.get(worker.rollout_group.remote(states, samplings, 3))  # doctest: +SKIP
            >>> [type(s).__name__ for s in out]
            ['RolloutState', 'RolloutState', 'MalformedPayload', 'RolloutState']
        """
        with ExitStack() as stack:
            opened = [self._open(stack, state) for state in states]
            asked = [
                self._ask(state, cont, sampling) if isinstance(cont, RoutingContinuation) else cont
                for state, cont, sampling in zip(states, opened, samplings, strict=True)
            ]
            good = [
                (i, cont, answer)
                for i, (cont, answer) in enumerate(zip(opened, asked, strict=True))
                if isinstance(cont, RoutingContinuation) and isinstance(answer, _Answered)
            ]
            try:
                results: list[SampleRouting | Exception] = list(
                    ingest_and_finish_group(
                        [cont for _, cont, _ in good],
                        [answer.routing for _, _, answer in good],
                        writer=self._writer,
                        store=self._store,
                        weight_version=version,
                        spec=self._spec,
                    )
                )
            except Exception as exc:  # the group's write or leases failed: each member
                results = [_portable(exc)] * len(good)  # is set aside with the error
            written = {i: result for (i, _, _), result in zip(good, results, strict=True)}
            return self._place_all(states, opened, asked, written, version)

    def _open(
        self, stack: ExitStack, state: RolloutState
    ) -> RoutingContinuation[SampleRouting] | Exception:
        try:
            _refuse_dense(state)
            return stack.enter_context(state.routing.continuation(self._traces, state.prompt_ids))
        except Exception as exc:  # e.g. the session's prefix could not be borrowed
            return _portable(exc)

    def _ask(
        self, state: RolloutState, cont: RoutingContinuation[SampleRouting], sampling: Sampling
    ) -> _Answered | Exception:
        """One member's request and its answer, decoded and checked against the member's
        history (``check_continues``), or the error that refused it (an engine key it
        refuses is freed: nobody will adopt it)."""
        where = f"sample {state.sample_id}"
        start = self._wire.routing_start(cont.rows)
        try:
            answer = self._post(*self._request(state, sampling, start), where)
            completion = self._wire.read_completion(answer, where=where)
            routing = read_response(
                self._wire.engine, answer, self._spec, where=where, start_row=start
            )
        except Exception as exc:  # this member is set aside; the group goes on
            return _portable(exc)
        try:
            check_continues(routing, cont.history)  # refuses it here, not for the group
        except Exception as exc:
            if routing.key is not None:
                self._free_refused(routing.key, exc)
            return _portable(exc)
        return _Answered(completion=completion, routing=routing)

    def _free_refused(self, key: EngineKey, error: Exception) -> None:
        try:
            self._store.free_key(key)
        except Exception as failure:
            attach_notes(error, [failure], f"freeing engine key {key.key}")

    def _place_all(
        self,
        states: list[RolloutState],
        opened: list[RoutingContinuation[SampleRouting] | Exception],
        asked: list[_Answered | Exception],
        results: dict[int, SampleRouting | Exception],
        version: int,
    ) -> list[RolloutState | Exception]:
        """Each member's state, finished (its new lease held) or set aside with its
        error (its input keeps its own lease; its borrowed lease ends)."""
        out: list[RolloutState | Exception | None] = [None] * len(opened)
        finished: list[tuple[int, SampleRouting, Completion]] = []
        for index, (cont, answer) in enumerate(zip(opened, asked, strict=True)):
            if isinstance(cont, Exception):
                out[index] = cont
            elif isinstance(answer, Exception):
                out[index] = _abandoned(cont, answer)
            elif isinstance(result := results[index], Exception):
                out[index] = _abandoned(cont, _portable(result))  # refused, or the group failed
            else:
                finished.append((index, result, answer.completion))
        placed = 0  # routings whose lease a state in ``out`` now names (or that ended)
        try:
            for index, routing, completion in finished:
                routed = states[index].with_sample_routing(routing)
                out[index] = _finished_or_refused(routed, completion, version)
                placed += 1
        except BaseException as exc:
            errors = _release_all([s for s in out if isinstance(s, RolloutState)])
            left = [routing for _, routing, _ in finished[placed:]]
            errors += [e for r in left if (e := r.try_release()[1]) is not None]
            attach_notes(exc, errors, "releasing the group's finished members")
            raise
        return [state for state in out if state is not None]

    def _request(
        self, state: RolloutState, sampling: Sampling, start: int
    ) -> tuple[str, dict[str, Any]]:
        return self._wire.request(
            state.prompt_ids + state.response_ids,
            max_new_tokens=sampling.max_new_tokens - len(state.response_ids),
            temperature=sampling.temperature,
            seed=sampling.seed,
            stop_after=sampling.stop_after,
            start_row=start,
        )

    def converse_group(
        self,
        states: list[RolloutState],
        user_turns: list[tuple[int, ...]],
        samplings: list[Sampling],
        version: int,
    ) -> list[RolloutState | Exception]:
        """Two-turn conversations of one group, each in its ``session_id``: turn 1 of all
        members is one group write (their shared prompt once) and goes to the sessions;
        turn 2 (prompt = turn 1 + the member's user turn) borrows each session's rows,
        and the members' new rows are one more write. Returns the turn-2 samples (or
        each failed member's error).

        Example:
            >>> out = ray.get(worker.converse_group.remote(states, turns, ms, 0))  # doctest: +SKIP
            >>> out[0].session_id == states[0].session_id
            True
        """
        assert all(s.session_id is not None for s in states), "a conversation needs a session"
        openings = [dataclasses.replace(s, session_id=None) for s in states]  # nothing to borrow
        whole = [dataclasses.replace(m, stop_after=None) for m in samplings]
        firsts = self.rollout_group(openings, whole, version)
        out: list[RolloutState | Exception] = list(firsts)
        seconds: dict[int, RolloutState] = {}
        for index, (state, first, turn) in enumerate(zip(states, firsts, user_turns, strict=True)):
            if isinstance(first, Exception):
                continue
            try:
                first = _store_turn(self._traces, first, state.session_id)
            except Exception as exc:  # without its frames: they hold ``out`` (a cycle)
                out[index] = exc.with_traceback(None)
                continue
            seconds[index] = RolloutState(
                sample_id=state.sample_id,
                group_id=state.group_id,
                prompt_ids=first.prompt_ids + first.response_ids + turn,
                session_id=state.session_id,
            )
        answers = self.rollout_group(
            list(seconds.values()), [samplings[i] for i in seconds], version
        )
        for index, answer in zip(seconds, answers, strict=True):
            out[index] = answer
        return out

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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Answered:
    """One member's engine answer, decoded and checked."""

    completion: Completion
    """Its tokens, log-probs and finish reason."""
    routing: EngineRouting
    """Its routing rows (checked against the member's history)."""


def _finished_or_refused(
    routed: RolloutState, completion: Completion, version: int
) -> RolloutState | Exception:
    """The finished member, or the error refusing it (``_finished`` ended its new lease):
    a refused member costs itself only."""
    try:
        return _finished(routed, completion, version)
    except Exception as exc:
        return _portable(exc)


def _abandoned(cont: RoutingContinuation[SampleRouting], error: Exception) -> Exception:
    """End a set-aside member's borrowed lease; a failure to is noted on its error."""
    try:
        cont.abandon()
    except Exception as failure:
        attach_notes(error, [failure], f"releasing {cont.routing.sample_id}'s borrowed prefix")
    return error


def _store_turn(traces: TraceStoreClient, first: RolloutState, session: str | None) -> RolloutState:
    """Turn 1 (answered outside its session: nothing to borrow) handed to ``session``,
    then its own lease ends (``SampleRouting.store_turn``)."""
    turn = dataclasses.replace(first, session_id=session)
    return turn.with_sample_routing(
        turn.routing.store_turn(traces, turn.prompt_ids + turn.response_ids)
    )


def _refuse_dense(state: RolloutState) -> None:
    if state.routing_kind is RoutingKind.DENSE:
        raise MisuseError(
            "a dense-model sample has no routing to generate",
            where=f"sample {state.sample_id}",
            hint="Roll dense samples out without a routing continuation.",
        )


def _release_all(states: list[RolloutState]) -> list[Exception]:
    """``try_release`` every state (all attempted); the errors of those that failed."""
    return [error for state in states if (error := state.try_release()[1]) is not None]


def _portable(error: Exception) -> Exception:
    """``error``, or a plain stand-in naming it when it cannot be pickled: a member's
    error goes back to the driver inside the group's answer, which must not fail."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {str(error)[:500]}")
    return error


def _finished(routed: RolloutState, completion: Completion, version: int) -> RolloutState:
    """The answered sample: ABORTED (a partial rollout resumes it), or COMPLETED once its
    rows match its tokens (``complete()``: rows == prompt + response - 1). A completion
    whose rows disagree (the engine saw other tokens than the sample holds) is refused
    with ``RowCountMismatch`` after its new lease ended: nobody can train it, and the
    input's lease already ended in ``finish``."""
    answered = routed.extend(completion.token_ids, completion.logprobs, version)
    if completion.finish_reason == "abort":
        return answered.with_status(Status.ABORTED, completion.finish_reason)
    try:
        return answered.complete(completion.finish_reason)
    except RowCountMismatch as exc:
        _, error = answered.try_release()
        attach_notes(exc, [error] if error is not None else [], f"releasing {routed.sample_id}")
        raise


# The Ray actor class (typed Any: ray.remote's result has no useful static type).
RolloutWorker: Any = producer_actor(WorkerShell, num_cpus=0)
