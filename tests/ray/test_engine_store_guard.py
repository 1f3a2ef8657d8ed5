"""``start_engine_store`` refuses what it must not join, and says why.

A module of its own: it needs the name ``lmdeploy/shared_store`` free at the start (the
other engine-store tests hold routeplay's store under it for their whole module). The
foreign actors here behave as LMDeploy's ``SharedStore`` does: ``put(data)`` keeps the
data and returns ``ObjectRef.hex()``, ``get(key)`` pops it.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray import exceptions as rex

import routeplay
from routeplay.bench.transfer_paths import make_routing
from routeplay.core import EngineKey, Handle, Segment, preset
from routeplay.errors import ForeignEngineStore, ProtocolMismatch, RouteplayNotImportable
from routeplay.store import StoreConfig, start_engine_store
from routeplay.store.remote.actors import EngineStoreActor, StoreShardActor
from routeplay.store.remote.protocol import PROTOCOL

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = preset("glm-4.5-air")

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


def _kill_until_its_name_is_free(actor: Any, name: str, namespace: str) -> None:
    """``ray.kill`` and wait until the name is released (the kill is asynchronous: until
    then the name still resolves to the dying actor)."""
    ray.kill(actor)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.02)
    raise AssertionError(f"{namespace}/{name} still named 30 s after ray.kill")


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
    _kill_until_its_name_is_free(foreign, "shared_store", "lmdeploy")
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
    try:
        with pytest.raises(ForeignEngineStore, match=r"lmdeploy_like\.SharedStore without .*get"):
            start_engine_store()
        # A key that names it reaches a shard, which asks before it calls: refused for
        # what it is, not as an old routeplay (LMDeploy alone started the store).
        store = StoreConfig(run="run-foreign-key", timeout_s=60).build()
        key = EngineKey(key=ray.get(foreign.put.remote(np.arange(6))), rows=6)
        refused = r"found an actor of class lmdeploy_like\.SharedStore"
        with pytest.raises(ProtocolMismatch, match=refused):
            store.adopt_keys([key], SPEC)
        store.shutdown()
        _still_works(foreign)
    finally:
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


def _routeplay_at(tmp_path: Path, protocol_line: str) -> dict[str, Any]:
    """A runtime env whose workers import a copy of this routeplay with ``protocol.py``'s
    ``PROTOCOL`` line replaced: another routeplay, as on a node not yet upgraded."""
    copy = tmp_path / "routeplay"
    shutil.copytree(Path(routeplay.__file__).parent, copy, ignore=shutil.ignore_patterns("*.pyc"))
    module = copy / "store" / "remote" / "protocol.py"
    source = module.read_text(encoding="utf-8")
    assert f"PROTOCOL: Final = {PROTOCOL}\n" in source
    module.write_text(source.replace(f"PROTOCOL: Final = {PROTOCOL}\n", protocol_line))
    return {"env_vars": {"PYTHONPATH": _pythonpath(tmp_path)}}


def test_an_engine_store_of_another_protocol_is_neither_joined_nor_adopted_from(
    tmp_path: Path,
) -> None:
    # A detached engine store left from an older routeplay, its keys still there.
    old_env = _routeplay_at(tmp_path, f"PROTOCOL: Final = {PROTOCOL - 1}\n")
    name = "shared_store_old"
    old = EngineStoreActor.options(
        name=name, namespace="lmdeploy", lifetime="detached", runtime_env=old_env
    ).remote(600.0, 60.0)
    stores = [old]  # detached: ended by this test, whatever fails
    try:
        key = ray.get(old.put.remote(make_routing(SPEC, 6, all_layers=True, seed=1)))
        with pytest.raises(ProtocolMismatch) as refused:
            start_engine_store(name=name, timeout_s=120)
        message = str(refused.value)
        assert f"lmdeploy/{name}" in message
        assert f"found protocol {PROTOCOL - 1} (routeplay " in message
        assert f"expected protocol {PROTOCOL} (routeplay " in message
        assert "ray.kill" in message  # and what to do
        # A shard asks every engine store before taking from any: an adoption that also
        # names a current store's key leaves that key where it was, too.
        current = start_engine_store(name="shared_store_current")
        stores.append(current)
        fresh = ray.get(current.put.remote(make_routing(SPEC, 6, all_layers=True, seed=2)))
        keys = [EngineKey(key=fresh, rows=6, actor="shared_store_current")]
        keys.append(EngineKey(key=key, rows=6, actor=name))
        store = StoreConfig(run="run-old-engine", timeout_s=60).build()
        with pytest.raises(ProtocolMismatch, match=f"found protocol {PROTOCOL - 1}"):
            store.adopt_keys(keys, SPEC)
        assert ray.get(old.stats.remote()).live_keys == 1  # still the engine's to free
        assert ray.get(current.stats.remote()).live_keys == 1
        # The client's own calls to a store (free, a direct read) ask first as well.
        with pytest.raises(ProtocolMismatch):
            store.free_key(keys[1])
        direct = Segment(source=keys[1], start=0, stop=6, spec=SPEC)
        with pytest.raises(ProtocolMismatch):
            store.read(Handle.of(direct))
        assert ray.get(old.stats.remote()).live_keys == 1
        assert store.free_key(keys[0])  # a store of this protocol: answered as before
        store.shutdown()
    finally:
        for actor in stores:
            ray.kill(actor)


def test_joined_shards_from_before_protocol_versions_are_refused(tmp_path: Path) -> None:
    # The oldest case: the peer's routeplay has no PROTOCOL at all.
    old_env = _routeplay_at(tmp_path, "")
    run = "run-old-shards"
    # Held here: an actor whose last handle goes is ended, and join would start anew.
    old = StoreShardActor.options(
        name=f"routeplay.store.{run}.0", namespace="routeplay", runtime_env=old_env
    ).remote(run, 0, None, 60.0, None)
    try:
        with pytest.raises(ProtocolMismatch) as refused:
            StoreConfig(run=run, shards=2, join=True, timeout_s=120).build()
        message = str(refused.value)
        assert f"routeplay/routeplay.store.{run}.0" in message
        assert "before protocol versions" in message
        assert "new run id" in message
        with pytest.raises(ValueError, match="Failed to look up actor"):  # none started beside
            ray.get_actor(f"routeplay.store.{run}.1", namespace="routeplay")
        # The other job's shard is left to it: neither ended nor replaced under its name.
        joined = ray.get_actor(f"routeplay.store.{run}.0", namespace="routeplay")
        assert joined._actor_id == old._actor_id
    finally:
        ray.kill(old)
