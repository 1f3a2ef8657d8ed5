"""The R3 recipe's pieces without Ray: the routing-sensitive init of the reference model
and the paper's metrics as the demo reports them (the library's meters per step, merged
over the run: k3 KL, per-step means, differing layers per token, live drift)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from routeplay.core.spec import RouteSpec  # noqa: E402
from routeplay.engine.model import EngineConfig, build_model  # noqa: E402
from routeplay.errors import MisuseError  # noqa: E402
from routeplay.pipeline.metrics import ReplayTally, StepDrift  # noqa: E402
from routeplay.pipeline.report import R3Metrics  # noqa: E402
from routeplay.train import DriftMeter  # noqa: E402

TINY = EngineConfig(hidden_size=32, vocab_size=64)


def test_init_scales_multiply_the_experts_and_the_head_only() -> None:
    plain = dict(build_model(TINY, dtype="float32").named_parameters())
    scaled = build_model(
        EngineConfig(hidden_size=32, vocab_size=64, expert_init_scale=1.5, lm_head_init_scale=16),
        dtype="float32",
    )
    seen = set()
    for name, param in scaled.named_parameters():
        if ".experts." in name:
            factor, seen = 1.5, seen | {"experts"}
        elif name == "lm_head.weight":
            factor, seen = 16.0, seen | {"head"}
        else:
            factor = 1.0
        torch.testing.assert_close(param, plain[name] * factor, rtol=0, atol=0)
    assert seen == {"experts", "head"}


def test_init_scales_must_be_positive() -> None:
    with pytest.raises(MisuseError):
        EngineConfig(expert_init_scale=0.0)
    with pytest.raises(MisuseError):
        EngineConfig(lm_head_init_scale=-1.0)


def _step(own: np.ndarray, engine: np.ndarray, trainer_lp: np.ndarray) -> StepDrift:
    """A step as the demo's trainer reads it: one library meter per figure."""
    spec = RouteSpec(num_layers=engine.shape[1], top_k=engine.shape[2], num_experts=8)
    meters = {name: DriftMeter(spec) for name in ("live", "no_replay", "used")}
    meters["no_replay"].compare(own, engine)
    meters["live"].compare(engine, engine)  # stands in for the replay's live feed
    meters["used"].compare(engine, engine)
    engine_lp = np.log(np.full(trainer_lp.shape, 0.5))
    meters["no_replay"].logprobs(trainer_lp, engine_lp)
    meters["live"].logprobs(engine_lp, engine_lp)
    empty = StepDrift.empty(top_k=spec.top_k)
    return dataclasses.replace(empty, **{name: m.drift() for name, m in meters.items()})


def test_the_tally_merges_the_library_figures_per_step_and_over_the_run() -> None:
    engine = np.tile(np.arange(2, dtype=np.uint8), (4, 3, 1))  # 4 tokens, 3 layers, top-2
    own = engine.copy()
    own[0, :2] = [2, 3]  # token 0: two layers differ
    own[1, 0] = [1, 0]  # same experts, other order: no difference
    tally = ReplayTally()
    first = tally.add(_step(own, engine, np.log(np.full(2, 0.5)) + 0.1))
    tally.add(StepDrift.empty(top_k=2))  # a step that trained nothing
    tally.add(_step(engine, engine, np.log(np.full(6, 0.5))))
    assert first.kl_k3[0] == pytest.approx(math.expm1(0.1) - 0.1)
    assert first.kl_k3[2] == 0.0
    assert math.isnan(first.kl_k3[1])  # no R2 log-probs fed
    r3 = R3Metrics.from_tally(tally)
    assert r3.route_disagreement == pytest.approx(2 / 24)  # 8 tokens x 3 layers
    assert r3.tokens_any_layer == pytest.approx(1 / 8)
    assert r3.layers_per_token == pytest.approx(2 / 8)
    assert r3.live_route_disagreement == 0.0
    assert r3.kl_k3_without == pytest.approx((math.expm1(0.1) - 0.1) * 2 / 8)
    assert r3.mismatched_routes_with == 0
    assert [step[0] is None for step in r3.kl_k3_per_step] == [False, True, False]
    per_step = [d.no_replay.get("layers_per_token") for d in r3.drift_per_step]
    assert per_step == [pytest.approx(2 / 4), None, 0.0]  # a step that trained nothing: no figure
    assert r3.drift_per_step[0].no_replay["layer_1/route_diff_share"] == 0.25
    assert tally.rows_replayed == 8


def test_the_jobs_of_one_group_and_kind_run_as_one_batch() -> None:
    from routeplay.pipeline.rollout_worker import Sampling
    from routeplay.pipeline.rollouts import Job, _batches
    from routeplay.rollout import RolloutState, Status

    def job(sample: str, group: str, session: str | None = None, *, kind: str = "") -> Job:
        state = RolloutState(
            sample_id=sample, group_id=group, prompt_ids=(1, 2), session_id=session
        )
        if kind == "resume":
            state = state.with_status(Status.ABORTED, "abort")
        if kind == "retry":
            state = state.with_sample_routing(dataclasses.replace(state.routing, retries=1))
        turn = (3,) if session and not kind else None
        return Job(state=state, sampling=Sampling(max_new_tokens=2), user_turn=turn)

    jobs = [
        job("a0", "a"),
        job("b0", "b", "b0"),
        job("a1", "a"),
        job("c0", "c"),
        job("b1", "b", "b1"),
        job("a2", "a", kind="resume"),
        job("b2", "b", "b2", kind="retry"),
        job("a3", "a", kind="resume"),
    ]
    batches = [[j.state.sample_id for j in batch] for batch in _batches(jobs)]
    assert batches == [["a0", "a1"], ["b0", "b1"], ["c0"], ["a2", "a3"], ["b2"]]
