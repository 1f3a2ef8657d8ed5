"""The materializer against a reference that builds whole packs and slices them.

Also: row counts are checked before any read, a rank reads only the rows (and blocks)
it needs, leases end as micro-batches are consumed (and on errors), resident bytes stay
at (prefetch + 1) micro-batch shards however large the step is, padding is distinct.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import random_routing, seeds

from routeplay.core import (
    EngineKey,
    Handle,
    InlineSource,
    RouteSpec,
    Segment,
    StoreRef,
    canonicalize,
    preset,
)
from routeplay.errors import MisuseError, RoutesLost, RowCountMismatch, SpecMismatch
from routeplay.store import RouteStore, StoreConfig
from routeplay.train.materializer import Materializer, MicroBatchRoutes, padding_rows
from routeplay.train.packing import (
    Pack,
    PackedSample,
    PackingPlan,
    RankCoords,
    local_ranges,
    local_tokens,
    pack_samples,
    seq_alignment,
)

SPEC = RouteSpec(num_layers=2, top_k=3, num_experts=7)
WIDE = RouteSpec(num_layers=2, top_k=2, num_experts=300)  # uint16
DEEP = RouteSpec(num_layers=6, top_k=2, num_experts=9)  # layer subsets of several ranges
Arrays = dict[str, npt.NDArray[Any]]


class SpyStore:
    """Forwards ``read_many`` to a store and records every request."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self.calls: list[list[tuple[Handle, int, int]]] = []

    def read_many(
        self,
        requests: Sequence[tuple[Handle, int, int]],
        *,
        holder: str = "",
        out: Sequence[npt.NDArray[Any]] | None = None,
    ) -> list[npt.NDArray[Any]]:
        self.calls.append(list(requests))
        return self.store.read_many(requests, holder=holder, out=out)

    def stored_ranges(self) -> list[tuple[str, int, int]]:
        """``(payload, start, stop)`` of every stored row range requested, in order."""
        out = []
        for call in self.calls:
            for handle, start, stop in call:
                for piece in handle.pieces(start, stop):
                    src = piece.segment.source
                    if isinstance(src, StoreRef):
                        out.append((src.payload_id, piece.segment.start, piece.segment.stop))
        return out


def new_store(run: str = "mat", block_rows: int = 4096) -> RouteStore:
    return RouteStore.local(StoreConfig(run=run, block_rows=block_rows))


def put_sample(
    store: RouteStore, spec: RouteSpec, rows: int, seed: int, split: int | None = None
) -> tuple[Handle, npt.NDArray[Any]]:
    """Store ``rows`` rows (in two payloads when ``split`` is given, like a resumed rollout)."""
    array = random_routing(spec, rows, seed).astype(spec.dtype)
    if rows == 0:
        return Handle(spec), array
    if split is None or not 0 < split < rows:
        return store.put(canonicalize(array, spec)), array
    head = store.put(canonicalize(array[:split], spec))
    return head + store.put(canonicalize(array[split:], spec)), array


def reference(plan: PackingPlan, arrays: Arrays, mb: int, coords: RankCoords) -> tuple[Any, Any]:
    """Build each whole pack (rows at offsets, padding elsewhere), then take the rank's
    positions by the layout's definition (``brute_force_positions``: ``np.split``), not
    by ``local_ranges``, which the materializer itself uses."""
    spec = plan.spec
    routes, masks = [], []
    for index in plan.micro_batches[mb]:
        pack = plan.packs[index]
        full = np.empty((pack.length, *spec.row_shape), spec.dtype)
        full[:] = np.arange(spec.top_k) % spec.num_experts
        mask = np.zeros(pack.length, bool)
        for s in pack.samples:
            full[s.offset : s.offset + s.tokens - 1] = arrays[s.sample_id]
            mask[s.offset : s.offset + s.tokens - 1] = True
        positions = brute_force_positions(pack, coords)
        routes.append(full[positions])
        masks.append(mask[positions])
    return np.concatenate(routes), np.concatenate(masks)


def brute_force_positions(pack: Pack | int, coords: RankCoords) -> npt.NDArray[np.int64]:
    """Pack positions of a rank, by the definition (np.split), for checking local_ranges."""
    length = pack if isinstance(pack, int) else pack.length
    positions = np.arange(length)
    cp, rank = coords.cp_size, coords.cp_rank
    mirror = 2 * cp - 1 - rank
    if coords.cp_split == "pack_zigzag":
        chunks = np.split(positions, 2 * cp)
        cp_local = np.concatenate([chunks[rank], chunks[mirror]])
    elif coords.cp_split == "per_sequence" and cp > 1 and not isinstance(pack, int):
        parts = []
        for s in pack.samples:  # each sequence in 2 * cp chunks, then the tail in cp parts
            chunks = np.split(positions[s.offset : s.end], 2 * cp)
            parts += [chunks[rank], chunks[mirror]]
        parts.append(np.split(positions[pack.samples[-1].end :], cp)[rank])
        cp_local = np.concatenate(parts)
    else:
        cp_local = np.split(positions, cp)[rank]
    return np.split(cp_local, coords.sp_size)[coords.sp_rank]


def all_coords(sp: int, cp: int, split: str, dp: int = 1) -> list[RankCoords]:
    return [
        RankCoords(dp_rank=d, sp_rank=s, sp_size=sp, cp_rank=c, cp_size=cp, cp_split=split)
        for d in range(dp)
        for c in range(cp)
        for s in range(sp)
    ]


def rows_handle(spec: RouteSpec, rows: int) -> Handle:
    """A handle of ``rows`` inline padding rows: enough to lay out a plan without a store."""
    if rows == 0:
        return Handle(spec)
    source = InlineSource(array=padding_rows(spec, rows))
    return Handle(spec, [Segment(source=source, start=0, stop=rows, spec=spec)])


def holder_leases(store: RouteStore, holder: str) -> int:
    return dict(store.stats().leases_by_holder).get(holder, 0)


# -- layout ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "sp", "cp", "split", "rank", "expected"),
    [
        (16, 2, 2, "contiguous", (1, 0), [(8, 12)]),
        (16, 2, 2, "pack_zigzag", (0, 0), [(0, 4)]),
        (16, 2, 2, "pack_zigzag", (0, 1), [(12, 16)]),
        (16, 4, 2, "pack_zigzag", (0, 2), [(12, 14)]),
        (16, 1, 1, "pack_zigzag", (0, 0), [(0, 16)]),  # chunks 0 and 1 are adjacent: one range
        (24, 3, 2, "pack_zigzag", (0, 1), [(4, 6), (18, 20)]),  # an SP part straddles chunks
    ],
)
def test_local_ranges_examples(
    length: int, sp: int, cp: int, split: str, rank: tuple[int, int], expected: list[Any]
) -> None:
    coords = RankCoords(sp_size=sp, cp_size=cp, cp_rank=rank[0], sp_rank=rank[1], cp_split=split)
    assert local_ranges(length, coords) == expected


def test_per_sequence_cp_gives_each_rank_two_chunks_of_every_sequence() -> None:
    # Two sequences of 8 and 4 positions (aligned to 2 * cp * sp = 4), then a tail of 4.
    spec = RouteSpec(num_layers=1, top_k=1, num_experts=2)
    samples = [("a", rows_handle(spec, 7), 8), ("b", rows_handle(spec, 2), 3)]
    plan = pack_samples(samples, 16, seq_align=seq_alignment(cp_size=2, sp_size=1))
    [pack] = plan.packs
    assert [(s.offset, s.end) for s in pack.samples] == [(0, 8), (8, 12)]
    rank0 = RankCoords(cp_size=2, cp_rank=0)
    rank1 = RankCoords(cp_size=2, cp_rank=1)
    # a: chunks of 2 -> rank 0 holds [0,2) and [6,8); b: chunks of 1 -> [8,9) and [11,12);
    # the tail [12,16) -> [12,14). Adjacent ranges merge.
    assert local_ranges(pack, rank0) == [(0, 2), (6, 9), (11, 14)]
    assert local_ranges(pack, rank1) == [(2, 6), (9, 11), (14, 16)]
    with_sp = RankCoords(cp_size=2, cp_rank=1, sp_size=2, sp_rank=1)  # second half of rank 1
    assert local_ranges(pack, with_sp) == [(9, 11), (14, 16)]


def test_packs_can_end_at_their_last_sequence_rounded_up() -> None:
    spec = RouteSpec(num_layers=1, top_k=1, num_experts=2)
    samples = [(f"s{i}", rows_handle(spec, t - 1), t) for i, t in enumerate([9, 14, 30, 3])]
    exact = pack_samples(samples, 32, seq_align=4, pack_multiple=4)  # verl: no tail at all
    assert [p.length for p in exact.packs] == [24, 32, 4]
    assert all(p.length == p.samples[-1].end for p in exact.packs)
    slime = pack_samples(samples, 32, seq_align=4, pack_multiple=16)  # a local pad multiple
    assert [p.length for p in slime.packs] == [32, 32, 16]
    assert [p.length for p in pack_samples(samples, 32, seq_align=4).packs] == [32, 32, 32]


def test_the_trainer_alignment_rule() -> None:
    assert seq_alignment(cp_size=1, sp_size=1) == 1
    assert seq_alignment(cp_size=1, sp_size=4) == 4  # SP only: a multiple of TP
    assert seq_alignment(cp_size=2, sp_size=4) == 16  # CP: a multiple of 2 * CP * TP


def test_a_fed_last_token_is_a_padding_position_of_its_sequence() -> None:
    spec = RouteSpec(num_layers=1, top_k=1, num_experts=2)
    samples = [("a", rows_handle(spec, 5), 6), ("b", rows_handle(spec, 2), 3)]
    plan = pack_samples(samples, 12, feeds_last_token=True, seq_align=2)
    assert [(s.offset, s.stop, s.end) for s in plan.packs[0].samples] == [(0, 5, 6), (6, 8, 10)]


@given(
    sp=st.sampled_from([1, 2, 3, 4]),
    cp=st.sampled_from([1, 2, 4]),
    split=st.sampled_from(["contiguous", "pack_zigzag", "per_sequence"]),
    multiple=st.integers(1, 5),
    tokens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
)
def test_local_ranges_match_the_definition_and_cover_each_pack_once(
    sp: int, cp: int, split: str, multiple: int, tokens: list[int]
) -> None:
    spec = RouteSpec(num_layers=1, top_k=1, num_experts=2)
    align = seq_alignment(cp_size=cp, sp_size=sp)
    length = 2 * cp * sp * multiple
    samples = [(f"s{i}", rows_handle(spec, t - 1), t) for i, t in enumerate(tokens)]
    for pack in pack_samples(samples, length + 40 * align, seq_align=align).packs:
        covered = np.zeros(pack.length, int)
        for coords in all_coords(sp, cp, split):
            ranges = local_ranges(pack, coords)
            positions = np.concatenate([np.arange(a, b) for a, b in ranges])
            np.testing.assert_array_equal(positions, brute_force_positions(pack, coords))
            assert local_tokens(pack, coords) == pack.length // (sp * cp)
            covered[positions] += 1
        assert (covered == 1).all()


def test_uneven_splits_and_bad_ranks_are_refused() -> None:
    with pytest.raises(MisuseError, match="split evenly"):
        local_ranges(20, RankCoords(cp_size=4, cp_split="pack_zigzag"))  # 20 % 8
    with pytest.raises(MisuseError, match="split evenly"):
        local_ranges(18, RankCoords(sp_size=4))
    with pytest.raises(MisuseError, match="needs the pack"):
        local_ranges(16, RankCoords(cp_size=2))  # per-sequence needs the sequences
    spec = RouteSpec(num_layers=1, top_k=1, num_experts=2)
    unaligned = pack_samples([("a", rows_handle(spec, 5), 6)], 16)
    with pytest.raises(MisuseError, match="padded to a multiple"):
        local_ranges(unaligned.packs[0], RankCoords(cp_size=2))
    with pytest.raises(MisuseError, match="sp_rank"):
        RankCoords(sp_rank=2, sp_size=2)
    with pytest.raises(MisuseError, match="cp_split"):
        RankCoords(cp_split="ring")


# -- the property test -------------------------------------------------------------------


@st.composite
def steps(draw: st.DrawFn) -> dict[str, Any]:
    sp, cp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    length = 2 * sp * cp * draw(st.integers(1, 5))
    tokens = draw(st.lists(st.integers(1, length + 1), min_size=1, max_size=9))
    spec = draw(st.sampled_from([SPEC, WIDE, DEEP]))
    some_layers = st.sets(st.integers(0, spec.num_layers - 1), min_size=1).map(sorted)
    return {
        "spec": spec,
        "layers": draw(st.none() | some_layers),
        "sp": sp,
        "cp": cp,
        "split": draw(st.sampled_from(["contiguous", "pack_zigzag", "per_sequence"])),
        "length": length,
        "tokens": tokens,
        "splits": draw(st.lists(st.integers(0, length), min_size=len(tokens), max_size=9)),
        "per_mb": draw(st.integers(1, 3)),
        "dp": draw(st.integers(1, 2)),
        "prefetch": draw(st.integers(0, 2)),
        "reverse": draw(st.booleans()),
        "seed": draw(seeds),
    }


def test_zigzag_cp_ranks_get_their_rows_written_out() -> None:
    """One pack of 8 positions holding a 7-row sample, CP=2 zigzag: chunks of 2, rank 0
    holds chunks 0 and 3 (positions 0, 1, 6, 7: the last one padding), rank 1 chunks 1
    and 2 (positions 2-5). Expected rows written out from the sample's array."""
    store = new_store()
    handle, rows = put_sample(store, SPEC, 7, seed=5)
    plan = pack_samples([("a", handle, 8)], 8, seq_align=seq_alignment(cp_size=2, sp_size=1))
    pad = np.arange(SPEC.top_k) % SPEC.num_experts  # the materializer's padding row
    expected = {
        0: (np.stack([rows[0], rows[1], rows[6], [pad] * SPEC.num_layers]), [1, 1, 1, 0]),
        1: (np.stack([rows[2], rows[3], rows[4], rows[5]]), [1, 1, 1, 1]),
    }
    with store.acquire(handle, "train/step"):  # the step's batch, while each rank reads
        for rank, (want_routes, want_mask) in expected.items():
            coords = RankCoords(cp_size=2, cp_rank=rank, cp_split="pack_zigzag")
            lease = store.acquire(handle, f"rank {rank}")
            with Materializer(store, plan, coords, leases={"a": lease}) as m:
                [item] = list(m)
            np.testing.assert_array_equal(item.routes, want_routes)
            np.testing.assert_array_equal(item.mask, np.array(want_mask, bool))
    assert store.leaks() == []


@settings(max_examples=100)
@given(step=steps(), share=st.booleans())
def test_every_rank_gets_its_slice_of_the_whole_pack(step: dict[str, Any], share: bool) -> None:
    """Each rank materializes from the whole plan, or from its share (``plan.share``:
    what a driver sends it), and reads the same rows either way; a rank that reads a
    subset of the MoE layers (a pipeline stage's) gets exactly those columns, and copies
    only their bytes."""
    spec, store = step["spec"], new_store()
    arrays: Arrays = {}
    samples = []
    for i, tokens in enumerate(step["tokens"]):
        handle, arrays[f"s{i}"] = put_sample(
            store, spec, tokens - 1, step["seed"] + i, step["splits"][i]
        )
        samples.append((f"s{i}", handle, tokens))
    align = seq_alignment(cp_size=step["cp"], sp_size=step["sp"])
    plan = pack_samples(
        samples, step["length"], step["per_mb"], dp_size=step["dp"], seq_align=align
    )
    # The step's batch keeps every payload alive while each rank holds (and ends) its own.
    batch = [store.acquire(handle, "train/step") for _, handle, _ in samples]
    for coords in all_coords(step["sp"], step["cp"], step["split"], step["dp"]):
        mine = plan.schedule(coords.dp_rank)
        order = mine[::-1] if step["reverse"] else mine
        holder = f"rank {coords.describe()}"
        leases = {
            s.sample_id: store.acquire(s.handle, holder) for mb in mine for s in plan.samples_of(mb)
        }
        given_plan = plan.share(coords.dp_rank) if share else plan
        layers = step["layers"]
        with Materializer(
            store,
            given_plan,
            coords,
            leases=leases,
            prefetch=step["prefetch"],
            order=order,
            layers=layers,
        ) as m:
            got = list(m)
        assert [item.index for item in got] == list(order)
        real_rows = 0
        for item in got:
            routes, mask = reference(plan, arrays, item.index, coords)
            if layers is not None:
                routes = routes[:, layers]
            assert item.routes.dtype == spec.dtype
            assert item.layers == (None if layers is None else tuple(layers))
            np.testing.assert_array_equal(item.routes, routes)
            np.testing.assert_array_equal(item.mask, mask)
            real_rows += int(mask.sum())
        assert holder_leases(store, holder) == 0
        stats = m.stats()
        read_layers = spec.num_layers if layers is None else len(layers)
        assert stats.bytes_read == real_rows * read_layers * spec.top_k * spec.dtype.itemsize
        assert stats.reads == len(mine)
        assert stats.leases_released == len(leases)
        assert stats.resident_bytes == 0
    for lease in batch:
        lease.release()
    assert store.leaks() == []


# -- checks before any read ------------------------------------------------------------------


def test_a_ranks_share_of_a_plan_holds_its_samples_only() -> None:
    store = new_store()
    samples = [(f"s{i}", put_sample(store, SPEC, 7, seed=i)[0], 8) for i in range(64)]
    plan = pack_samples(samples, pack_max_length=8, dp_size=4)
    for rank in range(4):
        mine = plan.share(rank)
        assert mine.micro_batches == plan.micro_batches
        assert mine.dp_ranks == plan.dp_ranks
        assert [p.length for p in mine.packs] == [p.length for p in plan.packs]
        kept = {s.sample_id for p in mine.packs for s in p.samples}
        assert kept == {s.sample_id for mb in plan.schedule(rank) for s in plan.samples_of(mb)}
        assert len(pickle.dumps(mine)) < len(pickle.dumps(plan)) / 2


def test_row_count_mismatch_is_raised_before_any_read() -> None:
    store = new_store()
    spy = SpyStore(store)
    good, _ = put_sample(store, SPEC, 9, seed=1)
    bad, _ = put_sample(store, SPEC, 10, seed=2)  # 10 rows for 10 tokens: one too many
    with pytest.raises(RowCountMismatch) as info:
        pack_samples([("ok", good, 10), ("sample-7", bad, 10)], pack_max_length=32)
    message = str(info.value)
    assert "sample-7" in message
    assert "9 rows" in message
    assert "10 rows" in message
    with pytest.raises(RowCountMismatch, match="sample-8"):
        PackedSample(sample_id="sample-8", handle=bad, tokens=12, offset=0)
    assert spy.calls == []


def test_plans_refuse_overlaps_duplicates_long_samples_and_foreign_specs() -> None:
    store = new_store()
    a, _ = put_sample(store, SPEC, 4, seed=1)
    s1 = PackedSample(sample_id="a", handle=a, tokens=5, offset=0)
    s2 = PackedSample(sample_id="b", handle=a, tokens=5, offset=2)
    with pytest.raises(MisuseError, match="disjoint"):
        Pack(samples=(s1, s2), length=16)
    with pytest.raises(MisuseError, match="disjoint"):
        Pack(samples=(s1,), length=3)
    with pytest.raises(MisuseError, match="twice"):
        pack_samples([("a", a, 5), ("a", a, 5)], pack_max_length=16)
    with pytest.raises(MisuseError, match="longer than a pack"):
        pack_samples([("a", a, 5)], pack_max_length=3)
    with pytest.raises(SpecMismatch, match="sample a"):
        pack_samples([("a", a, 5)], pack_max_length=8, spec=WIDE)
    pack = Pack(samples=(s1,), length=8)
    with pytest.raises(MisuseError, match="exactly one micro-batch"):
        PackingPlan(spec=SPEC, packs=(pack,), micro_batches=((0,), (0,)))


def test_bad_leases_orders_and_engine_keys_are_refused_before_any_read() -> None:
    store = new_store()
    spy = SpyStore(store)
    a, _ = put_sample(store, SPEC, 4, seed=1)
    b, _ = put_sample(store, SPEC, 4, seed=2)
    plan = pack_samples([("a", a, 5), ("b", b, 5)], 4, dp_size=2)  # one pack each
    coords = RankCoords(dp_rank=0)
    with pytest.raises(MisuseError, match="never reads"):
        Materializer(spy, plan, coords, leases={"b": store.acquire(b, "r0")})
    with pytest.raises(MisuseError, match="exactly once"):
        Materializer(spy, plan, coords, order=[0, 1])
    key = EngineKey(key="k", rows=4)
    keyed = Handle.of(Segment(source=key, start=0, stop=4, spec=SPEC))
    with pytest.raises(MisuseError, match="engine key"):
        Materializer(spy, pack_samples([("k", keyed, 5)], 8), coords)
    assert spy.calls == []


# -- what is read ---------------------------------------------------------------------------


def test_a_rank_reads_only_its_slice_of_each_sample() -> None:
    spec = preset("qwen3-235b-a22b")  # 752 B/row; blocks of 512 rows
    store = new_store(block_rows=512)
    a, arr_a = put_sample(store, spec, 2000, seed=1)
    b, arr_b = put_sample(store, spec, 2000, seed=2)
    plan = pack_samples([("a", a, 2001), ("b", b, 2001)], pack_max_length=4096)
    spy = SpyStore(store)
    coords = RankCoords(sp_rank=1, sp_size=4)  # positions [1024, 2048)
    with Materializer(spy, plan, coords) as m:
        [item] = list(m)
    assert len(spy.calls) == 1  # one batched read per micro-batch
    assert spy.stored_ranges() == [
        (a.segments[0].source.payload_id, 1024, 2000),
        (b.segments[0].source.payload_id, 0, 48),
    ]
    np.testing.assert_array_equal(item.routes, np.concatenate([arr_a[1024:], arr_b[:48]]))
    stats = m.stats()
    assert stats.bytes_read == 1024 * spec.row_nbytes
    # blocks 2-3 of a (512 + 464 rows) and block 0 of b: not the 4000 rows of both samples
    assert stats.block_bytes == (512 + 464 + 512) * spec.row_nbytes
    assert stats.block_bytes < a.nbytes + b.nbytes


def test_padding_rows_have_distinct_ids_and_a_false_mask() -> None:
    spec = RouteSpec(num_layers=3, top_k=4, num_experts=5)
    store = new_store()
    a, arr = put_sample(store, spec, 10, seed=3)
    plan = pack_samples([("a", a, 11)], pack_max_length=32)
    with Materializer(store, plan, RankCoords()) as m:
        [item] = list(m)
    assert item.routes.shape == (32, 3, 4)
    np.testing.assert_array_equal(item.mask, np.arange(32) < 10)
    np.testing.assert_array_equal(item.routes[:10], arr)
    pad = item.routes[~item.mask]
    np.testing.assert_array_equal(pad, np.broadcast_to([0, 1, 2, 3], pad.shape))
    ordered = np.sort(pad, axis=-1)
    assert (ordered[..., 1:] != ordered[..., :-1]).all()
    wide = padding_rows(WIDE, 3)
    assert wide.dtype == np.uint16
    assert wide.shape == (3, 2, 2)


# -- leases -----------------------------------------------------------------------------------


def three_micro_batches(store: RouteStore, holder: str) -> tuple[PackingPlan, dict[str, Any]]:
    samples = []
    for i in range(6):
        handle, _ = put_sample(store, SPEC, 7, seed=i)
        samples.append((f"s{i}", handle, 8))
    plan = pack_samples(samples, pack_max_length=16)  # two samples per pack, one pack per mb
    leases = {sid: store.acquire(h, holder) for sid, h, _ in samples}
    return plan, leases


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_leases_are_released_as_micro_batches_are_consumed(prefetch: int) -> None:
    store = new_store()
    plan, leases = three_micro_batches(store, "train/step-0/r0")
    m = Materializer(store, plan, RankCoords(), leases=leases, prefetch=prefetch)
    held = []
    for _ in m:
        held.append(holder_leases(store, "train/step-0/r0"))
    held.append(holder_leases(store, "train/step-0/r0"))
    # micro-batch i's two samples go once the consumer moves past it
    assert held == [6, 4, 2, 0]
    assert m.stats().leases_released == 6
    assert m.stats().micro_batches_done == 3
    m.close()  # idempotent
    assert store.leaks() == []


def test_an_exception_in_the_training_loop_releases_everything() -> None:
    store = new_store()
    plan, leases = three_micro_batches(store, "r0")
    m = Materializer(store, plan, RankCoords(), leases=leases, prefetch=2)

    def failing_step() -> None:
        with m:
            next(m)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing_step()
    assert holder_leases(store, "r0") == 0
    assert m.stats().resident_bytes == 0
    assert not any(t.name.startswith("routeplay materializer") for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(m)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failed_read_is_raised_to_the_consumer_and_releases_leases(prefetch: int) -> None:
    store = new_store()
    plan, leases = three_micro_batches(store, "r0")
    for sid in ("s4", "s5"):  # the last micro-batch's payloads are dropped behind our back
        leases.pop(sid).release()
    m = Materializer(store, plan, RankCoords(), leases=leases, prefetch=prefetch)
    next(m)
    next(m)
    with pytest.raises(RoutesLost, match="payload"):
        next(m)
    assert holder_leases(store, "r0") == 0
    assert store.leaks() == []


def test_data_parallel_ranks_take_their_micro_batches_in_the_given_order() -> None:
    store = new_store()
    samples = [(f"s{i}", put_sample(store, SPEC, 7, seed=i)[0], 8) for i in range(8)]
    plan = pack_samples(samples, pack_max_length=8, dp_size=2)  # one sample per pack
    assert plan.schedule(1) == (1, 3, 5, 7)
    leases = {f"s{i}": store.acquire(samples[i][1], "dp1") for i in (1, 3, 5, 7)}
    m = Materializer(store, plan, RankCoords(dp_rank=1), leases=leases, order=[7, 1, 5, 3])
    seen = []
    for item in m:
        seen.append((item.index, holder_leases(store, "dp1")))
    assert seen == [(7, 4), (1, 3), (5, 2), (3, 1)]
    assert holder_leases(store, "dp1") == 0


# -- memory -------------------------------------------------------------------------------------


def consume_slowly(m: Materializer, shard: int, prefetch: int) -> list[MicroBatchRoutes]:
    """Consume like a trainer slower than the reads: wait until read-ahead is full."""
    out = []
    total = m.stats().micro_batches
    for item in m:
        out.append(item)
        want = min(prefetch + 1, total - len(out) + 1) * shard
        deadline = time.monotonic() + 5
        while m.stats().resident_bytes < want and time.monotonic() < deadline:
            time.sleep(0.001)
        assert m.stats().resident_bytes == want
    return out


@pytest.mark.parametrize("prefetch", [0, 2])
def test_peak_resident_bytes_do_not_grow_with_the_step(prefetch: int) -> None:
    coords = RankCoords(sp_rank=1, sp_size=2)
    pack_length, per_mb = 64, 2
    shard = per_mb * local_tokens(pack_length, coords) * (SPEC.row_nbytes + 1)  # routes + mask
    peaks = []
    for micro_batches in (3, 30):  # the second step is 10x larger
        store = new_store()
        samples = [
            (f"s{i}", put_sample(store, SPEC, 32, seed=i)[0], 33)
            for i in range(micro_batches * per_mb * 2)
        ]
        plan = pack_samples(samples, pack_length, per_mb)
        assert len(plan.micro_batches) == micro_batches
        leases = {sid: store.acquire(h, "r") for sid, h, _ in samples}
        with Materializer(store, plan, coords, leases=leases, prefetch=prefetch) as m:
            items = consume_slowly(m, shard, prefetch)
        assert all(item.nbytes == shard for item in items)
        assert m.stats().bytes_read == micro_batches * per_mb * 32 * SPEC.row_nbytes
        peaks.append(m.stats().peak_resident_bytes)
    assert peaks == [(prefetch + 1) * shard] * 2


def test_output_buffers_are_recycled_only_when_the_consumer_let_go() -> None:
    store = new_store()
    expected = []
    samples = []
    for i in range(12):
        handle, array = put_sample(store, SPEC, 7, seed=i)
        samples.append((f"s{i}", handle, 8))
        expected.append(array)
    plan = pack_samples(samples, pack_max_length=16)  # six micro-batches of two samples
    bases = set()
    with Materializer(store, plan, RankCoords(), prefetch=1) as m:
        for item in m:  # a trainer that drops each micro-batch before the next
            bases.add(id(item.routes.base))
            del item
    assert len(bases) <= 3  # (prefetch + 2) buffers at most, reused, not six fresh ones
    with Materializer(store, plan, RankCoords(), prefetch=1) as m:
        kept = list(m)  # a consumer that keeps every micro-batch: nothing is overwritten
    assert len({id(item.routes.base) for item in kept}) == len(kept)
    for item in kept:
        rows = [expected[int(sid[1:])] for sid in _sample_ids(plan, item.index)]
        np.testing.assert_array_equal(item.routes[item.mask], np.concatenate(rows))


def test_a_closed_materializer_leaves_its_buffers_to_the_next_step() -> None:
    """A trainer makes a materializer per step: the next one copies into the buffers the
    last one freed (warm pages), never into one a consumer still holds."""
    store = new_store()
    spec = RouteSpec(num_layers=3, top_k=5, num_experts=11)  # a row shape no other test reads
    samples = [(f"s{i}", put_sample(store, spec, 7, seed=i)[0], 8) for i in range(4)]
    plan = pack_samples(samples, pack_max_length=16)  # two micro-batches of two samples
    with Materializer(store, plan, RankCoords(), prefetch=1) as m:
        first_step = {id(item.routes.base) for item in m}
    with Materializer(store, plan, RankCoords(), prefetch=1) as m:
        kept = list(m)  # this step's arrays stay with the consumer
    assert {id(item.routes.base) for item in kept} <= first_step
    others = [(f"t{i}", put_sample(store, spec, 7, seed=10 + i)[0], 8) for i in range(4)]
    with Materializer(store, pack_samples(others, pack_max_length=16), RankCoords()) as m:
        third_step = list(m)  # other rows: an overwrite of a kept array would show
    assert not {id(item.routes.base) for item in third_step} & {
        id(item.routes.base) for item in kept
    }
    for item in kept:  # nothing the third step copied overwrote the kept arrays
        rows = [store.read(sample.handle) for sample in plan.samples_of(item.index)]
        np.testing.assert_array_equal(item.routes[item.mask], np.concatenate(rows))


def _sample_ids(plan: PackingPlan, mb: int) -> list[str]:
    return [sample.sample_id for sample in plan.samples_of(mb)]


def test_a_rank_takes_its_leases_in_one_call_and_reads_without_another() -> None:
    """``Materializer.leasing``: one lease (one ``lease_many``) over exactly the payloads
    of this rank's samples, no locate (the grant carries the blocks), ended with the
    rank's last micro-batch."""
    store = RouteStore.local(StoreConfig(run="leasing"))
    arrays = [random_routing(SPEC, 9, seed) for seed in range(8)]
    handles = store.put_many([canonicalize(a, SPEC) for a in arrays])
    plan = pack_samples(
        [(f"s{i}", h, 10) for i, h in enumerate(handles)], pack_max_length=20, dp_size=2
    )
    mine = [s.sample_id for mb in plan.schedule(1) for s in plan.samples_of(mb)]
    before = dict(store.stats().calls_by_op)
    with Materializer.leasing(store, plan, RankCoords(dp_rank=1), holder="r1") as m:
        assert dict(store.stats().leases_by_holder) == {"r1": 1}
        mine_bytes = sum(handles[int(sid[1:])].nbytes for sid in mine)
        assert dict(store.stats().bytes_by_holder) == {"r1": mine_bytes}
        assert m.stats().leases_held == 1
        got = {
            s.sample_id: mb.routes[s.offset : s.stop] for mb in m for s in plan.samples_of(mb.index)
        }
    after = dict(store.stats().calls_by_op)
    grew = {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}
    assert grew["lease_many"] == 1
    assert grew["release_many"] == 1  # once, after the rank's last micro-batch
    assert "locate" not in grew
    assert store.stats().leases == 0
    assert m.stats().leases_released == 1
    assert m.stats().leases_held == 0
    for sample_id in mine:
        np.testing.assert_array_equal(got[sample_id], arrays[int(sample_id[1:])])


def test_a_leasing_rank_ends_its_share_lease_when_it_stops_early_or_is_refused() -> None:
    """The share lease ends with ``close()`` after one micro-batch (a trainer's step that
    stops early), and when the constructor refuses the plan (an engine key among
    the rank's samples): nothing stays leased either way."""
    store = RouteStore.local(StoreConfig(run="share"))
    handles = store.put_many([canonicalize(random_routing(SPEC, 9, s), SPEC) for s in range(6)])
    plan = pack_samples([(f"s{i}", h, 10) for i, h in enumerate(handles)], pack_max_length=10)
    m = Materializer.leasing(store, plan, RankCoords(), holder="r")
    with m:
        next(iter(m))
        assert store.stats().leases == 1
    # ``with`` closed it after one of its micro-batches, as an exception would.
    assert store.stats().leases == 0
    assert m.stats().leases_released == 1
    keyed = Handle.of(Segment(source=EngineKey(key="k", rows=9), start=0, stop=9, spec=SPEC))
    [fresh] = store.put_many([canonicalize(random_routing(SPEC, 9, 7), SPEC)])
    mixed = pack_samples([("a", fresh, 10), ("k", keyed, 10)], pack_max_length=20)
    with pytest.raises(MisuseError, match="engine key"):
        Materializer.leasing(store, mixed, RankCoords(), holder="r")
    assert store.stats().leases == 0


def test_a_leasing_rank_starts_pulling_its_whole_share_at_once() -> None:
    """``Materializer.leasing`` hands every block its grants carry to ``Backend.pull``
    once, before the first read: one bundle, not one pull per micro-batch."""
    store = RouteStore.local(StoreConfig(run="pull"))
    handles = store.put_many([canonicalize(random_routing(SPEC, 9, s), SPEC) for s in range(6)])
    plan = pack_samples([(f"s{i}", h, 10) for i, h in enumerate(handles)], pack_max_length=20)
    pulled: list[int] = []
    backend = store.backend
    backend.pull = lambda refs: pulled.append(len(refs))  # type: ignore[method-assign]
    with Materializer.leasing(store, plan, RankCoords(), holder="r") as m:
        assert pulled == [6]  # one block per payload, all six, before any read
        assert sum(1 for _ in m) == len(plan.micro_batches)
    assert pulled == [6]
