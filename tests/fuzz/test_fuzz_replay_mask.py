"""``ReplaySource(mask=)`` against a plain oracle, on random routes and masks (numpy and
torch alike): an id out of range is refused in any row, a repeated id only in a row the
mask says is routing; padding rows pass as the trainer laid them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routeplay.core import RouteSpec
from routeplay.errors import DuplicateExperts, ExpertOutOfRange

torch = pytest.importorskip("torch")

from routeplay.train import ReplaySource  # noqa: E402

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=4)


@st.composite
def routes_and_mask(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    rows = draw(st.integers(min_value=1, max_value=10))
    ids = draw(
        st.lists(
            st.integers(min_value=0, max_value=SPEC.num_experts),  # num_experts: out of range
            min_size=rows * SPEC.num_layers * SPEC.top_k,
            max_size=rows * SPEC.num_layers * SPEC.top_k,
        )
    )
    mask = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    routes = np.array(ids, dtype=np.uint8).reshape(rows, SPEC.num_layers, SPEC.top_k)
    return routes, np.array(mask, dtype=bool)


def expected(routes: np.ndarray, mask: np.ndarray) -> type[Exception] | None:
    if (routes >= SPEC.num_experts).any():
        return ExpertOutOfRange
    real = routes[mask]
    if (real[..., 0] == real[..., 1]).any():  # top-2: a repeat is the two ids equal
        return DuplicateExperts
    return None


@settings(max_examples=300, deadline=None)
@given(routes_and_mask(), st.booleans())
def test_the_mask_decides_only_where_repeats_are_refused(
    case: tuple[np.ndarray, np.ndarray], as_tensor: bool
) -> None:
    routes, mask = case
    data = torch.from_numpy(routes) if as_tensor else routes
    flags = torch.from_numpy(mask) if as_tensor else mask
    error = expected(routes, mask)
    if error is None:
        source = ReplaySource(data, SPEC, mask=flags)
        ids = source.ids(0, device=torch.device("cpu"), rows=len(mask))
        np.testing.assert_array_equal(ids.numpy(), routes[:, 0])  # replayed as laid out
    else:
        with pytest.raises(error):
            ReplaySource(data, SPEC, mask=flags)
