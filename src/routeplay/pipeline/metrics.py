"""What the demo measures, as plain counters (numpy only, no Ray, no torch).

- ``ReplayTally``: per micro-batch, the experts the trainer's routers used under replay
  against the engine's routing (every real row: must never differ), and the R3 paper's
  measurements in the same run, on the same tokens: the trainer's own routing (no
  replay) against the engine's on rows produced by the weights the trainer holds (per
  (token, layer) route, per token, differing layers per token), and the training-
  inference mismatch between trainer and engine log-probs (mean |gap| and the k3
  estimate of KL(engine || trainer)) three ways: no replay, R2 (the trainer replays the
  routing it recorded in its own old-logprob pass) and R3 (it replays the engine's),
  over every generated token of samples produced entirely by those weights, per step
  and summed, and the |gap| over the *affected* tokens (a routing difference at or
  before the position that predicts them: where replay can matter).
- ``Timeline``: object-store bytes and live leases at each phase of each step.

Expert sets are compared per (token, layer) row, order-free: the order inside a top-k
row carries no meaning for the experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Point", "ReplayTally", "Timeline", "affected_positions", "differing_rows", "k3"]


def k3(trainer: npt.NDArray[np.floating], engine: npt.NDArray[np.floating]) -> npt.NDArray[Any]:
    """Per token, the k3 estimate of KL(engine || trainer) from engine-sampled tokens:
    ``r - 1 - log r`` with ``r = p_trainer / p_engine`` (unbiased, never negative)."""
    log_ratio = np.asarray(trainer, np.float64) - np.asarray(engine, np.float64)
    return np.asarray(np.expm1(log_ratio) - log_ratio)


def differing_rows(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """``[tokens, L]``: True where the two routings name different expert sets."""
    if a.shape != b.shape:
        raise ValueError(f"routing shapes differ: {a.shape} vs {b.shape}")
    return np.asarray((np.sort(a, axis=-1) != np.sort(b, axis=-1)).any(axis=-1))


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


@dataclass(slots=True)
class ReplayTally:
    """Routing and log-prob comparisons summed over a run."""

    rows_replayed: int = 0
    """Real (token) rows trained under replay."""
    mismatches: int = 0
    """(token, layer) rows whose experts under replay differ from the engine's."""
    own_rows: int = 0
    """Rows compared without replay (produced by the weights the trainer holds)."""
    own_route_diffs: int = 0
    """(token, layer) rows where the trainer's own routing differs from the engine's."""
    own_token_diffs: int = 0
    """Rows with at least one such layer."""
    layers: int = 0
    """MoE layers per row."""
    logprob_tokens: int = 0
    """Generated tokens whose log-probs are compared (same weights as the engine)."""
    logprob_gap_replay: float = 0.0
    """Sum of |trainer - engine| log-prob over them, with replay."""
    logprob_gap_own: float = 0.0
    """The same sum without replay (the trainer's own routing)."""
    affected_tokens: int = 0
    """Of those tokens, the ones after a routing difference in their sample."""
    affected_gap_replay: float = 0.0
    """Sum of |trainer - engine| log-prob over the affected tokens, with replay."""
    affected_gap_own: float = 0.0
    """The same without replay."""
    logprob_gap_r2: float = 0.0
    """Sum of |trainer - engine| log-prob with R2 (the trainer's own recorded routing)."""
    kl_own: float = 0.0
    """Sum of the per-token k3 KL(engine || trainer) without replay."""
    kl_replay: float = 0.0
    """The same with R3 replay (the engine's routing)."""
    kl_r2: float = 0.0
    """The same with R2 replay (the trainer's own old-logprob routing)."""
    step_kl: list[tuple[float, float, float]] = field(default_factory=list)
    """Per step: mean k3 KL without replay, with R2, with R3 (NaN: no token compared)."""
    _mark: tuple[int, float, float, float] = (0, 0.0, 0.0, 0.0)
    """Tokens and KL sums at the end of the last step (for the per-step means)."""

    def replayed(
        self, used: npt.NDArray[Any], engine: npt.NDArray[Any], real: npt.NDArray[np.bool_]
    ) -> None:
        """Experts used in training (recorded inside ``replay``) vs the engine's, real rows."""
        self.rows_replayed += int(real.sum())
        self.mismatches += int(differing_rows(used[real], engine[real]).sum())

    def own(
        self, own: npt.NDArray[Any], engine: npt.NDArray[Any], rows: npt.NDArray[np.bool_]
    ) -> None:
        """The trainer's routing without replay vs the engine's, on ``rows``."""
        diff = differing_rows(own[rows], engine[rows])
        self.layers = int(engine.shape[1])
        self.own_rows += int(rows.sum())
        self.own_route_diffs += int(diff.sum())
        self.own_token_diffs += int(diff.any(axis=1).sum())

    def logprobs(
        self,
        *,
        replay: npt.NDArray[np.floating],
        own: npt.NDArray[np.floating],
        r2: npt.NDArray[np.floating],
        engine: npt.NDArray[np.floating],
        affected: npt.NDArray[np.bool_],
    ) -> None:
        """Trainer log-probs with R3, without replay and with R2 vs the engine's, same tokens."""
        gap_replay, gap_own = np.abs(replay - engine), np.abs(own - engine)
        self.logprob_tokens += int(engine.size)
        self.logprob_gap_replay += float(gap_replay.sum())
        self.logprob_gap_own += float(gap_own.sum())
        self.logprob_gap_r2 += float(np.abs(r2 - engine).sum())
        self.kl_own += float(k3(own, engine).sum())
        self.kl_replay += float(k3(replay, engine).sum())
        self.kl_r2 += float(k3(r2, engine).sum())
        self.affected_tokens += int(affected.sum())
        self.affected_gap_replay += float(gap_replay[affected].sum())
        self.affected_gap_own += float(gap_own[affected].sum())

    def end_step(self) -> tuple[float, float, float]:
        """Close a step: its mean k3 KL without replay, with R2 and with R3 (appended to
        ``step_kl``; NaN when the step compared no token)."""
        tokens, own, r2, replay = self._mark
        count = self.logprob_tokens - tokens
        means = tuple(
            (now - before) / count if count else float("nan")
            for now, before in ((self.kl_own, own), (self.kl_r2, r2), (self.kl_replay, replay))
        )
        self._mark = (self.logprob_tokens, self.kl_own, self.kl_r2, self.kl_replay)
        step = (means[0], means[1], means[2])
        self.step_kl.append(step)
        return step

    def summary(self) -> dict[str, float]:
        """The R3-effect fractions and means."""
        rows, tokens = max(self.own_rows, 1), max(self.logprob_tokens, 1)
        affected = max(self.affected_tokens, 1)
        return {
            "layers_per_token_no_replay": self.own_route_diffs / rows,
            "logprob_abs_diff_r2": self.logprob_gap_r2 / tokens,
            "kl_k3_no_replay": self.kl_own / tokens,
            "kl_k3_replay": self.kl_replay / tokens,
            "kl_k3_r2": self.kl_r2 / tokens,
            "route_diff_fraction_no_replay": self.own_route_diffs / (rows * max(self.layers, 1)),
            "token_diff_fraction_no_replay": self.own_token_diffs / rows,
            "logprob_abs_diff_no_replay": self.logprob_gap_own / tokens,
            "logprob_abs_diff_replay": self.logprob_gap_replay / tokens,
            "logprob_abs_diff_no_replay_affected": self.affected_gap_own / affected,
            "logprob_abs_diff_replay_affected": self.affected_gap_replay / affected,
            "tokens_affected": float(self.affected_tokens),
            "rows_compared": float(self.own_rows),
            "tokens_compared": float(self.logprob_tokens),
        }


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
