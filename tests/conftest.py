"""Shared fixtures and the hypothesis profile (seeds print on failure for replay).

Ray: one local instance per test process (``ray_cluster``; each pytest-xdist worker has
its own), started once. Starting Ray costs about 4 s of CPU on this machine (with a
bytecode cache), connecting a driver to a running instance under a second, and the suite
has some twenty modules that need Ray. Each module connects as a Ray job of its own
(``ray_local``), so what its driver owns (objects, actors) ends with the module as it
would with an instance of its own; what would outlive the job (detached actors, such as
an engine store) is ended at the module's end, and a module starts only once the cluster
is its alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest
import ray
from hypothesis import HealthCheck, settings
from ray._private import state
from ray.cluster_utils import Cluster

settings.register_profile(
    "routeplay",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("ci", parent=settings.get_profile("routeplay"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "routeplay"))

RAY_OBJECT_STORE_BYTES = 256 * 1024 * 1024
COVERAGE_SAVE_EVERY_S = 0.5  # tests/coverage_startup/sitecustomize.py's SAVE_EVERY_S
SETTLE_S = 60.0  # an earlier module's job and actors end asynchronously (2 busy CPUs)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The address of this process's local Ray instance (2 CPUs, small object store)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": RAY_OBJECT_STORE_BYTES,
            "include_dashboard": False,
        },
    )
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_local(request: pytest.FixtureRequest, ray_cluster: str) -> Iterator[None]:
    """This module connected to the instance as a Ray job of its own, alone on it; nothing
    of it is left behind."""
    # Test modules are not importable by Ray workers: ship their actor classes by value.
    ray.cloudpickle.register_pickle_by_value(request.module)
    ray.init(address=ray_cluster, namespace="routeplay-tests", log_to_driver=False)
    try:
        _wait_until_alone()
        yield
    finally:
        _let_workers_save_coverage()
        _end_named_actors()
        ray.shutdown()


def _let_workers_save_coverage() -> None:
    """Under `make coverage`, a Ray worker saves its coverage every half second
    (tests/coverage_startup), and the module's end kills its workers: wait for one save
    after the module's last test."""
    if os.environ.get("COVERAGE_PROCESS_CONFIG"):
        time.sleep(COVERAGE_SAVE_EVERY_S + 0.1)


def _wait_until_alone() -> None:
    """Until no other job is alive and no named actor is left (both end asynchronously
    after the earlier module's driver left)."""
    own = ray.get_runtime_context().get_job_id()

    def others() -> tuple[list[str], list[dict[str, str]]]:
        jobs = [j["JobID"] for j in state.jobs() if not j["IsDead"] and j["JobID"] != own]
        return jobs, ray.util.list_named_actors(all_namespaces=True)

    deadline = time.monotonic() + SETTLE_S
    while any(others()):
        assert time.monotonic() < deadline, f"Ray instance not free: {others()}"
        time.sleep(0.05)


def _end_named_actors() -> None:
    """End the named actors still alive (a detached one outlives its job), and wait until
    they are gone from the cluster's names."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    deadline = time.monotonic() + SETTLE_S
    while ray.util.list_named_actors(all_namespaces=True) and time.monotonic() < deadline:
        time.sleep(0.05)


# The longest modules start first: pytest-xdist hands whole files (--dist loadfile) to
# the workers in collection order, so a long module collected last would run alone at
# the end while the other worker idles (test_xtuner_doc.py, 15 s, did). Measured with
# `pytest --durations=0` (2 workers; each module's setup, calls and teardowns added up):
# the `long` runs (`make test-long`) by what they take there, the rest by what they take
# in `make test` (a clone of `67e897e`).
LONGEST_FIRST = (
    "e2e/test_demo.py",
    "ray/test_multinode.py",
    "ray/test_verl_ray.py",
    "e2e/test_verl_flow.py",
    "e2e/test_soak.py",
    "ray/test_bench_rl_step.py",
    "e2e/test_two_runs.py",
    "ray/test_cancel_storm.py",
    "e2e/test_xtuner_flow.py",
    "e2e/test_group_calls.py",
    "ray/test_ingest_validation.py",
    "ray/test_coalesced_writes.py",
    "ray/test_async_store.py",
    "ray/test_route_store.py",
    "ray/test_fast_paths_ray.py",
    "ray/test_engine_store_guard.py",
    "ray/test_key_new_rows.py",
    "unit/test_hf_replay.py",
    "unit/test_import_hygiene.py",
    "ray/test_lmdeploy_capture.py",
    "ray/test_reliability_ray.py",
    "ray/test_compaction.py",
    "megatron/test_megatron_pipeline.py",
    "unit/test_lifecycle_machine.py",
    "xtuner/test_xtuner_doc.py",
    "ray/test_engine_store.py",
    "unit/test_engine.py",
    "unit/test_materializer.py",
    "ray/test_accounting.py",
    "unit/test_wires.py",
    "ray/test_lifecycle_ray.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        ranks = (i for i, name in enumerate(LONGEST_FIRST) if path.endswith("tests/" + name))
        return next(ranks, len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order inside a module and among the rest stays
