"""A trainer that packs its own way and goes over a step several times (XTuner's flow).

The reference is written from XTuner's source (commit ``b934f462``), not from routeplay:
``TrainingController._packing`` concatenates each pack's samples (``input_ids =
prompt + response[:-1]``, one routing row each) and pads the tail to
``pack_max_length``; ``fit`` appends whole padding packs so the pack count is a multiple
of the DP size and deals pack ``i`` to DP rank ``i % dp``; ``SequenceContext.split`` pads
a pack to a multiple of ``sp`` (``pad_to_multiple_of``) and gives SP rank ``r`` rows
``[r * ceil(n / sp), (r + 1) * ceil(n / sp))`` (``split_for_sequence_parallel``). XTuner
fills padding routing with zeros or random ids; routeplay with ``arange(K) % E`` (distinct
ids) and mask False, which is all the reference changes.
"""

from __future__ import annotations

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

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.errors import MisuseError, RowCountMismatch
from routeplay.store import Lease, RouteStore, StoreConfig
from routeplay.train.materializer import Materializer
from routeplay.train.packing import PackedSample, PackingPlan, RankCoords, local_ranges

SPEC = RouteSpec(num_layers=2, top_k=3, num_experts=7)
WIDE = RouteSpec(num_layers=2, top_k=2, num_experts=300)  # uint16
Arrays = dict[str, npt.NDArray[Any]]


def new_store(run: str) -> RouteStore:
    return RouteStore.local(StoreConfig(run=run, block_rows=8))


def put(store: RouteStore, spec: RouteSpec, rows: int, seed: int) -> tuple[Handle, Any]:
    array = random_routing(spec, rows, seed).astype(spec.dtype)
    return store.put(canonicalize(array, spec)), array


def pad_row(spec: RouteSpec) -> npt.NDArray[Any]:
    return (np.arange(spec.top_k) % spec.num_experts).astype(spec.dtype)


def xtuner_pack(
    spec: RouteSpec, arrays: Sequence[npt.NDArray[Any]], pack_max_length: int
) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """``_packing``: the samples' rows back to back, then the padded tail."""
    real = sum(len(a) for a in arrays)
    rows = np.empty((pack_max_length, *spec.row_shape), spec.dtype)
    rows[:] = pad_row(spec)
    if arrays:
        rows[:real] = np.concatenate(arrays)
    return rows, np.arange(pack_max_length) < real


def xtuner_split(
    rows: npt.NDArray[Any], mask: npt.NDArray[np.bool_], sp: int, rank: int, spec: RouteSpec
) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """``SequenceContext.split``: ``pad_to_multiple_of`` then ``split_for_sequence_parallel``."""
    length = len(rows)
    if length % sp:
        extra = sp - length % sp
        rows = np.concatenate([rows, np.broadcast_to(pad_row(spec), (extra, *spec.row_shape))])
        mask = np.concatenate([mask, np.zeros(extra, bool)])
    split = -(-len(rows) // sp)
    start = min(rank * split, len(rows))
    stop = min(start + split, len(rows))
    return rows[start:stop], mask[start:stop]


def xtuner_step(
    store: RouteStore, spec: RouteSpec, packs_tokens: Sequence[Sequence[int]], seed: int
) -> tuple[list[list[tuple[str, Handle, int]]], Arrays]:
    """Samples of ``tokens`` tokens each (``tokens - 1`` routing rows), grouped in packs."""
    packs, arrays = [], {}
    for p, tokens_list in enumerate(packs_tokens):
        pack = []
        for i, tokens in enumerate(tokens_list):
            sample_id = f"p{p}s{i}"
            handle, arrays[sample_id] = put(store, spec, tokens - 1, seed + 31 * p + i)
            pack.append((sample_id, handle, tokens))
        packs.append(pack)
    return packs, arrays


def leases_of(store: RouteStore, plan: PackingPlan, dp: int, holder: str) -> dict[str, Lease]:
    return {
        s.sample_id: store.acquire(s.handle, holder)
        for mb in plan.schedule(dp)
        for s in plan.samples_of(mb)
    }


def holder_leases(store: RouteStore, holder: str) -> int:
    return dict(store.stats().leases_by_holder).get(holder, 0)


class ReleaseSpy:
    """Records every lease the store is asked to release (idempotent calls included)."""

    def __init__(self, store: RouteStore) -> None:
        self.released: list[tuple[str, ...]] = []
        inner = store.release_many

        def release_many(leases: Sequence[Lease]) -> None:
            self.released.extend(lease.lease_ids for lease in leases)
            inner(leases)

        store.release_many = release_many  # type: ignore[method-assign]


# -- XTuner's layout -------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    sp=st.sampled_from([1, 2, 3, 4]),
    dp=st.sampled_from([1, 2, 3]),
    pack_max_length=st.integers(5, 23),
    sizes=st.lists(st.lists(st.integers(2, 8), max_size=3), min_size=1, max_size=4),
    spec=st.sampled_from([SPEC, WIDE]),
    seed=seeds,
)
def test_a_trainers_own_packs_read_as_xtuner_lays_them_on_every_rank(
    sp: int, dp: int, pack_max_length: int, sizes: list[list[int]], spec: RouteSpec, seed: int
) -> None:
    # Keep only samples that fit: XTuner asserts len(input_ids) <= pack_max_length.
    packs_tokens, used = [], 0
    for pack in sizes:
        kept, used = [], 0
        for tokens in pack:
            if used + tokens - 1 <= pack_max_length:
                kept.append(tokens)
                used += tokens - 1
        packs_tokens.append(kept)  # an empty list is a padding pack of the trainer's own
    store = new_store("xtuner-layout")
    packs, arrays = xtuner_step(store, spec, packs_tokens, seed)
    plan = PackingPlan.from_packs(packs, pack_max_length=pack_max_length, dp_size=dp, spec=spec)
    # The step's batch keeps every payload alive while each rank holds (and ends) its own.
    batch = [store.acquire(h, "train/step") for pack in packs for _, h, _ in pack]
    # fit(): pad_num = ceil(n / dp) * dp - n whole padding packs, then packs[dp_idx::dp].
    assert len(plan.packs) == -(-len(packs) // dp) * dp
    expected = [
        xtuner_pack(spec, [arrays[sid] for sid, _, _ in pack], pack_max_length) for pack in packs
    ]
    expected += [xtuner_pack(spec, [], pack_max_length)] * (len(plan.packs) - len(packs))
    for d in range(dp):
        assert [plan.micro_batches[mb] for mb in plan.schedule(d)] == [
            (i,) for i in range(d, len(plan.packs), dp)
        ]
        for r in range(sp):
            coords = RankCoords(dp_rank=d, sp_rank=r, sp_size=sp, sp_split="pad_to_multiple")
            holder = f"dp{d}/sp{r}"
            leases = leases_of(store, plan, d, holder)
            with Materializer(store, plan, coords, leases=leases, prefetch=1) as m:
                for item in m:
                    [pack] = item.packs
                    rows, mask = xtuner_split(*expected[pack], sp, r, spec)
                    np.testing.assert_array_equal(item.routes, rows)
                    np.testing.assert_array_equal(item.mask, mask)
            assert holder_leases(store, holder) == 0
    Lease.release_all(batch)
    assert store.leaks() == []


def test_empty_dp_padding_packs_read_as_distinct_padding_rows() -> None:
    store = new_store("dp-padding")
    packs, arrays = xtuner_step(store, SPEC, [[5, 4], [9], [3, 3, 3]], seed=7)
    plan = PackingPlan.from_packs(packs, pack_max_length=12, dp_size=4)
    assert [len(p.samples) for p in plan.packs] == [2, 1, 3, 0]  # one whole padding pack
    assert plan.packs[3].length == 12
    assert plan.dp_ranks == (0, 1, 2, 3)
    coords = RankCoords(dp_rank=3, sp_rank=1, sp_size=2)
    with Materializer(store, plan, coords, leases={}) as m:
        [item] = list(m)
    assert item.packs == (3,)
    assert item.routes.shape == (6, *SPEC.row_shape)
    assert not item.mask.any()
    np.testing.assert_array_equal(item.routes, np.broadcast_to(pad_row(SPEC), item.routes.shape))
    ordered = np.sort(item.routes, axis=-1)
    assert (ordered[..., 1:] != ordered[..., :-1]).all()  # distinct ids in every padding row
    # A real rank next to it reads exact rows: pack 2's [3, 3, 3] tokens = 6 rows, then pad.
    with Materializer(store, plan, RankCoords(dp_rank=2)) as m:
        [item] = list(m)
    real = np.concatenate([arrays["p2s0"], arrays["p2s1"], arrays["p2s2"]])
    np.testing.assert_array_equal(item.routes[:6], real)
    np.testing.assert_array_equal(item.mask, np.arange(12) < 6)
    # Without pad_dp the trainer's own count stands (and DP rank 3 trains nothing).
    unpadded = PackingPlan.from_packs(packs, pack_max_length=12, dp_size=4, pad_dp=False)
    assert len(unpadded.packs) == 3
    assert unpadded.schedule(3) == ()


def test_sp_zero_padding_reads_exact_rows_and_pads_past_the_pack() -> None:
    store = new_store("sp-padding")
    packs, arrays = xtuner_step(store, SPEC, [[4, 8]], seed=3)  # 3 + 7 = 10 rows, no tail
    plan = PackingPlan.from_packs(packs)  # each pack ends at its last sample: 10 positions
    [pack] = plan.packs
    assert pack.length == 10
    real = np.concatenate([arrays["p0s0"], arrays["p0s1"]])
    got_rows, got_mask = [], []
    for r in range(4):  # 10 rows over sp=4: 3 rows each, the last rank holds 1 + 2 pad
        coords = RankCoords(sp_rank=r, sp_size=4, sp_split="pad_to_multiple")
        assert local_ranges(pack, coords) == [(3 * r, 3 * r + 3)]
        with Materializer(store, plan, coords) as m:
            [item] = list(m)
        got_rows.append(item.routes)
        got_mask.append(item.mask)
    routes, mask = np.concatenate(got_rows), np.concatenate(got_mask)
    np.testing.assert_array_equal(mask, np.arange(12) < 10)
    np.testing.assert_array_equal(routes[:10], real)
    np.testing.assert_array_equal(routes[10:], np.broadcast_to(pad_row(SPEC), (2, 2, 3)))
    # The even split still refuses it, and names the option; CP with SP padding is refused.
    with pytest.raises(MisuseError, match="pad_to_multiple"):
        local_ranges(pack, RankCoords(sp_rank=0, sp_size=4))
    with pytest.raises(MisuseError, match="without CP"):
        RankCoords(sp_size=2, cp_size=2, sp_split="pad_to_multiple")
    with pytest.raises(MisuseError, match="sp_split"):
        RankCoords(sp_split="ring")  # type: ignore[arg-type]


def test_packs_of_token_ranges_and_placed_samples() -> None:
    store = new_store("ranges")
    whole, arr_a = put(store, SPEC, 11, seed=1)  # a 12-token sample
    other, arr_b = put(store, SPEC, 3, seed=2)
    placed = PackedSample(sample_id="b", handle=other, tokens=4, offset=8)
    # Two trainable segments of one sample in two packs, then a placed sample after a gap.
    plan = PackingPlan.from_packs(
        [[("a-turn1", whole, 12, (0, 4))], [("a-turn2", whole, 12, (4, 11)), placed]],
        pack_max_length=12,
    )
    first, second = plan.packs
    assert [(s.offset, s.rows) for s in first.samples] == [(0, 4)]
    assert [(s.offset, s.rows) for s in second.samples] == [(0, 7), (8, 3)]
    with Materializer(store, plan, RankCoords()) as m:
        a, b = list(m)
    np.testing.assert_array_equal(a.routes[:4], arr_a[:4])
    np.testing.assert_array_equal(b.routes[:7], arr_a[4:])
    np.testing.assert_array_equal(b.routes[8:11], arr_b)
    np.testing.assert_array_equal(b.mask, np.isin(np.arange(12), [*range(7), 8, 9, 10]))
    with pytest.raises(RowCountMismatch, match="bad"):
        PackingPlan.from_packs([[("bad", whole, 11)]])  # 11 rows, not 10
    with pytest.raises(RowCountMismatch, match="bad"):
        PackingPlan.from_packs([[("bad", whole, 11, (0, 2))]])  # checked before the range
    with pytest.raises(MisuseError, match="inside the sample"):
        PackingPlan.from_packs([[("a", whole, 12, (5, 12))]])
    with pytest.raises(MisuseError, match="longer than pack_max_length"):
        PackingPlan.from_packs([[("a", whole, 12)]], pack_max_length=10)
    with pytest.raises(MisuseError, match="needs a length"):
        PackingPlan.from_packs([[("a", whole, 12)], []])
    with pytest.raises(MisuseError, match="must be positive"):
        PackingPlan.from_packs([[("a", whole, 12)]], pack_max_length=0)
    with pytest.raises(MisuseError, match="needs a spec"):
        PackingPlan.from_packs([[]], pack_max_length=4)


# -- several passes over one step ----------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_three_passes_read_exact_rows_on_every_sp_rank_and_end_leases_once(prefetch: int) -> None:
    store = new_store(f"passes-{prefetch}")
    spy = ReleaseSpy(store)
    packs, arrays = xtuner_step(store, SPEC, [[5, 6], [11], [4, 4, 4], [7]], seed=11)
    plan = PackingPlan.from_packs(packs, pack_max_length=12, dp_size=2)
    batch = [store.acquire(h, "train/step") for pack in packs for _, h, _ in pack]
    sp = 3
    for d in range(2):
        for r in range(sp):
            coords = RankCoords(dp_rank=d, sp_rank=r, sp_size=sp)
            holder = f"dp{d}/sp{r}"
            leases = leases_of(store, plan, d, holder)
            held = []
            with Materializer(store, plan, coords, leases=leases, prefetch=prefetch, passes=3) as m:
                for pass_index in range(3):
                    for item in m.next_pass():
                        assert item.pass_index == pass_index
                        [pack] = item.packs
                        sids = [s.sample_id for s in plan.packs[pack].samples]
                        full = xtuner_pack(SPEC, [arrays[s] for s in sids], 12)
                        rows, mask = xtuner_split(*full, sp, r, SPEC)
                        np.testing.assert_array_equal(item.routes, rows)
                        np.testing.assert_array_equal(item.mask, mask)
                    held.append(holder_leases(store, holder))
                stats = m.stats()
            # Held through the first two passes, all ended by the end of the last.
            assert held == [len(leases), len(leases), 0]
            assert stats.reads == 3 * stats.micro_batches
            assert stats.micro_batches_done == 3 * stats.micro_batches
            assert stats.leases_released == len(leases)
            assert stats.resident_bytes == 0
            shard = 4 * (SPEC.row_nbytes + 1)  # one pack of 12 over sp=3: 4 rows + mask
            assert stats.peak_resident_bytes <= (prefetch + 1) * shard  # per pass, not the step
            assert all(lease.released for lease in leases.values())
    assert len(spy.released) == len(set(spy.released))  # no lease was sent twice
    Lease.release_all(batch)
    assert store.leaks() == []


def test_leases_end_once_after_the_last_pass_as_its_micro_batches_are_consumed() -> None:
    store = new_store("passes-schedule")
    packs, _ = xtuner_step(store, SPEC, [[5, 6], [11], [4, 4]], seed=5)  # 5 samples, 3 mbs
    plan = PackingPlan.from_packs(packs, pack_max_length=12)
    leases = leases_of(store, plan, 0, "r")
    spy = ReleaseSpy(store)
    seen = []
    with Materializer(store, plan, RankCoords(), leases=leases, passes=2) as m:
        for item in m:  # plain iteration: every pass in a row
            seen.append((item.pass_index, item.index, holder_leases(store, "r")))
    assert seen == [(0, 0, 5), (0, 1, 5), (0, 2, 5), (1, 0, 5), (1, 1, 3), (1, 2, 2)]
    assert holder_leases(store, "r") == 0
    assert sorted(spy.released) == sorted(lease.lease_ids for lease in leases.values())


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_exception_in_a_later_pass_ends_every_lease_once(prefetch: int) -> None:
    store = new_store(f"passes-fail-{prefetch}")
    packs, _ = xtuner_step(store, SPEC, [[5, 6], [11], [4, 4]], seed=9)
    plan = PackingPlan.from_packs(packs, pack_max_length=12)
    leases = leases_of(store, plan, 0, "r")
    spy = ReleaseSpy(store)
    m = Materializer(store, plan, RankCoords(), leases=leases, prefetch=prefetch, passes=3)

    def old_logprobs_then_fail() -> None:
        with m:
            list(m.next_pass())
            for _ in m.next_pass():
                raise RuntimeError("reference model failed")

    with pytest.raises(RuntimeError, match="reference model"):
        old_logprobs_then_fail()
    assert holder_leases(store, "r") == 0
    assert sorted(spy.released) == sorted(lease.lease_ids for lease in leases.values())
    assert m.stats().resident_bytes == 0
    assert not any(t.name.startswith("routeplay materializer") for t in threading.enumerate())
    with pytest.raises(MisuseError, match="closed"):
        m.next_pass()
    m.close()  # idempotent: nothing released twice
    assert len(spy.released) == len(leases)
    assert store.leaks() == []


def test_passes_are_taken_in_turn() -> None:
    store = new_store("passes-misuse")
    packs, _ = xtuner_step(store, SPEC, [[5], [6]], seed=2)
    plan = PackingPlan.from_packs(packs, pack_max_length=8)
    leases = leases_of(store, plan, 0, "r")
    with Materializer(store, plan, RankCoords(), leases=leases, passes=2) as m:
        first = m.next_pass()
        next(first)
        with pytest.raises(MisuseError, match="pass 0 is not finished"):
            m.next_pass()
        next(first)
        list(first)  # the pass ends: the next may begin
        assert len(list(m.next_pass())) == 2
        with pytest.raises(MisuseError, match="every pass"):
            m.next_pass()
    assert all(lease.released for lease in leases.values())
    with pytest.raises(MisuseError, match="passes must be at least 1"):
        Materializer(store, plan, RankCoords(), passes=0)
    # A DP rank without micro-batches goes through its passes without reading anything.
    with Materializer(store, plan, RankCoords(dp_rank=1), passes=2) as idle:
        assert [list(idle.next_pass()) for _ in range(2)] == [[], []]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_memory_per_pass_is_bounded_by_micro_batches_not_the_step(prefetch: int) -> None:
    store = new_store(f"passes-memory-{prefetch}")
    packs, _ = xtuner_step(store, SPEC, [[9, 8]] * 10, seed=13)  # 10 packs of 15 rows
    plan = PackingPlan.from_packs(packs, pack_max_length=16)
    coords = RankCoords(sp_rank=1, sp_size=2)
    shard = 8 * (SPEC.row_nbytes + 1)  # half a pack: routes and mask
    leases = leases_of(store, plan, 0, "r")
    with Materializer(store, plan, coords, leases=leases, prefetch=prefetch, passes=3) as m:
        for _ in range(3):
            for _ in m.next_pass():
                # A trainer slower than the reads: let the read-ahead fill before moving on.
                done = m.stats().micro_batches_done
                want = min(prefetch + 1, 30 - done) * shard
                deadline = time.monotonic() + 5
                while m.stats().resident_bytes < want and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert m.stats().resident_bytes == want
        stats = m.stats()
    assert stats.peak_resident_bytes == (prefetch + 1) * shard  # of 30 reads in the step
    assert stats.bytes_read == 3 * 10 * 7 * SPEC.row_nbytes  # each pass reads its rows again
    assert holder_leases(store, "r") == 0
