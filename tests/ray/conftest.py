"""A module-scoped local Ray instance (2 CPUs, small object store)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

OBJECT_STORE_BYTES = 256 * 1024 * 1024


@pytest.fixture(scope="module")
def ray_local(request: pytest.FixtureRequest) -> Iterator[None]:
    # Test modules are not importable by Ray workers: ship their actor classes by value.
    ray.cloudpickle.register_pickle_by_value(request.module)
    ray.init(
        address="local",  # never join a cluster some other process left running
        num_cpus=2,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        namespace="routeplay-tests",
    )
    try:
        yield
    finally:
        ray.shutdown()
