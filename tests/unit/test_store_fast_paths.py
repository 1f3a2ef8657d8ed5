"""The store's fast paths, on the in-process backend (the same shard classes as Ray):
leases carry block references (leased reads make no shard call), a step acquires and
releases in one call per shard, pins never outlive a lease, batched puts, shared
prompt prefixes (verified, counted), an LMDeploy key with one trailing row, reused
output buffers."""

from __future__ import annotations

import copy as copying
import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routeplay.core import EngineKey, Handle, InlineSource, Routes, RouteSpec, Segment, canonicalize
from routeplay.errors import (
    MisuseError,
    ReleaseFailed,
    RoutesLost,
    RowCountMismatch,
    SpecMismatch,
    StoreTimeout,
)
from routeplay.store import RouteStore, StoreConfig
from routeplay.store import write_plan as writes
from routeplay.store.remote.backend import LocalBackend
from routeplay.store.write_plan import plan_batch

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


class CountingStore:
    """Counts the shard calls a client makes (every shard call, metadata or release, is
    sent through ``Backend.send``)."""

    def __init__(self, store: RouteStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        backend = store.backend
        for name in ("send",):
            real = getattr(backend, name)

            def counted(calls: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
                self.calls.extend(call.method for call in calls)
                return _real(calls, *args, **kwargs)

            monkeypatch.setattr(backend, name, counted)


def copy_lease(lease: Any) -> Any:
    """A copy made through ``Lease.__reduce__``, as pickling makes it."""
    return copying.copy(lease)


@pytest.fixture
def store() -> RouteStore:
    return RouteStore.local(StoreConfig(run="fast", shards=3))


def test_a_1000_segment_handle_acquires_and_reads_with_one_call_per_shard(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = [routing(5, seed=i) for i in range(1000)]
    handles = [store.put(r, weight_version=i) for i, r in enumerate(parts)]
    joined = Handle.concat(SPEC, handles)
    assert len(joined.segments) == 1000
    assert len(joined.sources()) == 1000
    spy = CountingStore(store, monkeypatch)
    lease = store.acquire(joined, "session/long")
    assert spy.calls == ["lease_many"] * 3  # one per shard, whatever the segment count
    rows = lease.read(1234, 4321)
    assert spy.calls == ["lease_many"] * 3  # the grant carried the blocks: no locate
    np.testing.assert_array_equal(rows, np.concatenate([r.array for r in parts])[1234:4321])
    lease.release()  # waited for, one call per shard
    assert spy.calls.count("release") == 3


def test_a_step_acquires_and_releases_many_samples_in_one_call_per_shard(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    handles = store.put_many([routing(20, seed=i) for i in range(12)])
    spy = CountingStore(store, monkeypatch)
    leases = store.acquire_many([(h, f"train/step-1/{i}") for i, h in enumerate(handles)])
    assert spy.calls == ["lease_many"]  # a batched put lands on one shard
    outs = store.read_many([(h, 2, 18) for h in handles])
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, routing(20, seed=i).array[2:18])
    assert dict(store.stats().leases_by_holder)["train/step-1/3"] == 1
    store.release_many(leases)
    store.release_many(leases)  # idempotent
    assert all(lease.released for lease in leases)
    assert spy.calls.count("release_many") == 1
    assert store.stats().live_payloads == 0
    with pytest.raises(RoutesLost, match="last lease"):
        store.read(handles[0])


def test_a_half_failed_acquire_many_leaves_no_lease(store: RouteStore) -> None:
    alive, doomed = store.put_many([routing(3, seed=1), routing(3, seed=2)])
    store.acquire(doomed, "gone").release()
    with pytest.raises(RoutesLost):
        store.acquire_many([(alive, "train/a"), (doomed, "train/b")])
    assert store.leaks() == []
    assert store.stats().unleased_payloads == 1  # alive is back to STORED, TTL and all


def test_pins_go_with_the_release_the_pickle_or_the_garbage_collector(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, third = store.put_many([routing(8, seed=s) for s in range(3)])
    released = store.acquire(first, "buffer/a")
    clone = released.clone("session/a")
    assert len(store._core.pins) == 1
    released.release()
    assert len(store._core.pins) == 1  # the clone still pins it
    clone.release()
    assert len(store._core.pins) == 0

    shipped = store.acquire(second, "rollout/b")
    copy = copy_lease(shipped)  # what pickling does (the local backend cannot be pickled)
    assert len(store._core.pins) == 0  # the copy may be the one released: nothing pinned here
    spy = CountingStore(store, monkeypatch)
    np.testing.assert_array_equal(copy.read(), routing(8, seed=1).array)  # located instead
    assert "locate" in spy.calls
    copy.release()
    assert shipped.released is False  # a copy is released on its own (ids are shared)

    dropped = store.acquire(third, "forgotten")
    assert len(store._core.pins) == 1
    del dropped
    gc.collect()
    assert len(store._core.pins) == 0  # a lost lease object keeps no reference alive


def test_an_unpinned_lease_carries_no_blocks_and_its_reads_locate_them(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pin=False`` (a rollout worker's sample leases): the grant brings no block
    references, nothing is pinned, the rows stay alive all the same, and a read through
    it asks the shard where the blocks are; a pinned lease reads without a shard call."""
    kept, read_here = store.put_many([routing(8, seed=s) for s in range(2)])
    unpinned = store.acquire_many([(kept, "rollout/a")], pin=False)[0]
    assert unpinned.pinned == ()
    assert len(store._core.pins) == 0
    assert store.stats().leases == 1  # a lease all the same: the payload is held
    spy = CountingStore(store, monkeypatch)
    np.testing.assert_array_equal(unpinned.read(), routing(8, seed=0).array)
    assert spy.calls.count("locate") == 1
    pinned = store.acquire(read_here, "train/b")
    spy.calls.clear()
    np.testing.assert_array_equal(pinned.read(), routing(8, seed=1).array)
    assert "locate" not in spy.calls
    store.release_many([unpinned, pinned])
    store.flush()
    assert store.leaks() == []


def test_a_failed_release_is_raised_not_lost(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    [handle] = store.put_many([routing(4, seed=9)])
    lease = store.acquire(handle, "train/x")

    def failing(lease_ids: Any) -> Any:
        raise StoreTimeout("release timed out", where="shard")

    for shard in backend._shards:
        monkeypatch.setattr(shard, "release_many", failing)
    store.release_many([lease])  # sent without waiting; the next call collects its outcome
    assert lease.released
    with pytest.raises(ReleaseFailed, match="StoreTimeout"):
        store.stats()
    monkeypatch.undo()
    assert [leak.holder for leak in store.leaks()] == ["train/x"]  # visible, not forgotten


def test_batched_puts_store_each_sample_once_in_one_adopt(
    store: RouteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = [routing(10 + i, seed=i) for i in range(50)]
    spy = CountingStore(store, monkeypatch)
    handles = store.put_many(batch, weight_version=2)
    assert spy.calls == ["adopt_many"]
    assert store.stats().live_bytes == sum(r.nbytes for r in batch)
    for handle, routes in zip(handles, batch, strict=True):
        np.testing.assert_array_equal(store.read(handle), routes.array)
        assert set(handle.weight_versions().tolist()) == {2}
    assert store.put_many([]) == []
    wide = RouteSpec(num_layers=4, top_k=2, num_experts=300)
    mixed = [batch[0], canonicalize(batch[0].array.astype(np.uint16), wide)]
    with pytest.raises(SpecMismatch, match="mixes"):
        store.put_many(mixed)


def _group(prompt: Routes, completions: list[int], seed: int) -> list[Routes]:
    """Samples sharing ``prompt``'s rows, each with its own completion rows."""
    return [
        canonicalize(np.concatenate([prompt.array, routing(n, seed=seed + i).array]), SPEC)
        for i, n in enumerate(completions)
    ]


def test_a_grpo_group_stores_its_prompt_once_and_each_sample_keeps_its_lease(
    store: RouteStore,
) -> None:
    prompt = routing(64, seed=100)
    group = _group(prompt, [7, 9, 11, 13], seed=200)
    other = routing(64 + 5, seed=300)  # same length, different prompt rows: not shared
    batch = [*group, other]
    handles = store.put_many(batch, shared_prefix=64, pack=True)
    stats = store.stats()
    assert stats.live_payloads == 1  # packed: one write, one record for the group
    assert stats.shared_prefix_bytes_saved == 3 * prompt.nbytes
    assert stats.live_bytes == prompt.nbytes + sum(n for n in (7, 9, 11, 13)) * SPEC.row_nbytes + (
        other.nbytes
    )
    assert stats.live_bytes == sum(r.nbytes for r in batch) - stats.shared_prefix_bytes_saved
    prefix_sources = {h.segments[0].source for h in handles[:4]}
    assert len(prefix_sources) == 1  # every sample points at the one stored prompt
    assert len(handles[4].segments) == 1  # the odd one keeps its own rows
    leases = store.acquire_many([(h, f"buffer/{i}") for i, h in enumerate(handles)])
    for handle, routes in zip(handles, batch, strict=True):
        np.testing.assert_array_equal(store.read(handle), routes.array)
    store.release_many(leases[:3])
    np.testing.assert_array_equal(leases[3].read(0, 64), prompt.array)  # still held by 3
    store.release_many(leases[3:])
    assert store.stats().live_payloads == 0


@pytest.mark.parametrize("colliding_digest", [False, True])
def test_prefixes_are_shared_only_when_verified_equal(
    colliding_digest: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if colliding_digest:  # every prefix hashes alike: only the byte compare tells them apart
        monkeypatch.setattr(writes, "_digest", lambda rows: b"same")
    prompt = routing(16, seed=1)
    near = prompt.array.copy()
    near[15, 3] = near[15, 3][::-1]  # same ids, another order in one row: not equal
    samples = [
        *_group(prompt, [3], seed=2),
        canonicalize(np.concatenate([near, routing(3, seed=3).array]), SPEC),
        *_group(prompt, [4], seed=4),
        routing(10, seed=5),  # shorter than the prefix: stored whole
    ]
    layout = plan_batch(samples, prefix_rows=16)
    per_sample = tuple(layout.payloads_of(i) for i in range(len(samples)))
    assert per_sample == ((0, 1), (2,), (0, 3), (4,))  # the odd one keeps its own
    assert layout.saved_bytes == prompt.nbytes
    packed = plan_batch(samples, prefix_rows=16, pack=True)
    assert len(packed.arrays) == 1
    assert packed.saved_bytes == prompt.nbytes
    assert packed.arrays[0].nbytes == sum(a.nbytes for a in layout.arrays)
    for parts, routes in zip(packed.samples, samples, strict=True):
        rows = [packed.arrays[0][part.start : part.stop] for part in parts]
        np.testing.assert_array_equal(np.concatenate(rows), routes.array)


def test_an_lmdeploy_key_with_one_trailing_row_is_adopted_and_keeps_its_rows(
    store: RouteStore,
) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    payload = routing(21, seed=7).array.astype(np.uint16)  # the stop token's row included
    key = backend.engine_store().put(payload)
    handle = store.adopt_key(EngineKey(key=key, rows=20, trailing_rows=1), SPEC)
    assert handle.rows == 20
    with store.acquire(handle, "buffer/k"):
        np.testing.assert_array_equal(store.read(handle), payload[:20].astype(np.uint8))
    two_more = backend.engine_store().put(routing(22, seed=8).array)
    with pytest.raises(RowCountMismatch, match="22 rows"):
        store.adopt_key(EngineKey(key=two_more, rows=20, trailing_rows=1), SPEC)
    strict = backend.engine_store().put(routing(21, seed=9).array)
    with pytest.raises(RowCountMismatch):
        store.adopt_key(EngineKey(key=strict, rows=20), SPEC)  # no trailing row declared
    assert backend.engine_store().stats().freed == 2  # refused keys are freed, not leaked


def test_reads_copy_into_given_buffers_of_the_exact_shape(store: RouteStore) -> None:
    [handle] = store.put_many([routing(30, seed=3)])
    buffer = np.empty((20, *SPEC.row_shape), SPEC.dtype)
    [out] = store.read_many([(handle, 5, 25)], out=[buffer])
    assert out is buffer
    np.testing.assert_array_equal(buffer, routing(30, seed=3).array[5:25])
    with pytest.raises(MisuseError, match="does not fit"):
        store.read_many([(handle, 0, 30)], out=[buffer])


def test_one_block_per_payload_unless_it_exceeds_the_block_size() -> None:
    small = RouteStore.local(StoreConfig(run="blocks", max_block_bytes=256 * 1024))
    rows = 256 * 1024 // SPEC.row_nbytes
    [one, split] = small.put_many([routing(rows, seed=1), routing(rows + 1, seed=2)])
    assert one.segments[0].source.block_rows == 0  # type: ignore[union-attr]
    assert split.segments[0].source.block_rows == rows  # type: ignore[union-attr]
    np.testing.assert_array_equal(small.read(split), routing(rows + 1, seed=2).array)
    with pytest.raises(MisuseError):
        StoreConfig(run="tiny", max_block_bytes=1024)


def test_a_group_of_adopted_keys_stores_its_verified_prompt_once(store: RouteStore) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    prompt = routing(32, seed=40)
    group = _group(prompt, [5, 6, 7], seed=41)
    other = routing(32 + 4, seed=42)  # another prompt: keeps its own rows
    keys = [
        EngineKey(key=backend.engine_store().put(r.array.astype(np.uint16)), rows=r.rows)
        for r in [*group, other]
    ]
    handles = store.adopt_keys(keys, SPEC, shared_prefix=32)
    assert store.stats().shared_prefix_bytes_saved == 2 * prompt.nbytes
    assert len({h.segments[0].source for h in handles[:3]}) == 1
    assert len(handles[3].segments) == 1
    leases = store.acquire_many([(h, f"buffer/{i}") for i, h in enumerate(handles)])
    for handle, routes in zip(handles, [*group, other], strict=True):
        np.testing.assert_array_equal(store.read(handle), routes.array)
    store.release_many(leases)
    assert store.stats().live_payloads == 0


def test_a_read_mixing_sources_lands_every_row_where_it_belongs() -> None:
    """Stored runs are copied in one go (``np.concatenate``); an inline segment between
    them, a payload of several blocks read in part, and several requests each break a
    run where they must."""
    store = RouteStore.local(StoreConfig(run="mixed", shards=2, block_rows=1))
    parts = [routing(rows, seed=i) for i, rows in enumerate((5, 3, 70_000, 4, 7, 6))]
    stored = [store.put(r, weight_version=i) for i, r in enumerate(parts)]
    block_rows = stored[2].segments[0].source.block_rows  # type: ignore[union-attr]
    assert 0 < block_rows < 70_000 // 2  # three blocks (raised to MIN_BLOCK_BYTES)
    inline = Handle.of(
        Segment(source=InlineSource(array=parts[3].array), start=0, stop=4, spec=SPEC)
    )
    joined = Handle.concat(SPEC, [stored[0], stored[1], stored[2], inline, stored[4], stored[5]])
    whole = np.concatenate([r.array for r in parts])
    lease = store.acquire(joined, "mixed")
    requests = [
        (joined, 0, joined.rows),
        (joined, 6, 40_000),
        (joined, 70_006, 70_014),
        (stored[2], 30_000, 66_000),
    ]
    outs = store.read_many(requests)
    for (handle, lo, hi), out in zip(requests, outs, strict=True):
        expected = whole[lo:hi] if handle is joined else parts[2].array[lo:hi]
        np.testing.assert_array_equal(out, expected)
    lease.release()


@settings(max_examples=60)
@given(
    prompts=st.lists(st.integers(0, 2), min_size=1, max_size=9),
    short=st.sets(st.integers(0, 8)),
)
def test_each_sample_shares_the_prefix_of_the_first_sample_equal_to_it(
    prompts: list[int], short: set[int]
) -> None:
    # Samples routed one of three prompts (some shorter than the prefix): each one's
    # leader is the first sample whose prefix is byte-equal to its own, and only
    # prefixes two samples or more share are grouped.
    heads = [routing(8, seed=100 + p).array for p in range(3)]
    batch = [
        canonicalize(heads[p][:5] if i in short else np.concatenate([heads[p], heads[p]]), SPEC)
        for i, p in enumerate(prompts)
    ]
    eligible = [i for i in range(len(batch)) if i not in short]
    first_of = {i: next(j for j in eligible if prompts[j] == prompts[i]) for i in eligible}
    expected = {
        i: first
        for i, first in first_of.items()
        if sum(1 for j in eligible if first_of[j] == first) > 1
    }
    assert writes._equal_prefix_groups(batch, 8) == expected
