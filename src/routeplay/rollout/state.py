"""``RolloutState``: one sample between the engine and the trainer.

A state is immutable; every transition returns a new state. Its routing is one embedded
``SampleRouting`` (``state.routing``: the handle, the state's *own* lease, the leases
whose release failed, the origin and the retries), the same holder any framework embeds
in its own sample type. The routing steps are that holder's (``state.routing.claim``,
``.continuation``, ``.store_turn``, ...; the step order is documented in
``rollout/sample_routing.py``); a step's result goes back into the state with
``with_sample_routing``. So a ``RolloutState`` is one ``RoutedSample`` among others: the
buffer, the batch, the ledger and the checkpoint only call those members.

What the state adds to its routing: tokens, scores and statuses, and the transitions
that change both together::

    from       method                          to
    ---------  ------------------------------  ----------------------------------------
    LEASED     release() / try_release()       RELEASED   the own lease ended
    LEASED     release(), the release fails    raises     the caller's state is unchanged
    LEASED     try_release(), release fails    RELEASED   + the lease kept in unreleased
    LEASED     reset_response()                refused    MisuseError: release first
    RELEASED   reset_response()                UNROUTED   pending regeneration
    any        complete()                      COMPLETED  rows checked against the tokens

- ``reset_response`` refuses while the own lease is live, so a reset can never silently
  drop (leak) or free (break) routing; a stuck lease (its release failed) rides along in
  ``routing.unreleased`` until a later release ends it.
- The state's ``session_id``, per-token ``weight_versions`` and prompt length are its
  routing's ``session_id``, ``response_versions`` and ``prompt_tokens``: the state keeps
  them equal, its own fields winning (the routing's copies say where a turn is stored
  and count staleness).

Staleness counts every weight version the sample depends on: its response tokens'
*and* its routing rows' (prompt rows borrowed from a trace session were routed by the
weights of the turn that stored them, so they count too); ``staleness(v,
StalenessBasis.RESPONSE_TOKENS)`` counts the response tokens only, as XTuner does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, cast

from routeplay.errors import HandleError, MisuseError
from routeplay.rollout.routing_terms import Origin, StalenessBasis
from routeplay.rollout.sample_routing import SampleRouting

__all__ = [
    "ROLLOUT_STATE_CODEC",
    "Origin",
    "RolloutState",
    "RolloutStateCodec",
    "RoutingKind",
    "Status",
]


class Status(Enum):
    """Where a sample is in its rollout."""

    PENDING = "pending"
    """Waiting for (re)generation."""
    ABORTED = "aborted"
    """Interrupted mid-generation; resumable (partial rollout)."""
    COMPLETED = "completed"
    """Generation finished; ready for the buffer."""
    FAILED = "failed"
    """Set aside (bad routing, engine error); counted, never trained on."""


class RoutingKind(Enum):
    """Whether the model routes at all."""

    DENSE = "dense"
    """No routing exists (dense model): ``routing.handle`` is always None."""
    MOE = "moe"
    """Routing must exist for every trained row; None means it is missing."""


_NEW_HOLDER: Final = cast(SampleRouting, object())
"""``RolloutState.routing``'s default: replaced by the sample's own empty holder."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutState:
    """One sample's tokens, scores, status and routing (one embedded ``SampleRouting``).

    Example:
        >>> state = RolloutState(sample_id="a", group_id="g", prompt_ids=(1, 2, 3))
        >>> state.routing.sample_id, state.routing.holds_lease
        ('a', False)
    """

    sample_id: str
    """Unique id of the sample."""
    group_id: str
    """Group (prompt) the sample belongs to, e.g. for GRPO advantages."""
    prompt_ids: tuple[int, ...]
    """Prompt token ids."""
    session_id: str | None = None
    """Trace session of a multi-turn task, if any."""
    response_ids: tuple[int, ...] = ()
    """Generated token ids so far."""
    logprobs: tuple[float, ...] = ()
    """Engine log-probability of each generated token."""
    weight_versions: tuple[int, ...] = ()
    """Policy weight version that generated each response token."""
    status: Status = Status.PENDING
    """Lifecycle status."""
    finish_reason: str | None = None
    """Engine finish reason (stop, length, abort)."""
    routing_kind: RoutingKind = RoutingKind.MOE
    """Dense models carry no routing."""
    # The default is a marker: __post_init__ puts the sample's own empty holder there,
    # so every state has one. An explicit None is refused: it would drop live leases.
    routing: SampleRouting = _NEW_HOLDER
    """The sample's routing holder: handle, own lease, stuck leases, origin, retries."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.weight_versions) != n:
            raise HandleError(
                "per-token fields disagree with the response length",
                expected=f"{n} logprobs and weight versions",
                found=f"{len(self.logprobs)} logprobs, {len(self.weight_versions)} versions",
                where=f"sample {self.sample_id}",
            )
        routing = cast("SampleRouting | None", self.routing)
        if routing is _NEW_HOLDER:
            routing = SampleRouting(sample_id=self.sample_id, session_id=self.session_id)
        elif routing is None:
            raise MisuseError(
                "a state's routing cannot be None",
                expected="a SampleRouting (or no routing argument: a new, empty one)",
                found="None",
                where=f"sample {self.sample_id}",
                hint="None would drop the state's live and stuck leases; release first,"
                " then reset_response().",
            )
        self._check_routing(routing)
        object.__setattr__(self, "routing", self._synced(routing))  # frozen: set once, here

    def _synced(self, routing: SampleRouting) -> SampleRouting:
        """``routing`` carrying the state's session, per-token versions and prompt length.
        The state's own fields are the authority: a copy with another session (a turn
        answered outside its session) carries its routing along, and the prompt length
        is known before ``complete()`` (XTuner's staleness rule needs it)."""
        own = (self.session_id, self.weight_versions, len(self.prompt_ids))
        if (routing.session_id, routing.response_versions, routing.prompt_tokens) == own:
            return routing
        session, versions, prompt = own
        return dataclasses.replace(
            routing, session_id=session, response_versions=versions, prompt_tokens=prompt
        )

    def _check_routing(self, routing: SampleRouting) -> None:
        if routing.sample_id != self.sample_id:
            raise MisuseError(
                "a sample's routing belongs to that sample",
                expected=f"routing of sample {self.sample_id}",
                found=f"routing of sample {routing.sample_id}",
                where=f"sample {self.sample_id}",
            )
        if self.routing_kind is RoutingKind.DENSE and routing.handle is not None:
            raise MisuseError("a dense-model state cannot carry routing", where=self.sample_id)

    @property
    def tokens(self) -> int:
        """Prompt plus response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def routing_missing(self) -> bool:
        """True for a MoE sample without routing (as opposed to a dense sample)."""
        return self.routing_kind is RoutingKind.MOE and self.routing.handle is None

    @property
    def sample_routing(self) -> SampleRouting:
        """The embedded routing (the ``RoutedSample`` protocol the containers call)."""
        return self.routing

    def with_sample_routing(self, routing: SampleRouting) -> RolloutState:
        """This state carrying ``routing`` (a step's result; the ``RoutedSample``
        protocol). Refuses another sample's routing, and routing on a dense sample.

        Example:
            >>> moved = state.routing.take_over("buffer", store)  # doctest: +SKIP
            >>> state = state.with_sample_routing(moved)  # doctest: +SKIP
        """
        return dataclasses.replace(self, routing=routing)

    def reset_for_retry(self, routing: SampleRouting) -> RolloutState:
        """This state pending regeneration (no response, ``PENDING``), carrying
        ``routing`` (already reset; the ``RoutedSample`` protocol the buffer calls)."""
        return dataclasses.replace(
            self,
            routing=routing,
            response_ids=(),
            logprobs=(),
            weight_versions=(),
            status=Status.PENDING,
            finish_reason=None,
        )

    def oldest_version(self) -> int | None:
        """The oldest weight version among the response tokens and the routing rows
        (prompt rows included); None when the sample has neither yet."""
        return self.routing.oldest_version(StalenessBasis.EVERY_ROW)

    def staleness(
        self, current_version: int, basis: StalenessBasis = StalenessBasis.EVERY_ROW
    ) -> int:
        """How many versions behind the oldest weights this sample depends on are (0
        with none): its response tokens' and its routing rows' by default; its response
        tokens' only with ``StalenessBasis.RESPONSE_TOKENS``."""
        return self.routing.staleness(current_version, basis)

    def extend(
        self,
        response_ids: tuple[int, ...],
        logprobs: tuple[float, ...],
        weight_version: int,
    ) -> RolloutState:
        """Append generated tokens (a first rollout, or a resumed partial one)."""
        return dataclasses.replace(
            self,
            response_ids=self.response_ids + response_ids,
            logprobs=self.logprobs + logprobs,
            weight_versions=self.weight_versions + (weight_version,) * len(response_ids),
        )

    def with_status(self, status: Status, finish_reason: str | None = None) -> RolloutState:
        """A status change (and the engine's finish reason)."""
        return dataclasses.replace(self, status=status, finish_reason=finish_reason)

    def complete(self, finish_reason: str | None = None) -> RolloutState:
        """``COMPLETED``, after checking the routing rows against the tokens (rows ==
        prompt + response - 1, else ``RowCountMismatch``); a dense sample has no rows.

        Example:
            >>> done = routed.extend(ids, logprobs, 3).complete("stop")  # doctest: +SKIP
        """
        routing = self.routing
        if self.routing_kind is RoutingKind.MOE:
            routing = routing.complete(
                prompt_tokens=len(self.prompt_ids), response_tokens=len(self.response_ids)
            )
        return dataclasses.replace(
            self, routing=routing, status=Status.COMPLETED, finish_reason=finish_reason
        )

    def release(self) -> RolloutState:
        """End this state's own lease and retry its stuck ones (idempotent); other
        holders are untouched. If a release fails, the first error is raised and this
        state still names every lease (use ``try_release`` to go on regardless).

        Example:
            >>> state = state.release()  # doctest: +SKIP
        """
        state, error = self.try_release()
        if error is not None:
            raise error
        return state

    def try_release(self) -> tuple[RolloutState, Exception | None]:
        """``release()`` that never raises: the next state (no own lease; leases whose
        release failed in ``routing.unreleased``) and the first error, or None.

        Example:
            >>> state, error = state.try_release()  # doctest: +SKIP
            >>> retry = state.reset_response()  # works even if error is not None
        """
        after, error = self.routing.try_release()
        return self.with_sample_routing(after), error

    def reset_response(self) -> RolloutState:
        """Drop the response and its routing for regeneration (pure: releases nothing;
        stuck leases are kept, to be released later). Refuses while the own lease is
        live: release first.

        Example:
            >>> retry = state.release().reset_response()  # doctest: +SKIP
        """
        return self.reset_for_retry(self.routing.reset())


@dataclass(frozen=True, slots=True)
class RolloutStateCodec:
    """How a buffer checkpoint writes and reads a ``RolloutState``'s own fields (the
    routing part is a ``RoutingRecord``); any sample type passes its own codec."""

    def to_record(self, state: RolloutState) -> dict[str, Any]:
        """The state's fields other than routing (JSON-safe)."""
        return {
            "group_id": state.group_id,
            "prompt_ids": list(state.prompt_ids),
            "response_ids": list(state.response_ids),
            "logprobs": list(state.logprobs),
            "weight_versions": list(state.weight_versions),
            "status": state.status.value,
            "finish_reason": state.finish_reason,
            "routing_kind": state.routing_kind.value,
        }

    def from_record(self, record: dict[str, Any], routing: SampleRouting) -> RolloutState:
        """The state from ``to_record``'s fields, carrying ``routing``."""
        return RolloutState(
            sample_id=routing.sample_id,
            group_id=record["group_id"],
            session_id=routing.session_id,
            prompt_ids=tuple(record["prompt_ids"]),
            response_ids=tuple(record["response_ids"]),
            logprobs=tuple(record["logprobs"]),
            weight_versions=tuple(record["weight_versions"]),
            status=Status(record["status"]),
            finish_reason=record.get("finish_reason"),
            routing_kind=RoutingKind(record.get("routing_kind", RoutingKind.MOE.value)),
            routing=routing,
        )

    @staticmethod
    def response_versions(record: dict[str, Any]) -> tuple[int, ...]:
        """Per-token versions a record keeps (they stand for the routing's own)."""
        return tuple(int(v) for v in record.get("weight_versions", ()))


ROLLOUT_STATE_CODEC = RolloutStateCodec()
"""The codec ``save_buffer`` / ``load_buffer`` use by default."""
