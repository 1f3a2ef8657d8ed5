"""The producer outbox (split_blocks, stage/take) and the read planner, simulated end to
end: payloads split into blocks, adopted by real StoreShards, located per shard and
copied into outputs exactly as the plan says, then compared with a reference read."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core import EngineKey, Handle, InlineSource, RouteSpec, Segment, StoreRef
from routeplay.errors import AlreadyConsumed
from routeplay.store.client.read_plan import DirectCopy, ReadPlan, plan_reads
from routeplay.store.remote.outbox import PayloadOutbox, split_blocks
from routeplay.store.shard.shard import StoreShard, shard_of

RUN = "run-a"
SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=1000)  # uint16: room for row tags
UNWRITTEN = np.iinfo(SPEC.dtype).max


def _tagged(rows: int, tag: int) -> npt.NDArray[Any]:
    """Rows whose every value names (tag, row, layer, slot): any misplaced row shows."""
    row = np.arange(rows).reshape(-1, 1, 1) * 6
    cell = np.arange(SPEC.num_layers).reshape(1, -1, 1) * 2 + np.arange(SPEC.top_k)
    return (tag * 200 + row + cell).astype(SPEC.dtype)


# -- split_blocks ------------------------------------------------------------------------
@given(st.integers(0, 30), st.integers(0, 8))
def test_split_blocks_are_views_covering_every_row_in_order(rows: int, block_rows: int) -> None:
    array = _tagged(rows, tag=1)
    blocks = split_blocks(array, block_rows)
    np.testing.assert_array_equal(np.concatenate(blocks), array)
    if block_rows == 0 or rows <= block_rows:
        assert len(blocks) == 1
        assert blocks[0] is array
        return
    assert len(blocks) == -(-rows // block_rows)
    assert [len(b) for b in blocks[:-1]] == [block_rows] * (len(blocks) - 1)
    assert 1 <= len(blocks[-1]) <= block_rows
    for block in blocks:
        assert np.shares_memory(block, array)
        assert block.base is array


def test_split_blocks_last_block_is_shorter_and_views_see_writes() -> None:
    array = _tagged(10, tag=2)
    blocks = split_blocks(array, 4)
    assert [len(b) for b in blocks] == [4, 4, 2]
    array[9] = 7
    assert (blocks[2][1] == 7).all()


# -- PayloadOutbox -----------------------------------------------------------------------
def test_outbox_hands_blocks_over_once() -> None:
    outbox = PayloadOutbox()
    array = _tagged(10, tag=3)
    token, count = outbox.stage(array, block_rows=4)
    assert count == 3
    assert len(outbox) == 1
    taken = outbox.take(token)
    assert isinstance(taken, tuple)
    assert [len(b) for b in taken] == [4, 4, 2]
    assert all(np.shares_memory(b, array) for b in taken)
    np.testing.assert_array_equal(np.concatenate(taken), array)
    assert len(outbox) == 0
    with pytest.raises(AlreadyConsumed, match="already taken") as caught:
        outbox.take(token)
    assert isinstance(caught.value, KeyError)
    assert token in str(caught.value)


def test_outbox_forgets_only_what_was_staged_too_long_ago() -> None:
    """A taker that gave up (its deadline passed, or the call that staged ran twice)
    never takes: ``sweep`` drops it after a while, and nothing younger."""
    outbox = PayloadOutbox()
    token = outbox.stage_many((_tagged(4, tag=1),))
    assert outbox.sweep(3600.0) == 0  # staged just now: kept
    assert outbox.hand_over(token)[-1] == "handed-over"
    stale = outbox.stage_many((_tagged(4, tag=2), _tagged(4, tag=3)))
    assert outbox.sweep(-1.0) == 1  # everything is older than a second from now
    assert len(outbox) == 0
    with pytest.raises(AlreadyConsumed):
        outbox.take(stale)


def test_outbox_returns_a_single_block_bare() -> None:
    outbox = PayloadOutbox()
    array = _tagged(3, tag=4)
    for block_rows in (0, 3, 8):
        token, count = outbox.stage(array, block_rows=block_rows)
        assert count == 1
        taken = outbox.take(token)
        assert isinstance(taken, np.ndarray)
        assert taken is array


def test_outbox_tokens_are_distinct_and_independent() -> None:
    outbox = PayloadOutbox()
    arrays = [_tagged(5, tag=t) for t in range(4)]
    tokens = [outbox.stage(a, block_rows=0)[0] for a in arrays]
    assert len(set(tokens)) == 4
    assert len(outbox) == 4
    for token, array in reversed(list(zip(tokens, arrays, strict=True))):
        assert outbox.take(token) is array
    assert len(outbox) == 0


def test_outbox_discard_is_idempotent() -> None:
    outbox = PayloadOutbox()
    kept, _ = outbox.stage(_tagged(2, tag=5), block_rows=0)
    token, _ = outbox.stage(_tagged(2, tag=6), block_rows=0)
    outbox.discard(token)
    assert len(outbox) == 1
    outbox.discard(token)
    outbox.discard("never-staged")
    assert len(outbox) == 1
    with pytest.raises(AlreadyConsumed):
        outbox.take(token)
    with pytest.raises(AlreadyConsumed, match="never staged"):
        outbox.take("never-staged")
    assert outbox.take(kept) is not None


def test_outbox_lets_go_of_the_array_once_taken() -> None:
    outbox = PayloadOutbox()
    array = _tagged(9, tag=7)
    gone = weakref.ref(array)
    token, _ = outbox.stage(array, block_rows=4)
    del array
    assert gone() is not None  # staged: the outbox keeps it
    taken = outbox.take(token)
    assert gone() is not None  # the caller's blocks keep it
    del taken
    assert gone() is None


# -- plan_reads: a simulated read ---------------------------------------------------------
@dataclass
class World:
    """Stored payloads on real shards, plus what each one holds."""

    shards: dict[int, StoreShard]
    full: dict[str, npt.NDArray[Any]]  # payload id -> the whole payload


def _materialize(handle: Handle, world: World) -> npt.NDArray[Any]:
    parts = []
    for seg in handle.segments:
        source = seg.source
        array = source.array if isinstance(source, InlineSource) else world.full[source.payload_id]
        parts.append(array[seg.start : seg.stop])
    return np.concatenate(parts) if parts else np.empty((0, *SPEC.row_shape), SPEC.dtype)


@st.composite
def worlds_and_requests(draw: st.DrawFn) -> tuple[World, list[tuple[Handle, int, int]]]:
    shards = {i: StoreShard(RUN, i, ttl_s=None) for i in range(draw(st.integers(2, 3)))}
    world = World(shards=shards, full={})
    sources: list[InlineSource | StoreRef] = []
    for tag in range(draw(st.integers(2, 6))):
        rows = draw(st.integers(1, 20))
        array = _tagged(rows, tag=tag)
        if draw(st.integers(0, 3)) == 0:
            sources.append(InlineSource(array=array))
            continue
        block_rows = draw(st.sampled_from([0, 0, 1, 2, 3, 4, 5, 6, 7]))
        shard = shards[draw(st.sampled_from(sorted(shards)))]
        blocks = split_blocks(array, block_rows)
        ref = shard.adopt(blocks, rows=rows, nbytes=array.nbytes, block_rows=block_rows)
        world.full[ref.payload_id] = array
        sources.append(ref)
    requests = []
    for _ in range(draw(st.integers(1, 4))):
        segments = []
        for _ in range(draw(st.integers(1, 6))):
            source = draw(st.sampled_from(sources))
            start = draw(st.integers(0, source.rows))
            stop = draw(st.integers(start, source.rows))
            segments.append(Segment(source=source, start=start, stop=stop, spec=SPEC))
        handle = Handle(SPEC, segments)
        start = draw(st.integers(0, handle.rows))
        requests.append((handle, start, draw(st.integers(start, handle.rows))))
    return world, requests


def _execute(plan: ReadPlan, world: World) -> tuple[list[npt.NDArray[Any]], set[tuple[str, int]]]:
    """Run a plan as a reader does; returns the outputs and the blocks fetched."""
    outs = [np.full((rows, *SPEC.row_shape), UNWRITTEN, SPEC.dtype) for rows in plan.rows]
    written = [np.zeros(rows, dtype=np.int64) for rows in plan.rows]
    for direct in plan.direct:
        seg = direct.segment
        assert isinstance(seg.source, InlineSource)
        outs[direct.request][direct.offset : direct.offset + seg.rows] = seg.source.array[
            seg.start : seg.stop
        ]
        written[direct.request][direct.offset : direct.offset + seg.rows] += 1
    fetched: dict[tuple[str, int], Any] = {}
    for index in sorted(plan.wanted):
        wanted = plan.locate_requests(index)
        located = world.shards[index].locate(wanted, RUN)
        for (pid, blocks), refs in zip(wanted, located, strict=True):
            assert blocks == sorted(set(blocks))
            assert len(refs) == len(blocks)
            for block, ref in zip(blocks, refs, strict=True):
                assert (pid, block) not in fetched  # each block fetched once
                fetched[(pid, block)] = ref
    for copy in plan.copies:
        block = fetched[(copy.payload_id, copy.block)]
        assert 0 <= copy.lo < copy.hi <= len(block)  # a copy never reads nothing
        source = copy.segment.source
        assert isinstance(source, StoreRef)
        assert copy.first_row == copy.block * source.block_rows + copy.lo
        rows = copy.hi - copy.lo
        outs[copy.request][copy.offset : copy.offset + rows] = block[copy.lo : copy.hi]
        written[copy.request][copy.offset : copy.offset + rows] += 1
    for count in written:
        assert (count == 1).all()  # every output row written exactly once
    return outs, set(fetched)


@given(worlds_and_requests())
def test_a_planned_read_gives_the_same_rows_as_slicing_the_payloads(
    case: tuple[World, list[tuple[Handle, int, int]]],
) -> None:
    world, requests = case
    plan = plan_reads(requests)
    assert plan.rows == [stop - start for _, start, stop in requests]
    outs, _ = _execute(plan, world)
    for out, (handle, start, stop) in zip(outs, requests, strict=True):
        np.testing.assert_array_equal(out, _materialize(handle, world)[start:stop])


@given(worlds_and_requests())
def test_every_wanted_block_is_used_and_grouped_by_its_shard(
    case: tuple[World, list[tuple[Handle, int, int]]],
) -> None:
    world, requests = case
    plan = plan_reads(requests)
    used = {(copy.payload_id, copy.block) for copy in plan.copies}
    wanted = {(pid, b) for per in plan.wanted.values() for pid, bs in per.items() for b in bs}
    assert wanted == used
    for index, per_shard in plan.wanted.items():
        assert per_shard  # no empty locate calls
        assert all(shard_of(pid) == index for pid in per_shard)
        assert all(blocks for blocks in per_shard.values())
    # The exact set of blocks: those overlapping a requested range of a stored segment.
    expected = set()
    for handle, start, stop in requests:
        for piece in handle.pieces(start, stop):
            seg = piece.segment
            if isinstance(seg.source, StoreRef):
                for row in range(seg.start, seg.stop):
                    block_rows = seg.source.block_rows
                    expected.add((seg.source.payload_id, row // block_rows if block_rows else 0))
    assert wanted == expected
    _, fetched = _execute(plan, world)
    assert fetched == wanted


@given(worlds_and_requests())
def test_planning_blocks_only_wants_the_same_blocks_and_copies_nothing(
    case: tuple[World, list[tuple[Handle, int, int]]],
) -> None:
    """What ``hold_blocks`` plans: the full plan's blocks, per shard, in the same order."""
    _, requests = case
    full, blocks_only = plan_reads(requests), plan_reads(requests, copies=False)
    assert blocks_only.wanted == full.wanted
    assert blocks_only.blocks == full.blocks
    assert blocks_only.copies == []
    assert blocks_only.direct == []


def _stored(rows: int, block_rows: int, payload_id: str = "2.a") -> Handle:
    ref = StoreRef(payload_id=payload_id, run=RUN, rows=rows, block_rows=block_rows)
    return Handle.of(Segment(source=ref, start=0, stop=rows, spec=SPEC))


def test_a_range_inside_block_2_fetches_only_block_2() -> None:
    plan = plan_reads([(_stored(20, 4), 8, 11)])
    assert plan.wanted == {2: {"2.a": [2]}}
    assert plan.locate_requests(2) == [("2.a", [2])]
    [copy] = plan.copies
    assert (copy.block, copy.lo, copy.hi, copy.offset, copy.first_row) == (2, 0, 3, 0, 8)
    assert plan.direct == []


def test_a_range_across_a_block_boundary_fetches_both_blocks() -> None:
    plan = plan_reads([(_stored(20, 4), 9, 13)])
    assert plan.wanted == {2: {"2.a": [2, 3]}}
    assert [(c.block, c.lo, c.hi, c.offset) for c in plan.copies] == [(2, 1, 4, 0), (3, 0, 1, 3)]


def test_an_unblocked_payload_is_one_block() -> None:
    plan = plan_reads([(_stored(20, 0), 5, 17)])
    assert plan.wanted == {2: {"2.a": [0]}}
    [copy] = plan.copies
    assert (copy.block, copy.lo, copy.hi, copy.offset) == (0, 5, 17, 0)


def test_blocks_of_many_requests_are_merged_per_payload_and_sorted() -> None:
    handle = _stored(20, 4)
    other = _stored(6, 2, payload_id="0.1")
    plan = plan_reads([(handle, 16, 20), (other, 0, 1), (handle, 0, 5), (handle, 17, 18)])
    assert plan.locate_requests(2) == [("2.a", [0, 1, 4])]
    assert plan.locate_requests(0) == [("0.1", [0])]
    assert sorted(plan.wanted) == [0, 2]
    assert len(plan.copies) == 5


def test_empty_ranges_plan_nothing() -> None:
    plan = plan_reads([(_stored(20, 4), 7, 7), (Handle(SPEC), 0, 0)])
    assert plan.rows == [0, 0]
    assert plan.wanted == {}
    assert plan.copies == []
    assert plan.direct == []


def test_inline_and_engine_key_segments_are_direct_copies() -> None:
    inline = InlineSource(array=_tagged(4, tag=1))
    key = EngineKey(key="ab" * 28, rows=5)
    handle = Handle(
        SPEC,
        [
            Segment(source=inline, start=1, stop=4, spec=SPEC),
            Segment(source=key, start=0, stop=5, spec=SPEC),
            Segment(source=inline, start=0, stop=2, spec=SPEC),
        ],
    )
    plan = plan_reads([(handle, 2, 9)])
    assert plan.wanted == {}
    assert [(d.offset, d.segment.source, d.segment.start, d.segment.stop) for d in plan.direct] == [
        (0, inline, 3, 4),
        (1, key, 0, 5),
        (6, inline, 0, 1),
    ]
    assert all(isinstance(d, DirectCopy) for d in plan.direct)
