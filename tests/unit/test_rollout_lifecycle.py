"""RolloutState transitions, the replay buffer (staleness, retries, discards, policies),
the training-batch hand-off and buffer checkpoints, on the in-process store."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from faults import FaultyBackend, faulty_store

from routeplay.core import Handle, Routes, RouteSpec, canonicalize
from routeplay.errors import (
    AlreadyReleased,
    HandleError,
    MalformedPayload,
    MisuseError,
    RoutesDataError,
    RoutesLost,
)
from routeplay.rollout import (
    BufferConfig,
    Group,
    Origin,
    ReplayBuffer,
    RolloutState,
    RoutingKind,
    SamplingPolicy,
    SessionLedger,
    Status,
    TrainingBatch,
    load_buffer,
    save_buffer,
)
from routeplay.store import Lease, RouteStore, StoreConfig
from routeplay.store.shard.api import ShardApi, shard_call

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


@pytest.fixture
def store() -> RouteStore:
    return RouteStore.local(StoreConfig(run="lifecycle"))


def sample(store: RouteStore, sid: str, group: str, version: int, seed: int = 0) -> RolloutState:
    """A completed 4-prompt + 3-response sample holding its own lease."""
    state = RolloutState(sample_id=sid, group_id=group, prompt_ids=(1, 2, 3, 4))
    state = state.extend((5, 6, 7), (-0.1, -0.2, -0.3), version).with_status(
        Status.COMPLETED, "stop"
    )
    handle = store.put(routing(state.tokens - 1, seed), weight_version=version)
    return attached(state, handle, store.acquire(handle, f"rollout/{sid}"), Origin.PRODUCED)


def attached(state: RolloutState, handle: Handle, lease: Lease, origin: Origin) -> RolloutState:
    """``state`` holding ``handle`` under ``lease`` (its routing's ``attach`` step)."""
    return state.with_sample_routing(state.routing.attach(handle, lease, origin))


def test_dense_and_missing_routing_are_distinguishable() -> None:
    dense = RolloutState(
        sample_id="d", group_id="g", prompt_ids=(1,), routing_kind=RoutingKind.DENSE
    )
    moe = RolloutState(sample_id="m", group_id="g", prompt_ids=(1,))
    assert not dense.routing_missing
    assert moe.routing_missing


def test_a_dense_state_refuses_routing_whichever_way_it_comes(store: RouteStore) -> None:
    moe = sample(store, "m", "g", version=0)
    dense = RolloutState(
        sample_id="m", group_id="g", prompt_ids=(1,), routing_kind=RoutingKind.DENSE
    )
    handle = moe.routing.handle
    assert handle is not None
    with pytest.raises(MisuseError, match="dense"):
        attached(dense, handle, store.acquire(handle, "rollout/dense"), Origin.PRODUCED)
    with pytest.raises(MisuseError, match="dense"):
        dense.with_sample_routing(moe.sample_routing)  # the containers' way in
    with pytest.raises(MisuseError, match="dense"):
        dataclasses.replace(moe, routing_kind=RoutingKind.DENSE)  # built with routing
    with pytest.raises(MisuseError, match="belongs to that sample"):
        moe.with_sample_routing(dataclasses.replace(moe.sample_routing, sample_id="other"))
    store.revoke_holder("rollout/dense")  # the lease the dense state refused to hold
    moe.release()
    assert store.leaks() == []


def test_reset_is_pure_and_refuses_to_drop_a_live_lease(store: RouteStore) -> None:
    state = sample(store, "s1", "g1", version=0)
    with pytest.raises(MisuseError, match="cannot reset the routing while") as refused:
        state.reset_response()
    assert "release" in str(refused.value)  # the hint: release first
    fresh = state.release().reset_response()
    assert fresh.response_ids == ()
    assert fresh.routing.handle is None
    assert fresh.routing.retries == 1
    assert fresh.status is Status.PENDING
    assert store.leaks() == []


def test_the_states_session_and_weight_versions_are_copied_into_its_routing(
    store: RouteStore,
) -> None:
    empty = RolloutState(sample_id="e", group_id="g", prompt_ids=(1,), session_id="s")
    assert (empty.routing.sample_id, empty.routing.session_id) == ("e", "s")
    state = sample(store, "a", "g", version=2)
    assert (state.routing.session_id, state.routing.response_versions) == (None, (2, 2, 2))
    moved = dataclasses.replace(state, session_id="s")  # the routing rides along
    assert moved.routing.session_id == "s"
    assert moved.routing.handle == state.routing.handle
    assert moved.routing.lease is state.routing.lease
    assert state.extend((8,), (-0.4,), 3).routing.response_versions == (2, 2, 2, 3)
    other = dataclasses.replace(state.routing, session_id="t", response_versions=(9,))
    built = RolloutState(**{**_fields(state), "routing": other})
    assert (built.routing.session_id, built.routing.response_versions) == (None, (2, 2, 2))
    state.release()
    assert store.leaks() == []


def test_a_routing_of_none_is_refused_and_the_leases_stay_named(store: RouteStore) -> None:
    # None would stand for "a new, empty holder" and drop the live lease (a review found
    # dataclasses.replace(state, routing=None) doing so); the default is a marker instead.
    state = sample(store, "n", "g", version=0)
    with pytest.raises(MisuseError, match="routing cannot be None"):
        dataclasses.replace(state, routing=None)  # type: ignore[arg-type]
    assert state.routing.holds_lease
    assert [leak.holder for leak in store.leaks()] == ["rollout/n"]
    state.release()
    assert store.leaks() == []
    assert state.routing.prompt_tokens == len(state.prompt_ids) == 4


def test_per_token_fields_must_agree() -> None:
    with pytest.raises(HandleError, match="logprobs"):
        RolloutState(sample_id="s", group_id="g", prompt_ids=(1,), response_ids=(2,))


def test_buffer_takes_over_leases_and_retries_stale_groups(store: RouteStore) -> None:
    buffer = BufferConfig(max_staleness=1, max_retries=1).build(store)
    buffer.add("g1", [sample(store, "a", "g1", version=0), sample(store, "b", "g1", version=0)])
    assert dict(store.stats().leases_by_holder) == {"buffer/g1": 2}
    retried, discarded = buffer.refresh(current_version=2)
    assert (sorted(retried), discarded) == (["a", "b"], [])
    assert store.leaks() == []  # the buffer released its own leases
    again = buffer.take_retries()
    assert [s.routing.retries for s in again] == [1, 1]
    assert all(s.routing.handle is None and s.status is Status.PENDING for s in again)


def test_a_group_max_staleness_behind_is_kept_and_one_more_is_stale(store: RouteStore) -> None:
    """Pins the staleness bound in ``ReplayBuffer.refresh``: a group exactly
    ``max_staleness`` versions behind is still fresh (``<=``), one more is stale."""
    buffer = BufferConfig(max_staleness=2, max_retries=1).build(store)
    buffer.add("g1", [sample(store, "a", "g1", version=3)])
    assert buffer.refresh(current_version=5) == ([], [])  # 5 - 3 = 2 = max: kept
    assert len(buffer) == 1
    assert dict(store.stats().leases_by_holder) == {"buffer/g1": 1}
    assert buffer.refresh(current_version=6) == (["a"], [])  # 6 - 3 = 3 > max: retried
    assert len(buffer) == 0
    assert [s.sample_id for s in buffer.take_retries()] == ["a"]
    assert store.leaks() == []


def test_sampling_at_exactly_max_staleness_hands_the_group_out(store: RouteStore) -> None:
    """The same bound through ``sample``: 1 version behind with ``max_staleness=1`` is
    sampled, 2 behind is retried instead (nothing to sample)."""
    buffer = BufferConfig(max_staleness=1, max_retries=1).build(store)
    buffer.add("g1", [sample(store, "a", "g1", version=0)])
    buffer.add("g2", [sample(store, "b", "g2", version=1)])
    [picked] = buffer.sample(2, current_version=2)  # g1: 2 behind, retried; g2: 1 behind
    assert picked.group_id == "g2"
    assert [s.sample_id for s in buffer.take_retries()] == ["a"]
    for state in picked.states:
        state.release()
    assert store.leaks() == []


def test_groups_out_of_retries_are_discarded(store: RouteStore) -> None:
    buffer = BufferConfig(max_staleness=0, max_retries=1).build(store)
    tired = sample(store, "a", "g1", version=0).release().reset_response()
    redo = tired.extend((9,), (-0.5,), 0).with_status(Status.COMPLETED, "stop")
    handle = store.put(routing(redo.tokens - 1, 1))
    buffer.add("g1", [attached(redo, handle, store.acquire(handle, "rollout/a"), Origin.PRODUCED)])
    assert buffer.refresh(current_version=1) == ([], ["g1"])
    assert store.stats().live_payloads == 0


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        (SamplingPolicy.FIFO, ["old-fresh", "new-stale"]),
        (SamplingPolicy.STALENESS_FIRST, ["new-stale", "old-fresh"]),
    ],
)
def test_sampling_policies(store: RouteStore, policy: SamplingPolicy, order: list[str]) -> None:
    buffer = BufferConfig(max_staleness=5, policy=policy).build(store)
    buffer.add("old-fresh", [sample(store, "a", "old-fresh", version=3)])
    buffer.add("new-stale", [sample(store, "b", "new-stale", version=1)])
    picked = buffer.sample(2, current_version=3)
    assert [g.group_id for g in picked] == order
    for group in picked:
        for state in group.states:
            state.release()
    assert store.leaks() == []


def test_a_training_batch_refuses_rows_never_stamped_before_any_lease_moves(
    store: RouteStore,
) -> None:
    state = RolloutState(sample_id="u", group_id="g", prompt_ids=(1, 2, 3, 4))
    state = state.extend((5, 6, 7), (-0.1, -0.2, -0.3), 0)
    handle = store.put(routing(state.tokens - 1, 0), weight_version=Handle.UNSTAMPED)
    state = attached(state, handle, store.acquire(handle, "rollout/u"), Origin.PRODUCED)
    with pytest.raises(MisuseError, match="never stamped"):
        TrainingBatch(3, [Group(group_id="g", states=(state,))])
    assert dict(store.stats().leases_by_holder) == {"rollout/u": 1}  # nothing moved
    stamped = state.with_sample_routing(
        dataclasses.replace(state.routing, handle=handle.stamped(0))
    )
    with TrainingBatch(3, [Group(group_id="g", states=(stamped,))]) as batch:
        assert batch.states[0].routing.handle == handle.stamped(0)
    assert store.leaks() == []


def test_training_batch_releases_leases_and_sessions_when_the_step_raises(
    store: RouteStore,
) -> None:
    buffer = BufferConfig().build(store)
    state = sample(store, "a", "g1", version=0)
    buffer.add("g1", [RolloutState(**{**_fields(state), "session_id": "sess-1"})])
    released: list[str] = []

    def failing_step() -> None:
        groups = buffer.sample(1, current_version=0)
        with TrainingBatch(7, groups, release_session=released.append) as batch:
            assert dict(store.stats().leases_by_holder) == {"train/step-7": 1}
            rows = store.read(batch.states[0].routing.handle)  # type: ignore[arg-type]
            np.testing.assert_array_equal(rows, routing(6, 0).array)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing_step()
    assert released == ["sess-1"]
    assert store.leaks() == []


def test_checkpoint_round_trip_recreates_leases_and_versions(
    store: RouteStore, tmp_path: Path
) -> None:
    buffer = BufferConfig().build(store)
    state = sample(store, "a", "g1", version=4, seed=3)
    buffer.add("g1", [state])
    buffer.requeue([sample(store, "b", "g2", version=1).release().reset_response()])
    save_buffer(buffer, tmp_path, SPEC)
    buffer.close()
    assert store.stats().live_payloads == 0
    restored = load_buffer(tmp_path, store, BufferConfig())
    [group] = restored.groups()
    [back] = group.states
    assert back.routing.origin is Origin.RESTORED
    assert back.routing.handle is not None
    assert back.routing.handle.weight_versions().tolist() == [4] * 6
    np.testing.assert_array_equal(store.read(back.routing.handle), routing(6, 3).array)
    assert dict(store.stats().leases_by_holder) == {"buffer/g1": 1}
    assert [s.sample_id for s in restored.pending_retries()] == ["b"]
    restored.close()
    assert store.leaks() == []


def test_an_older_checkpoint_without_ownership_fields_still_loads(
    store: RouteStore, tmp_path: Path
) -> None:
    np.savez(tmp_path / "routing.npz", r0=routing(3, 5).array)
    state = {
        "sample_id": "old", "group_id": "g", "session_id": None, "prompt_ids": [1, 2],
        "response_ids": [3, 4], "logprobs": [-1.0, -1.0], "weight_versions": [2, 2],
        "status": "completed", "finish_reason": "stop",
        "routing": {"array": "r0", "weight_version": 2},
    }  # fmt: skip
    spec = {"num_layers": 2, "top_k": 2, "num_experts": 8}
    meta = {
        "format": "routeplay.replay_buffer",
        "version": 1,
        "spec": spec,
        "groups": [{"group_id": "g", "states": [state]}],
    }
    (tmp_path / "buffer.json").write_text(json.dumps(meta), encoding="utf-8")
    restored = load_buffer(tmp_path, store, BufferConfig())
    [back] = restored.groups()[0].states
    assert back.routing.origin is Origin.RESTORED
    assert back.routing.retries == 0
    np.testing.assert_array_equal(store.read(back.routing.handle), routing(3, 5).array)  # type: ignore[arg-type]
    restored.close()
    assert store.leaks() == []


def test_checkpoints_are_validated_and_never_unpickled(store: RouteStore, tmp_path: Path) -> None:
    bad = routing(3, 6).array.copy()
    bad[1] = 0
    np.savez(tmp_path / "routing.npz", r0=bad)
    state = {"sample_id": "x", "group_id": "g", "prompt_ids": [1, 2], "response_ids": [3, 4],
             "logprobs": [0.0, 0.0], "weight_versions": [0, 0], "status": "completed",
             "routing": {"array": "r0", "segments": [[3, 0]]}}  # fmt: skip
    spec = {"num_layers": 2, "top_k": 2, "num_experts": 8}
    meta = {
        "format": "routeplay.replay_buffer",
        "version": 2,
        "spec": spec,
        "groups": [{"group_id": "g", "states": [state]}],
    }
    (tmp_path / "buffer.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(RoutesDataError, match="row 1"):
        load_buffer(tmp_path, store, BufferConfig())
    (tmp_path / "buffer.json").write_text(json.dumps({"format": "pickle"}), encoding="utf-8")
    with pytest.raises(MalformedPayload, match="checkpoint"):
        load_buffer(tmp_path, store, BufferConfig())


def _fields(state: RolloutState) -> dict[str, object]:
    return {name: getattr(state, name) for name in RolloutState.__dataclass_fields__}


def test_buffer_close_is_idempotent(store: RouteStore) -> None:
    buffer: ReplayBuffer
    with BufferConfig().build(store) as buffer:
        buffer.add("g", [sample(store, "a", "g", version=0)])
    buffer.close()
    assert store.leaks() == []


# -- lifecycle on error paths (a shard that died: releases answer RoutesLost) ---------
@pytest.fixture
def faulty() -> tuple[RouteStore, FaultyBackend]:
    return faulty_store("lifecycle-faults")


def holders(store: RouteStore) -> dict[str, int]:
    return dict(store.stats().leases_by_holder)


def test_a_failed_release_leaves_a_resettable_state_that_still_names_the_lease(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    state = sample(store, "a", "g", version=0)
    lease = state.routing.lease
    assert lease is not None
    backend.lose_releases(lease)
    with pytest.raises(RoutesLost):
        state.release()
    assert state.routing.holds_lease  # release() raised: the caller's state is unchanged
    after, error = state.try_release()
    assert isinstance(error, RoutesLost)
    assert (after.routing.holds_lease, after.routing.stuck, after.routing.lease) == (
        False,
        True,
        None,
    )
    retry = after.reset_response()  # a stuck lease does not block the reset
    assert retry.routing.stuck
    assert retry.routing.retries == 1
    assert [stuck.lease_ids for stuck in retry.routing.unreleased] == [lease.lease_ids]
    assert holders(store) == {"rollout/a": 1}  # the store still counts it
    with pytest.raises(RoutesLost):
        retry.release()
    backend.heal()
    done = retry.release()  # retries the stuck lease
    assert (done.routing.stuck, done.routing.unreleased) == (False, ())
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def test_try_release_of_each_state_ends_every_lease_it_can_and_keeps_the_stuck_one(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    states = [sample(store, sid, "g", version=0, seed=i) for i, sid in enumerate("abc")]
    backend.lose_releases(states[1].routing.lease)  # type: ignore[arg-type]
    released = [state.try_release() for state in states]
    failed = [after for after, error in released if error is not None]
    assert [f.sample_id for f in failed] == ["b"]
    assert [type(error) for _, error in released] == [type(None), RoutesLost, type(None)]
    assert (failed[0].routing.holds_lease, failed[0].routing.stuck) == (False, True)
    assert holders(store) == {"rollout/b": 1}  # a and c ended, b's still counted
    backend.heal()
    again, error = failed[0].try_release()  # retried: the stuck lease ends
    assert (error, again.routing.stuck, again.routing.unreleased) == (None, False, ())
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def test_take_unreleased_hands_the_stuck_lease_over(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    state = sample(store, "a", "g", version=0)
    backend.lose_releases(state.routing.lease)  # type: ignore[arg-type]
    after, _ = state.try_release()
    routing, stuck = after.routing.take_unreleased()
    clean = after.with_sample_routing(routing)
    assert (clean.routing.stuck, clean.routing.unreleased, len(stuck)) == (False, (), 1)
    backend.heal()
    stuck[0].release()  # whoever took it over ends it
    assert store.leaks() == []


def test_buffer_discard_releases_every_sample_and_keeps_the_failed_one(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    buffer = BufferConfig().build(store)
    buffer.add("g", [sample(store, sid, "g", version=0, seed=i) for i, sid in enumerate("abc")])
    [group] = buffer.groups()
    backend.lose_releases(group.states[0].routing.lease)  # type: ignore[arg-type]
    with pytest.raises(RoutesLost):
        buffer.discard("g")
    assert holders(store) == {"buffer/g": 1}  # b and c were released all the same
    assert [s.sample_id for s in buffer.release_failed()] == ["a"]
    assert buffer.stats().release_failed == 1
    assert buffer.stats().stuck_leases == 1
    assert buffer.discard("g") is False
    backend.heal()
    buffer.close()  # retries the release-failed sample
    assert buffer.release_failed() == ()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def test_buffer_close_raises_the_first_error_with_the_others_as_notes_and_retries(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    buffer = BufferConfig().build(store)
    buffer.add("g1", [sample(store, "a", "g1", version=0), sample(store, "b", "g1", version=0)])
    buffer.add("g2", [sample(store, "c", "g2", version=0)])
    for group in buffer.groups():
        backend.lose_releases(group.states[0].routing.lease)  # type: ignore[arg-type]
    with pytest.raises(RoutesLost) as first:
        buffer.close()
    assert "1 more failure while closing the replay buffer: RoutesLost" in first.value.__notes__[0]
    assert holders(store) == {"buffer/g1": 1, "buffer/g2": 1}
    assert sorted(s.sample_id for s in buffer.release_failed()) == ["a", "c"]
    with pytest.raises(RoutesLost):
        buffer.close()  # a second close retries: not a silent no-op
    # Each close tries each dead lease twice: in the failed batched call, then on its own
    # (to tell the live leases from the released ones).
    assert backend.failed_releases == 8
    backend.heal()
    buffer.close()
    buffer.close()  # idempotent once everything is released
    assert buffer.stats().release_failed == 0
    assert store.leaks() == []


def test_take_release_failed_hands_the_samples_and_their_live_leases_over(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    buffer = BufferConfig().build(store)
    buffer.add("g", [sample(store, "a", "g", version=0)])
    backend.lose_releases(buffer.groups()[0].states[0].routing.lease)  # type: ignore[arg-type]
    with pytest.raises(RoutesLost):
        buffer.close()
    [taken] = buffer.take_release_failed()
    assert taken.routing.stuck
    buffer.close()  # nothing left to retry: the caller owns the sample now
    backend.heal()
    taken.release()
    assert store.leaks() == []


def test_refresh_retries_a_stale_sample_whose_release_failed(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    buffer = BufferConfig(max_staleness=1, max_retries=1).build(store)
    buffer.add("g", [sample(store, "a", "g", version=0), sample(store, "b", "g", version=0)])
    backend.lose_releases(buffer.groups()[0].states[0].routing.lease)  # type: ignore[arg-type]
    with pytest.raises(RoutesLost):
        buffer.refresh(current_version=2)
    retries = buffer.take_retries()
    assert [(s.sample_id, s.routing.retries, s.routing.stuck) for s in retries] == [
        ("a", 1, False),
        ("b", 1, False),
    ]
    assert buffer.stats().retried_samples == 2
    assert [s.sample_id for s in buffer.release_failed()] == ["a"]  # the buffer keeps it
    assert holders(store) == {"buffer/g": 1}
    backend.heal()
    buffer.close()
    assert store.leaks() == []


def test_a_group_whose_callers_lease_is_on_a_dead_shard_stays_with_the_caller(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    """The group's leases move to the buffer in one atomic call of their shard: a dead
    shard moves nothing, so every sample keeps its lease and the add raises; once the
    shard is back the add succeeds. (A move over several shards, or awaited, is a clone
    then a release: there the caller's lease can fail to end and rides along, see
    test_routing_groups.)"""
    store, backend = faulty
    state = sample(store, "a", "g", version=0)
    backend.lose_releases(state.routing.lease)  # type: ignore[arg-type]
    buffer = BufferConfig().build(store)
    with pytest.raises(RoutesLost):
        buffer.add("g", [state])
    assert len(buffer) == 0
    assert holders(store) == {"rollout/a": 1}
    assert state.routing.holds_lease
    backend.heal()
    buffer.add("g", [state])
    assert holders(store) == {"buffer/g": 1}
    buffer.close()
    assert store.leaks() == []


def test_training_batch_takes_every_lease_or_none(store: RouteStore) -> None:
    buffer = BufferConfig().build(store)
    buffer.add("g1", [sample(store, "a", "g1", version=0), sample(store, "b", "g1", version=0)])
    buffer.add("g2", [sample(store, "c", "g2", version=0)])
    groups = buffer.sample(2, current_version=0)
    # c's lease was released elsewhere (e.g. a pickled copy in another process): this
    # Lease object still looks live, but its shard refuses to clone it.
    late = groups[1].states[0].routing.lease
    assert late is not None
    store.backend.call([shard_call(0, ShardApi.release, late.lease_ids[0])], "released elsewhere")
    with pytest.raises(AlreadyReleased):
        TrainingBatch(5, groups)
    assert holders(store) == {"buffer/g1": 2}  # nothing moved to train/step-5
    assert all(s.routing.holds_lease for s in groups[0].states)
    with TrainingBatch(6, groups[:1]) as batch:  # the caller can still hand them over
        assert holders(store) == {"train/step-6": 2}
        assert len(batch) == 2
    assert store.leaks() == []


def test_training_batch_rolls_back_when_a_clone_fails_on_a_dead_shard(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    buffer = BufferConfig().build(store)
    buffer.add("g", [sample(store, sid, "g", version=0) for sid in "abc"])
    [group] = buffer.sample(1, current_version=0)
    backend.lose_clones(group.states[2].routing.lease)  # type: ignore[arg-type]
    with pytest.raises(RoutesLost):
        TrainingBatch(1, [group])
    assert holders(store) == {"buffer/g": 3}
    backend.heal()
    with TrainingBatch(2, [group]):
        assert holders(store) == {"train/step-2": 3}
    assert store.leaks() == []


def test_training_batch_keeps_a_lease_that_fails_to_end_and_retries_it(
    faulty: tuple[RouteStore, FaultyBackend],
) -> None:
    store, backend = faulty
    buffer = BufferConfig().build(store)
    buffer.add("g", [sample(store, "a", "g", version=0), sample(store, "b", "g", version=0)])
    [group] = buffer.sample(1, current_version=0)
    batch = TrainingBatch(3, [group])
    assert holders(store) == {"train/step-3": 2}
    backend.lose_releases(batch.states[0].routing.lease)  # type: ignore[arg-type]
    with pytest.raises(RoutesLost):
        batch.close()
    assert holders(store) == {"train/step-3": 1}  # the other sample's lease ended
    assert [s.sample_id for s in batch.release_failed()] == ["a"]
    with pytest.raises(RoutesLost):
        batch.close()  # retried, still dead
    backend.heal()
    batch.close()
    assert batch.release_failed() == ()
    assert store.leaks() == []


def test_staleness_counts_routing_rows_not_only_response_tokens(store: RouteStore) -> None:
    """A retry at version 2 reusing prompt rows stored at version 0 is 2 versions stale."""
    old = store.put(routing(4, 1), weight_version=0)  # prompt rows, from an old turn
    new = store.put(routing(6, 2), weight_version=2)
    handle = old + new[4:6]
    state = RolloutState(sample_id="r", group_id="g", prompt_ids=(1, 2, 3, 4, 5))
    state = state.extend((6, 7), (-0.1, -0.2), 2).with_status(Status.COMPLETED, "stop")
    state = attached(state, handle, store.acquire(handle, "rollout/r"), Origin.BORROWED)
    assert state.staleness(2) == 2
    assert state.oldest_version() == 0
    buffer = BufferConfig(max_staleness=1, max_retries=1).build(store)
    buffer.add("g", [state])
    assert buffer.groups()[0].staleness(2) == 2
    assert buffer.refresh(current_version=2) == (["r"], [])
    buffer.close()
    assert store.leaks() == []


def test_a_checkpoint_that_fails_to_load_cleans_up_although_a_release_fails(
    faulty: tuple[RouteStore, FaultyBackend], tmp_path: Path
) -> None:
    store, backend = faulty
    buffer = BufferConfig().build(store)
    buffer.add("g1", [sample(store, "a", "g1", version=0, seed=1)])
    buffer.add("g2", [sample(store, "b", "g2", version=0, seed=2), sample(store, "c", "g2", 0, 3)])
    save_buffer(buffer, tmp_path, SPEC)
    buffer.close()
    arrays = dict(np.load(tmp_path / "routing.npz", allow_pickle=False))
    arrays["r2"] = arrays["r2"].copy()
    arrays["r2"][1] = 0  # c is corrupt: the load stops after storing b's routing
    np.savez(tmp_path / "routing.npz", **arrays)
    backend.dead_holders.add("buffer/g1")  # and the buffer's lease on g1 cannot end
    with pytest.raises(RoutesDataError, match="row 1") as failed:
        load_buffer(tmp_path, store, BufferConfig())
    assert "RoutesLost" in failed.value.__notes__[0]  # the load error stays the error
    assert holders(store) == {"buffer/g1": 1}  # visible in leaks(), for a revoke
    assert store.stats().live_payloads == 1  # b's stored routing was dropped all the same
    assert store.stats().unleased_payloads == 0


# -- sessions: released when the last waiting sample is done ---------------------------
def in_session(state: RolloutState, session: str) -> RolloutState:
    return RolloutState(**{**_fields(state), "session_id": session})


def test_a_session_is_released_when_its_last_waiting_sample_is_done(store: RouteStore) -> None:
    released: list[str] = []
    ledger = SessionLedger(released.append)
    a, b, c = (in_session(sample(store, sid, f"g{sid}", 0), "s") for sid in "abc")
    ledger.hold(a, b, c)
    ledger.hold(b)  # a retry of the same sample registers nothing new
    assert (ledger.sessions(), ledger.waiting("s")) == (["s"], 3)
    buffer = BufferConfig().build(store, sessions=ledger)
    for state in (a, b, c):
        buffer.add(state.group_id, [state])
    with TrainingBatch(1, buffer.sample(1, current_version=0), sessions=ledger):
        pass
    assert (released, ledger.waiting("s")) == ([], 2)  # b and c still wait on it
    assert buffer.discard("gb") is True
    assert (released, ledger.waiting("s")) == ([], 1)
    [group] = buffer.sample(1, current_version=0)
    for state in group.states:  # c's job failed: the caller says so
        state.release()
    assert ledger.done(*group.states) == ["s"]
    assert released == ["s"]
    assert ledger.done(*group.states) == []  # nothing waits: nothing more to release
    assert store.leaks() == []


def test_a_batch_refuses_two_ways_of_ending_sessions(store: RouteStore) -> None:
    ledger = SessionLedger(lambda _: None)
    with pytest.raises(MisuseError, match="sessions one way"):
        TrainingBatch(1, [], release_session=lambda _: None, sessions=ledger)


def test_a_sample_the_ledger_never_held_releases_its_session_if_nobody_else_waits(
    store: RouteStore,
) -> None:
    released: list[str] = []
    ledger = SessionLedger(released.append)
    held = in_session(sample(store, "a", "g", 0), "s")
    ledger.hold(held)
    stranger = in_session(sample(store, "b", "g", 0), "s").release()
    other = in_session(sample(store, "c", "g", 0), "t").release()
    assert ledger.done(stranger, other) == ["t"]  # s: a still waits; t: nobody does
    assert ledger.done(held.release()) == ["s"]
    assert released == ["t", "s"]


def test_a_session_release_that_fails_is_retried_by_close(store: RouteStore) -> None:
    calls: list[str] = []

    def flaky(session: str) -> None:
        calls.append(session)
        if len(calls) == 1:
            raise RoutesLost("the trace store did not answer", where=f"session {session}")

    ledger = SessionLedger(flaky)
    state = in_session(sample(store, "a", "g", 0), "s").release()
    ledger.hold(state)
    with pytest.raises(RoutesLost):
        ledger.done(state)
    assert ledger.failed == ("s",)
    ledger.close()
    assert (calls, ledger.failed) == (["s", "s"], ())
