"""Fuzzing every decoder and every engine reader: success or a ``RouteplayError``, never
anything else (``fuzzing.check``).

Inputs are near-valid bodies built by the real body builders of every engine, endpoint
and option, then mutated (wrong types at every path, huge and non-finite numbers, JSON
nested up to 100,000 deep, 4 MB strings among the ids, truncated or corrupted base64,
hostile .npy headers), plus raw bytes and text.

Settings: ``ROUTEPLAY_FUZZ=ci`` (default: a few seconds per test) or ``long`` (thousands
of inputs per test; ``benchmarks/fuzz_long.py`` runs that and counts). A failure prints
``@reproduce_failure(...)`` and the falsifying example: paste the decorator above the
test to replay it exactly, or rerun with ``--hypothesis-seed=N``
(``--hypothesis-show-statistics`` shows how many inputs each test ran).
"""

from __future__ import annotations

import copy
import tracemalloc
from functools import cache
from typing import Any

import numpy as np
from fuzzing import (
    DENSE,
    FUZZ,
    SPEC,
    b64,
    check,
    engine_cases,
    hostile_values,
    materialize,
    mutated,
    npy_files,
    payload_strings,
    seed_bodies,
)
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core import RouteSpec, read_response, read_responses, read_stream
from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.core.formats.b64 import decode_base64
from routeplay.core.formats.npy import read_npy
from routeplay.core.wires import ENGINES, Engine

specs = st.sampled_from([SPEC, DENSE])
expected_rows = st.one_of(st.none(), st.integers(-2, 12), st.just(2**62))


@FUZZ
@given(
    st.one_of(st.text(max_size=200), st.binary(max_size=200), payload_strings(), hostile_values())
)
def test_base64(text: Any) -> None:
    check("b64", lambda: decode_base64(materialize(text), what="fuzz"))


@FUZZ
@given(st.one_of(npy_files(), st.binary(max_size=300)))
def test_npy_reader(raw: bytes) -> None:
    check("npy", lambda: read_npy(raw))


@FUZZ
@given(st.one_of(npy_files(), st.binary(max_size=300)), specs, expected_rows)
def test_vllm_npy_codec(raw: bytes, spec: RouteSpec, expected: int | None) -> None:
    check("vllm-codec", lambda: vllm.decode(b64(raw), spec, expected=expected))


@FUZZ
@given(st.one_of(payload_strings(), hostile_values()), specs, st.integers(0, 8), expected_rows)
def test_sglang_int32_codec(
    payload: Any, spec: RouteSpec, start: int, expected: int | None
) -> None:
    value = materialize(payload)
    check(
        "sglang-codec",
        lambda: sglang.decode(value, spec, start_row=start, expected=expected),
    )


def _good_lists(spec: RouteSpec) -> list[Any]:
    rng = np.random.default_rng(0)
    keys = rng.random((5, spec.decoder_layers, spec.num_experts))
    return np.argsort(keys, axis=-1)[..., : spec.top_k].tolist()  # type: ignore[no-any-return]


@FUZZ
@given(st.data(), specs, expected_rows)
def test_lmdeploy_lists(data: st.DataObject, spec: RouteSpec, expected: int | None) -> None:
    value = data.draw(st.one_of(mutated(_good_lists(spec)), hostile_values()))
    value = materialize(value)
    check("lists", lambda: lmdeploy.decode_lists(value, spec, expected=expected))


@FUZZ
@given(engine_cases(), st.integers(0, 2))
def test_read_response(case: tuple[Engine, RouteSpec, int, Any], choice: int) -> None:
    engine, spec, start, body = case
    value = materialize(body)
    check(
        f"read_response-{engine.value}",
        lambda: read_response(engine, value, spec, choice=choice, start_row=start),
    )


@FUZZ
@given(engine_cases(), st.one_of(st.integers(0, 4), st.lists(st.integers(0, 4), max_size=3)))
def test_read_responses(case: tuple[Engine, RouteSpec, int, Any], starts: Any) -> None:
    engine, spec, _, body = case
    value = materialize(body)
    check(
        f"read_responses-{engine.value}",
        lambda: read_responses(engine, value, spec, start_rows=starts),
    )


@FUZZ
@given(st.lists(engine_cases(), min_size=0, max_size=3), st.sampled_from(list(Engine)))
def test_read_stream(cases: list[tuple[Engine, RouteSpec, int, Any]], engine: Engine) -> None:
    chunks = [materialize(body) for _, _, _, body in cases]
    spec = cases[0][1] if cases else SPEC
    check(f"read_stream-{engine.value}", lambda: read_stream(engine, chunks, spec))


@FUZZ
@given(engine_cases())
def test_read_completion(case: tuple[Engine, RouteSpec, int, Any]) -> None:
    engine, _, _, body = case
    value = materialize(body)
    check(
        f"read_completion-{engine.value}",
        lambda: ENGINES[engine].read_completion(value, where="fuzz"),
    )


MEMORY_BOUND = 4 << 20
"""Bytes one LMDeploy completion read may allocate, whatever the body (4 MB strings and
100,000-deep lists among them): it never copies or formats an unbounded value."""


@cache
def lmdeploy_completion_seeds() -> tuple[Any, ...]:
    """LMDeploy's real bodies (the builder's, conformance-tested against the independent
    encoders): ``/generate`` and chat, and ``/generate`` streams split one chunk per
    token the way ``generate_stream_generator`` sends them."""
    bodies = [body for engine, _, _, body in seed_bodies() if engine is Engine.LMDEPLOY]
    generates = [b for b in bodies if "output_ids" in b]
    return (*bodies, *(_as_stream(b) for b in generates))


def _as_stream(body: dict[str, Any]) -> list[dict[str, Any]]:
    ids, meta = body["output_ids"], body["meta_info"]
    chunks = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        part = copy.deepcopy(meta) if last else {**meta, "finish_reason": None}
        part["routed_experts"] = meta["routed_experts"] if last else None
        part["output_token_logprobs"] = [meta["output_token_logprobs"][i]]
        part["completion_tokens"] = i + 1
        chunks.append({"text": "", "output_ids": [token], "meta_info": part})
    return chunks


@FUZZ
@given(st.data(), st.booleans())
def test_lmdeploy_completion_reader(data: st.DataObject, required: bool) -> None:
    """The /generate and chat completion reader and both stream joins: typed refusals
    only, no hang (``check``), and bounded memory."""
    seeds = lmdeploy_completion_seeds()
    seed = seeds[data.draw(st.integers(0, len(seeds) - 1), label="seed")]
    value = materialize(data.draw(mutated(seed)) if data.draw(st.integers(0, 7)) else seed)
    wire = ENGINES[Engine.LMDEPLOY]

    def read() -> object:
        body = wire.join_stream(value, where="fuzz") if isinstance(value, list) else value
        return wire.read_completion(body, where="fuzz", require_logprobs=required)

    tracemalloc.start()
    try:
        check("read_completion-lmdeploy-real", read)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"{peak} bytes allocated reading one body"


def test_every_lmdeploy_completion_seed_is_read() -> None:
    wire = ENGINES[Engine.LMDEPLOY]
    for seed in lmdeploy_completion_seeds():
        body = wire.join_stream(seed, where="seed") if isinstance(seed, list) else seed
        if "output_ids" in body or "choices" in body:
            assert wire.read_completion(body, where="seed").finish_reason == "length"


def test_every_seed_body_is_read() -> None:
    """The seeds are valid: fuzzing starts from bodies the readers accept."""
    for engine, spec, start, body in seed_bodies():
        choices = range(2) if _two_results(engine, body) else range(1)
        for choice in choices:
            routing = read_response(engine, body, spec, choice=choice, start_row=start)
            assert routing.routes is not None or routing.key is not None


def _two_results(engine: Engine, body: Any) -> bool:
    if isinstance(body, list):
        return len(body) == 2
    if engine is Engine.SGLANG:
        choices = body.get("choices") or []
        return bool(choices) and "meta_info" in choices[0]
    return len(body.get("choices") or []) == 2
