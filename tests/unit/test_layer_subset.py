"""A pipeline stage reads and replays only its MoE layers (``LayerSubset``): the columns
it copies are exactly those layers', a replay maps each router to its column, and a
router whose layer was not read is refused before anything runs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tiny_moe import qwen3_moe  # noqa: E402

from routeplay.core import RouteSpec, canonicalize  # noqa: E402
from routeplay.core.layers import LayerSubset  # noqa: E402
from routeplay.errors import MisuseError, SpecMismatch  # noqa: E402
from routeplay.integrations.megatron.layout import MegatronLayout  # noqa: E402
from routeplay.store import RouteStore, StoreConfig  # noqa: E402
from routeplay.train.hf import find_routers, replay  # noqa: E402
from routeplay.train.replay_core import ReplaySource  # noqa: E402

SPEC = RouteSpec(num_layers=8, top_k=2, num_experts=16)


def _routes(rows: int, spec: RouteSpec = SPEC, seed: int = 0) -> Any:
    keys = np.random.default_rng(seed).random((rows, spec.num_layers, spec.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : spec.top_k].astype(np.uint8), spec)


@given(st.sets(st.integers(0, SPEC.num_layers - 1), min_size=1).map(sorted))
def test_a_subset_takes_exactly_its_columns_range_by_range(layers: list[int]) -> None:
    subset = LayerSubset.of(layers, SPEC)
    rows = _routes(5).array
    np.testing.assert_array_equal(subset.take(rows), rows[:, layers])
    assert sum(stop - first for first, stop, _ in subset.runs) == len(layers)
    assert [subset.column(layer) for layer in layers] == list(range(len(layers)))
    assert all(subset.column(x) is None for x in range(SPEC.num_layers) if x not in layers)
    assert subset.whole == (len(layers) == SPEC.num_layers)


@pytest.mark.parametrize("layers", [[], [2, 1], [1, 1], [-1, 2], [7, 8]])
def test_a_subset_must_name_distinct_layers_of_the_model_in_order(layers: list[int]) -> None:
    with pytest.raises(SpecMismatch, match="distinct MoE layers"):
        LayerSubset.of(layers, SPEC)


def test_a_store_read_copies_only_the_subsets_columns() -> None:
    store = RouteStore.local(StoreConfig(run="subset", block_rows=8))
    routes = _routes(20)
    handle = store.put(routes)  # three blocks of rows
    layers = LayerSubset.of([1, 2, 5], SPEC)
    [rows] = store.read_many([(handle, 3, 17)], layers=layers)
    np.testing.assert_array_equal(rows, routes.array[3:17][:, [1, 2, 5]])
    other = LayerSubset.of([0], RouteSpec(num_layers=4, top_k=2, num_experts=16))
    with pytest.raises(SpecMismatch, match="layer subset of another model"):
        store.read_many([(handle, 0, 4)], layers=other)


def test_a_replay_source_maps_layers_to_columns_and_refuses_the_others() -> None:
    routes = _routes(6)
    stage = [2, 3, 6]
    source = ReplaySource(routes.array[:, stage], SPEC, layers=stage)
    whole = ReplaySource(routes, SPEC)
    for layer in stage:
        torch.testing.assert_close(
            source.ids(layer, device=torch.device("cpu"), rows=6),
            whole.ids(layer, device=torch.device("cpu"), rows=6),
        )
    with pytest.raises(MisuseError, match="other MoE layers") as caught:
        source.ids(4, device=torch.device("cpu"), rows=6)
    assert "[2, 3, 6]" in str(caught.value)
    with pytest.raises(SpecMismatch, match="the layers read"):
        ReplaySource(routes.array[:, :2], SPEC, layers=stage)
    with pytest.raises(MisuseError, match="every MoE layer"):
        ReplaySource(routes, SPEC, layers=stage)
    whole = ReplaySource(routes, SPEC, layers=range(SPEC.num_layers))  # harmless: all of them
    assert whole.column(7) == 7
    with pytest.raises(SpecMismatch, match="out of range"):
        ReplaySource(routes, SPEC).column(SPEC.num_layers)
    with pytest.raises(SpecMismatch, match="out of range"):
        source.column(-1)


def test_a_stage_of_a_virtual_pipeline_reads_its_chunks_layers() -> None:
    layout = MegatronLayout(pp_size=2, pp_rank=1, vp_size=2, num_layers=SPEC.num_layers)
    assert layout.moe_layers(SPEC) == (2, 3, 6, 7)  # chunk 0: layers 2-3, chunk 1: 6-7
    assert LayerSubset.of(layout.moe_layers(SPEC), SPEC).runs == ((2, 4, 0), (6, 8, 2))
    with pytest.raises(SpecMismatch, match="decoder layers"):
        MegatronLayout(pp_size=2, pp_rank=0, num_layers=6).moe_layers(SPEC)


def test_an_hf_model_replays_from_a_read_of_its_layers_and_refuses_a_missing_one() -> None:
    model = qwen3_moe().eval()
    spec = find_routers(model).spec
    routes = _routes(12, spec, seed=3)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with replay(model, routes):
            want = model(input_ids=ids).logits
        with replay(model, routes.array[:, [0, 1, 2]], layers=[0, 1, 2]):
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with (
        pytest.raises(MisuseError, match="other MoE layers"),
        replay(model, routes.array[:, [0, 2]], layers=[0, 2]),
    ):
        pytest.fail("a replay whose routes lack layer 1 must be refused before it starts")
