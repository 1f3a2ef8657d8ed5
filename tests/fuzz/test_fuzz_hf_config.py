"""``spec_from_hf_config`` on hostile ``config.json`` values (what ``routeplay inspect
--config`` reads): a geometry, or ``SpecMismatch``; never another exception, and never
memory sized by a claimed layer count."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routeplay.core.hf_config import MAX_LAYERS, spec_from_hf_config
from routeplay.core.spec import RouteSpec
from routeplay.errors import SpecMismatch

BASE = {"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 2}
KEYS = (
    "num_hidden_layers",
    "num_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "moe_layer_freq",
    "decoder_sparse_step",
    "mlp_only_layers",
    "expert_layer_period",
    "expert_layer_offset",
    "moe_layer_interval",
    "moe_layer_start_index",
    "moe_layer_end_index",
    "num_nextn_predict_layers",
    "mtp_config",
    "moe_layers",
    "mlp_layer_types",
)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _config(values: dict[str, Any]) -> SimpleNamespace:
    """A config object as transformers gives it (attributes; nested dicts as objects)."""
    fields = {k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in values.items()}
    return SimpleNamespace(**fields)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=6))
def test_a_hostile_config_gives_a_spec_or_spec_mismatch(changes: dict[str, Any]) -> None:
    try:
        spec = spec_from_hf_config(_config({**BASE, **changes}))
    except SpecMismatch:
        return
    assert isinstance(spec, RouteSpec)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_hidden_layers", 3_000_000),
        ("num_hidden_layers", float("inf")),
        ("num_hidden_layers", 0),
        ("expert_layer_period", 0),
        ("decoder_sparse_step", 0),
        ("moe_layer_interval", 0),
        ("mtp_config", {}),
        ("mtp_config", 2),
        ("num_nextn_predict_layers", MAX_LAYERS + 1),
    ],
)
def test_each_value_a_review_found_is_refused_typed(field: str, value: Any) -> None:
    with pytest.raises(SpecMismatch):
        spec_from_hf_config(_config({**BASE, field: value}))
