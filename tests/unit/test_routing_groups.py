"""Lifecycle steps over many samples (``routeplay.rollout.routing_groups``) and the
containers that use them: a step's shard calls grow with its groups, not its samples.

The step here is the one a rollout worker and a trainer make with the public API: each
GRPO group's answers ingested together (``ingest_routing_group``: one write), finished
together (``finish_all``), added to the replay buffer, sampled, taken over by a
``TrainingBatch`` and released when it closes. The calls are counted by the shard
(``stats().calls_by_op``), with the exact numbers written out per group.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from faults import faulty_store
from hypothesis import given, settings
from hypothesis import strategies as st

from routeplay.core import Handle, RouteSpec, read_response
from routeplay.core.wires import Engine
from routeplay.errors import MisuseError, RoutesLost
from routeplay.rollout import (
    BufferConfig,
    SampleRouting,
    TrainingBatch,
    ingest_routing_group,
)
from routeplay.rollout.fake_engines import FakeSglang
from routeplay.rollout.routing_groups import (
    adiscard_all,
    adiscard_failures,
    afinish_all,
    atake_over_all,
    discard_all,
    discard_failures,
    finish_all,
    take_over_all,
)
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
PROMPT, RESPONSE = 6, 4


def rows(seed: int) -> npt.NDArray[np.uint8]:
    """A member's rows: the group's prompt (seed 0), then its own."""

    def draw(n: int, s: int) -> npt.NDArray[np.uint8]:
        keys = np.random.default_rng(s).random((n, SPEC.num_layers, SPEC.num_experts))
        return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)

    return np.concatenate([draw(PROMPT, 0), draw(RESPONSE - 1, 100 + seed)])


def finished_group(store: RouteStore, group: int, size: int) -> list[SampleRouting]:
    """One GRPO group's samples after their answers: one write, one finish."""
    conts = [
        SampleRouting(sample_id=f"g{group}-m{m}").continuation(prompt_ids=range(PROMPT))
        for m in range(size)
    ]
    answers = [
        read_response(
            Engine.SGLANG,
            FakeSglang(spec=SPEC).respond(
                rows(m), prompt_tokens=PROMPT, completion_tokens=RESPONSE, start_row=0
            ),
            SPEC,
        )
        for m in range(size)
    ]
    handles = ingest_routing_group(conts, answers, writer=store, weight_version=0)
    assert all(isinstance(h, Handle) for h in handles)
    return finish_all(conts, store, [h for h in handles if isinstance(h, Handle)])


def step_calls(groups: int, size: int) -> dict[str, int]:
    """The shard calls of one whole step, by operation (one shard)."""
    store = RouteStore.local(StoreConfig(run=f"calls-{groups}-{size}"))
    before = dict(store.stats().calls_by_op)
    buffer = BufferConfig(max_staleness=5).build(store)
    for group in range(groups):
        buffer.add(f"g{group}", finished_group(store, group, size))
    with TrainingBatch(1, buffer.sample(groups, current_version=0)) as batch:
        assert len(batch) == groups * size
    after = store.stats()
    assert after.leases == 0
    assert after.live_payloads == 0
    return {op: n - before.get(op, 0) for op, n in after.calls_by_op if n > before.get(op, 0)}


def test_a_steps_shard_calls_grow_with_its_groups_not_its_samples() -> None:
    # A fresh finish has no lease to end; adding to the buffer moves the group's leases
    # (one shard: one atomic transfer); the batch moves them again, then ends them.
    per_group = {"put_many": 1, "lease_many": 1, "transfer_many": 1}
    per_batch = {"transfer_many": 1, "release_many": 1}
    for groups, size in [(2, 4), (2, 16), (5, 8)]:
        expected = {
            op: groups * per_group.get(op, 0) + per_batch.get(op, 0)
            for op in {*per_group, *per_batch}
        }
        # put_many is how the local backend names a batched write (adopt_many on Ray).
        calls = step_calls(groups, size)
        calls["put_many"] = calls.pop("adopt_many", 0) + calls.pop("adopt_leased", 0)
        assert calls == expected, (groups, size)


def test_a_buffer_takes_many_groups_over_in_one_call_each_to_its_own_holder() -> None:
    store = RouteStore.local(StoreConfig(run="add-all"))
    groups = {f"g{g}": finished_group(store, g, 4) for g in range(6)}
    buffer = BufferConfig(max_staleness=5).build(store)
    sent = _recorded(store)
    buffer.add_all(groups)
    assert sent == ["transfer_many"]  # six groups, one shard: one call
    assert dict(store.stats().leases_by_holder) == {f"buffer/g{g}": 4 for g in range(6)}
    assert [group.group_id for group in buffer.groups()] == list(groups)
    for group in buffer.groups():
        assert {s.lease.holder for s in group.states if s.lease} == {f"buffer/{group.group_id}"}
    with pytest.raises(MisuseError, match="already in the buffer"):
        buffer.add_all({"g9": [], "g2": []})  # refused before anything moved
    assert "g9" not in {group.group_id for group in buffer.groups()}
    buffer.close()
    assert store.leaks() == []


def test_a_buffer_adding_many_groups_moves_none_if_one_lease_cannot_move() -> None:
    store, backend = faulty_store(run="add-all-none")
    groups = {f"g{g}": finished_group(store, g, 3) for g in range(3)}
    backend.lose_clones(groups["g1"][2].lease)  # type: ignore[arg-type]
    buffer = BufferConfig(max_staleness=5).build(store)
    with pytest.raises(RoutesLost):
        buffer.add_all(groups)
    assert len(buffer) == 0
    holders = {f"rollout/g{g}-m{m}": 1 for g in range(3) for m in range(3)}
    assert dict(store.stats().leases_by_holder) == holders
    discard_all([s for states in groups.values() for s in states])


def _recorded(store: RouteStore) -> list[str]:
    """The shard operations the store sends, in order, from now on."""
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    sent: list[str] = []
    inner = backend.send

    def send(calls: Any) -> list[Any]:
        sent.extend(call.method for call in calls)
        return inner(calls)

    backend.send = send  # type: ignore[method-assign]
    return sent


def test_a_take_over_clones_for_everyone_before_any_old_lease_ends() -> None:
    """Leases of one shard move in one call (the shard clones every lease, then ends the
    old ones, under its lock); awaited, or over several shards, the clones come first,
    then the old leases end."""
    store = RouteStore.local(StoreConfig(run="order"))
    group = finished_group(store, 0, 5)
    sent = _recorded(store)
    taken = take_over_all(group, "buffer/g0")
    assert sent == ["transfer_many"]
    assert {r.lease.holder for r in taken if r.lease is not None} == {"buffer/g0"}
    assert all(r.lease is not None and r.lease.released for r in group)
    assert dict(store.stats().leases_by_holder) == {"buffer/g0": 5}
    outcomes = discard_all(taken)
    assert [error for _, error in outcomes] == [None] * 5
    assert store.stats().leases == 0


def test_finish_all_ends_the_replaced_and_borrowed_leases_after_the_new_ones() -> None:
    store = RouteStore.local(StoreConfig(run="finish"))
    first = finished_group(store, 0, 3)
    # The next request of each sample (a resume): its own lease is replaced by the new one.
    conts = [routing.continuation() for routing in first]
    handles = [cont.history for cont in conts]
    sent = _recorded(store)
    again = finish_all(conts, store, [h for h in handles if h is not None])
    assert sent == ["lease_many", "release_many"]
    assert [r.lease.holder for r in again if r.lease is not None] == [
        f"rollout/g0-m{m}" for m in range(3)
    ]
    assert store.stats().leases == 3  # the replaced ones are gone
    discard_all(again)
    assert store.leaks() == []


def test_a_dead_lease_stays_with_its_own_sample_only() -> None:
    store, backend = faulty_store(run="dead-lease")
    group = finished_group(store, 0, 4)
    backend.lose_releases(group[2].lease)  # type: ignore[arg-type]
    outcomes = discard_all(group)
    assert [error is not None for _, error in outcomes] == [False, False, True, False]
    stuck, error = outcomes[2]
    assert isinstance(error, RoutesLost)
    assert [lease.holder for lease in stuck.unreleased] == ["rollout/g0-m2"]
    assert dict(store.stats().leases_by_holder) == {"rollout/g0-m2": 1}
    backend.heal()
    [(clean, retried)] = discard_all([stuck])
    assert retried is None
    assert clean.unreleased == ()
    assert store.leaks() == []


@pytest.mark.parametrize("face", ["blocking", "awaitable"])
def test_discarding_for_nobody_returns_only_the_failures(face: str) -> None:
    """``discard_failures`` ends every lease as ``discard_all`` does and gives back only
    the sample whose release failed: its position among the samples (not among their
    leases: ahead of it, one names no lease and one a stuck lease only), its value with
    the stuck lease, its error; a retry of that value ends it."""
    store, backend = faulty_store(run=f"failures-{face}")
    group = finished_group(store, 0, 4)
    backend.lose_releases(group[0].lease)  # type: ignore[arg-type]
    [(stuck_before, _)] = discard_all([group[0]])  # its lease rides in unreleased now
    backend.heal()
    backend.lose_releases(group[2].lease)  # type: ignore[arg-type]
    routings = [SampleRouting(sample_id="no-lease"), stuck_before, group[1], group[2], group[3]]
    before = dict(store.stats().calls_by_op)
    if face == "blocking":
        failures = discard_failures(routings)
    else:
        failures = asyncio.run(adiscard_failures(routings))
    calls = {op: n - before.get(op, 0) for op, n in store.stats().calls_by_op}
    assert {op: n for op, n in calls.items() if n} == {"release": 3}  # the lost one: not
    [(at, stuck, error)] = failures
    assert at == 3
    assert isinstance(error, RoutesLost)
    assert stuck.sample_id == "g0-m2"
    assert stuck.lease is None
    assert [lease.holder for lease in stuck.unreleased] == ["rollout/g0-m2"]
    assert dict(store.stats().leases_by_holder) == {"rollout/g0-m2": 1}
    backend.heal()
    assert discard_failures([stuck]) == []
    assert store.leaks() == []


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 6), lost=st.sets(st.integers(0, 5)), run=st.uuids())
def test_the_failures_are_the_ones_discard_all_reports(size: int, lost: set[int], run: Any) -> None:
    """Two identical groups, one released by ``discard_all``, the other by
    ``discard_failures``, the same members' releases lost in each: the same samples fail,
    at the same positions, with the same stuck holders and error types."""

    def failures(discard: Any) -> list[tuple[int, str, list[str], type]]:
        store, backend = faulty_store(run=f"same-{run}-{discard.__name__}")
        group = finished_group(store, 0, size)
        backend.lose_releases(*(group[i].lease for i in sorted(lost) if i < size))
        outcome = discard(group)
        if discard is discard_all:
            outcome = [(at, after, error) for at, (after, error) in enumerate(outcome) if error]
        return [
            (at, after.sample_id, [x.holder for x in after.unreleased], type(error))
            for at, after, error in outcome
        ]

    expected = failures(discard_all)
    assert failures(discard_failures) == expected
    assert [at for at, *_ in expected] == sorted(i for i in lost if i < size)


def test_a_failed_take_over_leaves_every_sample_as_it_was() -> None:
    store, backend = faulty_store(run="no-clone")
    group = finished_group(store, 0, 3)
    backend.lose_clones(group[1].lease)  # type: ignore[arg-type]
    with pytest.raises(RoutesLost):
        take_over_all(group, "train/step-1")
    assert dict(store.stats().leases_by_holder) == {f"rollout/g0-m{m}": 1 for m in range(3)}
    assert all(r.lease is not None and not r.lease.released for r in group)
    discard_all(group)


def test_the_awaitable_steps_make_the_same_calls() -> None:
    store = RouteStore.local(StoreConfig(run="awaited"))
    group = finished_group(store, 0, 4)

    async def run() -> list[str]:
        sent = _recorded(store)
        conts = [routing.continuation() for routing in group]
        again = await afinish_all(conts, store, [c.history for c in conts if c.history])
        taken = await atake_over_all(again, "buffer/g")
        outcomes = await adiscard_all(taken)
        assert [error for _, error in outcomes] == [None] * 4
        return sent

    sent = asyncio.run(run())
    # awaited, a move is a clone then a release: a cancellation leaves the old leases whole
    assert sent == ["lease_many", "release_many", "clone_many", "release_many", "release_many"]
    assert store.leaks() == []


def test_a_shards_batched_move_is_all_or_none() -> None:
    from routeplay.store.shard.shard import StoreShard

    shard = StoreShard("moves", 0, ttl_s=None)
    ref = shard.adopt(["block"], rows=3, nbytes=12, block_rows=0)
    first = shard.acquire([ref.payload_id], "rollout/a", "moves")
    second = shard.acquire([ref.payload_id], "rollout/b", "moves")
    with pytest.raises(Exception, match="moves/0"):
        shard.transfer_many([first, "moves/0/lease-gone", second], ["buffer/g"] * 3)
    assert {lease.holder for lease in shard.leaks()} == {"rollout/a", "rollout/b"}
    with pytest.raises(MisuseError, match="one holder per lease"):
        shard.transfer_many([first, second], "buffer/g")  # a str is not one per lease
    moved = shard.transfer_many([first, second], ["buffer/g", "buffer/h"])
    assert [lease.holder for lease in shard.leaks()] == ["buffer/g", "buffer/h"]
    assert sorted(lease.lease_id for lease in shard.leaks()) == sorted(moved)


def test_an_awaited_take_over_keeps_an_old_lease_that_failed_to_end() -> None:
    """Awaited, a move is a clone then a release: the new leases exist before any old one
    ends, and an old lease whose release fails rides in its sample's ``unreleased``."""
    store, backend = faulty_store(run="awaited-stuck")
    group = finished_group(store, 0, 3)
    backend.lose_releases(group[1].lease)  # type: ignore[arg-type]
    taken = asyncio.run(atake_over_all(group, "buffer/g"))
    assert [bool(r.unreleased) for r in taken] == [False, True, False]
    assert all(r.lease is not None and r.lease.holder == "buffer/g" for r in taken)
    assert dict(store.stats().leases_by_holder) == {"buffer/g": 3, "rollout/g0-m1": 1}
    backend.heal()
    assert [error for _, error in discard_all(taken)] == [None] * 3
    assert store.leaks() == []
