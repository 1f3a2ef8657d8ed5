"""The soak's faults: which kinds exist, how often each fires, and how failures are told apart.

``FaultConfig`` gives each kind a per-step rate; ``FaultPlan`` draws, from one seeded
generator, whether a kind fires in a step (the same seed fires the same faults in the
same steps), and with ``each_at_least_once`` forces a kind that has not fired yet by
step ``i`` (``i`` its index in ``FAULT_KINDS``) to fire then, so a few steps cover every
kind. ``classify`` names the error a lost sample died of; ``is_premature_release`` picks
out the errors that mean data was released under a holder that still held it.
``tamper`` corrupts an engine answer the way a broken transport would.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from ray import exceptions as rex

from routeplay.errors import AlreadyReleased, LifetimeError, MisuseError, RouteplayError, RoutesLost

__all__ = [
    "FAULT_KINDS",
    "FaultConfig",
    "FaultPlan",
    "InjectedFault",
    "classify",
    "is_premature_release",
    "tamper",
]

FAULT_KINDS: Final = (
    "stale_retry",
    "partial_interrupt",
    "trace_overwrite",
    "train_exception",
    "worker_kill",
    "engine_kill",
    "trainer_kill",
    "dropped_response",
    "malformed_payload",
)
"""Every fault the soak injects, in the order ``each_at_least_once`` forces them."""


class InjectedFault(LifetimeError):
    """An exception the soak raised on purpose (inside a training step)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultConfig:
    """Per-step probability of each fault kind, and the seed of the draws.

    Example:
        >>> FaultConfig(worker_kill=0.5, seed=3).rate("worker_kill")
        0.5
    """

    stale_retry: float = 0.2
    """Buffered groups made stale early (refreshed one weight version ahead): retried."""
    partial_interrupt: float = 0.3
    """One extra new sample interrupted mid-generation (resumed next step)."""
    trace_overwrite: float = 0.2
    """A live session's turn re-inserted over itself (the trie replaces the entry)."""
    train_exception: float = 0.1
    """An exception raised inside a training step, after its first micro-batch."""
    worker_kill: float = 0.1
    """A rollout worker ``ray.kill``-ed with jobs in flight, then restarted."""
    engine_kill: float = 0.05
    """The engine's HTTP server stopped with jobs in flight, restarted on the same port."""
    trainer_kill: float = 0.05
    """The trainer dropped mid-fetch (its materializer prefetching), rebuilt from the
    weights last pushed to the engine."""
    dropped_response: float = 0.2
    """A request whose answer nobody reads: its engine key must expire by TTL."""
    malformed_payload: float = 0.2
    """One engine answer corrupted between the engine and the adapter."""
    worker_kill_in_flight: bool = True
    """Kill the worker while it runs a job (True), or just before the step's jobs are
    sent to it (False: every job sent to it fails, none is half done). Leases a worker
    killed mid-job leaves behind are revoked by the rollout pool."""
    each_at_least_once: bool = True
    """Force every kind that has not fired by step ``i`` (its index) to fire at ``i``."""
    seed: int = 0
    """Seed of the draws."""

    def __post_init__(self) -> None:
        bad = {k: self.rate(k) for k in FAULT_KINDS if not 0.0 <= self.rate(k) <= 1.0}
        if bad:
            raise MisuseError("a fault rate is a probability", expected="0 <= rate <= 1", found=bad)

    def rate(self, kind: str) -> float:
        """The per-step rate of ``kind``."""
        value: float = getattr(self, kind)
        return value

    def replace(self, **changes: Any) -> FaultConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def build(self) -> FaultPlan:
        """The seeded plan of these rates."""
        return FaultPlan(self)


class FaultPlan:
    """Draws each step's faults; counts what fired."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self.fired: Counter[str] = Counter()

    def draw(self, step: int) -> frozenset[str]:
        """The kinds that fire in ``step`` (one draw per kind per step, always made, so a
        forced fault does not shift the later draws)."""
        out = set()
        for index, kind in enumerate(FAULT_KINDS):
            hit = bool(self._rng.random() < self.config.rate(kind))
            forced = self.config.each_at_least_once and index == step and not self.fired[kind]
            if hit or forced:
                out.add(kind)
        return frozenset(out)

    def count(self, kind: str, times: int = 1) -> None:
        """Note that ``kind`` really happened ``times`` times (a drawn fault can find
        nothing to act on, e.g. no live session to overwrite)."""
        self.fired[kind] += times


def classify(exc: BaseException) -> str:
    """The error type a failure is counted under: ours by class name; a dead Ray actor
    as ``RayActorError``; anything else as ``untyped:<class>``."""
    cause = exc.cause if isinstance(exc, rex.RayTaskError) else exc
    if isinstance(cause, RouteplayError):
        return type(cause).__name__
    if isinstance(cause, rex.RayActorError):
        return "RayActorError"
    return f"untyped:{type(cause).__name__}"


def is_premature_release(exc: BaseException) -> bool:
    """An error saying data was released or lost while someone still held it."""
    cause = exc.cause if isinstance(exc, rex.RayTaskError) else exc
    return isinstance(cause, AlreadyReleased | RoutesLost)


def tamper(body: Any) -> tuple[Any, bool]:
    """A corrupted copy of an engine answer, and whether anything was corrupted: every
    engine key string loses its hex form, every routing list (ids nested three deep)
    gets expert id -1, every base64 blob is cut to an odd length."""
    if isinstance(body, dict):
        pairs = [(k, tamper(v)) for k, v in body.items()]
        return {k: v for k, (v, _) in pairs}, any(hit for _, (_, hit) in pairs)
    if isinstance(body, list):
        if _depth(body) == 3 and body[0] and body[0][0]:
            bad = [list(map(list, row)) for row in body]
            bad[0][0][0] = -1
            return bad, True
        items = [tamper(v) for v in body]
        return [v for v, _ in items], any(hit for _, hit in items)
    if isinstance(body, str) and len(body) == 56 and all(c in "0123456789abcdef" for c in body):
        return "z" + body[1:], True
    if isinstance(body, str) and len(body) > 64 and body.isascii() and " " not in body:
        return body[:-3], True
    return body, False


def _depth(value: Any) -> int:
    depth = 0
    while isinstance(value, list) and value:
        value, depth = value[0], depth + 1
    return depth if isinstance(value, int) else 0
