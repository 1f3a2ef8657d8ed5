"""A group's members validated at ingest are laid out from their blocks as they are
(``key_check.canonical_group(..., validated=...)``, ``validated_routes``): the same layout
as from their raw payloads validated near the engine, and nothing validated again."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routeplay.bench.transfer_paths import make_routing
from routeplay.core import EngineKey, RouteSpec, preset
from routeplay.core.validate import canonicalize
from routeplay.errors import (
    DuplicateExperts,
    MalformedPayload,
    RouteplayError,
    RowCountMismatch,
)
from routeplay.store.engine.key_check import canonical_group, validated_routes

SPEC = preset("glm-4.5-air")  # every decoder layer sent, the first dense: narrowed on read
SMALL = RouteSpec(num_layers=3, top_k=2, num_experts=6)


def _key(index: int, rows: int, trailing: int = 0) -> EngineKey:
    return EngineKey(key=f"{index:02x}" * 28, rows=rows, trailing_rows=trailing)


def _group(spec: RouteSpec, members: int, prompt: int, own: int, seed: int) -> list[np.ndarray]:
    """Raw payloads (uint16, every decoder layer) sharing their first ``prompt`` rows."""
    shared = make_routing(spec, prompt, all_layers=True, seed=seed)
    return [
        np.concatenate([shared, make_routing(spec, own, all_layers=True, seed=seed + 1 + m)])
        for m in range(members)
    ]


def _ingested(raw: np.ndarray) -> np.ndarray:
    """What a validation at ingest leaves: every row, canonical (a read-only block)."""
    return canonicalize(raw, SPEC).array


def _layout(group: Any) -> tuple[list[bytes], tuple[Any, ...], tuple[Any, ...]]:
    arrays = [np.asarray(a).tobytes() for a in group.layout.arrays]
    return arrays, group.layout.samples, group.outcomes


@settings(max_examples=25, deadline=None)
@given(
    members=st.integers(1, 4),
    prompt=st.integers(0, 6),
    own=st.integers(1, 5),
    trailing=st.integers(0, 1),
    ingested=st.lists(st.booleans(), min_size=4, max_size=4),
    starts=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    seed=st.integers(0, 1000),
)
def test_blocks_validated_at_ingest_lay_out_as_their_raw_payloads_validated(
    members: int,
    prompt: int,
    own: int,
    trailing: int,
    ingested: list[bool],
    starts: list[int],
    seed: int,
) -> None:
    raws = _group(SPEC, members, prompt, own + trailing, seed)
    rows = prompt + own
    keys = [_key(m, rows, trailing) for m in range(members)]
    begin = [min(s, rows - 1) for s in starts[:members]]
    flags = ingested[:members]
    payloads = [_ingested(raw) if done else raw for raw, done in zip(raws, flags, strict=True)]
    for pack in (False, True):
        from_raw = canonical_group(raws, keys, SPEC, begin, shared_prefix=prompt, pack=pack)
        mixed = canonical_group(
            payloads, keys, SPEC, begin, shared_prefix=prompt, pack=pack, validated=flags
        )
        assert _layout(mixed) == _layout(from_raw)


def test_a_block_validated_at_ingest_is_not_validated_again() -> None:
    """Its rows are taken as they are: a block that would fail validation (it never
    comes from a validation that refused) is laid out all the same, while the same rows
    sent raw are refused with their typed error, costing only their member."""
    raws = _group(SMALL, 2, 2, 3, seed=4)
    blocks = [canonicalize(raw, SMALL).array.copy() for raw in raws]
    blocks[1][3, 1] = blocks[1][3, 1, 0]  # an expert twice in one row
    keys = [_key(0, 5), _key(1, 5)]
    taken = canonical_group(blocks, keys, SMALL, [0, 0], shared_prefix=2, validated=[True, True])
    assert taken.outcomes == (0, 1)
    raw = blocks[1].astype(np.uint16)
    checked = canonical_group([blocks[0], raw], keys, SMALL, [0, 0], validated=[True, False])
    assert isinstance(checked.outcomes[1], DuplicateExperts)
    assert checked.outcomes[0] == 0


@pytest.mark.parametrize(
    ("block", "error"),
    [
        (np.zeros((5, 3, 2), np.uint16), MalformedPayload),  # not narrowed: not a block of ours
        (np.zeros((5, 4, 2), np.uint8), MalformedPayload),  # another row shape
        ([[0, 1]], MalformedPayload),  # not an array at all
        (np.zeros((7, 3, 2), np.uint8), RowCountMismatch),  # rows the key cannot explain
    ],
)
def test_a_block_that_is_not_the_keys_canonical_rows_is_refused_with_a_typed_error(
    block: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match=f"engine key {'05' * 28}"):
        validated_routes(block, _key(5, 5), SMALL)


def test_a_block_gives_its_rows_from_the_start_row_read_only_and_without_a_copy() -> None:
    block = canonicalize(make_routing(SMALL, 6, all_layers=False, seed=9), SMALL).array
    routes = validated_routes(block, _key(1, 5, trailing=1), SMALL, start=2)
    assert routes.start_row == 2  # rows [2, 5): the trailing row left
    assert routes.rows == 3
    assert np.shares_memory(routes.array, block)
    assert not routes.array.flags.writeable
    np.testing.assert_array_equal(routes.array, block[2:5])


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(["uint8", "uint16", "int32", "float32", "bool"]),
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=4),
    rows=st.integers(1, 6),
    trailing=st.integers(0, 1),
    start=st.integers(0, 5),
)
def test_any_block_is_taken_as_the_keys_rows_or_refused_with_a_typed_error(
    dtype: str, shape: list[int], rows: int, trailing: int, start: int
) -> None:
    """Whatever a block is (dtype, rank, sizes), ``validated_routes`` gives exactly the
    key's rows from ``start`` or raises a ``RouteplayError``, never anything untyped."""
    block = np.zeros(shape, dtype=dtype)
    key = _key(3, rows, trailing)
    begin = min(start, rows - 1)
    try:
        routes = validated_routes(block, key, SMALL, start=begin)
    except RouteplayError:
        return
    assert routes.array.shape == (rows - begin, *SMALL.row_shape)
    assert routes.start_row == begin
