"""A Ray job per test module (the demo runs of this folder) on the test process's shared
local Ray instance (``tests/conftest.py``: 2 CPUs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest


@pytest.fixture(scope="module")
def ray_local(ray_job: Callable[..., AbstractContextManager[None]]) -> Iterator[None]:
    with ray_job(namespace="routeplay-e2e"):
        yield
