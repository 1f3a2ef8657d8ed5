"""Hypothesis strategies for routing geometry and valid routing arrays.

Arrays are drawn from a numpy Generator seeded by hypothesis, then built with one
vectorized argsort: no Python loop per element, so 40 rows x 6 layers x 1000 experts
stays cheap. Shrinking works on the seed and the row count.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st

from routeplay.core import RouteSpec

__all__ = [
    "MAX_ROWS",
    "dense_specs",
    "random_routing",
    "routing_arrays",
    "seeds",
    "specs",
]

MAX_ROWS = 40

seeds = st.integers(min_value=0, max_value=2**32 - 1)


def _experts(top_k: int) -> st.SearchStrategy[int]:
    # Mostly uint8 models; about one draw in four above 256 so uint16 is exercised.
    return st.one_of(
        st.integers(min_value=top_k, max_value=300),
        st.integers(min_value=top_k, max_value=300),
        st.integers(min_value=top_k, max_value=300),
        st.integers(min_value=257, max_value=1000),
    )


@st.composite
def specs(draw: st.DrawFn) -> RouteSpec:
    """Plain specs (no dense layers): L 1..6, K 1..8, E from K..300, sometimes 257..1000."""
    top_k = draw(st.integers(min_value=1, max_value=8))
    return RouteSpec(
        num_layers=draw(st.integers(min_value=1, max_value=6)),
        top_k=top_k,
        num_experts=draw(_experts(top_k)),
    )


@st.composite
def dense_specs(draw: st.DrawFn) -> RouteSpec:
    """Specs whose model also has dense decoder layers (layer_map and total_layers set)."""
    base = draw(specs())
    total = draw(st.integers(min_value=base.num_layers + 1, max_value=base.num_layers + 4))
    chosen = draw(
        st.lists(
            st.integers(min_value=0, max_value=total - 1),
            min_size=base.num_layers,
            max_size=base.num_layers,
            unique=True,
        )
    )
    return RouteSpec(
        num_layers=base.num_layers,
        top_k=base.top_k,
        num_experts=base.num_experts,
        layer_map=tuple(sorted(chosen)),
        total_layers=total,
    )


def random_routing(
    spec: RouteSpec, rows: int, seed: int, *, num_experts: int | None = None
) -> npt.NDArray[np.int64]:
    """Valid ``[rows, L, K]`` ids: distinct per (row, layer), in ``[0, num_experts)``.

    ``num_experts`` (default ``spec.num_experts``) can be smaller to draw only low ids.
    """
    experts = spec.num_experts if num_experts is None else num_experts
    rng = np.random.default_rng(seed)
    keys = rng.random((rows, spec.num_layers, experts))
    # The K smallest keys of each (row, layer) name K distinct experts, uniformly.
    ids: npt.NDArray[np.int64] = np.argsort(keys, axis=-1)[..., : spec.top_k].astype(np.int64)
    return ids


@st.composite
def routing_arrays(
    draw: st.DrawFn, spec: RouteSpec, rows: int | st.SearchStrategy[int] | None = None
) -> npt.NDArray[np.int64]:
    """Valid int64 ``[rows, L, K]`` arrays for ``spec``; rows drawn from 0..40 when not given."""
    if rows is None:
        rows = st.integers(min_value=0, max_value=MAX_ROWS)
    count = draw(rows) if isinstance(rows, st.SearchStrategy) else rows
    return random_routing(spec, count, draw(seeds))
