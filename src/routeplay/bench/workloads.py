"""What the data-path benchmark measures: workloads and the run's configuration.

Example:
    config = BenchConfig.quick()          # a few minutes on a laptop-sized machine
    [w.name for w in config.workloads]    # ['qwen3-235b-a22b/32k/sp4', ...]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from routeplay.core import RouteSpec, preset
from routeplay.errors import MisuseError

__all__ = ["BenchConfig", "RLStepShape", "SessionShape", "VerlStepShape", "Workload"]

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """One step's routing: ``samples`` samples of ``tokens`` tokens read by ``sp`` ranks."""

    model: str
    """Preset name (``routeplay.core.preset``)."""
    tokens: int
    """Tokens per sample (prompt + completion); a sample has ``tokens - 1`` routing rows."""
    samples: int
    """Samples in the step."""
    sp: int
    """Sequence-parallel ranks on the trainer node, each reading ``1/sp`` of every sample."""
    prompt_tokens: int = 0
    """> 0: a GRPO group whose samples share this many prompt tokens (routed alike)."""
    label: str = ""
    """Name override (e.g. ``grpo``)."""

    @property
    def spec(self) -> RouteSpec:
        """The model's routing geometry."""
        return preset(self.model)

    @property
    def rows(self) -> int:
        """Routing rows per sample."""
        return self.tokens - 1

    @property
    def name(self) -> str:
        """``model/tokens/spN`` (``k`` for thousands), or the label."""
        tokens = f"{self.tokens // 1024}k" if self.tokens % 1024 == 0 else str(self.tokens)
        base = self.label or f"{self.model}/{tokens}"
        return f"{base}/x{self.samples}/sp{self.sp}"

    def sample_plan(self, seed: int) -> list[tuple[int, int, int, int]]:
        """``(rows, seed, prompt_rows, prompt_seed)`` per sample: what the engine returns."""
        prompt_seed = seed * 1000 + 999
        return [
            (self.rows, seed * 1000 + i, self.prompt_tokens, prompt_seed)
            for i in range(self.samples)
        ]

    @property
    def payload_bytes(self) -> int:
        """Canonical bytes of the step, every sample counted whole."""
        return self.samples * self.spec.nbytes(self.rows)

    @property
    def raw_bytes(self) -> int:
        """Bytes of one sample as the engine stores it (uint16, every decoder layer)."""
        spec = self.spec
        return self.rows * spec.decoder_layers * spec.top_k * np.dtype(np.uint16).itemsize

    @property
    def unique_bytes(self) -> int:
        """Canonical bytes once a shared prompt is stored once."""
        if not self.prompt_tokens:
            return self.payload_bytes
        suffix = self.rows - self.prompt_tokens
        return self.spec.nbytes(self.prompt_tokens) + self.samples * self.spec.nbytes(suffix)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionShape:
    """The multi-turn workloads (``routeplay.bench.sessions``): one agentic session, a
    trunk of turns and two branches off its last turn, and one partial rollout resumed
    several times; each on every wire.

    Example:
        >>> SessionShape().path_turns  # turns from the first to a branch's last
        22
    """

    model: str = "qwen3-30b-a3b"
    """Preset name (``routeplay.core.preset``)."""
    system_tokens: int = 1024
    """The first turn's prompt before its user message (system prompt, tools)."""
    user_tokens: int = 96
    """Tokens of each turn's user message (or tool result)."""
    answer_tokens: int = 320
    """Tokens each turn generates."""
    trunk_turns: int = 12
    """Turns before the branch point."""
    branch_turns: int = 10
    """Turns of each of the two branches that continue the trunk's last turn."""
    rollout_prompt_tokens: int = 1024
    """Prompt of the partial rollout."""
    piece_tokens: int = 512
    """Tokens the partial rollout generates between two interruptions."""
    pieces: int = 8
    """Generations of the partial rollout: the first one and ``pieces - 1`` resumes."""

    @property
    def path_turns(self) -> int:
        """Turns from the session's first to the last turn of one branch."""
        return self.trunk_turns + self.branch_turns

    @property
    def turns(self) -> int:
        """Turns the session stores: the trunk's and both branches'."""
        return self.trunk_turns + 2 * self.branch_turns


@dataclass(frozen=True, slots=True, kw_only=True)
class RLStepShape:
    """The realistic RL step (``routeplay.bench.rl_step``): GRPO groups of ``group``
    samples sharing a prompt, written during generation, then one trainer step over
    ``dp`` data-parallel ranks, at each of ``samples`` samples per step.

    Example:
        >>> shape = RLStepShape(samples=(64,))
        >>> shape.groups(64), shape.rows, shape.spec.nbytes(shape.rows)
        (8, 1023, 392832)
    """

    model: str = "qwen3-30b-a3b"
    """Preset name (``routeplay.core.preset``)."""
    tokens: int = 1024
    """Tokens per sample (prompt + response): ``tokens - 1`` routing rows."""
    shared_prompt: int = 512
    """Prompt tokens a GRPO group's samples share (their first routing rows, routed alike)."""
    group: int = 8
    """Samples per GRPO group."""
    dp: int = 4
    """Data-parallel trainer ranks (actors on the trainer node), each reading its share."""
    pack_length: int = 8192
    """Positions per pack (``pack_samples``); one pack per micro-batch."""
    samples: tuple[int, ...] = (64, 256, 1024, 4096)
    """Samples per step, one measured point each."""
    runs: int = 3
    """Timed runs per path and point (after one checked warm-up run); medians kept."""
    store_bytes: int = 4608 * MiB
    """Object store of each node of the step's own local cluster (verl's path holds
    every sample at int16, padded to ``tokens``, on the driver's node and the trainer's)."""

    def __post_init__(self) -> None:
        unit = self.group * self.dp
        if not 0 < self.shared_prompt < self.tokens - 1 or self.tokens - 1 > self.pack_length:
            raise MisuseError(
                "a sample needs a prompt, a response, and a pack it fits in",
                expected="0 < shared_prompt < tokens - 1 <= pack_length",
                found=f"prompt {self.shared_prompt}, tokens {self.tokens}, pack {self.pack_length}",
            )
        if self.runs < 1 or any(n < unit or n % unit for n in self.samples):
            raise MisuseError(
                "each step size must deal whole GRPO groups to every DP rank, and a point "
                "needs a timed run",
                expected=f"samples: multiples of group x dp = {unit}; runs >= 1",
                found=f"samples {self.samples}, runs {self.runs}",
            )

    @property
    def spec(self) -> RouteSpec:
        """The model's routing geometry."""
        return preset(self.model)

    @property
    def rows(self) -> int:
        """Routing rows per sample."""
        return self.tokens - 1

    def groups(self, samples: int) -> int:
        """GRPO groups in a step of ``samples`` samples."""
        return samples // self.group


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlStepShape:
    """verl's R3 data path against routeplay's (``routeplay.bench.verl_step``): one
    trainer step of ``passes`` passes over ``samples`` samples, on ``dp`` x ``tp`` x
    ``pp`` Megatron rank actors (sequence parallel over TP), scaled down from verl's
    235B example (512 samples x 16k tokens, TP4 PP8 DP2).

    Example:
        >>> shape = VerlStepShape(samples=8, prompt=64, response=128, dp=2, tp=1, pp=2)
        >>> shape.ranks, shape.stage_layers(), shape.lengths(0)
        (4, (None, None), (63, 96))
    """

    model: str = "qwen3-235b-a22b"
    """Preset name (``routeplay.core.preset``): verl's example model."""
    samples: int = 24
    """Samples in the step, dealt to the DP ranks in verl's chunks (consecutive). 24 is
    the most a 24 GiB host holds at DP2 x TP2 x PP4: each of verl's sixteen ranks holds
    verl, torch and its chunk's whole tensor storage (about 1 GiB at 32 samples, where
    Ray's memory monitor kills them)."""
    prompt: int = 1024
    """verl's ``prompt_length``: prompts (random lengths, at least half of it) are
    left-padded to it."""
    response: int = 3072
    """verl's ``response_length``: responses (random lengths, at least a third of it)
    are right-padded to it."""
    dp: int = 2
    """Data-parallel ranks: each gets one chunk of the batch."""
    tp: int = 2
    """Tensor-parallel ranks per DP rank (sequence parallel: each sees 1/TP of the rows)."""
    pp: int = 4
    """Pipeline stages per DP rank (each reads its stage's MoE layers only)."""
    passes: int = 3
    """Passes over the batch per step: old log-probs, reference, update (verl's trainer)."""
    pack_tokens: int = 8192
    """Positions per micro-batch pack on routeplay's path (``pack_samples``)."""
    runs: int = 5
    """Timed steps per path (after one checked warm-up step each); medians kept."""
    store_bytes: int = 3072 * MiB
    """Object store of each node of the step's own local cluster (verl's padded int16
    batch sits on the driver's node and, per chunk, on the trainer's)."""

    def __post_init__(self) -> None:
        if self.prompt < 2 or self.response < 3 or self.prompt + self.response > self.pack_tokens:
            raise MisuseError(
                "a sample needs a prompt, a response, and a pack it fits in",
                expected="prompt >= 2, response >= 3, prompt + response <= pack_tokens",
                found=f"prompt {self.prompt}, response {self.response}, pack {self.pack_tokens}",
            )
        if min(self.dp, self.tp, self.pp, self.passes, self.runs) < 1 or self.samples % self.dp:
            raise MisuseError(
                "each DP rank needs a whole chunk, and a step a rank, a pass and a timed run",
                expected=f"samples a positive multiple of dp={self.dp}; dp, tp, pp, passes, "
                "runs >= 1",
                found=f"samples {self.samples}, dp {self.dp}, tp {self.tp}, pp {self.pp}, "
                f"passes {self.passes}, runs {self.runs}",
            )
        self.stage_layers()  # refuses a pipeline the model's layers do not split over

    @property
    def spec(self) -> RouteSpec:
        """The model's routing geometry."""
        return preset(self.model)

    @property
    def ranks(self) -> int:
        """Trainer rank actors: DP x TP x PP."""
        return self.dp * self.tp * self.pp

    def lengths(self, sample: int) -> tuple[int, int]:
        """(prompt tokens, response tokens) of a sample: random, within the padding, the
        same in every process."""
        rng = np.random.default_rng([7, sample])
        prompt = int(rng.integers(self.prompt // 2, self.prompt + 1))
        return prompt, int(rng.integers(self.response // 3, self.response + 1))

    def stage_layers(self) -> tuple[int | None, int | None]:
        """Megatron's first and last stage layers when the decoder layers do not split
        evenly over ``pp`` (the middle stages even, the first and last alike)."""
        layers = self.spec.decoder_layers
        if layers % self.pp == 0:
            return None, None
        for edge in range(layers // self.pp, 0, -1):
            if self.pp > 2 and (layers - 2 * edge) % (self.pp - 2) == 0:
                return edge, edge
        raise MisuseError(
            "the model's decoder layers do not split over the pipeline stages",
            expected=f"pp dividing {layers}, or middle stages that share the rest evenly",
            found=f"pp={self.pp}",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """One benchmark run."""

    workloads: tuple[Workload, ...]
    """The side-by-side workloads (eager, producer, adopt, limit for each)."""
    runs: int = 5
    """Timed runs per path and workload (after one warm-up); median, min and max kept."""
    pair_runs: int = 9
    """Producer runs, each paired with a bare-Ray run (at least ``runs``): the pairs'
    differences vary by tens of ms on a shared machine, so their median needs more."""
    store_bytes: int = 1536 * MiB
    """Object store of each of the four nodes."""
    scale_tokens: tuple[int, ...] = (1024, 4096, 16384, 65536)
    """Tokens per sample for the scaling table (Qwen3-235B, 2 samples, SP=1)."""
    scale_samples: tuple[int, ...] = (1, 4, 16)
    """Samples per step for the scaling table (Qwen3-30B, 8k tokens, SP=1)."""
    scale_segments: tuple[int, ...] = (1, 10, 100, 1000)
    """Segments per handle: acquire + read overhead beyond the copy."""
    small_samples: int = 512
    """Samples of 1k tokens for the small-puts measurement."""
    scale_runs: int = 3
    """Timed runs per scaling point."""
    sessions: SessionShape = field(default_factory=SessionShape)
    """The multi-turn bytes workloads (a long branching session, a resumed rollout)."""
    rl_step: RLStepShape = field(default_factory=RLStepShape)
    """The realistic RL step (``routeplay.bench.rl_step``), on a local cluster of its own."""
    verl_step: VerlStepShape = field(default_factory=VerlStepShape)
    """verl's R3 data path against routeplay's (``routeplay.bench.verl_step``), on a
    local cluster of its own."""
    mode: str = "full"
    """Which preset this is: ``full``, ``quick`` or ``smoke``."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Free-form notes copied into the results file."""

    @classmethod
    def full(cls) -> BenchConfig:
        """Every workload the issue names."""
        workloads = tuple(
            Workload(model=model, tokens=tokens, samples=8, sp=sp)
            for model in ("qwen3-30b-a3b", "qwen3-235b-a22b")
            for tokens in (8192, 32768)
            for sp in (1, 4)
        )
        grpo = tuple(
            Workload(model=m, tokens=4096 + 512, samples=8, sp=1, prompt_tokens=4096, label="grpo")
            for m in ("qwen3-30b-a3b", "qwen3-235b-a22b")
        )
        return cls(workloads=workloads + grpo)

    @classmethod
    def quick(cls) -> BenchConfig:
        """A few minutes: the headline workload, a small one, GRPO, short scaling sets."""
        return cls(
            workloads=(
                Workload(model="qwen3-235b-a22b", tokens=32768, samples=4, sp=4),
                Workload(model="qwen3-30b-a3b", tokens=8192, samples=4, sp=1),
                Workload(
                    model="qwen3-30b-a3b",
                    tokens=4096 + 512,
                    samples=8,
                    sp=1,
                    prompt_tokens=4096,
                    label="grpo",
                ),
            ),
            runs=5,
            store_bytes=1024 * MiB,
            scale_tokens=(1024, 8192, 32768),
            scale_samples=(1, 8),
            scale_segments=(1, 100, 1000),
            small_samples=256,
            scale_runs=3,
            rl_step=RLStepShape(samples=(64, 256), runs=2, store_bytes=512 * MiB),
            verl_step=VerlStepShape(
                samples=8,
                prompt=512,
                response=1536,
                dp=2,
                tp=2,
                pp=2,
                runs=2,
                store_bytes=512 * MiB,
            ),
            mode="quick",
        )

    @classmethod
    def smoke(cls) -> BenchConfig:
        """Seconds, for the test suite: tiny payloads, every code path once."""
        return cls(
            workloads=(
                Workload(model="qwen3-30b-a3b", tokens=2048, samples=2, sp=2),
                Workload(
                    model="qwen3-30b-a3b",
                    tokens=1024 + 512,
                    samples=4,
                    sp=1,
                    prompt_tokens=1024,
                    label="grpo",
                ),
            ),
            runs=1,
            pair_runs=1,
            store_bytes=96 * MiB,
            scale_tokens=(),
            scale_samples=(),
            scale_segments=(1, 50),
            small_samples=16,
            scale_runs=1,
            # a turn's new rows stay over 100 KiB (Ray keeps smaller ones out of plasma)
            sessions=SessionShape(
                system_tokens=256,
                trunk_turns=4,
                branch_turns=3,
                rollout_prompt_tokens=256,
                piece_tokens=320,
                pieces=3,
            ),
            rl_step=RLStepShape(samples=(64,), runs=1, store_bytes=192 * MiB),
            # a sample's padded int16 rows stay over 100 KiB (Ray keeps smaller objects
            # out of plasma, and out of the node counters); two stages (each process that
            # loads verl costs ~3 CPU-s: TP x PP x DP splits are tested in process)
            verl_step=VerlStepShape(
                samples=4,
                prompt=64,
                response=128,
                dp=1,
                tp=1,
                pp=2,
                pack_tokens=256,
                runs=1,
                store_bytes=96 * MiB,
            ),
            mode="smoke",
        )
