"""The realistic RL step (``routeplay.bench.rl_step``) at a tiny size, on the suite's
local Ray (one node: every role's actor on it).

Every path delivers every sample's rows exactly as the engine routed them (the digest of
what the ranks read equals one computed here from the engine's arrays), nothing is left
in the store after a step (and a lease left over fails the run), a step's phases add up
to it, and each routeplay path reports its shard calls by phase while Ray's floor and
verl's path make none.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from rich.console import Console

from routeplay.bench import rl_step
from routeplay.bench.rl_report import rl_calls_table, rl_step_table
from routeplay.bench.rl_roles import (
    StepOwner,
    StepRollout,
    engine_routing,
    rows_digest,
    sample_id,
)
from routeplay.bench.rl_step import PATHS, PHASES, rl_point, step_digest
from routeplay.bench.workloads import RLStepShape
from routeplay.core import canonicalize
from routeplay.store import RouteStore, StoreConfig, start_engine_store

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.long]

# Groups of 4 sharing a 128-token prompt, 256 tokens a sample, 2 DP ranks, 4 samples a
# pack: 8 samples in 2 groups, a rank a group. A group's payload (244 KiB) is a Ray
# plasma object, as at full size.
SHAPE = RLStepShape(
    tokens=256, shared_prompt=128, group=4, dp=2, pack_length=1024, samples=(8,), runs=1
)
SAMPLES = 8


def _anywhere(role: str) -> dict[str, Any]:
    return {}  # one node: no role resources to place by


@pytest.fixture(scope="module")
def store() -> Iterator[RouteStore]:
    start_engine_store(spec=SHAPE.spec)  # as the bench runs it: validated at ingest
    store = StoreConfig(run="test-rl-step", timeout_s=60).build()
    try:
        yield store
    finally:
        store.shutdown()


@pytest.fixture(scope="module")
def point(store: RouteStore) -> dict[str, Any]:
    return rl_point(store, SHAPE, SAMPLES, place=_anywhere)


def test_every_path_delivers_the_rows_the_engine_routed(point: dict[str, Any]) -> None:
    spec = SHAPE.spec
    expected = step_digest(
        (sample_id(group, member), rows_digest(canonicalize(rows, spec).array))
        for group in range(SHAPE.groups(SAMPLES))
        for member, rows in enumerate(engine_routing(SHAPE, group, seed=SAMPLES))
    )
    assert point["rows_identical_across_paths"]
    assert point["digest"] == expected
    assert set(point["paths"]) == set(PATHS)
    assert point["skipped"] == {}


def test_nothing_is_left_after_the_steps(store: RouteStore, point: dict[str, Any]) -> None:
    stats = store.stats()
    assert (stats.leases, stats.live_payloads) == (0, 0)
    assert store.leaks() == []


def test_a_step_that_leaves_a_lease_fails_the_run(store: RouteStore) -> None:
    spec = SHAPE.spec
    rows = canonicalize(engine_routing(SHAPE, 0, seed=1)[0], spec)
    left = r"leaked: 1 leases \(test/left-over\), 1 payloads"
    with store.acquire(store.put(rows), "test/left-over"), pytest.raises(RuntimeError, match=left):
        rl_point(store, SHAPE, SAMPLES, place=_anywhere)
    store.flush()
    assert store.stats().leases == 0


def test_a_steps_phases_add_up_to_it(point: dict[str, Any]) -> None:
    for path, figures in point["paths"].items():
        phases = figures["phases_ms"]
        assert set(phases) == set(PHASES), path
        # one timed run: the medians are that run's figures (rounded to 0.01 and 0.1)
        assert sum(phases.values()) == pytest.approx(figures["median_ms"], abs=0.1), path
        assert figures["median_ms"] <= figures["wall_ms"] + 0.1, path
        assert figures["generation_ms"] + figures["trainer_ms"] == pytest.approx(
            figures["median_ms"], abs=0.1
        )
        assert phases["reads"] > 0, path


def test_shard_calls_are_reported_per_phase_for_routeplay_only(point: dict[str, Any]) -> None:
    for path in ("producer", "adopt"):
        figures = point["paths"][path]
        calls = figures["calls_by_phase"]
        assert figures["shard_calls"] == sum(sum(ops.values()) for ops in calls.values())
        assert figures["shard_calls_per_sample"] == round(figures["shard_calls"] / SAMPLES, 2)
        # Groups answered together are written together: the producer stages them all
        # for one adopt call that also leases their members; the engine keys of all of
        # them go in one adoption call, and their members' leases in one more.
        writes = {
            "producer": {"adopt_from_leased": 1},
            "adopt": {"adopt_key_batches": 1, "lease_many": 1},
        }[path]
        assert calls["writes"] == writes, path
        assert calls["buffer"] == {"transfer_many": 1}, path  # every group at once
        assert calls["reads"], path  # the ranks lease their samples
        assert calls["releases"], path  # the batch ends its leases
        assert figures["shard_call_cpu_ms"] > 0, path
    for path in ("ray_floor", "ray_owned", "verl"):
        assert point["paths"][path]["shard_calls"] == 0, path
        assert point["paths"][path]["over_ray_floor"] is not None, path
        assert point["paths"][path]["over_ray_owned"] is not None, path


def test_the_owned_floors_objects_are_the_owners_not_the_workers(store: RouteStore) -> None:
    """What the owned floor stands for: payloads that survive their writer. Its owner
    calls the rollout worker, so the objects are the owner's (Ray's floor's are the
    worker's, lost with it), laid out as the floor's, and still read once the worker
    is gone."""
    groups = SHAPE.groups(SAMPLES)
    rollout = StepRollout.remote(store, SHAPE)
    owner = StepOwner.remote(rollout)
    worker_of = {
        actor: bytes.fromhex(ray.get(actor.__ray_call__.remote(_worker_id)))
        for actor in (rollout, owner)
    }
    ray.get(rollout.prepare.remote(groups, 5))
    [refs] = ray.get(owner.make.remote(groups))
    [floor_refs] = ray.get(rollout.put_groups.remote())
    assert all(worker_of[owner] in ref.owner_address() for ref in refs)
    assert all(worker_of[rollout] in ref.owner_address() for ref in floor_refs)
    assert not any(worker_of[rollout] in ref.owner_address() for ref in refs)
    floor = ray.get(floor_refs)
    ray.kill(rollout)
    for rows, want in zip(ray.get(refs, timeout=30), floor, strict=True):
        np.testing.assert_array_equal(rows, want)
    ray.get(owner.drop.remote())
    ray.kill(owner)


def _worker_id(actor: Any) -> str:
    return str(ray.get_runtime_context().get_worker_id())


def test_every_run_starts_settled(store: RouteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    settled: list[int] = []
    real = rl_step.gc_meter.settle
    monkeypatch.setattr(rl_step.gc_meter, "settle", lambda: settled.append(1) or real())
    rl_point(store, SHAPE, SAMPLES, place=_anywhere)
    # the driver's settle, once per run: a checked run and SHAPE.runs timed runs per path
    assert len(settled) == len(PATHS) * (1 + SHAPE.runs)


def test_each_run_reports_the_collections_it_triggered(point: dict[str, Any]) -> None:
    for path, figures in point["paths"].items():
        assert set(figures["gc_cpu_ms"]) == {"driver", "rollout", "ranks"}, path
        assert all(ms >= 0.0 for ms in figures["gc_cpu_ms"].values()), path
        assert figures["gc_full"] >= 0, path


def test_the_tables_show_every_path(point: dict[str, Any]) -> None:
    results = {"rl_step": {"shape": {"group": 4}, "points": [point]}}
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(rl_step_table(results))
    console.print(rl_calls_table(results))
    text = console.export_text()
    for label in (
        "routeplay producer",
        "routeplay LMDeploy key",
        "Ray's floor",
        "actor-owned",
        "verl",
    ):
        assert label in text
    assert "1.00x" in text  # Ray's floor over itself
