"""Shared fixtures and the hypothesis profile (seeds print on failure for replay)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "routeplay",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("ci", parent=settings.get_profile("routeplay"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "routeplay"))
