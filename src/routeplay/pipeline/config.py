"""The demo's typed configuration: ``DemoConfig`` over one dataclass per component (each
beside the class it builds: ``RolloutConfig`` in ``pipeline.rollouts``,
``TrainerConfig`` in ``pipeline.trainer``, ``EngineConfig`` in ``engine.model``), and
named recipes (``default``: the R3 run, under two minutes on 2 CPUs; ``smoke``: the tiny
two-step e2e run).

A run is a Python recipe; the CLI picks one and overrides a few fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final

from routeplay.core.wires import WIRE_NAMES
from routeplay.engine.model import EngineConfig
from routeplay.errors import MisuseError
from routeplay.pipeline.rollouts import RolloutConfig
from routeplay.pipeline.trainer import TrainerConfig
from routeplay.rollout import BufferConfig

__all__ = ["RECIPES", "DemoConfig", "RolloutConfig", "TrainerConfig", "recipe"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """A whole demo run."""

    steps: int = 16
    """RL steps (each: rollout, train, weight push)."""
    wire: str = "lmdeploy-key"
    """Engine wire format, one of ``routeplay.core.wires.WIRE_NAMES``."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The reference engine's model (bf16); the trainer runs the same weights in
    ``trainer.dtype``."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers and the per-step sample mix."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The learner."""
    buffer: BufferConfig = field(default_factory=lambda: BufferConfig(max_staleness=1))
    """Staleness and retry rules of the replay buffer."""
    address: str | None = None
    """Ray cluster to join; None starts a local one (or uses the one already running)."""
    num_cpus: int | None = None
    """CPUs of the local Ray instance (None: Ray's default)."""
    store_shards: int = 1
    """Route store shard actors."""
    seed: int = 0
    """Seed of prompts, user turns and sampling."""

    def __post_init__(self) -> None:
        if self.wire not in WIRE_NAMES:
            raise MisuseError("unknown engine wire format", expected=WIRE_NAMES, found=self.wire)
        if self.steps < 1:
            raise MisuseError("a demo needs at least one step", found=self.steps)

    def replace(self, **changes: Any) -> DemoConfig:
        """A copy with some fields changed (the CLI's overrides)."""
        return dataclasses.replace(self, **changes)


R3_ENGINE: Final = EngineConfig(
    num_layers=24,
    num_experts=128,
    top_k=8,
    hidden_size=64,
    # A fresh MoE layer adds about 1% to the residual stream and a fresh LM head gives
    # near-uniform distributions: routes would differ (depth and experts give that) but
    # barely move a log-prob. Scaled like this, a flipped route moves the output as in a
    # trained model (measured: ~12% of routes differ, ~90% of tokens have a differing layer).
    expert_init_scale=1.5,
    lm_head_init_scale=16.0,
)
"""The default recipe's model: Qwen3-MoE, 24 MoE layers, 128 experts, top-8 (Qwen3-30B-A3B
has 48, 128, 8), hidden 64, routing-sensitive init; bf16 engine with KV-cache decode."""

R3_ROLLOUT: Final = RolloutConfig(
    group_size=4,
    groups_per_step=2,
    partial_groups_per_step=1,
    conversations_per_step=1,
    # Agentic: long prompts and tool outputs, short turns. A row is 24 x 8 uint8 ids (192
    # bytes); each group's writes are one payload: its 600+ prompt rows once plus every
    # member's own rows (~117+ KiB), and its second turns' tool outputs and answers
    # (4 x 166 rows, ~125 KiB). Only a resume's few new rows are small.
    prompt_tokens=(600, 680),
    user_turn_tokens=160,
    max_new_tokens=6,
    stop_after=2,
)
"""The default recipe's sample mix: 2 GRPO groups of 4 (one interrupted and resumed) and
one group of two-turn sessions per step."""

RECIPES: Final[dict[str, DemoConfig]] = {
    # vLLM's wire: the producer path writes each payload once (LMDeploy's shared_store
    # actor re-puts its argument, and an argument over 100 KiB is itself an object: two).
    # Staleness 0 with every complete group trained each step: the resumed group (two
    # weight versions) goes stale and is regenerated, so every trained sample comes from
    # the weights the trainer holds and every generated token is compared.
    "default": DemoConfig(
        steps=3,
        wire="vllm",
        engine=R3_ENGINE,
        rollout=R3_ROLLOUT,
        # A gentler step than the smoke run's: at 1e-2 (or 1e-3) Adam sharpens the toy
        # policy within a step or two, its log-probs go to ~0 and so does every mismatch.
        # Packs sized to fit (one sample each at these lengths): the trainer's forwards
        # then skip the padding and the masked attention kernel (a quarter of its time).
        trainer=TrainerConfig(groups_per_step=3, pack_max_length=896, pack_multiple=1, lr=3e-4),
        buffer=BufferConfig(max_staleness=0),
    ),
    # The tiny model (2 MoE layers, 8 experts, top-2, 100-byte payloads), two steps: no
    # group can be more than one version old, so staleness 0 is what makes one go stale:
    # the group interrupted in step 0 and resumed in step 1 is retried.
    # Twelve new tokens per turn (an interruption after four): every path of a step is
    # there, and the engine's decode, a soak's main cost, stays short.
    "smoke": DemoConfig(
        steps=2,
        rollout=RolloutConfig(max_new_tokens=12, stop_after=4),
        buffer=BufferConfig(max_staleness=0),
    ),
}


def recipe(name: str) -> DemoConfig:
    """A named recipe."""
    if name not in RECIPES:
        raise MisuseError("unknown demo recipe", expected=sorted(RECIPES), found=name)
    return RECIPES[name]
