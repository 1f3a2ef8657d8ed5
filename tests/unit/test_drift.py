"""Live routing drift under HF replay, and the meter's arithmetic.

The routes replayed here are built from each router's own choice *in the very forward
that replays them*: a ``record`` block opened outside the ``replay`` block sees the
router's native output (blocks run newest outermost), and a provider hands each layer
its native ids with exactly the chosen rows changed. So the drift of layer ``l`` must be
exactly ``n_l / N``, whatever the replay did to the hidden states of earlier layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_hf_replay import TOKENS, checkpointing_disable, checkpointing_enable, inputs, tiny_model  # noqa: E402

from routeplay.core.spec import RouteSpec  # noqa: E402
from routeplay.errors import MisuseError, RowCountMismatch, SpecMismatch  # noqa: E402
from routeplay.train import (  # noqa: E402
    DriftMeter,
    RoutingDrift,
    logprob_gaps,
    model_spec,
    record,
    replay,
)
from routeplay.train.drift import differing_routes, route_overlap  # noqa: E402
from routeplay.train.replay_core import RouteRecorder  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()  # tiny models: threads only spin (see test_hf_replay)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Families with plain softmax top-k, selection bias + group-limited top-k (DeepSeek-V3,
# GLM-4.5), a bias-only selection (ERNIE), a block-level hook (DBRX), dense scores
# (Llama-4) and a top-k-then-softmax router with a bias in its logits (gpt-oss).
FAMILIES = [
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "ernie4_5_moe",
    "dbrx",
    "llama4_text",
    "gpt_oss",
]


class _Native(RouteRecorder):
    """Keeps each layer's latest native ids (the forward running now)."""

    def __init__(self, spec: RouteSpec) -> None:
        super().__init__(spec)
        self.last: dict[int, Any] = {}

    def capture(self, layer: int, ids: Any) -> None:
        self.last[layer] = ids.detach().to(torch.int64)


def _altered(native: Any, rows: dict[int, int], experts: int) -> Any:
    """``native`` with ``rows[r]`` ids of row ``r`` swapped for experts it does not use."""
    out = native.clone()
    for row, count in rows.items():
        unused = [e for e in range(experts) if e not in set(native[row].tolist())]
        out[row, :count] = torch.tensor(unused[:count])
    return out


def _plan(spec: RouteSpec) -> list[dict[int, int]]:
    """Per MoE layer: which rows change, and how many of their K ids."""
    plan = []
    for layer in range(spec.num_layers):
        rows = range(layer, TOKENS, 3 + layer)  # a different set per layer
        plan.append({row: 1 + (row + layer) % spec.top_k for row in rows})
    return plan


def _replay_drift(model: Any, mask: Any, *, backward: bool = False) -> tuple[Any, list[Any]]:
    spec = model_spec(model)
    plan = _plan(spec)
    native = _Native(spec)
    meter = DriftMeter(spec)
    replayed: list[Any] = []

    def provider(layer: int) -> Any:
        ids = _altered(native.last[layer], plan[layer], spec.num_experts)
        replayed.append(ids)
        return ids

    with record(model, recorder=native), replay(model, provider, drift=meter, mask=mask):
        out = model(input_ids=inputs())
        if backward:
            out.logits.float().pow(2).mean().backward()
    return meter.drift(), plan


@pytest.mark.parametrize("model_type", FAMILIES)
def test_drift_equals_the_share_of_routes_changed_per_layer(model_type: str) -> None:
    model = tiny_model(model_type)
    spec = model_spec(model)
    drift, plan = _replay_drift(model, None)
    assert [layer.layer for layer in drift.layers] == list(range(spec.num_layers))
    for layer, rows in zip(drift.layers, plan, strict=True):
        assert layer.routes == TOKENS
        assert layer.differing == len(rows)
        assert layer.share == len(rows) / TOKENS
        changed_ids = sum(rows.values())
        assert layer.overlap == pytest.approx(1 - changed_ids / (TOKENS * spec.top_k))
    touched = set().union(*plan)
    assert drift.tokens == TOKENS
    assert drift.tokens_differing == len(touched)
    assert drift.layers_per_token == pytest.approx(sum(map(len, plan)) / TOKENS)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_only_real_tokens_count(model_type: str) -> None:
    model = tiny_model(model_type)
    mask = np.zeros(TOKENS, bool)
    mask[: TOKENS // 2 + 1] = True
    drift, plan = _replay_drift(model, mask)
    real = set(np.flatnonzero(mask).tolist())
    for layer, rows in zip(drift.layers, plan, strict=True):
        assert layer.routes == len(real)
        assert layer.differing == len(real & set(rows))
        changed = sum(count for row, count in rows.items() if row in real)
        spec = model_spec(model)
        assert layer.overlap == pytest.approx(1 - changed / (len(real) * spec.top_k))
    assert drift.tokens == len(real)
    assert drift.tokens_differing == len(real & set().union(*plan))


def test_checkpoint_recompute_is_not_counted_twice() -> None:
    model = tiny_model("qwen3_moe")
    model.train()
    checkpointing_enable(model)
    try:
        drift, plan = _replay_drift(model, None, backward=True)
    finally:
        checkpointing_disable(model)
        model.eval()
    assert [layer.routes for layer in drift.layers] == [TOKENS] * len(plan)
    assert [layer.differing for layer in drift.layers] == [len(rows) for rows in plan]


def test_replaying_the_own_choice_measures_no_drift_and_the_default_meter_is_on() -> None:
    model = tiny_model("deepseek_v3")
    with torch.no_grad(), record(model) as own:
        model(input_ids=inputs())
    with torch.no_grad(), replay(model, own.tensor()) as source:
        model(input_ids=inputs())
    assert source.drift is not None
    drift = source.drift.drift()
    assert drift.tokens == TOKENS
    assert drift.differing == 0
    assert drift.overlap == 1.0
    with torch.no_grad(), replay(model, own.tensor(), drift=False) as source:
        model(input_ids=inputs())
    assert source.drift is None


def test_one_meter_sums_the_blocks_of_a_step() -> None:
    model = tiny_model("qwen3_moe")
    spec = model_spec(model)
    meter = DriftMeter(spec)
    with torch.no_grad(), record(model) as own:
        model(input_ids=inputs())
    for _ in range(3):
        with torch.no_grad(), replay(model, own.tensor(), drift=meter):
            model(input_ids=inputs())
    drift = meter.drift()
    assert drift.tokens == 3 * TOKENS
    assert [layer.routes for layer in drift.layers] == [3 * TOKENS] * spec.num_layers
    meter.reset()
    assert meter.drift().tokens == 0
    assert meter.drift().layers == ()


def test_bad_masks_and_meters_are_refused() -> None:
    model = tiny_model("qwen3_moe")
    spec = model_spec(model)
    with torch.no_grad(), record(model) as own:
        model(input_ids=inputs())
    with pytest.raises(RowCountMismatch), replay(model, own.tensor(), mask=np.ones(3, bool)):
        model(input_ids=inputs())
    with pytest.raises(MisuseError), replay(model, own.tensor(), mask=np.ones(TOKENS, int)):
        pass
    with pytest.raises(MisuseError), replay(model, own.tensor(), drift=False, mask=np.ones(3)):
        pass
    other = RouteSpec(num_layers=spec.num_layers, top_k=1, num_experts=spec.num_experts)
    with pytest.raises(SpecMismatch), replay(model, own.tensor(), drift=DriftMeter(other)):
        pass


# --------------------------------------------------------------------------- arithmetic


def test_compare_counts_sets_not_orders() -> None:
    spec = RouteSpec(num_layers=3, top_k=2, num_experts=8)
    engine = np.tile(np.arange(2, dtype=np.uint8), (4, 3, 1))  # 4 tokens, 3 layers, top-2
    own = engine.copy()
    own[0, :2] = [2, 3]  # token 0: two layers differ, no expert shared
    own[1, 0] = [1, 0]  # same experts, other order: no difference
    own[2, 2] = [0, 5]  # token 2: one layer, one expert shared
    meter = DriftMeter(spec)
    meter.compare(own, engine, mask=np.array([True, True, True, False]))
    drift = meter.drift()
    assert drift.tokens == 3
    assert drift.tokens_differing == 2
    assert [layer.differing for layer in drift.layers] == [1, 1, 1]
    assert drift.layers[2].overlap == pytest.approx(1 - 1 / 6)
    assert drift.route_share == pytest.approx(3 / 9)
    assert drift.layers_per_token == pytest.approx(3 / 3)
    assert differing_routes(own, engine).tolist() == [
        [True, True, False],
        [False, False, False],
        [False, False, True],
        [False, False, False],
    ]
    assert route_overlap(own[0], engine[0]).tolist() == [0, 0, 2]


def test_logprob_gaps_match_the_direct_formula() -> None:
    engine = np.log(np.array([0.5, 0.25, 0.9, 0.1]))
    trainer = engine + np.array([0.1, -0.2, 0.0, 0.7])
    kl, gap = logprob_gaps(trainer, engine)
    p_t, p_e = np.exp(trainer), np.exp(engine)
    direct = p_t / p_e - 1 - np.log(p_t / p_e)
    np.testing.assert_allclose(kl.numpy(), direct, rtol=1e-12)
    np.testing.assert_allclose(gap.numpy(), np.abs(trainer - engine), rtol=1e-12)
    assert kl[2] == 0.0
    assert bool((kl >= 0).all())

    meter = DriftMeter(RouteSpec(num_layers=1, top_k=1, num_experts=2))
    mask = np.array([True, False, True, True])
    meter.logprobs(torch.from_numpy(trainer).float(), torch.from_numpy(engine).float(), mask=mask)
    drift = meter.drift()
    assert drift.logprob_tokens == 3
    assert drift.kl_k3 == pytest.approx(direct[mask].mean(), rel=1e-6)
    assert drift.logprob_gap == pytest.approx(np.abs(trainer - engine)[mask].mean(), rel=1e-6)


def test_as_metrics_keys_are_stable() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=4)
    meter = DriftMeter(spec)
    # Nothing measured: counts only, no share that would read as perfect agreement.
    assert meter.drift().as_metrics() == {"routing_drift/tokens": 0.0, "routing_drift/routes": 0.0}
    routes = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]]])
    native = routes.copy()
    native[0, 1] = [2, 0]
    meter.compare(native, routes)
    meter.logprobs(np.zeros(2), np.log(np.array([0.5, 1.0])))
    metrics = meter.drift().as_metrics(prefix="train/")
    assert list(metrics) == [
        "train/route_diff_share",
        "train/overlap",
        "train/token_diff_share",
        "train/layers_per_token",
        "train/tokens",
        "train/routes",
        "train/layer_0/route_diff_share",
        "train/layer_0/overlap",
        "train/layer_1/route_diff_share",
        "train/layer_1/overlap",
        "train/kl_k3",
        "train/logprob_abs_gap",
        "train/logprob_tokens",
    ]
    assert all(isinstance(value, float) for value in metrics.values())
    assert metrics["train/layer_1/route_diff_share"] == 0.5
    assert metrics["train/layer_1/overlap"] == 0.75
    assert metrics["train/token_diff_share"] == 0.5
    assert metrics["train/kl_k3"] == pytest.approx(
        (1 - 1 - math.log(1)) / 2 + (2 - 1 - math.log(2)) / 2
    )


def test_figures_merge_as_their_sums_would() -> None:
    # Two meters fed apart, merged on the host, equal one meter fed both.
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=4)
    rng = np.random.default_rng(4)
    parts = []
    for part in range(2):
        engine = np.stack([rng.permutation(4)[:2] for _ in range(10)]).reshape(5, 2, 2)
        own = engine.copy()
        for row in range(part + 1):  # a shifted pair of Z/4 is always another set
            own[row, row % 2] = (engine[row, row % 2] + 1) % 4
        lp = (rng.normal(size=4), np.log(rng.uniform(0.2, 1.0, size=4)))
        parts.append((own, engine, lp))
    both, merged = DriftMeter(spec), []
    for own, engine, lp in parts:
        alone = DriftMeter(spec)
        for meter in (both, alone):
            meter.compare(own, engine)
            meter.logprobs(*lp)
        merged.append(alone.drift())
    whole, summed = both.drift(), merged[0] + merged[1]
    assert (whole.differing, whole.tokens_differing) == (3, 3)
    assert summed.layers == tuple(
        dataclasses.replace(a, overlap=pytest.approx(a.overlap)) for a in whole.layers
    )
    assert (summed.tokens, summed.tokens_differing) == (whole.tokens, whole.tokens_differing)
    assert summed.kl_k3 == pytest.approx(whole.kl_k3)
    assert summed.logprob_gap == pytest.approx(whole.logprob_gap)
    empty = RoutingDrift.empty(top_k=2)
    assert empty + whole == whole + empty == whole
    with pytest.raises(SpecMismatch):
        whole + RoutingDrift.empty(top_k=3)


def test_a_meter_that_saw_nothing_real_reports_no_figure() -> None:
    """No forward, or a forward of padding only: no share and no overlap (None), never a
    0.0 / 1.0 that reads as perfect agreement; counts stay honest zeros."""
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=4)
    routes = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]]])
    native = np.array([[[2, 3], [0, 1]], [[3, 0], [1, 2]]])  # every route differs
    for mask in (None, np.zeros(2, dtype=bool)):
        meter = DriftMeter(spec)
        if mask is not None:
            meter.compare(native, routes, mask=mask)  # padding rows only
        drift = meter.drift()
        assert (drift.routes, drift.tokens) == (0, 0)
        assert not drift.measured
        assert drift.route_share is None
        assert drift.overlap is None
        assert drift.token_share is None
        assert drift.layers_per_token is None
    meter.compare(native, routes, mask=np.array([True, False]))
    drift = meter.drift()
    assert (drift.route_share, drift.overlap, drift.token_share) == (1.0, 0.0, 1.0)
    assert drift.layers_per_token == 2.0
