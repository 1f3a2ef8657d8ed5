"""``DistinctCheck`` (shifted column compares) agrees with sorting each top-k row."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from routeplay.core.validate import DistinctCheck


def _sorted_says_distinct(pairs: np.ndarray) -> bool:
    ordered = np.sort(pairs, axis=1)
    return not bool((ordered[:, 1:] == ordered[:, :-1]).any())


@settings(max_examples=200, deadline=None, print_blob=True)
@given(
    top_k=st.integers(1, 12),
    count=st.integers(0, 50),
    experts=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.uint8, np.uint16]),
)
def test_distinct_check_agrees_with_a_per_row_sort(
    top_k: int, count: int, experts: int, seed: int, dtype: type
) -> None:
    # Few experts make repeats common; many make distinct rows common: both get drawn.
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, experts, size=(count, top_k)).astype(dtype)
    check = DistinctCheck(top_k=top_k, max_pairs=64, dtype=np.dtype(dtype))
    assert check.holds(pairs) == _sorted_says_distinct(pairs)
    # Reused buffers keep no state from the call before.
    distinct = np.argsort(rng.random((count, max(top_k, experts))), axis=1)[:, :top_k]
    assert check.holds(distinct.astype(dtype))


def test_a_repeat_in_any_two_slots_is_found() -> None:
    check = DistinctCheck(top_k=8, max_pairs=4, dtype=np.dtype(np.uint8))
    for i in range(8):
        for j in range(i + 1, 8):
            row = np.arange(8, dtype=np.uint8)
            row[j] = row[i]
            assert not check.holds(np.stack([np.arange(8, dtype=np.uint8), row]))
