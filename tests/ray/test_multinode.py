"""Three nodes on one machine (engine, rollout, trainer) plus a head that hosts the
store shards: an adopted key is validated and narrowed once, on the engine's node (one
compact write there), and the trainer pulls those compact rows straight from it;
nothing is written on the rollout node or on the store's node. The eager path relays
the payload through the rollout node."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from routeplay.bench.transfer_paths import actors_on
from routeplay.core import preset
from routeplay.store import StoreConfig, start_engine_store
from routeplay.store.accounting import node_store_stats

ROLES = ("head", "engine", "rollout", "trainer")
SPEC = preset("qwen3-235b-a22b")
ROWS = 4000
RAW_BYTES = ROWS * SPEC.decoder_layers * SPEC.top_k * 2
COMPACT_BYTES = SPEC.nbytes(ROWS)  # uint8, MoE layers only


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    store_bytes = 96 * 1024 * 1024
    nodes = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 1},
            "object_store_memory": store_bytes,
        },
    )
    for role in ROLES[1:]:
        nodes.add_node(num_cpus=1, resources={role: 1}, object_store_memory=store_bytes)
    ray.init(address=nodes.address, log_to_driver=False)
    store = StoreConfig(run="run-3node", resources=(("head", 0.01),), timeout_s=60).build()
    start_engine_store(resources={"engine": 0.01})
    actors = actors_on(store, SPEC, pinned=True)
    roles = {n["NodeID"]: next(r for r in ROLES if r in n["Resources"]) for n in ray.nodes()}
    try:
        yield {"actors": actors, "roles": roles, "store": store}
    finally:
        ray.shutdown()
        nodes.shutdown()


def _written_per_role(roles: dict[str, str]) -> dict[str, int]:
    return {roles[node]: stats.created_bytes for node, stats in node_store_stats().items()}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {role: after[role] - before[role] for role in ROLES}


def test_trainer_reads_from_the_engine_node_and_nothing_is_relayed(cluster: dict[str, Any]) -> None:
    actors, roles = cluster["actors"], cluster["roles"]
    start = _written_per_role(roles)
    key = ray.get(actors.engine.generate_one_write.remote(ROWS))
    after_put = _written_per_role(roles)
    handle = ray.get(actors.rollout.lazy.remote(key, ROWS))
    ray.get(actors.trainer.read_lazy.remote(handle))
    put, moved = _delta(start, after_put), _delta(after_put, _written_per_role(roles))
    assert RAW_BYTES <= put["engine"] < RAW_BYTES * 1.01
    assert moved["rollout"] == 0  # the rollout worker only handled a handle
    assert put["head"] == moved["head"] == 0  # the store shards never see payload bytes
    # validated once where the engine wrote it; the trainer pulls the compact rows once
    assert COMPACT_BYTES <= moved["engine"] < COMPACT_BYTES * 1.01
    assert COMPACT_BYTES <= moved["trainer"] < COMPACT_BYTES * 1.01


def test_eager_path_relays_through_the_rollout_node(cluster: dict[str, Any]) -> None:
    actors, roles = cluster["actors"], cluster["roles"]
    key = ray.get(actors.engine.generate_one_write.remote(ROWS))
    before = _written_per_role(roles)
    wrapped = ray.get(actors.rollout.eager.remote(key))
    ray.get(actors.trainer.read_eager.remote(wrapped))
    moved = _delta(before, _written_per_role(roles))
    assert moved["rollout"] >= 2 * RAW_BYTES  # pulled in, then put again
    assert moved["trainer"] >= RAW_BYTES
    ray.get(actors.rollout.drop.remote())
