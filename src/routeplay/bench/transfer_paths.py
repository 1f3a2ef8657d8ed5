"""Engine → rollout → trainer transfer of one payload, the eager way and the lazy way.

Three actors stand in for the three roles; each can be pinned to a node by a custom
resource so the same code runs on one node or on a ``ray.cluster_utils.Cluster``.

- ``FakeLMDeployEngine`` does exactly what LMDeploy's engine does with routed experts:
  look up ``shared_store`` in namespace ``lmdeploy``, ``put`` the uint16 array, return
  the key. It can also hand its payload over with one write (``RoutesProducer``).
- Eager (what XTuner does today): the rollout worker ``get``s the key, ``np.asarray``s
  it, ``ray.put``s it again, and the trainer ``ray.get``s that.
- Lazy (routeplay): the rollout worker adopts the key into the route store without
  reading it; the trainer reads its rows straight from the engine's node.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import ray

from routeplay.core import EngineKey, Handle, RouteSpec
from routeplay.store import RoutesProducer, RouteStore, producer_actor

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

__all__ = ["FakeLMDeployEngine", "RolloutHop", "TrainerReader", "actors_on", "make_routing"]


def make_routing(
    spec: RouteSpec, rows: int, *, all_layers: bool, seed: int = 0, dtype: str = "uint16"
) -> npt.NDArray[Any]:
    """Valid routing as LMDeploy holds it (uint16, every decoder layer) or narrower."""
    rng = np.random.default_rng(seed)
    block = np.argsort(rng.random((1024, spec.num_experts)), axis=1)[:, : spec.top_k]
    layers = spec.decoder_layers if all_layers else spec.num_layers
    picks = rng.integers(0, block.shape[0], size=rows * layers)
    return block[picks].reshape(rows, layers, spec.top_k).astype(dtype)


class _FakeLMDeployEngine(RoutesProducer):
    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec

    def generate_lmdeploy(self, rows: int, seed: int = 0, dtype: str = "uint16") -> str:
        """LMDeploy's protocol: find ``shared_store`` by name, put, return the key."""
        store = ray.get_actor("shared_store", namespace="lmdeploy")
        payload = make_routing(self.spec, rows, all_layers=True, seed=seed, dtype=dtype)
        return str(ray.get(store.put.remote(payload), timeout=_DEADLINE_S))

    def generate_one_write(self, rows: int, seed: int = 0, dtype: str = "uint16") -> str:
        """Same result, but the store takes the staged array: one object-store write."""
        store = ray.get_actor("shared_store", namespace="lmdeploy")
        payload = make_routing(self.spec, rows, all_layers=True, seed=seed, dtype=dtype)
        token, _ = self.stage_routes(payload, block_rows=0)
        me = ray.get_runtime_context().current_actor
        return str(
            ray.get(
                store.put_from.remote(me, token, payload.shape, str(payload.dtype)),
                timeout=_DEADLINE_S,
            )
        )


class _RolloutHop:
    def __init__(self, store: RouteStore, spec: RouteSpec) -> None:
        self.store = store
        self.spec = spec
        self._held: list[Any] = []

    def eager(self, key: str) -> list[Any]:
        """XTuner's path: fetch, np.asarray, put again; returns the new ref (wrapped)."""
        engine_store = ray.get_actor("shared_store", namespace="lmdeploy")
        array = np.asarray(ray.get(engine_store.get.remote(key), timeout=_DEADLINE_S))
        ref = ray.put(array)
        self._held.append(ref)  # the worker must stay the owner until the trainer read
        return [ref]

    def lazy(self, key: str, rows: int) -> Handle:
        """routeplay's path: adopt the key into the route store, never touching bytes."""
        return self.store.adopt_key(EngineKey(key=key, rows=rows), self.spec)

    def drop(self) -> None:
        self._held.clear()


class _TrainerReader:
    def __init__(self, store: RouteStore, spec: RouteSpec) -> None:
        self.store = store
        self.spec = spec

    def read_eager(self, wrapped: list[Any]) -> str:
        """Trainer side of the eager path: get, keep the MoE layers, narrow (as it must)."""
        array = np.asarray(ray.get(wrapped[0], timeout=_DEADLINE_S))
        rows = array[:, list(self.spec.moe_layer_indices()), :].astype(self.spec.dtype)
        return hashlib.sha256(np.ascontiguousarray(rows).data).hexdigest()

    def read_lazy(self, handle: Handle) -> str:
        """Trainer side of the lazy path: one read of the rows, validated and canonical."""
        with self.store.acquire(handle, "train/bench"):
            rows = self.store.read(handle)
        return hashlib.sha256(rows.data).hexdigest()


@dataclass(frozen=True, slots=True)
class Roles:
    """The three actors of a transfer."""

    engine: Any
    rollout: Any
    trainer: Any


FakeLMDeployEngine: Any = producer_actor(_FakeLMDeployEngine, num_cpus=0)
RolloutHop: Any = ray.remote(num_cpus=0)(_RolloutHop)
TrainerReader: Any = ray.remote(num_cpus=0)(_TrainerReader)


def actors_on(store: RouteStore, spec: RouteSpec, *, pinned: bool) -> Roles:
    """Start the three roles; ``pinned`` places them on nodes with resources
    ``engine``, ``rollout`` and ``trainer`` (one unit each)."""

    def where(role: str) -> dict[str, Any]:
        return {"resources": {role: 0.01}} if pinned else {}

    return Roles(
        engine=FakeLMDeployEngine.options(**where("engine")).remote(spec),
        rollout=RolloutHop.options(**where("rollout")).remote(store, spec),
        trainer=TrainerReader.options(**where("trainer")).remote(store, spec),
    )
