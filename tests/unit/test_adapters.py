"""The conformance check every engine adapter runs against its fake: fresh samples,
partial resumes (history kept, only new rows stored), start_len responses, row-count
and format refusals. Runs on the in-process store backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from routeplay.core import RouteSpec
from routeplay.errors import AlreadyConsumed, HandleError, RoutesDataError, RowCountMismatch
from routeplay.rollout.adapters import ADAPTERS
from routeplay.rollout.fake_engines import (
    FAKE_ENGINES,
    FakeEngine,
    FakeLmdeployInline,
    FakeLmdeployKey,
    FakeSglang,
    FakeVllmHttp,
    FakeVllmInProcess,
)
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend

# Two decoder layers, the first dense: engines send both, the handle keeps the MoE one.
SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 2), total_layers=3)
PROMPT, FIRST, SECOND = 5, 4, 6


def truth(rows: int = 40, seed: int = 0) -> np.ndarray:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(SPEC.dtype)


@pytest.fixture
def store() -> RouteStore:
    return RouteStore.local(StoreConfig(run="adapters", block_rows=8))


def make_fake(name: str, store: RouteStore) -> FakeEngine:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    fakes: dict[str, Any] = {
        "vllm": FakeVllmHttp(spec=SPEC),
        "vllm-inprocess": FakeVllmInProcess(spec=SPEC),
        "sglang": FakeSglang(spec=SPEC),
        "lmdeploy-inline": FakeLmdeployInline(spec=SPEC),
        "lmdeploy-key": FakeLmdeployKey(spec=SPEC, put=backend.engine_store().put),
    }
    return fakes[name]  # type: ignore[no-any-return]


@pytest.fixture(params=FAKE_ENGINES)
def fake(request: pytest.FixtureRequest, store: RouteStore) -> FakeEngine:
    return make_fake(request.param, store)


def test_a_fresh_sample_reads_back_exactly(fake: FakeEngine, store: RouteStore) -> None:
    full = truth()
    response = fake.respond(full, prompt_tokens=PROMPT, completion_tokens=FIRST)
    handle = ADAPTERS[fake.adapter].ingest(response, spec=SPEC, writer=store, weight_version=3)
    assert handle.rows == PROMPT + FIRST - 1
    with store.acquire(handle, "test/fresh"):
        np.testing.assert_array_equal(store.read(handle), full[: handle.rows])
    assert set(handle.weight_versions().tolist()) == {3}


def test_partial_resume_keeps_history_and_stores_only_new_rows(
    fake: FakeEngine, store: RouteStore
) -> None:
    full, adapter = truth(), ADAPTERS[fake.adapter]
    first = fake.respond(full, prompt_tokens=PROMPT, completion_tokens=FIRST)
    history = adapter.ingest(first, spec=SPEC, writer=store, weight_version=1)
    held = store.acquire(history, "sample/s1")
    start = history.rows if fake.supports_start else 0
    second = fake.respond(
        full, prompt_tokens=PROMPT, completion_tokens=FIRST + SECOND, start_row=start
    )
    resumed = adapter.ingest(
        second, spec=SPEC, writer=store, weight_version=2, history=history, start_row=start
    )
    assert resumed[: history.rows] == history  # the history's segments, untouched
    versions = resumed.weight_versions()
    assert versions[: history.rows].tolist() == [1] * history.rows
    assert set(versions[history.rows :].tolist()) == {2}
    with store.acquire(resumed, "sample/s1-resumed"):
        held.release()  # the input's lease is released explicitly by its holder
        np.testing.assert_array_equal(store.read(resumed), full[: resumed.rows])
        if fake.adapter != "lmdeploy":  # stored rows: the history once, then only new rows
            assert store.stats().live_bytes == resumed.nbytes


def test_token_counts_that_disagree_with_the_rows_are_refused(
    fake: FakeEngine, store: RouteStore
) -> None:
    response = fake.respond(truth(), prompt_tokens=PROMPT, completion_tokens=FIRST)
    _lie_about_completion_tokens(response, FIRST + 1)
    with pytest.raises(RowCountMismatch):
        ADAPTERS[fake.adapter].ingest(response, spec=SPEC, writer=store, weight_version=0)


def test_a_resume_shorter_than_its_history_is_refused(fake: FakeEngine, store: RouteStore) -> None:
    full, adapter = truth(), ADAPTERS[fake.adapter]
    long = fake.respond(full, prompt_tokens=PROMPT, completion_tokens=SECOND)
    history = adapter.ingest(long, spec=SPEC, writer=store, weight_version=0)
    short = fake.respond(full, prompt_tokens=PROMPT, completion_tokens=FIRST)
    with pytest.raises((RowCountMismatch, HandleError)):
        adapter.ingest(short, spec=SPEC, writer=store, weight_version=1, history=history)


def test_sglang_start_len_past_the_history_is_refused(store: RouteStore) -> None:
    fake = FakeSglang(spec=SPEC)
    full = truth()
    history = ADAPTERS["sglang"].ingest(
        fake.respond(full, prompt_tokens=PROMPT, completion_tokens=FIRST),
        spec=SPEC,
        writer=store,
        weight_version=0,
    )
    skip = history.rows + 2
    gap = fake.respond(full, prompt_tokens=PROMPT, completion_tokens=SECOND, start_row=skip)
    with pytest.raises(HandleError, match="skips rows"):
        ADAPTERS["sglang"].ingest(
            gap, spec=SPEC, writer=store, weight_version=1, history=history, start_row=skip
        )


def test_lmdeploy_keys_stay_lazy_and_are_consumed_once(store: RouteStore) -> None:
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    fake = make_fake("lmdeploy-key", store)
    response = fake.respond(truth(), prompt_tokens=PROMPT, completion_tokens=FIRST)
    ADAPTERS["lmdeploy"].ingest(response, spec=SPEC, writer=store, weight_version=0)
    assert backend.engine_store().stats().consumed == 1
    with pytest.raises(AlreadyConsumed):
        ADAPTERS["lmdeploy"].ingest(response, spec=SPEC, writer=store, weight_version=0)


@pytest.mark.parametrize("name", ["vllm", "sglang", "lmdeploy-inline"])
def test_zero_padded_routing_is_refused(name: str, store: RouteStore) -> None:
    bad = truth()
    bad[2] = 0
    response = make_fake(name, store).respond(bad, prompt_tokens=PROMPT, completion_tokens=FIRST)
    with pytest.raises(RoutesDataError, match="row 2"):
        ADAPTERS[make_fake(name, store).adapter].ingest(
            response, spec=SPEC, writer=store, weight_version=0
        )
    assert store.stats().live_payloads == 0  # nothing stored for a refused sample


def test_every_fake_has_an_adapter(store: RouteStore) -> None:
    for name in FAKE_ENGINES:
        assert make_fake(name, store).adapter in ADAPTERS


def _lie_about_completion_tokens(response: Any, count: int) -> None:
    if isinstance(response, dict) and "usage" in response:
        response["usage"]["completion_tokens"] = count
    elif isinstance(response, dict):
        response["meta_info"]["completion_tokens"] = count
    else:
        response.outputs[0].token_ids = list(range(count))
