"""LMDeploy 0.18.0's own engine code puts captures into routeplay's engine store; a bad
capture is refused by the adoption, never by a trainer's read.

``EngineInstance._get_extra_outputs`` (``lmdeploy.pytorch.engine.engine_instance``) is
run as LMDeploy runs it with the Ray executor: ``_lazy_create_ray_store`` looks up (or
creates) ``lmdeploy/shared_store``, finds routeplay's, and the finished response's
``routed_experts`` (uint16 ``[tokens, layers, top_k]``, cut to ``tokens - 1`` rows) is
``put`` there; the key goes into LMDeploy's own ``GenerateReqOutput`` body. An id out of
range and an all-zero capture (the failure vLLM, vLLM-Ascend and SGLang users report) are
refused by ``adopt_key``, its awaitable twin and ``SampleRouting``'s ingest, with and
without validation at ingest; the key is gone; and the step's ``Materializer`` reads every
handle the adoptions returned without meeting a validation error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import wait_until

from routeplay.core import EngineKey, RouteSpec
from routeplay.errors import DegenerateRouting, DuplicateExperts, ExpertOutOfRange
from routeplay.rollout import ADAPTERS, SampleRouting
from routeplay.store import RouteStore, StoreConfig, start_engine_store
from routeplay.train import Materializer, RankCoords, pack_samples

engine_instance = pytest.importorskip(
    "lmdeploy.pytorch.engine.engine_instance",
    reason="lmdeploy 0.18.0 is not installed (make test installs it with --no-deps)",
)
from lmdeploy.messages import ResponseType  # noqa: E402
from lmdeploy.pytorch.engine.request import Response  # noqa: E402
from lmdeploy.serve.openai.protocol import GenerateReqMetaOutput, GenerateReqOutput  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)
TOP1 = RouteSpec(num_layers=4, top_k=1, num_experts=16)
PROMPT, COMPLETION = 30, 20
ROWS = PROMPT + COMPLETION - 1


def captures(spec: RouteSpec) -> dict[str, np.ndarray]:
    """What LMDeploy's engine hands over, one row per input token (the last generated
    token's row too, which ``_get_extra_outputs`` cuts): valid, one id out of range,
    all zeros."""
    keys = np.random.default_rng(3).random((ROWS + 1, spec.num_layers, spec.num_experts))
    good = np.argsort(keys, axis=-1)[..., : spec.top_k].astype(np.uint16)
    out_of_range = good.copy()
    out_of_range[11, 2, 0] = spec.num_experts
    return {"good": good, "out_of_range": out_of_range, "zeros": np.zeros_like(good)}


@pytest.fixture(params=[True, False], ids=["validated-at-ingest", "raw"])
def engine_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """routeplay's store under LMDeploy's name, started before the engine, with or
    without the model's spec; LMDeploy's module-level handle starts empty."""
    actor = start_engine_store(ttl_s=60, spec=SPEC if request.param else None)
    monkeypatch.setattr(engine_instance, "_SHARED_STORE", None)
    try:
        yield actor
    finally:
        ray.kill(actor)


@pytest.fixture(scope="module")
def store() -> RouteStore:
    return StoreConfig(run="run-lmdeploy-capture", timeout_s=20).build()


def lmdeploy_put(routed_experts: np.ndarray) -> str:
    """LMDeploy's engine instance finishing a request with ``routed_experts`` (its method,
    on an instance with only the flag ``__init__`` sets for the Ray executor)."""
    engine_instance._lazy_create_ray_store()
    instance = SimpleNamespace(_enable_transfer_obj_ref=True)
    response = Response(
        type=ResponseType.FINISH, sender_id=0, event=None, data={"routed_experts": routed_experts}
    )
    outputs = engine_instance.EngineInstance._get_extra_outputs(
        instance, response, PROMPT + COMPLETION
    )
    return str(outputs["routed_experts"])


def body(key: str) -> dict[str, Any]:
    """LMDeploy's ``/generate`` answer carrying the key (its own protocol models)."""
    meta = GenerateReqMetaOutput(
        prompt_tokens=PROMPT,
        completion_tokens=COMPLETION,
        finish_reason={"type": "length"},
        routed_experts=key,
    )
    return GenerateReqOutput(
        text="x", output_ids=list(range(COMPLETION)), meta_info=meta
    ).model_dump()


def live_keys(actor: Any) -> list[str]:
    return list(ray.get(actor.keys.remote(), timeout=20))


def test_lmdeploy_finds_routeplays_store(engine_store: Any) -> None:
    key = lmdeploy_put(captures(SPEC)["good"])
    assert engine_instance._SHARED_STORE._actor_id == engine_store._actor_id
    assert live_keys(engine_store) == [key]
    ray.get(engine_store.free.remote(key), timeout=20)


REFUSALS = {"out_of_range": ExpertOutOfRange, "zeros": DuplicateExperts}


def test_bad_captures_are_refused_by_every_adoption_and_the_step_reads_the_rest(
    engine_store: Any, store: RouteStore
) -> None:
    arrays = captures(SPEC)
    adopted: list[tuple[str, Any, int]] = []
    for name, array in arrays.items():
        key = lmdeploy_put(array)
        if name != "good" and ray.get(engine_store.validated.remote(key)) is not None:
            # Validated at ingest: the engine store knows the refusal before the adoption.
            assert wait_until(lambda k=key: ray.get(engine_store.validated.remote(k)) is False)
        engine_key = EngineKey(key=key, rows=ROWS)
        if name == "good":
            adopted.append((name, store.adopt_key(engine_key, SPEC), PROMPT + COMPLETION))
            continue
        with pytest.raises(REFUSALS[name]) as refused:
            store.adopt_key(engine_key, SPEC)
        assert refused.value.where.startswith(f"engine key {key}")
        assert key not in live_keys(engine_store)  # consumed, its payload dropped
    assert live_keys(engine_store) == []
    # The step: every handle an adoption returned is read without a validation error.
    plan = pack_samples(adopted, pack_max_length=64)
    leases = {name: store.acquire(handle, "train/step") for name, handle, _ in adopted}
    with Materializer(store, plan, RankCoords(), leases=leases, prefetch=0) as micro_batches:
        [mb] = list(micro_batches)
    canonical = arrays["good"][:ROWS].astype(SPEC.dtype)
    np.testing.assert_array_equal(mb.routes[:ROWS], canonical)
    store.flush()


def test_the_awaitable_and_sample_routing_adoptions_refuse_too(
    engine_store: Any, store: RouteStore
) -> None:
    arrays = captures(SPEC)
    key = lmdeploy_put(arrays["out_of_range"])
    with pytest.raises(ExpertOutOfRange):
        asyncio.run(store.aadopt_key(EngineKey(key=key, rows=ROWS), SPEC))
    key = lmdeploy_put(arrays["zeros"])
    routing = SampleRouting(sample_id="s-zero")
    with routing.continuation() as cont, pytest.raises(DuplicateExperts):
        cont.ingest(ADAPTERS["lmdeploy"], body(key), spec=SPEC, writer=store, weight_version=0)
    assert live_keys(engine_store) == []
    assert store.stats().leases == 0  # nothing held for the refused sample


def test_an_all_zero_top1_capture_is_refused_as_degenerate(store: RouteStore) -> None:
    actor = start_engine_store(name="top1_store", ttl_s=60, spec=TOP1)
    try:
        zeros = np.zeros((ROWS, TOP1.num_layers, 1), np.uint16)
        key = str(ray.get(actor.put.remote(zeros), timeout=20))
        with pytest.raises(DegenerateRouting, match="fill rows"):
            store.adopt_key(EngineKey(key=key, rows=ROWS, actor="top1_store"), TOP1)
        assert live_keys(actor) == []
    finally:
        ray.kill(actor)
