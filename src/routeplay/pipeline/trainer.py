"""The demo's learner: one trainer rank (SP = CP = 1) on the engine's model (float32 by
default, ``TrainerConfig.dtype``).

Per step: the batch's samples are packed (``pack_samples``), the rank's routing comes one
micro-batch at a time from the ``Materializer`` (``Materializer.leasing``: one lease over
the payloads of the rank's samples, ended after its last micro-batch), and each
micro-batch runs

1. a no-grad forward *without* replay, recording the trainer's own experts: the R3
   effect (how often float32 training would route otherwise than the bf16 engine). It
   is also R2's old-logprob pass: R2 records these experts and replays them;
2. a no-grad forward replaying those recorded experts: R2's log-probs (with one
   optimizer step per RL step R2's update runs at the weights it recorded with, so it
   can only match the no-replay mismatch: it never sees the engine's routing);
3. the training forward and backward *inside* ``replay(model, routes, drift=meter)``:
   the library measures the live routing drift of R3 there (each router's own top-k
   against the engine's ids), and a ``record`` nested in it captures the experts the MoE
   blocks really received: compared with the engine's routing on every real row (must
   never differ);
4. a PPO-clip policy-gradient loss against the engine's log-probs (the ratio R3 keeps
   honest), advantages from the toy reward.

Every comparison goes through the library's ``DriftMeter`` (one per figure and step,
``_StepMeters``): routes with ``compare`` or live in ``replay``, log-probs with
``logprobs`` (k3 KL, mean |gap|); each is read once at the end of the step into a
``StepDrift`` of plain figures.

Packed samples are separated by their position ids (each restarts at 0), which
transformers turns into a block-diagonal causal mask, so a packed forward computes what
the engine computed for each sample alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from routeplay.core.spec import RouteSpec
from routeplay.engine.model import EngineConfig, build_model, torch_dtype
from routeplay.errors import MisuseError
from routeplay.pipeline.metrics import ReplayTally, StepDrift, affected_positions
from routeplay.pipeline.task import advantages, reward
from routeplay.rollout import RolloutState, TrainingBatch
from routeplay.store import RouteStore
from routeplay.train import (
    DriftMeter,
    Materializer,
    MicroBatchRoutes,
    PackingPlan,
    RankCoords,
    model_spec,
    pack_samples,
    record,
    replay,
)
from routeplay.train.drift import differing_routes

__all__ = ["PackedInputs", "StepStats", "Trainer", "TrainerConfig", "pack_inputs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    """The learner: packing, replay, loss and optimizer."""

    groups_per_step: int = 3
    """Groups sampled from the replay buffer per step: fewer than a step makes (over-
    sampling), so a backlog builds up, ages, and its stale groups are retried (once)
    or discarded."""
    pack_max_length: int = 128
    """Positions per packed sequence (one micro-batch holds ``packs_per_micro_batch``)."""
    packs_per_micro_batch: int = 1
    """Packs per forward."""
    pack_multiple: int | None = None
    """None: every pack is ``pack_max_length`` long, its tail padding (XTuner's fixed-size
    packs). Else a pack ends at its last sample rounded up to this multiple (verl's packs
    sized to fit): no padding is computed, and a pack holding one sample gets the plain
    causal attention kernel instead of a block-diagonal mask."""
    lr: float = 1e-2
    """Adam learning rate."""
    clip: float = 0.2
    """PPO ratio clip."""
    prefetch: int = 1
    """Micro-batches the materializer reads ahead."""
    threads: int = 1
    """torch intra-op threads (tiny models gain nothing from more)."""
    dtype: str = "float32"
    """Precision of the trainer's model (a key of ``routeplay.engine.model.DTYPES``); the
    engine runs in ``EngineConfig.dtype``. ``bfloat16`` leaves only the kernel-shape gap
    (KV-cache decode vs full forward) between the two."""

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # refuses an unknown name

    def build(self, engine: EngineConfig, store: RouteStore) -> Trainer:
        """A copy of the engine's initial model in ``dtype``, and its optimizer."""
        return Trainer(self, engine, store)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """One training step."""

    samples: int
    """Samples trained."""
    tokens: int
    """Generated tokens in the loss."""
    micro_batches: int
    """Forwards (with replay) run."""
    loss: float
    """Policy-gradient loss of the step."""
    reward: float
    """Mean toy reward of the batch."""
    peak_routing_bytes: int
    """Most routing bytes the materializer held at once."""
    routing_bytes: int = 0
    """Routing bytes of the batch's samples, ``[T, L, K]`` each in the spec's dtype."""
    drift: StepDrift | None = None
    """The step's routing and log-prob figures (from the library's drift meters)."""

    @property
    def kl_k3(self) -> tuple[float, float, float]:
        """Mean k3 KL(engine || trainer) of the step's compared tokens: no replay, R2, R3."""
        return (float("nan"),) * 3 if self.drift is None else self.drift.kl_k3


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedInputs:
    """Token-level tensors of one micro-batch, ``[packs, pack_length]`` each."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    """Next token at each position where a generated token is predicted, else 0."""
    scored: torch.Tensor
    """True where ``targets`` is a generated token (the loss positions)."""
    old_logprobs: torch.Tensor
    """Engine log-prob of the target token (where ``scored``)."""
    advantages: torch.Tensor
    """The sample's advantage at its loss positions."""
    current: torch.Tensor
    """True at loss positions of samples produced entirely by the weights the trainer
    holds now (a resumed sample's history rows come from older weights)."""
    current_rows: npt.NDArray[np.bool_]
    """Flattened ``[tokens]``: routing rows produced by the weights the trainer holds now."""
    sample_of: npt.NDArray[np.int64]
    """Flattened ``[tokens]``: index of the sample at each position, -1 on padding."""


class Trainer:
    """A copy of the engine's initial model (in ``config.dtype``), its optimizer, the step."""

    def __init__(self, config: TrainerConfig, engine: EngineConfig, store: RouteStore) -> None:
        torch.set_num_threads(config.threads)  # process-wide: the engine runs in it too
        self.config = config
        self.store = store
        self.model = build_model(engine, dtype=config.dtype)
        self.model.train()
        self.spec = model_spec(self.model)
        self.coords = RankCoords()
        self._optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr)

    def step(
        self, batch: TrainingBatch[RolloutState], version: int, tally: ReplayTally
    ) -> StepStats:
        """Train once on ``batch`` (holding weights ``version``); adds to ``tally``."""
        states = {s.sample_id: s for s in batch.states}
        meters = _StepMeters(self.spec)
        if not states:  # every group went stale: nothing to train this step
            return StepStats(
                drift=tally.add(meters.read()),
                samples=0,
                tokens=0,
                micro_batches=0,
                loss=0.0,
                reward=0.0,
                peak_routing_bytes=0,
            )
        plan = pack_samples(
            ((s.sample_id, _routing(s), s.tokens) for s in batch.states),
            self.config.pack_max_length,
            self.config.packs_per_micro_batch,
            spec=self.spec,
            pack_multiple=self.config.pack_multiple,
        )
        holder = f"{batch.holder}/{self.coords.describe()}"
        scale = 1.0 / max(1, sum(len(s.response_ids) for s in batch.states))
        gains = advantages(batch.states)
        self._optimizer.zero_grad(set_to_none=True)
        loss_sum, micro_batches = 0.0, 0
        # One lease over the rank's share, ended by the materializer after its last read.
        materializer = Materializer.leasing(
            self.store, plan, self.coords, holder=holder, prefetch=self.config.prefetch
        )
        with materializer:
            for routes in materializer:
                inputs = pack_inputs(plan, routes, states, gains, version)
                loss_sum += self._micro_batch(inputs, routes, meters, scale)
                micro_batches += 1
            peak = materializer.stats().peak_resident_bytes
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self._optimizer.step()
        return StepStats(
            drift=tally.add(meters.read()),
            routing_bytes=sum(self.spec.nbytes(_routing(s).rows) for s in batch.states),
            samples=len(states),
            tokens=sum(len(s.response_ids) for s in batch.states),
            micro_batches=micro_batches,
            loss=loss_sum,
            reward=float(np.mean([reward(s.response_ids) for s in batch.states])),
            peak_routing_bytes=peak,
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the weights (trainer precision), for the engine's ``load_weights``."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _micro_batch(
        self, inputs: PackedInputs, routes: MicroBatchRoutes, meters: _StepMeters, scale: float
    ) -> float:
        engine, real = routes.routes, routes.mask
        rows = real & inputs.current_rows  # routed by the weights the trainer holds now
        with torch.no_grad(), record(self.model) as own:
            own_logprobs = self._logprobs(inputs)
        own_routes = own.routes()
        meters.no_replay.compare(own_routes, engine, mask=rows)
        r2 = replay(self.model, own_routes, spec=self.spec, drift=meters.r2, mask=rows)
        with torch.no_grad(), r2:
            r2_logprobs = self._logprobs(inputs)  # R2: the update replays the trainer's own
        with (
            replay(self.model, engine, spec=self.spec, drift=meters.live, mask=rows),
            record(self.model) as used,
        ):
            logprobs = self._logprobs(inputs)
            loss = _ppo_loss(logprobs, inputs, self.config.clip) * scale
            loss.backward()  # type: ignore[no-untyped-call]  # inside replay: recomputes replay too
        meters.used.compare(used.routes(), engine, mask=real)
        at = inputs.scored & inputs.current
        differs = differing_routes(own_routes, engine).any(dim=-1).numpy() & real
        affected = torch.from_numpy(affected_positions(differs, inputs.sample_of))
        affected = affected.reshape(at.shape)[at]
        engine_lp = inputs.old_logprobs[at]
        for meter, trainer_lp in (
            (meters.live, logprobs.detach()[at]),
            (meters.no_replay, own_logprobs[at]),
            (meters.r2, r2_logprobs[at]),
        ):
            meter.logprobs(trainer_lp, engine_lp)
        meters.live_affected.logprobs(logprobs.detach()[at], engine_lp, mask=affected)
        meters.no_replay_affected.logprobs(own_logprobs[at], engine_lp, mask=affected)
        return float(loss.detach())

    def _logprobs(self, inputs: PackedInputs) -> torch.Tensor:
        out = self.model(
            input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False
        )
        logits = out.logits.float()
        return torch.log_softmax(logits, dim=-1).gather(-1, inputs.targets[..., None])[..., 0]


def pack_inputs(
    plan: PackingPlan,
    routes: MicroBatchRoutes,
    states: Mapping[str, RolloutState],
    gains: Mapping[str, float],
    version: int,
) -> PackedInputs:
    """The tensors of one micro-batch, aligned with its routing rows (SP = CP = 1)."""
    packs = [plan.packs[i] for i in routes.packs]
    shape = (len(packs), max(p.length for p in packs))
    ids, positions, targets = (np.zeros(shape, np.int64) for _ in range(3))
    old, gain = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    scored, current = np.zeros(shape, np.bool_), np.zeros(shape, np.bool_)
    rows = np.zeros(shape, np.bool_)
    sample_of = np.full(shape, -1, np.int64)
    index = 0
    for b, pack in enumerate(packs):
        positions[b] = np.arange(shape[1])
        for sample in pack.samples:
            state = states[sample.sample_id]
            tokens = np.asarray(state.prompt_ids + state.response_ids, np.int64)
            lo, hi, first = sample.offset, sample.stop, sample.offset + len(state.prompt_ids) - 1
            ids[b, lo:hi] = tokens[:-1]
            positions[b, lo:hi] = np.arange(hi - lo)
            positions[b, hi:] = np.arange(shape[1] - hi)  # padding restarts: its own sequence
            targets[b, first:hi] = tokens[len(state.prompt_ids) :]
            scored[b, first:hi] = True
            old[b, first:hi] = state.logprobs
            gain[b, first:hi] = gains[sample.sample_id]
            rows[b, lo:hi] = sample.handle.weight_versions() == version
            current[b, first:hi] = bool(rows[b, lo:hi].all()) and set(state.weight_versions) == {
                version
            }
            sample_of[b, lo:hi] = index
            index += 1
    return PackedInputs(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(positions),
        targets=torch.from_numpy(targets),
        scored=torch.from_numpy(scored),
        old_logprobs=torch.from_numpy(old),
        advantages=torch.from_numpy(gain),
        current=torch.from_numpy(current),
        current_rows=rows.reshape(-1),
        sample_of=sample_of.reshape(-1),
    )


class _StepMeters:
    """One library ``DriftMeter`` per figure of ``StepDrift``, for one step."""

    def __init__(self, spec: RouteSpec) -> None:
        self.live = DriftMeter(spec)
        self.no_replay = DriftMeter(spec)
        self.r2 = DriftMeter(spec)
        self.used = DriftMeter(spec)
        self.live_affected = DriftMeter(spec)
        self.no_replay_affected = DriftMeter(spec)

    def read(self) -> StepDrift:
        """Every meter's figures (one sync each)."""
        return StepDrift(
            live=self.live.drift(),
            no_replay=self.no_replay.drift(),
            r2=self.r2.drift(),
            used=self.used.drift(),
            live_affected=self.live_affected.drift(),
            no_replay_affected=self.no_replay_affected.drift(),
        )


def _ppo_loss(logprobs: torch.Tensor, inputs: PackedInputs, clip: float) -> torch.Tensor:
    """Sum over loss positions of the clipped surrogate (the caller scales it)."""
    ratio = torch.exp(logprobs - inputs.old_logprobs)
    gain = inputs.advantages
    surrogate = torch.minimum(ratio * gain, ratio.clamp(1 - clip, 1 + clip) * gain)
    return -(surrogate * inputs.scored).sum()


def _routing(state: RolloutState) -> Any:
    if state.routing.handle is None:
        raise MisuseError("a sample reached training without routing", where=state.sample_id)
    return state.routing.handle
