"""Accounting from Ray's own object-store statistics: the lazy path writes a payload
once plus one compact copy (validated and narrowed on the engine's node, so trainers
pull uint8 MoE rows instead of the engine's uint16 of every layer), the eager path
(XTuner's: get → np.asarray → ray.put → trainer get) at least twice, and the store
returns to its baseline when the last lease goes."""

from __future__ import annotations

import pytest
import ray
from store_probe import created_bytes, used_bytes, wait_until

from routeplay.bench.transfer_paths import actors_on
from routeplay.core import preset
from routeplay.store import RouteStore, StoreConfig, start_engine_store

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = preset("qwen3-30b-a3b")
ROWS = 6000
RAW_BYTES = ROWS * SPEC.decoder_layers * SPEC.top_k * 2  # LMDeploy keeps uint16, all layers
COMPACT_BYTES = SPEC.nbytes(ROWS)  # the adopted key, validated once near the engine


def _created() -> int:
    return sum(node.created_bytes for node in created_bytes().values())


@pytest.fixture(scope="module")
def roles() -> object:
    start_engine_store()
    store = StoreConfig(run="run-accounting", timeout_s=30).build()
    return actors_on(store, SPEC, pinned=False), store


def test_lazy_path_writes_each_payload_once_and_frees_it(roles: tuple[object, RouteStore]) -> None:
    actors, store = roles
    baseline_used = used_bytes()
    before = _created()
    key = ray.get(actors.engine.generate_one_write.remote(ROWS))  # type: ignore[attr-defined]
    handle = ray.get(actors.rollout.lazy.remote(key, ROWS))  # type: ignore[attr-defined]
    ray.get(actors.trainer.read_lazy.remote(handle))  # type: ignore[attr-defined]
    written = _created() - before
    once = RAW_BYTES + COMPACT_BYTES
    assert once <= written < once * 1.01, (written, RAW_BYTES, COMPACT_BYTES)
    assert store.stats().live_payloads == 0  # the trainer's lease was the last one
    assert wait_until(lambda: used_bytes() <= baseline_used), (used_bytes(), baseline_used)


def test_eager_path_writes_at_least_twice(roles: tuple[object, RouteStore]) -> None:
    actors, _ = roles
    key = ray.get(actors.engine.generate_one_write.remote(ROWS))  # type: ignore[attr-defined]
    before = _created()
    wrapped = ray.get(actors.rollout.eager.remote(key))  # type: ignore[attr-defined]
    digest = ray.get(actors.trainer.read_eager.remote(wrapped))  # type: ignore[attr-defined]
    written = _created() - before
    assert written >= 2 * RAW_BYTES, (written, RAW_BYTES)
    ray.get(actors.rollout.drop.remote())  # type: ignore[attr-defined]
    assert len(digest) == 64
