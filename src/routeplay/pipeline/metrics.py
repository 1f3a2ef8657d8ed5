"""What the demo measures, as plain records (numpy only, no Ray, no torch).

- ``StepDrift``: one step's routing and log-prob figures, each a ``RoutingDrift`` read
  from the library's ``DriftMeter`` (``routeplay.train.drift``: the same meter, keys and
  k3 KL any trainer logs; the demo computes none of them itself). ``live`` is the drift
  the HF replay measured inside the training forward under R3 (each router's own top-k
  against the engine's ids); ``no_replay`` compares the trainer's own routing, recorded
  in a forward without replay, with the engine's on the same rows (the R3 paper's
  measurement); ``r2`` is the replay of that recording (R2). Log-probs (k3 KL(engine ||
  trainer), mean |gap|) go with each: over the generated tokens of samples produced
  entirely by the weights the trainer holds, and, in ``*_affected``, over those after a
  routing difference in their sample (where replay can matter). ``used`` compares the
  experts the MoE blocks really received under R3 with the engine's: must never differ.
- ``ReplayTally``: the run's steps and their merge.
- ``Timeline``: object-store bytes and live leases at each phase of each step.

Why ``live`` and ``no_replay`` differ a little on the same tokens: under replay, every
layer after the first replayed one sees hidden states computed with the engine's
experts, so its router scores are not those of the free-running forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import numpy.typing as npt

from routeplay.train.drift_figures import RoutingDrift

__all__ = ["Point", "ReplayTally", "StepDrift", "Timeline", "affected_positions"]


def affected_positions(
    differs: npt.NDArray[np.bool_], sample_of: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    """True at positions whose sample has a differing row at or before them (causal).

    ``differs`` and ``sample_of`` are ``[tokens]``; ``sample_of`` is -1 on padding and
    each sample's positions are contiguous.
    """
    out = np.zeros_like(differs)
    for sample in np.unique(sample_of[sample_of >= 0]):
        at = np.flatnonzero(sample_of == sample)
        out[at] = np.cumsum(differs[at]) > 0
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDrift:
    """One step's figures, read from the library's meters (see the module docstring).

    Example:
        >>> step = StepDrift.empty(top_k=2)
        >>> (step + step).live.tokens
        0
    """

    live: RoutingDrift
    """R3 replay, measured live in the training forward; with the R3 log-probs."""
    no_replay: RoutingDrift
    """The trainer's own routing vs the engine's, same rows; with the no-replay log-probs."""
    r2: RoutingDrift
    """The replay of the trainer's own recording (R2); with the R2 log-probs."""
    used: RoutingDrift
    """Experts used in training under R3 vs the engine's, every real row: 0 differing."""
    live_affected: RoutingDrift
    """R3 log-probs over the tokens after a routing difference in their sample."""
    no_replay_affected: RoutingDrift
    """No-replay log-probs over the same tokens."""

    @classmethod
    def empty(cls, top_k: int) -> StepDrift:
        """A step that measured nothing (no sample trained)."""
        return cls(**{f.name: RoutingDrift.empty(top_k) for f in fields(cls)})

    def __add__(self, other: StepDrift) -> StepDrift:
        merged = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        return StepDrift(**merged)

    @property
    def kl_k3(self) -> tuple[float, float, float]:
        """Mean k3 KL without replay, with R2, with R3 (NaN: no token compared)."""
        no_replay, r2, live = (
            float("nan") if d.kl_k3 is None else d.kl_k3
            for d in (self.no_replay, self.r2, self.live)
        )
        return no_replay, r2, live


@dataclass(slots=True)
class ReplayTally:
    """The run's steps (``StepDrift`` each), in order."""

    steps: list[StepDrift] = field(default_factory=list)
    """One per training step, also steps that trained nothing."""

    def add(self, step: StepDrift) -> StepDrift:
        """Append a step's figures (returns them)."""
        self.steps.append(step)
        return step

    def total(self) -> StepDrift | None:
        """Every step merged (None before the first step)."""
        if not self.steps:
            return None
        total = self.steps[0]
        for step in self.steps[1:]:
            total = total + step
        return total

    @property
    def rows_replayed(self) -> int:
        """Real (token) rows trained under replay."""
        total = self.total()
        return 0 if total is None else total.used.tokens

    @property
    def mismatches(self) -> int:
        """(token, layer) rows whose experts under replay differ from the engine's."""
        total = self.total()
        return 0 if total is None else total.used.differing


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    """One sample of the run's memory picture."""

    t_s: float
    """Seconds since the run started."""
    step: int
    """RL step."""
    phase: str
    """``start``, ``rollout``, ``train`` or ``teardown``."""
    object_store_bytes: int
    """Object-store bytes in use, all nodes."""
    routing_bytes: int
    """Payload bytes the route store keeps alive (wherever Ray holds them: payloads under
    its 100 KiB inline limit live in the owning shard's memory, not the object store)."""
    leases: int
    """Live leases in the route store."""
    live_payloads: int
    """Payloads the route store keeps alive."""


@dataclass(slots=True)
class Timeline:
    """Phase points, and object-store usage sampled in between, in time order."""

    points: list[Point] = field(default_factory=list)
    usage: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since start, object-store bytes in use), sampled in the background."""

    def add(self, point: Point) -> None:
        """Append a point."""
        self.points.append(point)

    def peak_bytes(self) -> int:
        """Largest object-store usage seen."""
        sampled = (used for _, used in self.usage)
        return max((*sampled, *(p.object_store_bytes for p in self.points)), default=0)
