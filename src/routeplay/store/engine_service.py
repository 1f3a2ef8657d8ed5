"""Starting the engine-side store where engines look for it.

Start it *before* the engine, on the same Ray cluster: LMDeploy's engine first calls
``ray.get_actor("shared_store", namespace="lmdeploy")`` and only creates its own actor
when that fails, so it finds and uses this one. SGLang setups that keep routing in a
Ray store use the same actor under namespace ``sglang``.
"""

from __future__ import annotations

from typing import Any

from routeplay.store.actors import EngineStoreActor

__all__ = ["LMDEPLOY_NAME", "LMDEPLOY_NAMESPACE", "SGLANG_NAMESPACE", "start_engine_store"]

LMDEPLOY_NAME = "shared_store"
LMDEPLOY_NAMESPACE = "lmdeploy"
SGLANG_NAMESPACE = "sglang"


def start_engine_store(
    *,
    name: str = LMDEPLOY_NAME,
    namespace: str = LMDEPLOY_NAMESPACE,
    ttl_s: float | None = 600.0,
    resources: dict[str, float] | None = None,
    timeout_s: float = 60.0,
) -> Any:
    """Start (or join) the detached engine store actor, as LMDeploy would create its own.

    ``resources`` pins it (e.g. to the engine's node, so payloads are written there).
    """
    return EngineStoreActor.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        resources=resources or {},
    ).remote(ttl_s, timeout_s)
