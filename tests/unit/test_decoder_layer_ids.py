"""``ReplaySource.decoder_ids``: routing for routers a framework indexes by decoder layer.

XTuner's ``MoEDecoderLayer`` hands its router (``GreedyRouter`` / ``NoAuxRouter``)
``rollout_routed_experts[:, self.layer_idx, :]``, ``layer_idx`` counting every decoder
layer (the first ``first_k_dense_replace`` are dense), and the router uses those ids as a
``gather`` index (int64). The accessor maps the decoder layer through the spec's layer map,
widens on the device, and keeps replay's checks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from strategies import random_routing  # noqa: E402

from routeplay.core.spec import RouteSpec  # noqa: E402
from routeplay.errors import (  # noqa: E402
    DuplicateExperts,
    ExpertOutOfRange,
    RowCountMismatch,
    SpecMismatch,
)
from routeplay.train.replay_core import ReplaySource  # noqa: E402

# Four decoder layers, the first dense (first_k_dense_replace=1) and the third dense too.
SPEC = RouteSpec(num_layers=2, top_k=3, num_experts=8, layer_map=(1, 3), total_layers=4)
WIDE = RouteSpec(num_layers=2, top_k=2, num_experts=300, layer_map=(1, 2), total_layers=3)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_each_decoder_layer_reads_its_moe_column_as_int64() -> None:
    routes = random_routing(SPEC, 10, seed=1).astype(np.uint8)  # [T, MoE layers, K]
    source = ReplaySource(routes, SPEC)
    assert [source.moe_layer(d) for d in range(4)] == [None, 0, None, 1]
    for decoder, moe in ((1, 0), (3, 1)):
        ids = source.decoder_ids(decoder, device=CPU, rows=10)
        assert ids.dtype == torch.int64
        assert ids.device == CPU
        np.testing.assert_array_equal(ids.numpy(), routes[:, moe, :])
    assert source.stats().calls == 2
    assert source.stats().peak_ids_bytes == 10 * 3 * 8  # one layer widened, never the payload


def test_a_tensor_over_every_decoder_layer_picks_the_moe_columns() -> None:
    # XTuner's own layout: [T, num_hidden_layers, K], dense layers' columns included.
    full = torch.from_numpy(random_routing(RouteSpec(num_layers=4, top_k=3, num_experts=8), 6, 2))
    source = ReplaySource(full.to(torch.uint8), SPEC)
    for decoder in (1, 3):
        ids = source.decoder_ids(decoder, device=CPU, rows=6)
        assert torch.equal(ids, full[:, decoder, :])


def test_wide_ids_widen_without_wrapping() -> None:
    routes = random_routing(WIDE, 5, seed=3).astype(np.uint16)
    routes[0, 1] = [299, 256]  # above the int16 range of uint16's bits
    source = ReplaySource(routes, WIDE)
    ids = source.decoder_ids(2, device=CPU, rows=5)
    assert ids.dtype == torch.int64
    assert ids[0].tolist() == [299, 256]


def test_routers_that_gather_with_the_ids_get_the_replayed_experts() -> None:
    # The call pattern of XTuner's MoE decoder layers and routers: one loop over every
    # decoder layer, routing only where a router is, used as the gather index.
    routes = random_routing(SPEC, 7, seed=4).astype(np.uint8)
    source = ReplaySource(routes, SPEC)
    logits = torch.randn(7, SPEC.num_experts)
    weights = torch.softmax(logits, dim=1, dtype=torch.float)
    for layer_idx in range(SPEC.decoder_layers):
        if source.moe_layer(layer_idx) is None:
            continue  # a dense decoder layer has no router
        topk_ids = source.decoder_ids(layer_idx, device=logits.device, rows=logits.shape[0])
        picked = weights.gather(dim=1, index=topk_ids)
        column = routes[:, source.moe_layer(layer_idx), :].astype(np.int64)
        expected = np.take_along_axis(weights.numpy(), column, axis=1)
        np.testing.assert_array_equal(picked.numpy(), expected)


def test_dense_and_unknown_layers_and_wrong_rows_are_refused() -> None:
    source = ReplaySource(random_routing(SPEC, 4, seed=5).astype(np.uint8), SPEC)
    with pytest.raises(SpecMismatch, match="dense") as dense:
        source.decoder_ids(2, device=CPU, rows=4)
    assert "decoder layer 2" in str(dense.value)
    with pytest.raises(SpecMismatch, match="out of range"):
        source.decoder_ids(4, device=CPU, rows=4)
    with pytest.raises(SpecMismatch, match="out of range"):
        source.moe_layer(-1)
    with pytest.raises(RowCountMismatch, match="decoder layer 3"):
        source.decoder_ids(3, device=CPU, rows=5)


def test_the_replay_id_checks_hold_for_decoder_layers() -> None:
    routes = random_routing(SPEC, 4, seed=6).astype(np.uint8)
    routes[2, 1] = [5, 5, 1]  # a repeated expert (zero padding rows do this)
    with pytest.raises(DuplicateExperts):
        ReplaySource(routes, SPEC)
    # A provider is checked block by block, when its layer asks.
    good = random_routing(SPEC, 4, seed=7).astype(np.uint8)

    def provider(moe_layer: int) -> np.ndarray:
        block = good[:, moe_layer, :].copy()
        if moe_layer == 1:
            block[0, 0] = SPEC.num_experts  # out of range
        return block

    source = ReplaySource(provider, SPEC)
    np.testing.assert_array_equal(source.decoder_ids(1, device=CPU, rows=4).numpy(), good[:, 0])
    with pytest.raises(ExpertOutOfRange, match="decoder layer 3"):
        source.decoder_ids(3, device=CPU, rows=4)
