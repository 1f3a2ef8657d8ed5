"""StoreShard without Ray: fake block references, a recording producer call, a fake clock."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

from routeplay.core import StoreRef
from routeplay.errors import MisuseError, RoutesExpired, RoutesLost, RunMismatch
from routeplay.store.shard.shard import StoredPayload, StoreShard, shard_of

RUN = "run-a"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BlockRef:
    """Stands in for the ObjectRef of one block: weak-referenceable, compared by identity."""

    __slots__ = ("__weakref__", "name")

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"BlockRef({self.name})"


class RecordingProducer:
    """A ``call_producer`` that records its arguments and mints one fresh ref per block.
    It keeps only weak references to what it hands out, so the shard is the sole owner."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, str, int]] = []
        self.handed_out: list[weakref.ref[BlockRef]] = []

    def __call__(self, producer: Any, token: str, blocks: int) -> list[Any]:
        self.calls.append((producer, token, blocks))
        refs = [BlockRef(f"{token}#{i}") for i in range(blocks)]
        self.handed_out.extend(weakref.ref(ref) for ref in refs)
        return refs

    def alive(self) -> list[bool]:
        return [ref() is not None for ref in self.handed_out]


def _shard(
    index: int = 0, *, ttl_s: float | None = 600.0
) -> tuple[StoreShard, RecordingProducer, Clock]:
    producer, clock = RecordingProducer(), Clock()
    shard = StoreShard(RUN, index, ttl_s=ttl_s, clock=clock, call_producer=producer)
    return shard, producer, clock


def _adopt(shard: StoreShard, blocks: int, *, rows: int = 12, block_rows: int = 4) -> StoreRef:
    return shard.adopt_from(
        "producer-actor",
        f"tok-{blocks}",
        blocks=blocks,
        rows=rows,
        nbytes=rows * 6,
        block_rows=block_rows,
    )


# -- adoption ----------------------------------------------------------------------------
@pytest.mark.parametrize("index", [0, 3, 17])
def test_adopted_payloads_get_distinct_ids_naming_their_shard(index: int) -> None:
    shard, _, _ = _shard(index)
    refs = [shard.adopt([BlockRef("b")], rows=1, nbytes=6, block_rows=0) for _ in range(40)]
    refs += [_adopt(shard, 1) for _ in range(40)]
    ids = [ref.payload_id for ref in refs]
    assert len(set(ids)) == len(ids)
    assert {shard_of(pid) for pid in ids} == {index}


def test_ids_of_different_shards_never_collide() -> None:
    shards = [_shard(i)[0] for i in range(12)]
    ids = [s.adopt([BlockRef("b")], rows=1, nbytes=1, block_rows=0).payload_id for s in shards]
    ids += [s.adopt([BlockRef("b")], rows=1, nbytes=1, block_rows=0).payload_id for s in shards]
    assert len(set(ids)) == len(ids)
    assert [shard_of(pid) for pid in ids] == list(range(12)) * 2


def test_the_store_ref_carries_rows_block_rows_and_run() -> None:
    shard, _, _ = _shard(2)
    ref = shard.adopt([BlockRef("a"), BlockRef("b")], rows=7, nbytes=42, block_rows=4)
    assert (ref.run, ref.rows, ref.block_rows) == (RUN, 7, 4)
    assert ref.blocks(0, 7) == range(2)
    staged = _adopt(shard, 3, rows=10, block_rows=4)
    assert (staged.run, staged.rows, staged.block_rows) == (RUN, 10, 4)
    stats = shard.stats()
    assert (stats.live_payloads, stats.live_bytes, stats.unleased_payloads) == (2, 42 + 60, 2)


def test_adopt_from_calls_the_producer_once_and_owns_its_blocks() -> None:
    shard, producer, _ = _shard()
    ref = shard.adopt_from("producer-actor", "tok-9", blocks=3, rows=10, nbytes=60, block_rows=4)
    assert producer.calls == [("producer-actor", "tok-9", 3)]
    [located] = shard.locate([(ref.payload_id, [0, 1, 2])], RUN)
    assert [block.name for block in located] == ["tok-9#0", "tok-9#1", "tok-9#2"]
    del located
    assert producer.alive() == [True, True, True]  # only the shard holds them now


def test_adopt_from_without_a_way_to_call_producers_is_refused() -> None:
    shard = StoreShard(RUN, 0)
    with pytest.raises(MisuseError, match="call producers"):
        shard.adopt_from("producer-actor", "tok", blocks=1, rows=1, nbytes=1, block_rows=0)
    assert shard.stats().live_payloads == 0


def test_adopt_from_many_takes_a_batch_with_one_producer_call() -> None:
    shard, producer, _ = _shard()
    payloads = [
        StoredPayload(blocks=2, rows=8, nbytes=48, block_rows=4),
        StoredPayload(blocks=1, rows=3, nbytes=18, block_rows=0),
    ]
    first, second = shard.adopt_from_many("producer-actor", "tok-b", payloads, saved_bytes=7)
    assert producer.calls == [("producer-actor", "tok-b", 3)]
    located = shard.locate([(first.payload_id, [0, 1]), (second.payload_id, [0])], RUN)
    assert [[block.name for block in blocks] for blocks in located] == [
        ["tok-b#0", "tok-b#1"],
        ["tok-b#2"],
    ]
    assert (first.rows, second.rows) == (8, 3)
    assert shard.stats().shared_prefix_bytes_saved == 7
    with pytest.raises(MisuseError, match="call producers"):
        StoreShard(RUN, 0).adopt_from_many("producer-actor", "tok", payloads)


def test_adopt_from_leased_takes_a_batch_and_leases_each_sample_to_its_holder() -> None:
    shard, producer, _ = _shard()
    payloads = [
        StoredPayload(blocks=1, rows=4, nbytes=24, block_rows=0),  # the group's prompt
        StoredPayload(blocks=1, rows=3, nbytes=18, block_rows=0),
        StoredPayload(blocks=1, rows=3, nbytes=18, block_rows=0),
    ]
    samples = [(0, 1), (0, 2)]
    stored, grant = shard.adopt_from_leased(
        "producer-actor", "tok-l", payloads, 0, samples, ["rollout/a", "rollout/b"],
        with_blocks=False,
    )  # fmt: skip
    assert producer.calls == [("producer-actor", "tok-l", 3)]
    assert len(stored) == 3
    assert len(grant.lease_ids) == 2
    assert grant.blocks == {}  # unpinned: no references travel back
    assert dict(shard.stats().leases_by_holder) == {"rollout/a": 1, "rollout/b": 1}
    shard.release(grant.lease_ids[0])
    assert shard.stats().live_payloads == 2  # b still holds the prompt and its own rows
    shard.release(grant.lease_ids[1])
    assert shard.stats().live_payloads == 0
    assert not any(producer.alive())


def test_a_leased_adopt_names_one_holder_per_sample() -> None:
    shard, producer, _ = _shard()
    payloads = [StoredPayload(blocks=1, rows=4, nbytes=24, block_rows=0)]
    for holders in (["a", "b"], "a"):
        with pytest.raises(MisuseError, match="one holder per sample"):
            shard.adopt_from_leased("p", "tok", payloads, 0, [(0,)], holders)  # type: ignore[arg-type]
    assert shard.stats().live_payloads == 0  # refused before anything was adopted
    assert producer.calls == []


# -- leases ------------------------------------------------------------------------------
def test_dropping_the_last_lease_drops_the_block_refs() -> None:
    shard, producer, _ = _shard(1)
    ref = _adopt(shard, 3)
    first = shard.acquire([ref.payload_id], "buffer/g1", RUN)
    assert first.startswith(f"{RUN}/1/")
    second = shard.clone(first, "train/step-1")
    assert second != first
    assert shard.release(first) == []
    assert producer.alive() == [True] * 3
    assert (shard.stats().live_payloads, shard.stats().unleased_payloads) == (1, 0)
    assert shard.release(second) == [ref.payload_id]
    assert producer.alive() == [False] * 3
    assert shard.release(second) == []  # idempotent
    stats = shard.stats()
    assert (stats.live_payloads, stats.leases, stats.released_payloads) == (0, 0, 1)


def test_a_dispose_takes_each_dropped_payloads_refs_once_and_nothing_else_holds_them() -> None:
    """The Ray shard hands dropped references to a thread of their own (``DroppedRefs``):
    the table gives each payload's refs to ``dispose`` exactly when its last lease ends
    or it expires, keeps none itself, and answers as before."""
    producer, clock = RecordingProducer(), Clock()
    disposed: list[list[Any]] = []
    shard = StoreShard(
        RUN, 0, ttl_s=10.0, clock=clock, call_producer=producer, dispose=disposed.append
    )
    kept, stale = _adopt(shard, 2), _adopt(shard, 1)
    first = shard.acquire([kept.payload_id], "buffer/g1", RUN)
    second = shard.clone(first, "train/step-1")
    shard.release(first)
    assert disposed == []
    assert shard.release(second) == [kept.payload_id]
    assert [[ref.name for ref in refs] for refs in disposed] == [["tok-2#0", "tok-2#1"]]
    clock.now = 11.0
    assert shard.expire() == [stale.payload_id]
    assert [ref.name for ref in disposed[-1]] == ["tok-1#0"]
    assert shard.release(second) == []  # idempotent: nothing disposed twice
    assert len(disposed) == 2
    with pytest.raises(RoutesLost, match="last lease"):
        shard.locate([(kept.payload_id, [0])], RUN)
    assert producer.alive() == [True] * 3  # held by the disposer's list alone
    disposed.clear()
    assert producer.alive() == [False] * 3


def test_transfer_never_lets_the_payload_go() -> None:
    shard, producer, _ = _shard()
    ref = _adopt(shard, 2)
    lease = shard.acquire([ref.payload_id], "buffer/g1", RUN)
    moved = shard.transfer(lease, "train/step-1")
    assert producer.alive() == [True, True]
    assert [(leak.lease_id, leak.holder) for leak in shard.leaks()] == [(moved, "train/step-1")]
    assert shard.release(lease) == []  # the old lease is already gone
    assert shard.release(moved) == [ref.payload_id]
    assert producer.alive() == [False, False]
    assert shard.leaks() == []


def test_one_lease_over_several_payloads() -> None:
    shard, producer, _ = _shard()
    a, b = _adopt(shard, 1), _adopt(shard, 2)
    lease = shard.acquire([a.payload_id, b.payload_id, a.payload_id], "buffer/g1", RUN)
    assert sorted(shard.release(lease)) == sorted([a.payload_id, b.payload_id])
    assert producer.alive() == [False] * 3


def test_acquire_refuses_another_run() -> None:
    shard, producer, _ = _shard()
    ref = _adopt(shard, 1)
    with pytest.raises(RunMismatch, match="run-b"):
        shard.acquire([ref.payload_id], "intruder", "run-b")
    assert shard.stats().leases == 0
    assert producer.alive() == [True]


# -- locate ------------------------------------------------------------------------------
def test_locate_returns_only_the_requested_blocks_in_request_order() -> None:
    shard, _, _ = _shard()
    blocks_a = [BlockRef(f"a{i}") for i in range(5)]
    blocks_b = [BlockRef(f"b{i}") for i in range(2)]
    a = shard.adopt(blocks_a, rows=20, nbytes=120, block_rows=4)
    b = shard.adopt(blocks_b, rows=5, nbytes=30, block_rows=4)
    located = shard.locate([(b.payload_id, [1]), (a.payload_id, [3, 1]), (a.payload_id, [])], RUN)
    assert len(located) == 3
    assert [[ref.name for ref in refs] for refs in located] == [["b1"], ["a3", "a1"], []]
    assert located[1][0] is blocks_a[3]
    assert located[0][0] is blocks_b[1]
    assert shard.locate([], RUN) == []


def test_locate_refuses_another_run() -> None:
    shard, _, _ = _shard()
    ref = _adopt(shard, 2)
    with pytest.raises(RunMismatch):
        shard.locate([(ref.payload_id, [0])], "run-b")


def test_locate_refuses_released_payloads() -> None:
    shard, _, _ = _shard()
    ref = _adopt(shard, 2)
    keep = _adopt(shard, 1)
    lease = shard.acquire([ref.payload_id], "buffer/g1", RUN)
    shard.release(lease)
    with pytest.raises(RoutesLost, match=ref.payload_id):
        shard.locate([(keep.payload_id, [0]), (ref.payload_id, [0])], RUN)
    with pytest.raises(RoutesLost, match="unknown"):
        shard.locate([("0.ffff", [0])], RUN)
    assert len(shard.locate([(keep.payload_id, [0])], RUN)[0]) == 1


# -- TTL ---------------------------------------------------------------------------------
def test_unleased_payloads_expire_and_their_refs_go() -> None:
    shard, producer, clock = _shard(ttl_s=10.0)
    stale = _adopt(shard, 2)
    leased = _adopt(shard, 1)
    lease = shard.acquire([leased.payload_id], "buffer/g1", RUN)
    clock.now = 5.0
    young = _adopt(shard, 1)
    clock.now = 12.0
    with pytest.raises(RoutesExpired, match="TTL"):
        shard.locate([(stale.payload_id, [0])], RUN)
    assert producer.alive() == [False, False, True, True]
    with pytest.raises(RoutesExpired):
        shard.acquire([stale.payload_id], "late", RUN)
    assert len(shard.locate([(leased.payload_id, [0]), (young.payload_id, [0])], RUN)) == 2
    stats = shard.stats()
    assert (stats.expired_payloads, stats.expired_bytes, stats.live_payloads) == (1, 72, 2)
    clock.now = 16.0
    assert shard.expire() == [young.payload_id]
    assert producer.alive() == [False, False, True, False]
    shard.release(lease)
    assert producer.alive() == [False] * 4


def test_adopt_expires_overdue_payloads_first() -> None:
    shard, producer, clock = _shard(ttl_s=10.0)
    _adopt(shard, 1)
    clock.now = 11.0
    _adopt(shard, 1)
    assert producer.alive() == [False, True]


def test_no_ttl_keeps_unleased_payloads() -> None:
    shard, producer, clock = _shard(ttl_s=None)
    ref = _adopt(shard, 2)
    clock.now = 1e9
    assert shard.expire() == []
    assert len(shard.locate([(ref.payload_id, [0, 1])], RUN)[0]) == 2
    assert producer.alive() == [True, True]
