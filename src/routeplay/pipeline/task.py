"""The toy RL task: random prompts, a reward for even token ids, group advantages.

Deliberately trivial (the demo is about the routing data plane, not about learning):
the policy earns the fraction of its generated ids that are even, and each sample's
advantage is its reward minus its group's mean (GRPO without the std).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from routeplay.rollout import RolloutState

__all__ = ["advantages", "random_tokens", "reward"]


def random_tokens(
    rng: np.random.Generator, vocab_size: int, lengths: tuple[int, int]
) -> tuple[int, ...]:
    """A random token sequence, its length drawn from ``[lo, hi]``."""
    lo, hi = lengths
    count = int(rng.integers(lo, hi + 1))
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=count))


def reward(response_ids: Sequence[int]) -> float:
    """Fraction of even ids in the response (0 for an empty one)."""
    if not response_ids:
        return 0.0
    return sum(1 for t in response_ids if t % 2 == 0) / len(response_ids)


def advantages(states: Iterable[RolloutState]) -> dict[str, float]:
    """Reward minus the group's mean reward, per sample id."""
    by_group: dict[str, list[RolloutState]] = {}
    for state in states:
        by_group.setdefault(state.group_id, []).append(state)
    out: dict[str, float] = {}
    for members in by_group.values():
        rewards = [reward(s.response_ids) for s in members]
        mean = sum(rewards) / len(rewards)
        out.update({s.sample_id: r - mean for s, r in zip(members, rewards, strict=True)})
    return out
