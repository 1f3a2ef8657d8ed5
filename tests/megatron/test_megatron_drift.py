"""Live routing drift through real Megatron-Core ``TopKRouter``s.

The native choice of each router is taken from the router itself, run with no session at
all (Megatron's own ``topk_routing_with_score_function``: score function, expert bias and
group-limited top-k as configured); the replayed routes change exactly chosen rows of it,
so the session's drift of layer ``l`` must be exactly ``n_l / N``. The routers see the same
input whatever the replay, so the native choice under replay is the free-running one.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'routeplay[megatron]')"
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from helpers import HIDDEN, Chunk, routing_ids, transformer_config
    from megatron.core.transformer.moe.router_replay import RouterReplay

from routeplay.core import RouteSpec  # noqa: E402
from routeplay.errors import MisuseError, RowCountMismatch  # noqa: E402
from routeplay.integrations.megatron import MegatronReplay  # noqa: E402
from routeplay.integrations.megatron.drift import router_order  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron_cpu"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=8)
SEQ, BATCH = 16, 3
TOKENS = SEQ * BATCH

CONFIGS: dict[str, dict[str, Any]] = {
    "softmax": {},
    "pre_softmax": {"moe_router_pre_softmax": True},
    "sigmoid_expert_bias": {
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
    },
    "group_limited_bias": {  # DeepSeek-V3 style
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": 2,
        "moe_router_group_topk": 1,
        "moe_router_topk_scaling_factor": 2.5,
    },
}


def _chunk(name: str) -> Chunk:
    chunk = Chunk(transformer_config(SPEC, **CONFIGS[name]), range(SPEC.num_layers), SPEC)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for router in chunk.routers():
            if router.expert_bias is not None:  # large enough to change the choice
                router.expert_bias.copy_(torch.randn(SPEC.num_experts, generator=generator))
    return chunk


def _inputs() -> Any:
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))


def _native(chunk: Chunk, x: Any) -> list[Any]:
    """Each router's own choice, ``[seq * batch, K]`` in Megatron's token order."""
    with torch.no_grad():
        return [torch.from_numpy(routing_ids(router(x)[1])) for router in chunk.routers()]


def _changed_rows(layer: int) -> dict[int, int]:
    """Router-order row -> how many of its K ids change, per layer (a different set each)."""
    return {row: 1 + (row + layer) % SPEC.top_k for row in range(layer, TOKENS, 4 + layer)}


def _replayed(native: list[Any]) -> Any:
    """``[tokens, L, K]`` routes in the materializer's (batch-major) row order."""
    layers = []
    for layer, ids in enumerate(native):
        ids = ids.clone()
        for row, count in _changed_rows(layer).items():
            unused = [e for e in range(SPEC.num_experts) if e not in set(ids[row].tolist())]
            ids[row, :count] = torch.tensor(unused[:count])
        # router order [seq, batch] -> rows [batch, seq]
        layers.append(ids.view(SEQ, BATCH, -1).transpose(0, 1).reshape(TOKENS, -1))
    return torch.stack(layers, dim=1).to(torch.uint8)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_drift_equals_the_share_of_routes_changed_per_layer(name: str) -> None:
    chunk, x = _chunk(name), _inputs()
    native = _native(chunk, x)
    routes = _replayed(native)
    with MegatronReplay(chunk, SPEC) as session:
        with session.replay(routes):
            used = [routing_ids(router(x)[1]) for router in chunk.routers()]
        drift = session.drift()
    for layer, figures in enumerate(drift.layers):
        rows = _changed_rows(layer)
        assert figures.layer == layer
        assert figures.routes == TOKENS
        assert figures.share == len(rows) / TOKENS
        assert figures.overlap == pytest.approx(1 - sum(rows.values()) / (TOKENS * SPEC.top_k))
        # and Megatron really routed the replayed experts
        expected = routes[:, layer].view(BATCH, SEQ, -1).transpose(0, 1).reshape(TOKENS, -1)
        np.testing.assert_array_equal(used[layer], np.sort(expected.numpy(), axis=-1))
    touched = set().union(*(_changed_rows(layer) for layer in range(SPEC.num_layers)))
    assert drift.tokens == TOKENS
    assert drift.tokens_differing == len(touched)
    metrics = drift.as_metrics(prefix="megatron/")
    assert metrics["megatron/layer_2/route_diff_share"] == len(_changed_rows(2)) / TOKENS
    assert set(metrics) >= {"megatron/layers_per_token", "megatron/token_diff_share"}
    for instance in RouterReplay.global_router_replay_instances:
        assert "get_replay_topk" not in vars(instance)  # unwrapped on close


def test_the_mask_counts_real_rows_in_the_routes_row_order() -> None:
    chunk, x = _chunk("group_limited_bias"), _inputs()
    routes = _replayed(_native(chunk, x))
    mask = np.zeros(TOKENS, bool)
    mask[:SEQ] = True  # the first sequence of the batch (rows are batch-major)
    with MegatronReplay(chunk, SPEC) as session:
        with session.replay(routes, mask=mask):
            for router in chunk.routers():
                router(x)
        drift = session.drift()
    real = set(range(0, TOKENS, BATCH))  # batch 0 in Megatron's [seq, batch] order
    for layer, figures in enumerate(drift.layers):
        assert figures.routes == SEQ
        assert figures.differing == len(real & set(_changed_rows(layer)))
    assert drift.tokens == SEQ


def test_router_order_is_the_order_the_session_puts_ids_in() -> None:
    # Batch 2, CP-local rows of 12 per sequence scattered over 4 TP ranks (3 each): rank 1
    # keeps positions 3..5 of each sequence, sequence-major as Megatron flattens [s, b].
    rows = torch.arange(2 * 12)
    ordered = router_order(rows, seq=3, batch=2, parts=4, rank=1)
    assert ordered.tolist() == [3, 15, 4, 16, 5, 17]


def test_recompute_and_recording_are_not_measured_r2_is() -> None:
    from torch.utils.checkpoint import checkpoint

    chunk, x = _chunk("softmax"), _inputs()
    with MegatronReplay(chunk, SPEC, recompute=True) as session:
        with torch.no_grad(), session.record() as recording:
            old = [torch.from_numpy(routing_ids(r(x)[1])) for r in chunk.routers()]
        with torch.no_grad():  # the policy moves between the two passes
            for router in chunk.routers():
                router.weight.add_(torch.randn_like(router.weight) * 0.5)
        now = _native(chunk, x)
        with session.replay(recording):
            loss = sum(
                checkpoint(lambda r, h: r(h)[0].sum(), r, x, use_reentrant=False)
                for r in chunk.routers()
            )
        loss.backward()
        assert session.stats().recomputes == SPEC.num_layers
        drift = session.drift()
        reduced = session.drift_meter.reduce()  # world size 1: the same sums
    for layer, figures in enumerate(drift.layers):
        differs = (torch.sort(old[layer]).values != torch.sort(now[layer]).values).any(-1)
        assert figures.routes == TOKENS  # the forward only, not its recompute
        assert figures.differing == int(differs.sum())
    assert sum(f.differing for f in drift.layers) > 0
    assert reduced == drift


def test_off_means_no_wrapper_and_no_figures() -> None:
    chunk, x = _chunk("softmax"), _inputs()
    routes = _replayed(_native(chunk, x))
    with MegatronReplay(chunk, SPEC, drift=False) as session:
        assert all("get_replay_topk" not in vars(r.router_replay) for r in chunk.routers())
        with pytest.raises(MisuseError), session.replay(routes, mask=np.ones(TOKENS, bool)):
            pass
        with session.replay(routes):
            chunk.routers()[0](x)
        with pytest.raises(MisuseError):
            session.drift()
    with (
        MegatronReplay(chunk, SPEC) as session,
        pytest.raises(RowCountMismatch),
        session.replay(routes, mask=np.ones(5, bool)),
    ):
        chunk.routers()[0](x)
