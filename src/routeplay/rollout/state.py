"""``RolloutState``: one sample between the engine and the trainer.

A state is immutable; every transition returns a new state. The routing a state points
to is kept alive by the state's *own* lease, whatever produced the rows: this rollout
(``Origin.PRODUCED``), a trace session's prefix (``BORROWED``: the session holds its own
lease too) or a checkpoint (``RESTORED``). The origin is visible for logs and metrics,
but release never depends on it: ``release()`` ends this state's lease and nothing else.

Resetting a response is a pure state change and refuses to run while the state still
holds a lease, so a reset can never silently drop (leak) or free (break) routing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from routeplay.core.handle import Handle
from routeplay.errors import HandleError, MisuseError
from routeplay.store.lease import Lease

__all__ = ["Origin", "RolloutState", "RoutingKind", "Status"]


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


class Origin(Enum):
    """Who produced the routing rows this state points at (informational)."""

    NONE = "none"
    PRODUCED = "produced"
    BORROWED = "borrowed"
    RESTORED = "restored"


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

    def staleness(self, current_version: int) -> int:
        """How many versions behind the oldest response token is (0 with no response)."""
        return current_version - min(self.weight_versions) if self.weight_versions else 0

    def with_routing(self, routing: Handle, lease: Lease, origin: Origin) -> RolloutState:
        """Attach routing and the lease that keeps it; refuses to drop a live lease."""
        self._check_no_live_lease("attach new routing")
        if self.routing_kind is RoutingKind.DENSE:
            raise MisuseError("a dense-model state cannot carry routing", where=self.sample_id)
        return dataclasses.replace(self, routing=routing, lease=lease, origin=origin)

    def with_lease(self, lease: Lease) -> RolloutState:
        """The same routing under a new lease of this state (after a transfer or clone)."""
        return dataclasses.replace(self, lease=lease)

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

    def release(self) -> RolloutState:
        """End this state's own lease (idempotent); other holders are untouched."""
        if self.lease is not None:
            self.lease.release()
        return dataclasses.replace(self, lease=None)

    def reset_response(self) -> RolloutState:
        """Drop the response and its routing for regeneration (pure: releases nothing)."""
        self._check_no_live_lease("reset the response")
        return dataclasses.replace(
            self,
            response_ids=(),
            logprobs=(),
            weight_versions=(),
            status=Status.PENDING,
            finish_reason=None,
            routing=None,
            lease=None,
            origin=Origin.NONE,
            retries=self.retries + 1,
        )

    def _check_no_live_lease(self, action: str) -> None:
        if self.holds_lease:
            raise MisuseError(
                f"cannot {action} while the state holds a live lease",
                where=f"sample {self.sample_id}",
                hint="Call release() first: resets never release, releases never guess.",
            )
