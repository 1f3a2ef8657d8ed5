"""Router replay primitives in plain torch: weighting rules, per-layer widening, recording."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402

from routeplay.core.spec import RouteSpec  # noqa: E402
from routeplay.core.validate import canonicalize  # noqa: E402
from routeplay.errors import (  # noqa: E402
    DtypeError,
    DuplicateExperts,
    ExpertOutOfRange,
    MisuseError,
    RowCountMismatch,
    SpecMismatch,
)
from routeplay.train.replay_core import (  # noqa: E402
    ReplaySource,
    RouteRecorder,
    dense_sigmoid_scores,
    in_backward,
    sigmoid_topk_weights,
    softmax_topk_weights,
    topk_softmax_weights,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a busy machine spinning
    # OpenMP workers slow these tests down ~5x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CPU = torch.device("cpu")
SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=8)


def logits(tokens: int = 16, experts: int = 8, seed: int = 0) -> Any:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def distinct_ids(spec: RouteSpec, tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    keys = rng.random((tokens, spec.num_layers, spec.num_experts))
    ids = np.argsort(keys, axis=-1)[..., : spec.top_k].astype(np.int64)
    return canonicalize(ids, spec).array


# --------------------------------------------------------------------------- weighting rules
# Each reference below is the transformers router's own code path (top-k, then weights);
# replaying the ids it chose must give its weights back bit for bit.


def test_softmax_topk_matches_qwen_style_router() -> None:
    x = logits()
    probs = torch.softmax(x, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, 2, dim=-1)
    assert torch.equal(softmax_topk_weights(x, ids), top)
    top /= top.sum(dim=-1, keepdim=True)
    assert torch.equal(softmax_topk_weights(x, ids, renormalize=True), top)


def test_softmax_topk_scale_clamp_and_dtype() -> None:
    x = logits().to(torch.bfloat16)
    probs = x.softmax(-1)  # Mistral-4: softmax in the logits' dtype
    top, ids = torch.topk(probs, 2, dim=-1)
    want = top / (top.sum(dim=-1, keepdim=True) + 1e-20) * 2.0
    got = softmax_topk_weights(x, ids, renormalize=True, eps=1e-20, scale=2.0, dtype=None)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    clamped = softmax_topk_weights(logits(), ids, renormalize=True, min_sum=10.0)
    assert torch.allclose(clamped.sum(dim=-1), clamped.sum(dim=-1).clamp(max=0.1))


def test_sigmoid_weights_ignore_the_selection_bias() -> None:
    x = logits()
    bias = torch.randn(8, generator=torch.Generator().manual_seed(9))
    scores = x.sigmoid()
    ids = torch.topk(scores + bias, 2, dim=-1, sorted=False).indices  # DeepSeek-V3 selection
    picked = scores.gather(1, ids)
    want = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * 2.5
    got = sigmoid_topk_weights(x, ids, renormalize=True, eps=1e-20, scale=2.5)
    assert torch.equal(got, want)
    unbiased = torch.topk(scores, 2, dim=-1).indices
    assert not torch.equal(ids.sort(-1).values, unbiased.sort(-1).values)  # bias did select


def test_topk_softmax_matches_gpt_oss_router() -> None:
    x = logits()
    top, ids = torch.topk(x, 2, dim=-1)
    assert torch.equal(topk_softmax_weights(x, ids), torch.softmax(top, dim=1, dtype=top.dtype))


def test_dense_sigmoid_scores_match_llama4_router() -> None:
    x = logits()
    top, ids = torch.topk(x, 1, dim=1)
    want = torch.sigmoid(torch.full_like(x, float("-inf")).scatter_(1, ids, top))
    got = dense_sigmoid_scores(x, ids)
    assert torch.equal(got, want)
    assert torch.equal(torch.nonzero(got)[:, 1:], ids)


@pytest.mark.parametrize(
    "rule",
    [
        lambda x, i: softmax_topk_weights(x, i, renormalize=True),
        lambda x, i: sigmoid_topk_weights(x, i, renormalize=True, scale=2.0),
        topk_softmax_weights,
        dense_sigmoid_scores,
    ],
    ids=["softmax-topk", "sigmoid", "topk-softmax", "dense-sigmoid"],
)
def test_replayed_weights_carry_gradient_to_the_logits(rule: Any) -> None:
    x = logits().requires_grad_()
    ids = torch.tensor(distinct_ids(SPEC, 16)[:, 0, :], dtype=torch.int64)
    weights = rule(x, ids)
    # Random coefficients: renormalized weights sum to 1, so a plain sum has no gradient.
    (
        weights * torch.randn(weights.shape, generator=torch.Generator().manual_seed(3))
    ).sum().backward()
    assert x.grad is not None
    assert bool(x.grad.abs().sum() > 0)


# --------------------------------------------------------------------------- widening


def test_each_layer_is_widened_alone_to_int64() -> None:
    routes = distinct_ids(SPEC, 16)
    source = ReplaySource(routes, SPEC)
    for layer in range(SPEC.num_layers):
        ids = source.ids(layer, device=CPU, rows=16)
        assert ids.dtype == torch.int64
        assert ids.is_contiguous()
        assert np.array_equal(ids.numpy(), routes[:, layer, :])
    stats = source.stats()
    assert stats.calls == 3
    assert stats.rows == 48
    assert stats.peak_ids_bytes == 16 * 2 * 8  # one layer of int64, never the payload


def test_uint16_ids_above_int16_range_survive_widening() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=60_000)
    routes = np.array([[[59_999, 32_768], [40_000, 1]]] * 4, dtype=np.uint16)
    from_numpy = ReplaySource(routes, spec).ids(0, device=CPU, rows=4)
    assert from_numpy.tolist() == [[59_999, 32_768]] * 4
    from_torch = ReplaySource(torch.from_numpy(routes), spec).ids(1, device=CPU, rows=4)
    assert from_torch.tolist() == [[40_000, 1]] * 4


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_torch_tensors_replay_like_arrays(dtype: Any) -> None:
    routes = distinct_ids(SPEC, 5)
    source = ReplaySource(torch.from_numpy(routes.astype(np.int64)).to(dtype), SPEC)
    assert np.array_equal(source.ids(2, device=CPU, rows=5).numpy(), routes[:, 2, :])


def test_canonical_routes_are_taken_without_revalidation() -> None:
    routes = canonicalize(distinct_ids(SPEC, 4), SPEC)
    assert np.array_equal(ReplaySource(routes, SPEC).ids(1, device=CPU, rows=4), routes.array[:, 1])
    other = RouteSpec(num_layers=3, top_k=2, num_experts=16)
    with pytest.raises(SpecMismatch, match="another model spec"):
        ReplaySource(routes, other)


def test_every_decoder_layer_sent_picks_the_moe_columns() -> None:
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 3), total_layers=4)
    full = np.zeros((6, 4, 2), dtype=np.uint8)
    full[:, 1] = [3, 4]
    full[:, 3] = [5, 6]
    source = ReplaySource(full, spec)
    assert source.ids(0, device=CPU, rows=6).tolist() == [[3, 4]] * 6
    assert source.ids(1, device=CPU, rows=6).tolist() == [[5, 6]] * 6


def test_a_provider_is_asked_for_its_layer_every_time() -> None:
    asked: list[int] = []
    routes = distinct_ids(SPEC, 4)

    def provider(layer: int) -> np.ndarray:
        asked.append(layer)
        return routes[:, layer, :]

    source = ReplaySource(provider, SPEC)
    first = source.ids(1, device=CPU, rows=4)
    again = source.ids(1, device=CPU, rows=4)  # what a checkpoint recompute does
    assert torch.equal(first, again)
    assert asked == [1, 1]
    assert source.rows is None


def test_bad_routes_are_refused_with_typed_errors() -> None:
    routes = distinct_ids(SPEC, 4)
    with pytest.raises(SpecMismatch, match="routing shape"):
        ReplaySource(routes[:, :2], SPEC)
    with pytest.raises(SpecMismatch, match="routing shape"):
        ReplaySource(routes[:, :, :1], SPEC)
    with pytest.raises(DtypeError):
        ReplaySource(routes.astype(np.float32), SPEC)
    with pytest.raises(DtypeError):
        ReplaySource(torch.zeros(4, 3, 2), SPEC)
    with pytest.raises(DtypeError):
        ReplaySource("routes", SPEC)  # type: ignore[arg-type]
    bad = routes.copy()
    bad[2, 1, 0] = 8
    with pytest.raises(ExpertOutOfRange, match="row 2, layer 1"):
        ReplaySource(bad, SPEC)
    with pytest.raises(ExpertOutOfRange):
        ReplaySource(torch.from_numpy(bad), SPEC)
    assert ReplaySource(bad, SPEC, check_ids=False).rows == 4  # the caller vouches for them
    source = ReplaySource(routes, SPEC)
    with pytest.raises(RowCountMismatch, match="MoE layer 0"):
        source.ids(0, device=CPU, rows=5)
    with pytest.raises(SpecMismatch, match="out of range"):
        source.ids(3, device=CPU, rows=4)
    wrong_k = ReplaySource(lambda layer: routes[:, layer, :1], SPEC)
    with pytest.raises(SpecMismatch, match="wrong shape"):
        wrong_k.ids(0, device=CPU, rows=4)
    floats = ReplaySource(lambda layer: routes[:, layer, :].astype(np.float32), SPEC)
    with pytest.raises(DtypeError, match="non-integer"):
        floats.ids(0, device=CPU, rows=4)


# --------------------------------------------------------------------------- recording


def test_recorder_groups_layers_into_forwards() -> None:
    rec = RouteRecorder(SPEC)
    first, second = distinct_ids(SPEC, 5, seed=1), distinct_ids(SPEC, 2, seed=2)
    for routes in (first, second):
        for layer in range(SPEC.num_layers):
            rec.capture(layer, torch.from_numpy(routes[:, layer, :].astype(np.int64)))
    got = rec.forwards()
    assert [a.dtype for a in got] == [np.uint8, np.uint8]
    assert np.array_equal(got[0], first)
    assert np.array_equal(got[1], second)
    assert np.array_equal(rec.routes(), np.concatenate([first, second]))
    assert rec.tensor().dtype == torch.uint8
    stats = rec.stats()
    assert (stats.forwards, stats.rows, stats.nbytes) == (2, 7, 7 * 3 * 2)
    rec.close()
    rec.close()
    assert rec.stats().forwards == 0
    assert rec.routes().shape == (0, 3, 2)


def test_recorder_narrows_wide_ids_to_uint16() -> None:
    spec = RouteSpec(num_layers=1, top_k=2, num_experts=384)  # Kimi-K2 sized
    with RouteRecorder(spec) as rec:
        rec.capture(0, torch.tensor([[383, 300], [0, 257]]))
        routes = rec.routes()
        assert routes.dtype == np.uint16
        assert routes[:, 0].tolist() == [[383, 300], [0, 257]]
    assert rec.stats().forwards == 0  # leaving the block dropped the data


def test_recorder_refuses_incomplete_or_inconsistent_forwards() -> None:
    rec = RouteRecorder(SPEC)
    rec.capture(0, torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(MisuseError, match="incomplete forward"):
        rec.routes()
    rec.capture(1, torch.zeros(3, 2, dtype=torch.int64))
    rec.capture(2, torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(MisuseError, match="different token counts"):
        rec.forwards()
    with pytest.raises(SpecMismatch, match="number of experts"):
        rec.capture(0, torch.zeros(4, 3, dtype=torch.int64))


def test_in_backward_is_true_only_inside_autograd() -> None:
    seen: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(in_backward()))
    assert not in_backward()
    y.sum().backward()
    assert seen == [True]


def test_recorder_skips_calls_made_during_backward() -> None:
    rec = RouteRecorder(RouteSpec(num_layers=1, top_k=2, num_experts=8))
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: rec.capture(0, torch.zeros(3, 2, dtype=torch.int64)))
    y.sum().backward()
    assert rec.stats().skipped_recomputes == 1
    assert rec.stats().forwards == 0


# --------------------------------------------------------------------------- checkpointing


class ToyMoE(torch.nn.Module):
    """One MoE layer whose router replays through a ReplaySource (no transformers)."""

    def __init__(self, layer: int, hidden: int = 8, experts: int = 8) -> None:
        super().__init__()
        self.layer = layer
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)

    def forward(self, x: Any, source: ReplaySource) -> Any:
        ids = source.ids(self.layer, device=x.device, rows=x.shape[0])
        weights = softmax_topk_weights(self.gate(x), ids, renormalize=True)
        mixed = torch.einsum(
            "tkh,tkhg->tkg", x[:, None].expand(-1, ids.shape[1], -1), self.experts[ids]
        )
        return x + torch.tanh((weights[..., None] * mixed).sum(dim=1))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_reads_the_same_ids(reentrant: bool) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(ToyMoE(layer) for layer in range(SPEC.num_layers))
    x = torch.randn(16, 8)
    routes = distinct_ids(SPEC, 16, seed=4)

    def grads(checkpointed: bool) -> tuple[list[Any], Any]:
        layers.zero_grad(set_to_none=True)
        source = ReplaySource(routes, SPEC)
        h = x.clone().requires_grad_(reentrant)  # reentrant checkpoint needs a grad input
        for layer in layers:
            if checkpointed:
                h = checkpoint(layer, h, source, use_reentrant=reentrant)
            else:
                h = layer(h, source)
        h.square().mean().backward()
        return [layer.gate.weight.grad.clone() for layer in layers], source.stats()

    plain, plain_stats = grads(False)
    again, stats = grads(True)
    assert plain_stats.recomputes == 0
    assert stats.recomputes == SPEC.num_layers
    assert stats.calls == 2 * SPEC.num_layers
    for a, b in zip(plain, again, strict=True):
        assert torch.equal(a, b)
        assert bool(a.abs().sum() > 0)


# --------------------------------------------------------------------------- refusals


def _with_duplicate(routes: np.ndarray, *, zero_row: bool) -> np.ndarray:
    bad = routes.copy()
    if zero_row:
        bad[3, 1, :] = 0  # an all-zero padding row: every id is expert 0
    else:
        bad[3, 1, 1] = bad[3, 1, 0]
    return bad


def _as(kind: str, array: np.ndarray) -> Any:
    """The same ids as a numpy array, a uint8/int64 tensor, or a provider of either."""
    if kind == "numpy":
        return array
    if kind == "uint8":
        return torch.from_numpy(array.astype(np.uint8))
    if kind == "uint16":
        return torch.from_numpy(array.astype(np.uint16))
    if kind == "int64":
        return torch.from_numpy(array.astype(np.int64))
    if kind == "provider_numpy":
        return lambda layer: array[:, layer, :]
    assert kind == "provider_tensor"
    tensor = torch.from_numpy(array.astype(np.int64))
    return lambda layer: tensor[:, layer, :]


KINDS = ["numpy", "uint8", "uint16", "int64", "provider_numpy", "provider_tensor"]


def _all_layers(source: ReplaySource, rows: int) -> None:
    for layer in range(SPEC.num_layers):
        source.ids(layer, device=CPU, rows=rows)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("zero_row", [False, True], ids=["repeat", "zero_row"])
def test_a_row_naming_an_expert_twice_is_refused(kind: str, zero_row: bool) -> None:
    bad = _with_duplicate(distinct_ids(SPEC, 8), zero_row=zero_row)
    with pytest.raises(DuplicateExperts, match="twice") as info:
        _all_layers(ReplaySource(_as(kind, bad), SPEC), rows=8)
    assert "row 3" in str(info.value)
    if zero_row:
        assert "all zeros" in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad_id", [8, -1])
def test_an_id_out_of_range_is_refused(kind: str, bad_id: int) -> None:
    if bad_id < 0 and kind in ("uint8", "uint16"):
        pytest.skip("unsigned tensors cannot hold a negative id")
    bad = distinct_ids(SPEC, 8).astype(np.int64)
    bad[5, 2, 0] = bad_id
    with pytest.raises(ExpertOutOfRange):
        _all_layers(ReplaySource(_as(kind, bad), SPEC), rows=8)


@pytest.mark.parametrize("kind", ["provider_numpy", "provider_tensor"])
def test_a_provider_block_of_the_wrong_shape_is_refused(kind: str) -> None:
    routes = _as(kind, distinct_ids(SPEC, 8))
    source = ReplaySource(lambda layer: routes(layer)[:, :1], SPEC)
    with pytest.raises(SpecMismatch, match="wrong shape"):
        source.ids(0, device=CPU, rows=8)
    short = ReplaySource(lambda layer: routes(layer)[:5], SPEC)
    with pytest.raises(RowCountMismatch):
        short.ids(0, device=CPU, rows=8)


def test_valid_routes_pass_every_check_and_unchecked_routes_are_not_read() -> None:
    routes = distinct_ids(SPEC, 8)
    for kind in KINDS:
        _all_layers(ReplaySource(_as(kind, routes), SPEC), rows=8)
    # check_ids=False is the caller's promise (e.g. routes validated at ingest): no pass.
    ReplaySource(_with_duplicate(routes, zero_row=True), SPEC, check_ids=False)
