"""``start_engine_store`` refuses what it must not join, and says why.

A module of its own: it needs the name ``lmdeploy/shared_store`` free at the start (the
other engine-store tests hold routeplay's store under it for their whole module). The
foreign actors here behave as LMDeploy's ``SharedStore`` does: ``put(data)`` keeps the
data and returns ``ObjectRef.hex()``, ``get(key)`` pops it.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray import exceptions as rex

from routeplay.errors import ForeignEngineStore, RouteplayNotImportable
from routeplay.store import start_engine_store

pytestmark = pytest.mark.usefixtures("ray_local")

LMDEPLOY_LIKE = textwrap.dedent(
    '''
    import ray


    class SharedStore:
        """put/get as LMDeploy's shared_store: keys are ObjectRef hex, get pops."""

        def __init__(self):
            self.refs = {}

        def put(self, data):
            ref = ray.put(data)
            self.refs[ref.hex()] = ref
            return ref.hex()

        def get(self, key):
            return ray.get(self.refs.pop(key))

        def clear(self):
            self.refs.clear()
    '''
)


class SharedStoreLookalike:
    """The same interface, defined in this test module (shipped to Ray by value)."""

    def __init__(self) -> None:
        self.refs: dict[str, Any] = {}

    def put(self, data: Any) -> str:
        ref = ray.put(data)
        self.refs[ref.hex()] = ref
        return str(ref.hex())

    def get(self, key: str) -> Any:
        return ray.get(self.refs.pop(key))


def _pythonpath(*first: Path) -> str:
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*map(str, first), *rest])


def _still_works(foreign: Any) -> None:
    key = ray.get(foreign.put.remote(np.arange(6, dtype=np.uint16)))
    np.testing.assert_array_equal(ray.get(foreign.get.remote(key)), np.arange(6))


def test_a_foreign_shared_store_is_refused_and_left_alone() -> None:
    foreign = (
        ray.remote(num_cpus=0)(SharedStoreLookalike)
        .options(name="shared_store", namespace="lmdeploy", lifetime="detached")
        .remote()
    )
    _still_works(foreign)
    with pytest.raises(ForeignEngineStore) as refused:
        start_engine_store()
    message = str(refused.value)
    assert "lmdeploy/shared_store" in message
    assert "SharedStoreLookalike" in message
    assert "get_ref" in message  # what is missing, i.e. what adopt_key would have called
    assert "ray.kill" in message  # and what to do
    _still_works(foreign)  # not joined, not replaced, not broken
    assert ray.get_actor("shared_store", namespace="lmdeploy")._actor_id == foreign._actor_id
    ray.kill(foreign)
    ours = start_engine_store()  # once the name is free, ours starts under it
    assert ray.get(ours.stats.remote()).live_keys == 0
    ray.kill(ours)


def test_a_foreign_store_whose_class_this_process_cannot_import_is_refused(
    tmp_path: Path,
) -> None:
    # The usual case: the rollout process has routeplay but not lmdeploy installed. Ray
    # then builds the handle on a placeholder class that keeps only the method names.
    (tmp_path / "lmdeploy_like.py").write_text(LMDEPLOY_LIKE, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        import lmdeploy_like  # type: ignore[import-not-found]

        foreign = (
            ray.remote(num_cpus=0)(lmdeploy_like.SharedStore)
            .options(
                name="shared_store",
                namespace="lmdeploy",
                lifetime="detached",
                runtime_env={"env_vars": {"PYTHONPATH": _pythonpath(tmp_path)}},
            )
            .remote()
        )
        _still_works(foreign)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lmdeploy_like", None)
    with pytest.raises(ForeignEngineStore, match=r"lmdeploy_like\.SharedStore without .*get_ref"):
        start_engine_store()
    _still_works(foreign)
    ray.kill(foreign)


def test_a_worker_without_routeplay_is_reported_with_a_hint(tmp_path: Path) -> None:
    # A Python environment whose 'routeplay' is not this one (here: an empty package that
    # shadows it), as on an engine node where routeplay was never installed.
    (tmp_path / "routeplay").mkdir()
    (tmp_path / "routeplay" / "__init__.py").write_text("", encoding="utf-8")
    env = {"env_vars": {"PYTHONPATH": str(tmp_path)}}
    with pytest.raises(RouteplayNotImportable) as refused:
        start_engine_store(name="shared_store_no_routeplay", runtime_env=env, timeout_s=120)
    message = str(refused.value)
    assert "No module named 'routeplay.store'" in message
    assert "importable" in message
    assert "docs/engine-store.md" in message
    assert isinstance(refused.value.__cause__, rex.RayActorError)  # translated at the boundary
