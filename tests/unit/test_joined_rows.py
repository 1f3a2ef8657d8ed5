"""``JoinedRows``: a packed payload's pieces are never joined on the write path: pickled
as their pieces (out of band with protocol 5, as Ray writes them), read back as views of
them, and any row range of them is that range of the joined array."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core import Routes, RouteSpec, canonicalize
from routeplay.store.joined_rows import JoinedRows
from routeplay.store.write_plan import plan_batch, split_blocks

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)


def _routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


def _pieces(lengths: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(len(lengths))
    return [rng.integers(0, 200, size=(n, 3, 2), dtype=np.uint8) for n in lengths]


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    start=st.integers(-12, 40),
    stop=st.integers(-12, 40),
)
def test_a_row_range_of_the_pieces_is_that_range_of_the_joined_array(
    lengths: list[int], start: int, stop: int
) -> None:
    pieces = _pieces(lengths)
    whole = np.concatenate(pieces)
    rows = JoinedRows(pieces)
    assert rows.shape == whole.shape
    assert rows.nbytes == whole.nbytes
    assert len(rows) == len(whole)
    part = rows[start:stop]
    np.testing.assert_array_equal(np.asarray(part), whole[start:stop])
    assert part.shape == whole[start:stop].shape


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    start=st.integers(0, 60),
    rows=st.integers(0, 60),
)
def test_views_are_the_pieces_that_hold_a_row_range(
    lengths: list[int], start: int, rows: int
) -> None:
    pieces = _pieces(lengths)
    whole = np.concatenate(pieces)
    start = min(start, len(whole))
    views = JoinedRows(pieces).views(start, start + rows)
    got = np.concatenate(views) if views else whole[:0]
    np.testing.assert_array_equal(got, whole[start : start + rows])
    assert all(v.shape[0] > 0 for v in views)  # an empty piece gives no view
    assert all(any(np.shares_memory(v, p) for p in pieces) for v in views)  # no copy


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pickled_it_stays_pieces_and_reads_the_same_rows(protocol: int) -> None:
    pieces = _pieces([4, 0, 3, 5])
    restored = pickle.loads(pickle.dumps(JoinedRows(pieces), protocol=protocol))
    assert type(restored) is JoinedRows
    assert [p.shape for p in restored.pieces] == [p.shape for p in pieces]
    np.testing.assert_array_equal(np.asarray(restored), np.concatenate(pieces))


def test_with_protocol_5_each_piece_is_an_out_of_band_buffer_read_without_a_copy() -> None:
    pieces = _pieces([400, 300, 500])
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(JoinedRows(pieces), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(pieces)
    assert len(data) < 1000  # the rows (7,200 bytes) never went through the pickle stream
    stored = [bytearray(b.raw()) for b in buffers]  # what the object store holds
    restored = pickle.loads(data, buffers=stored)
    for view, backing in zip(restored.pieces, stored, strict=True):
        assert np.shares_memory(view, np.frombuffer(backing, dtype=np.uint8))


@pytest.mark.parametrize("dtype", [np.uint8, ">u2", "<u2", np.int32])
def test_out_of_band_pieces_keep_their_dtype_rows_and_row_shape(dtype: object) -> None:
    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 120, size=(n, 3, 2)).astype(dtype) for n in (5, 0, 2)]
    pieces.append(rng.integers(0, 120, size=(8, 3, 2)).astype(dtype)[::2])  # not contiguous
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(JoinedRows(pieces), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(pieces)
    restored = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])
    assert [(p.dtype, p.shape) for p in restored.pieces] == [(p.dtype, p.shape) for p in pieces]
    assert restored.dtype == np.dtype(dtype)
    assert not any(p.flags.writeable for p in restored.pieces)  # views of read-only bytes
    np.testing.assert_array_equal(np.asarray(restored), np.concatenate(pieces))


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    dtype=st.sampled_from(["u1", ">u2", "<u2", "<i4", "?"]),
    strided=st.lists(st.booleans(), min_size=6, max_size=6),
    protocol=st.integers(2, 5),
    out_of_band=st.booleans(),
)
def test_any_pieces_come_back_as_the_same_rows_whatever_the_pickle(
    lengths: list[int], dtype: str, strided: list[bool], protocol: int, out_of_band: bool
) -> None:
    rng = np.random.default_rng(len(lengths))
    pieces = [
        rng.integers(0, 2, size=(2 * n, 3, 2)).astype(dtype)[:: 2 if step else 1][:n]
        for n, step in zip(lengths, strided, strict=False)
    ]
    buffers: list[pickle.PickleBuffer] = []
    callback = buffers.append if out_of_band and protocol >= 5 else None
    data = pickle.dumps(JoinedRows(pieces), protocol=protocol, buffer_callback=callback)
    restored = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])
    assert [p.shape for p in restored.pieces] == [p.shape for p in pieces]
    # Below protocol 5 numpy itself brings a foreign byte order home (same values);
    # from protocol 5 on (Ray's) the pieces keep their dtype exactly.
    kept = [p.dtype if protocol >= 5 else p.dtype.newbyteorder("=") for p in restored.pieces]
    assert kept == [p.dtype if protocol >= 5 else p.dtype.newbyteorder("=") for p in pieces]
    np.testing.assert_array_equal(np.asarray(restored), np.concatenate(pieces))


def test_a_packed_group_is_joined_only_when_written_and_blocks_stay_unjoined() -> None:
    prompt = _routing(6, seed=1).array
    group = [
        canonicalize(np.concatenate([prompt, _routing(n, seed=n).array]), SPEC) for n in (2, 3)
    ]
    layout = plan_batch(group, prefix_rows=6, pack=True)
    [packed] = layout.arrays
    assert isinstance(packed, JoinedRows)
    # views of the members' rows: nothing is copied when the group is planned
    leader, *own = packed.pieces
    assert np.shares_memory(leader, group[0].array)
    assert all(np.shares_memory(p, s.array) for p, s in zip(own, group, strict=True))
    blocks = split_blocks(packed, 4)
    assert all(isinstance(block, JoinedRows) for block in blocks)
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(b) for b in blocks]), np.asarray(packed)
    )


def test_only_row_ranges_are_taken() -> None:
    with pytest.raises(ValueError, match="row ranges"):
        JoinedRows(_pieces([3, 3]))[::2]


def test_misuse_is_refused_with_value_errors() -> None:
    rows = JoinedRows(_pieces([3, 3]))
    with pytest.raises(ValueError, match="without a copy"):
        np.asarray(rows, copy=False)
    with pytest.raises(ValueError, match="row ranges"):
        rows[2]  # type: ignore[index]
    with pytest.raises(ValueError, match="at least one piece"):
        JoinedRows([])
