"""``RolloutState``: one sample between the engine and the trainer.

A state is immutable; every transition returns a new state. The routing a state points
to is kept alive by the state's *own* lease, whatever produced the rows: this rollout
(``Origin.PRODUCED``), a trace session's prefix (``BORROWED``: the session holds its own
lease too) or a checkpoint (``RESTORED``). The origin is visible for logs and metrics,
but release never depends on it: ``release()`` ends this state's lease and nothing else.

The lease lifecycle of a sample (each row is one method; nothing else changes it)::

    from       method                          to
    ---------  ------------------------------  ----------------------------------------
    UNROUTED   with_routing(handle, lease)     LEASED
    LEASED     release() / try_release()       RELEASED   the own lease ended
    LEASED     release(), the release fails    raises     the caller's state is unchanged
    LEASED     try_release(), release fails    RELEASED   + the lease kept in unreleased
    LEASED     reset_response()                refused    MisuseError: release first
    RELEASED   reset_response()                UNROUTED   pending regeneration
    any        release(), all succeed          RELEASED   unreleased retried and emptied
    LEASED     swap_lease(new)                 LEASED     old lease released (or stuck)
    any        take_unreleased()               same       the stuck leases go to the caller

- ``reset_response`` and ``with_routing`` refuse while the own lease is live, so a reset
  can never silently drop (leak) or free (break) routing.
- A lease whose release failed (a dead shard) is *stuck*: it moves to ``unreleased``
  and rides along with the state through ``reset_response`` and ``with_routing`` (a
  stale sample can still be reset and regenerated), until a later ``release()`` ends it
  or ``take_unreleased()`` hands it to a caller that can revoke it. ``stuck`` says
  whether one is left. So a live lease is always named by the state that holds it,
  whatever raised on the way.

Staleness counts every weight version the sample depends on: its response tokens'
*and* its routing rows' (prompt rows borrowed from a trace session were routed by the
weights of the turn that stored them, so they count too); ``staleness(v,
StalenessBasis.RESPONSE_TOKENS)`` counts the response tokens only, as XTuner does.

Every routing transition above is a step of the state's ``SampleRouting``
(``rollout/sample_routing.py``, where the step order is documented): the state builds
that value from its fields (``sample_routing``), runs the step, and returns a new state
carrying the result (``with_sample_routing``). So a ``RolloutState`` is one
``RoutedSample`` among others: the buffer, the batch, the ledger and the checkpoint only
ever call those two members. ``complete()`` checks the rows against the tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from routeplay.core.handle import Handle
from routeplay.errors import HandleError, MisuseError
from routeplay.rollout.routing_terms import Origin, StalenessBasis
from routeplay.rollout.sample_routing import SampleRouting
from routeplay.store.lease import Lease

__all__ = [
    "ROLLOUT_STATE_CODEC",
    "Origin",
    "RolloutState",
    "RolloutStateCodec",
    "RoutingKind",
    "Status",
    "release_states",
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
    """No routing exists (dense model): ``routing`` is always None."""
    MOE = "moe"
    """Routing must exist for every trained row; None means it is missing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutState:
    """One sample's tokens, scores, status and routing (with the lease that holds it)."""

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
    routing: Handle | None = None
    """Routing rows ``[0, tokens - 1)`` of prompt + response, when present."""
    lease: Lease | None = field(default=None, compare=False)
    """This state's own lease on ``routing``'s payloads."""
    origin: Origin = Origin.NONE
    """Who produced the routing rows (informational; release never looks at it)."""
    retries: int = 0
    """Times this sample was reset for regeneration."""
    unreleased: tuple[Lease, ...] = field(default=(), compare=False)
    """Leases of this state whose release failed (e.g. a dead shard): still counted by
    the store, retried by every ``release()``, never dropped by a transition."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.weight_versions) != n:
            raise HandleError(
                "per-token fields disagree with the response length",
                expected=f"{n} logprobs and weight versions",
                found=f"{len(self.logprobs)} logprobs, {len(self.weight_versions)} versions",
                where=f"sample {self.sample_id}",
            )
        if self.routing_kind is RoutingKind.DENSE and self.routing is not None:
            raise MisuseError("a dense-model state cannot carry routing", where=self.sample_id)

    @property
    def tokens(self) -> int:
        """Prompt plus response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def routing_missing(self) -> bool:
        """True for a MoE sample without routing (as opposed to a dense sample)."""
        return self.routing_kind is RoutingKind.MOE and self.routing is None

    @property
    def holds_lease(self) -> bool:
        """True while this state's own lease is live."""
        return self.lease is not None and not self.lease.released

    @property
    def stuck(self) -> bool:
        """True while a lease whose release failed is still live (see ``unreleased``)."""
        return any(not lease.released for lease in self.unreleased)

    @property
    def sample_routing(self) -> SampleRouting:
        """This state's routing and leases as a ``SampleRouting`` (a new value on each
        call: the state is frozen, and every transition below is that value's step)."""
        return SampleRouting(
            sample_id=self.sample_id,
            session_id=self.session_id,
            handle=self.routing,
            lease=self.lease,
            origin=self.origin,
            unreleased=self.unreleased,
            response_versions=self.weight_versions,
            prompt_tokens=len(self.prompt_ids),
            retries=self.retries,
        )

    def with_sample_routing(self, routing: SampleRouting) -> RolloutState:
        """This state carrying ``routing``'s handle, leases, origin and retries (the
        ``RoutedSample`` protocol the containers call)."""
        if routing.sample_id != self.sample_id:
            raise MisuseError(
                "a sample's routing belongs to that sample",
                expected=f"routing of sample {self.sample_id}",
                found=f"routing of sample {routing.sample_id}",
                where=f"sample {self.sample_id}",
            )
        if self.routing_kind is RoutingKind.DENSE and routing.handle is not None:
            raise MisuseError("a dense-model state cannot carry routing", where=self.sample_id)
        return dataclasses.replace(
            self,
            routing=routing.handle,
            lease=routing.lease,
            origin=routing.origin,
            unreleased=routing.unreleased,
            retries=routing.retries,
        )

    def reset_for_retry(self, routing: SampleRouting) -> RolloutState:
        """This state pending regeneration (no response, ``PENDING``), carrying
        ``routing`` (already reset; the ``RoutedSample`` protocol the buffer calls)."""
        return dataclasses.replace(
            self.with_sample_routing(routing),
            response_ids=(),
            logprobs=(),
            weight_versions=(),
            status=Status.PENDING,
            finish_reason=None,
        )

    def oldest_version(self) -> int | None:
        """The oldest weight version among the response tokens and the routing rows
        (prompt rows included); None when the sample has neither yet."""
        return self.sample_routing.oldest_version(StalenessBasis.EVERY_ROW)

    def staleness(
        self, current_version: int, basis: StalenessBasis = StalenessBasis.EVERY_ROW
    ) -> int:
        """How many versions behind the oldest weights this sample depends on are (0
        with none): its response tokens' and its routing rows' by default; its response
        tokens' only with ``StalenessBasis.RESPONSE_TOKENS``."""
        return self.sample_routing.staleness(current_version, basis)

    def with_routing(self, routing: Handle, lease: Lease, origin: Origin) -> RolloutState:
        """Attach routing and the lease that keeps it; refuses to drop a live lease."""
        if self.routing_kind is RoutingKind.DENSE:
            self._check_no_live_lease("attach new routing")
            raise MisuseError("a dense-model state cannot carry routing", where=self.sample_id)
        return self._step(self._routing_step().attach(routing, lease, origin))

    def with_lease(self, lease: Lease) -> RolloutState:
        """The same routing under a new lease of this state (after a transfer or clone)."""
        return dataclasses.replace(self, lease=lease)

    def swap_lease(self, lease: Lease) -> RolloutState:
        """Hold ``lease`` (a clone taken first) instead of the own lease, which is
        released; if that release fails the old lease rides along in ``unreleased``
        (the second half of a transfer must not lose the new lease by raising)."""
        return self._step(self._routing_step().hand_over(lease))

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
        if self.routing_kind is RoutingKind.MOE:
            self.sample_routing.complete(
                prompt_tokens=len(self.prompt_ids), response_tokens=len(self.response_ids)
            )
        return self.with_status(Status.COMPLETED, finish_reason)

    def release(self) -> RolloutState:
        """End this state's own lease and retry its ``unreleased`` ones (idempotent);
        other holders are untouched. If a release fails, the first error is raised and
        this state still names every lease (use ``try_release`` to go on regardless).

        Example:
            >>> state = state.release()  # doctest: +SKIP
        """
        state, error = self.try_release()
        if error is not None:
            raise error
        return state

    def try_release(self) -> tuple[RolloutState, Exception | None]:
        """``release()`` that never raises: the next state (no own lease; leases whose
        release failed in ``unreleased``) and the first error, or None.

        Example:
            >>> state, error = state.try_release()  # doctest: +SKIP
            >>> retry = state.reset_response()  # works even if error is not None
        """
        after, error = self._routing_step().try_release()
        return self._step(after), error

    def take_unreleased(self) -> tuple[RolloutState, tuple[Lease, ...]]:
        """This state without its stuck leases, and those leases (still live in the
        store), for a caller that can revoke them; the caller then owns them."""
        after, stuck = self._routing_step().take_unreleased()
        return self._step(after), stuck

    def reset_response(self) -> RolloutState:
        """Drop the response and its routing for regeneration (pure: releases nothing;
        stuck leases in ``unreleased`` are kept, to be released later)."""
        self._check_no_live_lease("reset the response")
        return self.reset_for_retry(self._routing_step().reset())

    def _routing_step(self) -> SampleRouting:
        return self.sample_routing

    def _step(self, routing: SampleRouting) -> RolloutState:
        return dataclasses.replace(
            self,
            routing=routing.handle,
            lease=routing.lease,
            origin=routing.origin,
            unreleased=routing.unreleased,
            retries=routing.retries,
        )

    def _check_no_live_lease(self, action: str) -> None:
        if self.holds_lease:
            raise MisuseError(
                f"cannot {action} while the state holds a live lease",
                where=f"sample {self.sample_id}",
                hint=(
                    "Call release() first (try_release() if it may fail: a stuck lease"
                    " rides along): resets never release, releases never guess."
                ),
            )


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
        state = RolloutState(
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
        )
        return state.with_sample_routing(routing)

    @staticmethod
    def response_versions(record: dict[str, Any]) -> tuple[int, ...]:
        """Per-token versions a record keeps (they stand for the routing's own)."""
        return tuple(int(v) for v in record.get("weight_versions", ()))


ROLLOUT_STATE_CODEC = RolloutStateCodec()
"""The codec ``save_buffer`` / ``load_buffer`` use by default."""


def release_states(
    states: Iterable[RolloutState],
) -> tuple[list[RolloutState], list[Exception]]:
    """``try_release`` every state (all attempted); returns the states whose release
    failed, in their released form (live leases in ``unreleased``), and the errors.

    Example:
        >>> failed, errors = release_states(group.states)  # doctest: +SKIP
    """
    failed: list[RolloutState] = []
    errors: list[Exception] = []
    for state in states:
        after, error = state.try_release()
        if error is not None:
            failed.append(after)
            errors.append(error)
    return failed, errors
