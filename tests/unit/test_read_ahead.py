"""Read-ahead windows (``routeplay.train.read_ahead``, ``RouteStore.hold_blocks``): a
rank's next micro-batches' blocks fetched in one call and held while each micro-batch is
copied out; the same rows as one fetch per micro-batch; errors still surface at the
micro-batch they concern; the views go before the window's last micro-batch is out."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import random_routing

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.errors import RoutesLost
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.client.block_copies import HeldBlocks
from routeplay.store.client.lease import Lease
from routeplay.train import Materializer, RankCoords, pack_samples
from routeplay.train.read_ahead import PlannedRead, hold_window, windows

SPEC = RouteSpec(num_layers=2, top_k=3, num_experts=7)


def planned(block_bytes: int, position: int = 0) -> PlannedRead:
    return PlannedRead(
        position=position,
        pass_index=0,
        mb=0,
        handle=Handle(SPEC),
        mask=np.zeros(0, bool),
        real_rows=0,
        block_bytes=block_bytes,
    )


@given(
    st.lists(st.integers(0, 100), max_size=40),
    st.integers(1, 150),
    st.integers(1, 6),
    st.integers(1, 6),
    st.sets(st.integers(0, 40)),
)
def test_windows_keep_order_and_stay_within_their_bounds(
    sizes: list[int], max_bytes: int, max_items: int, first_items: int, ends: set[int]
) -> None:
    reads = [planned(size, position) for position, size in enumerate(sizes)]
    got = list(
        windows(
            reads,
            max_bytes=max_bytes,
            max_items=max_items,
            first_items=first_items,
            ends_after=ends,
        )
    )
    assert [r for window in got for r in window] == reads
    for window in got:  # a read that ends leases is a window's last
        assert all(r.position not in ends for r in window[:-1])
    limits = [min(first_items, max_items)] + [max_items] * len(got)
    for window, limit in zip(got, limits, strict=False):
        assert 1 <= len(window) <= limit
        total = sum(r.block_bytes for r in window)
        assert total <= max_bytes or len(window) == 1  # an oversized read goes alone
    for (window, after), limit in zip(itertools.pairwise(got), limits, strict=False):
        full = len(window) == limit  # a window closes only when full, or at an end
        ended = window[-1].position in ends
        assert (
            full or ended or sum(r.block_bytes for r in window) + after[0].block_bytes > max_bytes
        )


class Fetches:
    """Counts the backend's block fetches of a local store."""

    def __init__(self, store: RouteStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        backend = store.backend
        real = backend.fetch_as_created

        def counted(refs: Any, what: str) -> Iterator[Any]:
            self.count += 1
            return real(refs, what)

        monkeypatch.setattr(backend, "fetch_as_created", counted)


def stored(store: RouteStore, count: int, rows: int = 7) -> list[tuple[Handle, Any]]:
    arrays = [random_routing(SPEC, rows, seed).astype(SPEC.dtype) for seed in range(count)]
    return list(zip(store.put_many([canonicalize(a, SPEC) for a in arrays]), arrays, strict=True))


def test_held_blocks_serve_reads_without_a_fetch_and_others_fetch_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = RouteStore.local(StoreConfig(run="hold"))
    (a, rows_a), (b, rows_b), (c, rows_c) = stored(store, 3)
    fetches = Fetches(store, monkeypatch)
    with store.hold_blocks([(a, 0, a.rows), (b, 2, 5)]) as held:
        assert fetches.count == 1
        assert len(held) == 2
        [got_b] = store.read_many([(b, 2, 5)], held=held)
        [got_a] = store.read_many([(a, 0, a.rows)], held=held)
        assert fetches.count == 1  # both came from the held views
        [got_c] = store.read_many([(c, 0, c.rows)], held=held)  # not held: fetched
        assert fetches.count == 2
    assert len(held) == 0  # released by ``with``
    np.testing.assert_array_equal(got_a, rows_a)
    np.testing.assert_array_equal(got_b, rows_b[2:5])
    np.testing.assert_array_equal(got_c, rows_c)


def test_a_window_that_cannot_be_held_reads_each_micro_batch_on_its_own() -> None:
    store = RouteStore.local(StoreConfig(run="nohold"))
    (a, _), (b, _) = stored(store, 2)
    reads = [planned(10), planned(10)]
    with hold_window(object(), reads, "r") as held:  # a store without hold_blocks
        assert held is None
    with hold_window(store, reads[:1], "r") as held:  # one read: nothing to share
        assert held is None
    store.acquire(b, "gone").release()  # b's payload is dropped
    lost = [
        PlannedRead(position=i, pass_index=0, mb=i, handle=h, mask=np.ones(h.rows, bool),
                    real_rows=h.rows, block_bytes=1)
        for i, h in enumerate((a, b))
    ]  # fmt: skip
    with pytest.raises(RoutesLost):
        store.hold_blocks([(h, 0, h.rows) for h in (a, b)])
    with hold_window(store, lost, "r") as held:  # the fetch failed: read one by one
        assert held is None


@pytest.mark.parametrize("prefetch", [1, 3])
def test_a_rank_fetches_a_window_at_a_time_and_reads_the_same_rows(
    monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    store = RouteStore.local(StoreConfig(run="window"))
    samples = stored(store, 40)
    plan = pack_samples(
        [(f"s{i}", h, h.rows + 1) for i, (h, _) in enumerate(samples)], pack_max_length=16
    )  # two samples per pack, one pack per micro-batch: 20 micro-batches
    fetches = Fetches(store, monkeypatch)
    got: dict[str, Any] = {}
    with Materializer.leasing(store, plan, RankCoords(), holder="r", prefetch=prefetch) as m:
        for mb in m:
            for s in plan.samples_of(mb.index):
                got[s.sample_id] = mb.routes[s.offset : s.stop].copy()
    assert len(plan.micro_batches) == 20
    # The first micro-batch alone (the trainer's first waits for nothing else), then the
    # other 19 in one window (at most 32, 64 MiB).
    assert fetches.count == 2
    for i, (_, array) in enumerate(samples):
        np.testing.assert_array_equal(got[f"s{i}"], array)
    assert store.stats().leases == 0


def test_no_view_outlives_a_sample_lease_the_materializer_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per-sample leases ended as their last micro-batch is consumed (``release_each``),
    over two passes: the first pass ends no lease, so its micro-batches are read from
    held windows; a window ends at every micro-batch whose consumption ends leases, so
    when a lease ends, no held view of its payload is left."""
    store = RouteStore.local(StoreConfig(run="views"))
    samples = stored(store, 12)
    plan = pack_samples(
        [(f"s{i}", h, h.rows + 1) for i, (h, _) in enumerate(samples)], pack_max_length=16
    )
    leases = store.acquire_many([(h, "r") for h, _ in samples])
    live: list[HeldBlocks] = []
    held_sizes: list[int] = []  # blocks of each hold, when it was made
    real_init = HeldBlocks.__init__

    def tracked(self: HeldBlocks, views: dict[tuple[str, int], Any]) -> None:
        real_init(self, views)
        live.append(self)
        held_sizes.append(len(views))

    monkeypatch.setattr(HeldBlocks, "__init__", tracked)
    overlaps: list[set[str]] = []
    real_release = Lease.release_all

    def release_all(ended: Any) -> None:
        ended = list(ended)
        pids = {seg.source.payload_id for lease in ended for seg in lease.handle.segments}
        held = {pid for blocks in live for pid, _ in blocks._views}
        overlaps.append(pids & held)
        real_release(ended)

    monkeypatch.setattr(Lease, "release_all", staticmethod(release_all))
    by_id = {f"s{i}": lease for i, lease in enumerate(leases)}
    with Materializer(store, plan, RankCoords(), leases=by_id, prefetch=3, passes=2) as m:
        assert sum(1 for _ in m) == 2 * len(plan.micro_batches)
    assert any(size > 1 for size in held_sizes)  # windows were held: the check saw some
    assert len(overlaps) >= len(plan.micro_batches)  # a release per last-pass micro-batch
    assert all(not overlap for overlap in overlaps)
    assert store.stats().leases == 0


def test_a_hold_that_fails_midway_keeps_no_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any error during a hold's fetch (not only the typed ones) drops the views it had
    gathered: the traceback a trainer keeps must not pin blocks."""
    store = RouteStore.local(StoreConfig(run="midway"))
    (a, _), (b, _) = stored(store, 2)
    backend = store.backend
    real = backend.fetch_as_created

    def one_then_fail(refs: Any, what: str) -> Iterator[Any]:
        yield from real(refs[:1], what)
        raise RuntimeError("the fetch broke")

    monkeypatch.setattr(backend, "fetch_as_created", one_then_fail)
    with pytest.raises(RuntimeError, match="broke") as caught:
        store.hold_blocks([(a, 0, a.rows), (b, 0, b.rows)])
    tb = caught.value.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    [hold] = [f for f in frames if f.f_code.co_name == "hold"]
    assert hold.f_locals["views"] == {}
