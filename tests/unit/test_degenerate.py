"""Degenerate captures (``routeplay.core.degenerate``): fill rows of a top-1 model, a frozen
layer, and what real routing (including a model whose router has no choice) still passes.

Expected rows and layers are written out by hand from how each payload is built.
"""

from __future__ import annotations

import json

import numpy as np
import numpy.typing as npt
import pytest
from bodies import lmdeploy_generate
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import random_routing, seeds

from routeplay import read_response
from routeplay.core import RouteSpec, canonicalize
from routeplay.core.degenerate import DegenerateCheck
from routeplay.errors import DegenerateRouting, DuplicateExperts, SpecMismatch

TOP1 = RouteSpec(num_layers=4, top_k=1, num_experts=16)  # Llama-4 shaped, few layers
TOP2 = RouteSpec(num_layers=3, top_k=2, num_experts=8)


def real(spec: RouteSpec, rows: int, seed: int = 0) -> npt.NDArray[np.int64]:
    return random_routing(spec, rows, seed)


def test_an_all_zero_top1_capture_is_refused_naming_its_rows() -> None:
    with pytest.raises(DegenerateRouting, match="fill rows") as refused:
        canonicalize(np.zeros((40, 4, 1), np.int64), TOP1, where="sample s7 (vllm answer)")
    assert refused.value.where == "sample s7 (vllm answer), rows [0, 40), every layer"
    assert refused.value.found == "40 rows of expert 0 in all 4 layers"


def test_a_zero_filled_tail_is_refused_with_its_absolute_rows() -> None:
    """verl zero-fills the rows its engine never routed; here rows 30..49 of a payload
    that starts at sample row 100 (a resume's new rows)."""
    rows = real(TOP1, 50, seed=3)
    rows[30:] = 0
    with pytest.raises(DegenerateRouting) as refused:
        canonicalize(rows, TOP1, start_row=100, where="sample r")
    assert refused.value.where == "sample r, rows [130, 150), every layer"


def test_short_fill_runs_and_changing_fill_values_pass() -> None:
    rows = real(TOP1, 60, seed=4)
    rows[10:25] = 5  # 15 rows: one short of the default 16
    rows[40:56] = np.arange(16)[:, None, None]  # every row a fill row, the value changes
    canonicalize(rows, TOP1)
    rows[10:26] = 5  # 16 rows of expert 5
    with pytest.raises(DegenerateRouting, match="16 rows of expert 5"):
        canonicalize(rows, TOP1)


def test_fill_rows_of_a_model_with_few_layers_or_one_expert_are_its_routing() -> None:
    """Below ``min_fill_ids`` layers, or with one expert, real routers produce such rows."""
    canonicalize(np.zeros((40, 3, 1), np.int64), RouteSpec(num_layers=3, top_k=1, num_experts=16))
    canonicalize(np.zeros((80, 4, 1), np.int64), RouteSpec(num_layers=4, top_k=1, num_experts=1))


def test_zero_rows_of_a_top2_model_are_already_refused_as_duplicates() -> None:
    with pytest.raises(DuplicateExperts, match="all zeros"):
        canonicalize(np.zeros((40, 3, 2), np.int64), TOP2)


def test_a_frozen_layer_over_a_whole_sample_is_refused_naming_the_layer() -> None:
    rows = real(TOP2, 64, seed=5)
    rows[:, 2] = [6, 1]  # layer 2's buffer never written: one row repeated
    with pytest.raises(DegenerateRouting, match="frozen layer") as refused:
        canonicalize(rows, TOP2, where="engine key ab12")
    assert refused.value.where == "engine key ab12, layer 2, rows [0, 64)"
    assert refused.value.found == "ids [6, 1] in all 64 rows"


def test_a_frozen_layer_is_checked_only_on_whole_samples_long_enough() -> None:
    rows = real(TOP2, 64, seed=6)
    rows[:, 0] = [3, 4]
    canonicalize(rows[:63], TOP2)  # 63 rows: under the threshold
    canonicalize(rows, TOP2, start_row=1)  # a continuation: repeated text routes alike
    k_equals_e = RouteSpec(num_layers=2, top_k=2, num_experts=2)  # every row names both
    canonicalize(np.tile(np.array([0, 1]), (70, 2, 1)), k_equals_e)


def test_thresholds_are_configurable_and_can_be_turned_off() -> None:
    rows = np.zeros((40, 4, 1), np.int64)
    off = RouteSpec(
        num_layers=4,
        top_k=1,
        num_experts=16,
        degenerate=DegenerateCheck(fill_rows=None, frozen_rows=None),
    )
    assert off == TOP1  # a setting, not geometry
    canonicalize(rows, off)
    strict = RouteSpec(
        num_layers=4, top_k=1, num_experts=16, degenerate=DegenerateCheck(fill_rows=41)
    )
    canonicalize(rows, strict)  # 40 rows < 41
    with pytest.raises(SpecMismatch, match="at least 2 rows"):
        DegenerateCheck(frozen_rows=1)


def test_an_engine_wire_refuses_a_degenerate_capture_naming_the_wire() -> None:
    body = lmdeploy_generate(np.zeros((40, 4, 1), np.int32).tolist(), prompt=21, completion=20)
    with pytest.raises(DegenerateRouting) as refused:
        read_response("lmdeploy", json.loads(json.dumps(body)), TOP1)
    assert refused.value.where.startswith("lmdeploy")
    assert refused.value.where.endswith("rows [0, 40), every layer")


@settings(max_examples=60, deadline=None)
@given(
    seed=seeds,
    rows=st.integers(min_value=64, max_value=300),
    layers=st.integers(min_value=1, max_value=6),
    top_k=st.integers(min_value=1, max_value=4),
    experts=st.integers(min_value=4, max_value=64),
)
def test_random_routing_is_never_called_degenerate(
    seed: int, rows: int, layers: int, top_k: int, experts: int
) -> None:
    spec = RouteSpec(num_layers=layers, top_k=top_k, num_experts=max(experts, top_k + 1))
    canonicalize(real(spec, rows, seed), spec)
