"""RolloutState transitions, the replay buffer (staleness, retries, discards, policies),
the training-batch hand-off and buffer checkpoints, on the in-process store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from routeplay.core import Routes, RouteSpec, canonicalize
from routeplay.errors import HandleError, MalformedPayload, MisuseError, RoutesDataError
from routeplay.rollout import (
    BufferConfig,
    Origin,
    ReplayBuffer,
    RolloutState,
    RoutingKind,
    SamplingPolicy,
    Status,
    TrainingBatch,
    load_buffer,
    save_buffer,
)
from routeplay.store import RouteStore, StoreConfig

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
    return state.with_routing(handle, store.acquire(handle, f"rollout/{sid}"), Origin.PRODUCED)


def test_dense_and_missing_routing_are_distinguishable() -> None:
    dense = RolloutState(
        sample_id="d", group_id="g", prompt_ids=(1,), routing_kind=RoutingKind.DENSE
    )
    moe = RolloutState(sample_id="m", group_id="g", prompt_ids=(1,))
    assert not dense.routing_missing
    assert moe.routing_missing


def test_reset_is_pure_and_refuses_to_drop_a_live_lease(store: RouteStore) -> None:
    state = sample(store, "s1", "g1", version=0)
    with pytest.raises(MisuseError, match="release"):
        state.reset_response()
    fresh = state.release().reset_response()
    assert fresh.response_ids == ()
    assert fresh.routing is None
    assert fresh.retries == 1
    assert fresh.status is Status.PENDING
    assert store.leaks() == []


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
    assert [s.retries for s in again] == [1, 1]
    assert all(s.routing is None and s.status is Status.PENDING for s in again)


def test_groups_out_of_retries_are_discarded(store: RouteStore) -> None:
    buffer = BufferConfig(max_staleness=0, max_retries=1).build(store)
    tired = sample(store, "a", "g1", version=0).release().reset_response()
    redo = tired.extend((9,), (-0.5,), 0).with_status(Status.COMPLETED, "stop")
    handle = store.put(routing(redo.tokens - 1, 1))
    buffer.add(
        "g1", [redo.with_routing(handle, store.acquire(handle, "rollout/a"), Origin.PRODUCED)]
    )
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
            rows = store.read(batch.states[0].routing)  # type: ignore[arg-type]
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
    assert back.origin is Origin.RESTORED
    assert back.routing is not None
    assert back.routing.weight_versions().tolist() == [4] * 6
    np.testing.assert_array_equal(store.read(back.routing), routing(6, 3).array)
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
    assert back.origin is Origin.RESTORED
    assert back.retries == 0
    np.testing.assert_array_equal(store.read(back.routing), routing(3, 5).array)  # type: ignore[arg-type]
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
