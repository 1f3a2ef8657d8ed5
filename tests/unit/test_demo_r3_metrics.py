"""The R3 recipe's pieces without Ray: the routing-sensitive init of the reference model
and the paper's metrics (k3 KL, per-step means, differing layers per token)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from routeplay.engine.model import EngineConfig, build_model  # noqa: E402
from routeplay.errors import MisuseError  # noqa: E402
from routeplay.pipeline.metrics import ReplayTally, k3  # noqa: E402

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


def test_k3_is_zero_on_agreement_and_positive_otherwise() -> None:
    engine = np.log(np.array([0.5, 0.25, 0.9]))
    assert np.all(k3(engine, engine) == 0.0)
    values = k3(engine + np.array([0.1, -0.2, 0.0]), engine)
    assert values[0] == pytest.approx(math.expm1(0.1) - 0.1)
    assert values[1] == pytest.approx(math.expm1(-0.2) + 0.2)
    assert values[2] == 0.0


def test_tally_counts_layers_per_token_and_per_step_kl() -> None:
    tally = ReplayTally()
    engine = np.tile(np.arange(2, dtype=np.uint8), (4, 3, 1))  # 4 tokens, 3 layers, top-2
    own = engine.copy()
    own[0, :2] = [2, 3]  # token 0: two layers differ
    own[1, 0] = [1, 0]  # same experts, other order: no difference
    tally.own(own, engine, np.ones(4, bool))
    summary = tally.summary()
    assert summary["route_diff_fraction_no_replay"] == pytest.approx(2 / 12)
    assert summary["token_diff_fraction_no_replay"] == pytest.approx(1 / 4)
    assert summary["layers_per_token_no_replay"] == pytest.approx(2 / 4)

    base = np.log(np.array([0.5, 0.5]))
    tally.logprobs(
        replay=base, own=base + 0.1, r2=base + 0.1, engine=base, affected=np.ones(2, bool)
    )
    first = tally.end_step()
    assert first[2] == 0.0
    assert first[0] == first[1] == pytest.approx(math.expm1(0.1) - 0.1)
    assert all(math.isnan(v) for v in tally.end_step())  # a step that compared nothing
    assert len(tally.step_kl) == 2


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
            state = dataclasses.replace(state, retries=1)
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
