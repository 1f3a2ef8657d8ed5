"""Handle algebra: slicing, appending, concatenation, pieces, pickling (property tests)."""

from __future__ import annotations

import dataclasses
import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core import EngineKey, Handle, InlineSource, RouteSpec, Segment, StoreRef
from routeplay.errors import HandleError, SpecMismatch

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=16)
OTHER_SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=32)


def _inline(rows: int, seed: int) -> InlineSource:
    rng = np.random.default_rng(seed)
    keys = rng.random((rows, SPEC.num_layers, SPEC.num_experts))
    ids = np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(SPEC.dtype)
    return InlineSource(array=ids)


@st.composite
def segment_lists(draw: st.DrawFn, max_segments: int = 8) -> list[Segment]:
    """Segments over a few inline sources, with arbitrary row ranges and versions (as
    given: empty, contiguous and of the same version or not)."""
    sources = [_inline(draw(st.integers(1, 12)), seed=i) for i in range(draw(st.integers(1, 3)))]
    segments = []
    for _ in range(draw(st.integers(0, max_segments))):
        source = draw(st.sampled_from(sources))
        start = draw(st.integers(0, source.rows))
        stop = draw(st.integers(start, source.rows))
        version = draw(st.integers(0, 2))
        segments.append(
            Segment(source=source, start=start, stop=stop, spec=SPEC, weight_version=version)
        )
    return segments


@st.composite
def handles(draw: st.DrawFn, max_segments: int = 8) -> Handle:
    """Handles over a few inline sources, with arbitrary row ranges and versions."""
    return Handle(SPEC, draw(segment_lists(max_segments)))


def materialize(handle: Handle, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Reference read: the rows of a handle range, straight from the inline sources."""
    stop = handle.rows if stop is None else stop
    out = np.empty((stop - start, *SPEC.row_shape), SPEC.dtype)
    for piece in handle.pieces(start, stop):
        seg = piece.segment
        assert isinstance(seg.source, InlineSource)
        out[piece.offset : piece.offset + seg.rows] = seg.source.array[seg.start : seg.stop]
    return out


@st.composite
def handle_and_range(draw: st.DrawFn) -> tuple[Handle, int, int]:
    handle = draw(handles())
    start = draw(st.integers(0, handle.rows))
    return handle, start, draw(st.integers(start, handle.rows))


@given(handle_and_range())
def test_slice_reads_the_same_rows_as_slicing_the_full_array(case: tuple[Handle, int, int]) -> None:
    handle, start, stop = case
    sliced = handle[start:stop]
    assert sliced.rows == stop - start
    np.testing.assert_array_equal(materialize(sliced), materialize(handle)[start:stop])
    np.testing.assert_array_equal(materialize(handle, start, stop), materialize(handle)[start:stop])


@given(handle_and_range())
def test_split_and_concat_gives_back_the_same_handle(case: tuple[Handle, int, int]) -> None:
    handle, cut, _ = case
    assert handle[:cut] + handle[cut:] == handle
    assert Handle.concat(SPEC, [handle[:cut], handle[cut:]]) == handle


@given(handle_and_range(), st.data())
def test_slices_compose(case: tuple[Handle, int, int], data: st.DataObject) -> None:
    handle, start, stop = case
    inner_start = data.draw(st.integers(0, stop - start))
    inner_stop = data.draw(st.integers(inner_start, stop - start))
    assert (
        handle[start:stop][inner_start:inner_stop]
        == handle[start + inner_start : start + inner_stop]
    )


@given(segment_lists(), st.data())
def test_weight_versions_follow_rows(segments: list[Segment], data: st.DataObject) -> None:
    """Every row carries the version of the segment it was given in, whatever the handle
    merged; expected from the segments as given (a plain loop, no handle code)."""
    expected = [seg.weight_version for seg in segments for _ in range(seg.start, seg.stop)]
    handle = Handle(SPEC, segments)
    assert handle.weight_versions().tolist() == expected
    start = data.draw(st.integers(0, handle.rows))
    stop = data.draw(st.integers(start, handle.rows))
    assert handle[start:stop].weight_versions().tolist() == expected[start:stop]


def test_only_contiguous_segments_of_one_version_merge() -> None:
    """Pins ``Segment.continued_by``'s version rule: a contiguous segment of a newer
    version stays apart (its rows keep their version), one of the same version merges."""
    a, b = _inline(10, seed=7), _inline(4, seed=8)
    handle = Handle(
        SPEC,
        [
            Segment(source=a, start=0, stop=3, spec=SPEC, weight_version=0),
            Segment(source=a, start=3, stop=5, spec=SPEC, weight_version=1),  # newer: apart
            Segment(source=a, start=5, stop=8, spec=SPEC, weight_version=1),  # same: merged
            Segment(source=b, start=0, stop=2, spec=SPEC, weight_version=2),
        ],
    )
    assert [(s.start, s.stop, s.weight_version) for s in handle.segments] == [
        (0, 3, 0),
        (3, 8, 1),
        (0, 2, 2),
    ]
    assert handle.weight_versions().tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    assert handle[2:9].weight_versions().tolist() == [0, 1, 1, 1, 1, 1, 2]
    first = Handle.of(Segment(source=a, start=0, stop=3, spec=SPEC, weight_version=0))
    grown = first.append(Segment(source=a, start=3, stop=5, spec=SPEC, weight_version=1))
    assert grown.weight_versions().tolist() == [0, 0, 0, 1, 1]


@given(handle_and_range())
def test_pieces_tile_the_range_without_gaps(case: tuple[Handle, int, int]) -> None:
    handle, start, stop = case
    offset = 0
    for piece in handle.pieces(start, stop):
        assert piece.offset == offset
        assert piece.segment.rows > 0
        offset += piece.segment.rows
    assert offset == stop - start


@given(handles())
def test_normalized_segments_are_non_empty_and_not_mergeable(handle: Handle) -> None:
    for seg in handle.segments:
        assert seg.rows > 0
    for left, right in itertools.pairwise(handle.segments):
        assert not left.continued_by(right)
    assert handle.nbytes == handle.rows * SPEC.row_nbytes


@given(handles(), handles())
def test_append_adds_rows_after_the_last_one(first: Handle, second: Handle) -> None:
    combined = first
    for seg in second.segments:
        combined = combined.append(seg, at_row=combined.rows)
    assert combined.rows == first.rows + second.rows
    np.testing.assert_array_equal(
        materialize(combined), np.concatenate([materialize(first), materialize(second)])
    )


def test_append_at_the_wrong_row_is_refused() -> None:
    source = _inline(5, seed=0)
    handle = Handle.of(Segment(source=source, start=0, stop=3, spec=SPEC))
    with pytest.raises(HandleError, match="starting at 3"):
        handle.append(Segment(source=source, start=3, stop=5, spec=SPEC), at_row=2)


def test_segments_of_another_spec_are_refused() -> None:
    source = _inline(4, seed=1)
    with pytest.raises(SpecMismatch):
        Handle(SPEC, [Segment(source=source, start=0, stop=4, spec=OTHER_SPEC)])


@pytest.mark.parametrize(("start", "stop"), [(-1, 2), (3, 2), (0, 5)])
def test_segment_outside_its_source_is_refused(start: int, stop: int) -> None:
    with pytest.raises(HandleError):
        Segment(source=_inline(4, seed=2), start=start, stop=stop, spec=SPEC)


@pytest.mark.parametrize(("start", "stop"), [(-1, 2), (2, 1), (0, 9)])
def test_ranges_outside_the_handle_are_refused(start: int, stop: int) -> None:
    handle = Handle.of(Segment(source=_inline(4, seed=3), start=0, stop=4, spec=SPEC))
    with pytest.raises(HandleError):
        handle.slice(start, stop)


def test_stepped_slices_are_refused() -> None:
    handle = Handle.of(Segment(source=_inline(4, seed=4), start=0, stop=4, spec=SPEC))
    with pytest.raises(HandleError):
        handle[::2]


def test_inline_sources_compare_by_identity_store_refs_by_value() -> None:
    array = _inline(3, seed=5).array
    assert InlineSource(array=array) != InlineSource(array=array)
    assert StoreRef(payload_id="p1", run="r", rows=3) == StoreRef(payload_id="p1", run="r", rows=3)
    assert StoreRef(payload_id="p1", run="r", rows=3) != StoreRef(payload_id="p1", run="s", rows=3)


def _store_handle(segments: int) -> Handle:
    spec = RouteSpec(num_layers=94, top_k=8, num_experts=128, name="qwen3-235b-a22b")
    parts = [
        Segment(
            source=StoreRef(payload_id=f"{i:016x}", run="run-0001", rows=2048),
            start=0,
            stop=2048,
            spec=spec,
            weight_version=i // 10,
        )
        for i in range(segments)
    ]
    return Handle(spec, parts)


def test_a_100_segment_handle_pickles_small_and_round_trips() -> None:
    handle = _store_handle(100)
    blob = pickle.dumps(handle, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"pickled 100-segment handle: {len(blob)} bytes for {handle.nbytes / 1e6:.0f} MB of rows")
    assert pickle.loads(blob) == handle
    assert len(blob) < 8 * 1024  # ~70 bytes a segment: ids, rows, version; the spec once


def test_engine_key_segments_round_trip_through_pickle() -> None:
    key = EngineKey(key="ab" * 28, rows=7)
    spec = RouteSpec(num_layers=2, top_k=2, num_experts=8)
    handle = Handle.of(Segment(source=key, start=0, stop=7, spec=spec))
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert handle.sources() == (key,)


@given(handles(max_segments=12), st.data())
def test_appending_segment_by_segment_equals_the_handle_built_at_once(
    whole: Handle, data: st.DataObject
) -> None:
    """``append`` and ``+`` check only the new segments and merge only at the seam (a
    session appends every turn); the result is the handle normalized in one go."""
    cut = data.draw(st.integers(0, len(whole.segments)))
    grown = Handle(SPEC)
    for segment in whole.segments[:cut]:
        grown = grown.append(segment, at_row=grown.rows)
    grown = grown + Handle(SPEC, whole.segments[cut:])
    assert grown == whole
    assert grown.segments == whole.segments
    assert grown.rows == whole.rows


def test_a_continuing_append_merges_into_the_last_segment() -> None:
    source = _inline(10, seed=3)
    first = Handle.of(Segment(source=source, start=0, stop=4, spec=SPEC))
    grown = first.append(Segment(source=source, start=4, stop=9, spec=SPEC))
    assert grown.segments == (Segment(source=source, start=0, stop=9, spec=SPEC),)
    assert grown.rows == 9
    with pytest.raises(SpecMismatch):
        first + Handle.of(Segment(source=source, start=4, stop=9, spec=OTHER_SPEC))


def test_a_pickled_segment_is_checked_again_and_stays_frozen() -> None:
    source = StoreRef(payload_id="p", run="r", rows=4)
    segment = Segment(source=source, start=1, stop=4, spec=SPEC, weight_version=2)
    back = pickle.loads(pickle.dumps(segment))
    assert back == segment
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.stop = 5  # type: ignore[misc]
    short = StoreRef(payload_id="p", run="r", rows=2)
    build, args = segment.__reduce__()
    with pytest.raises(HandleError, match="outside their source"):
        build(short, *args[1:])
