"""What a soak runs (``SoakConfig``) and what happened to its samples (``SoakTally``):
read by the soak (``routeplay.pipeline.soak``) and its report
(``routeplay.pipeline.soak_report``), so neither imports the other."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayTaskError

from routeplay.pipeline.config import DemoConfig, recipe
from routeplay.pipeline.faults import FaultConfig, classify, is_premature_release

__all__ = ["SoakConfig", "SoakTally"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakConfig:
    """A soak: the demo recipe it runs, the faults, and the engine store's short TTL.

    Example:
        >>> SoakConfig(steps=20, faults=FaultConfig(seed=7)).demo.steps
        20
    """

    steps: int = 200
    """RL steps."""
    demo: DemoConfig = field(default_factory=lambda: recipe("smoke"))
    """The pipeline (its ``steps`` is set from ``steps``)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Fault rates and seed."""
    key_ttl_s: float = 5.0
    """Engine-store TTL: dropped responses' keys must expire within it."""
    expiry_wait_s: float = 20.0
    """How long the end waits for unconsumed engine keys to expire."""

    def __post_init__(self) -> None:
        if self.demo.steps != self.steps:
            object.__setattr__(self, "demo", self.demo.replace(steps=self.steps))

    def replace(self, **changes: Any) -> SoakConfig:
        """A copy with some fields changed (the CLI's overrides)."""
        return dataclasses.replace(self, **changes)


@dataclass(slots=True)
class SoakTally:
    """What happened to samples over the soak."""

    produced: int = 0
    trained: int = 0
    lost: Counter[str] = field(default_factory=Counter)
    """Samples lost, by the error type that lost them."""
    premature: list[str] = field(default_factory=list)
    """AlreadyReleased / RoutesLost errors (each one breaks an invariant)."""
    untyped: list[str] = field(default_factory=list)
    """Errors outside routeplay's tree and Ray's actor death."""
    examples: dict[str, str] = field(default_factory=dict)
    """The first message of each error type (why it was lost)."""

    def failure(self, exc: BaseException, samples: int, where: str) -> None:
        """``samples`` lost to ``exc``."""
        kind = classify(exc)
        self.lost[kind] += samples
        cause = exc.cause if isinstance(exc, RayTaskError) else exc  # no remote traceback
        line = f"{where}: {kind}: {cause}".splitlines()[0][:300]
        self.examples.setdefault(kind, line)
        if is_premature_release(exc):
            self.premature.append(line)
        if kind.startswith("untyped:"):
            self.untyped.append(line)
