"""``canonicalize`` checks range, narrows and checks distinctness in one sweep over
blocks of rows; a refusal is named exactly as the whole-array checks name it: the first
offender, and every range error before any distinctness error, across blocks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routeplay.core import RouteSpec
from routeplay.core.validate import _DISTINCT_BLOCK, canonicalize, check_distinct, check_range
from routeplay.errors import DuplicateExperts, ExpertOutOfRange

SPEC = RouteSpec(num_layers=4, top_k=4, num_experts=16)
BLOCK_ROWS = _DISTINCT_BLOCK // SPEC.num_layers  # rows per block of the sweep


def _routing(rows: int, seed: int, dtype: type = np.int32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    keys = rng.random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(dtype)


def test_a_range_error_in_a_later_block_wins_over_a_repeat_in_an_earlier_one() -> None:
    array = _routing(3 * BLOCK_ROWS, seed=1)
    array[5, 1, 2] = array[5, 1, 0]  # a repeat in the first block
    array[2 * BLOCK_ROWS + 7, 3, 1] = 99  # out of range in the third
    with pytest.raises(ExpertOutOfRange) as refused:
        canonicalize(array, SPEC, start_row=100)
    assert refused.value.where.endswith(f"row {100 + 2 * BLOCK_ROWS + 7}, layer 3, slot 1")


def test_the_first_repeat_is_named_across_blocks() -> None:
    array = _routing(2 * BLOCK_ROWS + 3, seed=2)
    array[BLOCK_ROWS + 4, 2, 3] = array[BLOCK_ROWS + 4, 2, 1]
    array[2 * BLOCK_ROWS + 1, 0, 1] = array[2 * BLOCK_ROWS + 1, 0, 0]
    with pytest.raises(DuplicateExperts) as refused:
        canonicalize(array, SPEC)
    assert refused.value.where.endswith(f"row {BLOCK_ROWS + 4}, layer 2")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 2 * BLOCK_ROWS + 5),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([np.int64, np.int16, np.uint16, np.uint8]),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(-3, 20)), max_size=3),
)
def test_the_sweep_agrees_with_the_whole_array_checks(
    rows: int, seed: int, dtype: type, flips: list[tuple[int, int]]
) -> None:
    array = _routing(rows, seed, dtype)
    flat = array.reshape(-1)
    for at, value in flips:
        if flat.size and (value >= 0 or np.dtype(dtype).kind == "i"):
            flat[at % flat.size] = value
    expected: type[Exception] | None = None
    try:
        check_range(array, SPEC)
        check_distinct(array.astype(SPEC.dtype))
    except (ExpertOutOfRange, DuplicateExperts) as exc:
        expected = type(exc)
    if expected is None:
        routes = canonicalize(array, SPEC)
        assert routes.array.dtype == SPEC.dtype
        assert np.array_equal(routes.array, array)
        assert not routes.array.flags.writeable
    else:
        with pytest.raises(expected):
            canonicalize(array, SPEC)


def test_a_read_only_canonical_array_is_checked_in_place_and_a_writable_one_copied() -> None:
    array = _routing(BLOCK_ROWS + 2, seed=3, dtype=np.uint8)
    assert SPEC.dtype == np.uint8
    assert not np.shares_memory(canonicalize(array, SPEC).array, array)  # caller may write
    array.flags.writeable = False
    assert np.shares_memory(canonicalize(array, SPEC).array, array)  # nobody can: no copy


def test_an_all_layers_payload_keeps_its_moe_layers_across_blocks() -> None:
    spec = RouteSpec(num_layers=4, top_k=4, num_experts=16, layer_map=(1, 2, 3, 5))
    full = np.zeros((BLOCK_ROWS + 9, 6, 4), np.int32)
    full[:] = np.arange(4, dtype=np.int32)  # dense layers: anything
    moe = _routing(BLOCK_ROWS + 9, seed=4)
    full[:, [1, 2, 3, 5], :] = moe
    assert np.array_equal(canonicalize(full, spec).array, moe)


@pytest.mark.parametrize("where", ["first half", "second half", "nowhere"])
def test_threaded_sweeps_agree_with_one_thread(where: str) -> None:
    rows = 20 * BLOCK_ROWS + 3  # enough blocks for two threads' shares
    array = _routing(rows, seed=5, dtype=np.int16)
    bad_row = {"first half": 3, "second half": rows - 2, "nowhere": None}[where]
    if bad_row is not None:
        array[bad_row, 2, 1] = array[bad_row, 2, 3]
    for threads in (2, 3):
        if bad_row is None:
            threaded = canonicalize(array, SPEC, threads=threads).array
            assert np.array_equal(threaded, canonicalize(array, SPEC).array)
            continue
        with pytest.raises(DuplicateExperts) as refused:
            canonicalize(array, SPEC, threads=threads)
        assert refused.value.where.endswith(f"row {bad_row}, layer 2")
