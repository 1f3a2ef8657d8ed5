"""One local Ray instance (2 CPUs) for the demo runs of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    ray.init(
        address="local",  # never join a cluster some other process left running
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        namespace="routeplay-e2e",
    )
    try:
        yield
    finally:
        ray.shutdown()
