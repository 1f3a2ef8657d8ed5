"""A Ray job per test module on the test process's shared local Ray instance
(``tests/conftest.py``: 2 CPUs, small object store)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import ray


@pytest.fixture(scope="module")
def ray_local(
    request: pytest.FixtureRequest, ray_job: Callable[..., AbstractContextManager[None]]
) -> Iterator[None]:
    # Test modules are not importable by Ray workers: ship their actor classes by value.
    ray.cloudpickle.register_pickle_by_value(request.module)
    with ray_job(namespace="routeplay-tests"):
        yield
