"""An LMDeploy key whose stored array kept the trimmed stop token's row (one row more than
the counts) is adopted whole and read as rows ``[0, rows)``: nothing lost, no copy.

The store side (``RouteStore.adopt_key`` and the read of an adopted payload) belongs to
``routeplay.store``; these tests pin what it must do with ``EngineKey.trailing_rows``.
"""

from __future__ import annotations

import engine_bodies as eb
import numpy as np
from strategies import random_routing

from routeplay import read_response
from routeplay.core import RouteSpec
from routeplay.core.wires import Answer, BodyOptions, engine_wire
from routeplay.rollout.adapters import ADAPTERS
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 2), total_layers=3)
PROMPT, GENERATED = 6, 5


def test_a_key_with_the_stop_row_kept_reads_back_the_counted_rows() -> None:
    store = RouteStore.local(StoreConfig(run="trailing"))
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    stopped = Answer(
        prompt_tokens=PROMPT,
        token_ids=tuple(range(GENERATED)),
        logprobs=(0.0,) * GENERATED,
        finish_reason="stop",
        routing=random_routing(SPEC, PROMPT + GENERATED - 1, 4),
    )
    options = BodyOptions(endpoint="generate", include_stop=False, put=backend.engine_store().put)
    body = engine_wire("lmdeploy").build_body([stopped], SPEC, options)
    key = read_response("lmdeploy", body, SPEC).key
    assert key is not None
    assert key.trailing_rows == 1
    rows = PROMPT + GENERATED - 2  # LMDeploy's counts lost the stop token, the array did not
    handle = ADAPTERS["lmdeploy"].ingest(body, spec=SPEC, writer=store, weight_version=0)
    assert handle.rows == rows
    np.testing.assert_array_equal(store.read(handle), stopped.routing[:rows])


def test_the_same_body_without_a_trimmed_stop_has_exactly_the_counted_rows() -> None:
    store = RouteStore.local(StoreConfig(run="exact"))
    backend = store.backend
    assert isinstance(backend, LocalBackend)
    full = random_routing(SPEC, PROMPT + GENERATED - 1, 5)
    key = backend.engine_store().put(eb.every_layer(full, SPEC, "uint16"))
    body = eb.lmdeploy_generate(key, PROMPT, GENERATED)
    handle = ADAPTERS["lmdeploy"].ingest(body, spec=SPEC, writer=store, weight_version=0)
    np.testing.assert_array_equal(store.read(handle), full)
