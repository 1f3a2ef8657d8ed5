"""Every engine body shape decodes to the right rows, start row and canonical bytes, or is
refused for the right reason; bodies come from the independent encoders in
``engine_bodies`` (built from how each engine builds its body, not from routeplay)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import engine_bodies as eb
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import dense_specs, random_routing, seeds

from routeplay import read_response, read_responses, read_stream
from routeplay.core import EngineKey, RouteSpec
from routeplay.core.wires import WIRE_NAMES, WIRES, Engine, engine_wire, wire
from routeplay.errors import MalformedPayload, MisuseError, RouteplayError, RowCountMismatch

# The first decoder layer is dense: engines send it as zeros, routeplay keeps the MoE ones.
SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 2), total_layers=3)
WIDE = RouteSpec(num_layers=2, top_k=2, num_experts=300)
PROMPT, COMPLETION = 6, 5
ROWS = PROMPT + COMPLETION - 1
START = 4


def truth(spec: RouteSpec = SPEC, rows: int = ROWS, seed: int = 0) -> npt.NDArray[Any]:
    return random_routing(spec, rows, seed)


def canonical_sha(rows: npt.NDArray[Any], spec: RouteSpec) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=spec.dtype).data).hexdigest()


@dataclass(frozen=True)
class Shape:
    engine: str
    body: Any
    rows: npt.NDArray[Any]
    """The rows decoding must give (absolute rows from ``start``)."""
    start: int = 0
    choice: int = 0
    spec: RouteSpec = SPEC
    counts: tuple[int | None, int | None] = (PROMPT, COMPLETION)


def shapes() -> dict[str, Shape]:
    full, other, wide = truth(), truth(seed=1), truth(WIDE, seed=2)
    short = other[: PROMPT + 3 - 1]  # a second choice with 3 generated tokens
    s, v = eb.sglang_payload, eb.vllm_payload
    return {
        "vllm-completions": Shape("vllm", eb.vllm_body([v(full, SPEC)], PROMPT, [5]), full),
        "vllm-completions-prompt-start": Shape(
            "vllm", eb.vllm_body([v(full, SPEC, START)], PROMPT, [5]), full[START:], START
        ),
        "vllm-chat-uint16": Shape(
            "vllm", eb.vllm_body([v(wide, WIDE)], PROMPT, [5], chat=True), wide, spec=WIDE
        ),
        "vllm-n2-second-choice": Shape(
            "vllm",
            eb.vllm_body([v(full, SPEC), v(short, SPEC)], PROMPT, [5, 3]),
            short,
            choice=1,
            counts=(PROMPT, 3),
        ),
        "sglang-generate": Shape("sglang", eb.sglang_generate(s(full, SPEC), PROMPT, 5), full),
        "sglang-generate-start-len": Shape(
            "sglang", eb.sglang_generate(s(full, SPEC, START), PROMPT, 5), full[START:], START
        ),
        "sglang-batched-second": Shape(
            "sglang",
            [
                eb.sglang_generate(s(full, SPEC), PROMPT, 5),
                eb.sglang_generate(s(short, SPEC, 2), PROMPT, 3),
            ],
            short[2:],
            start=2,
            choice=1,
            counts=(PROMPT, 3),
        ),
        "sglang-completions-sglext": Shape(
            "sglang", eb.sglang_openai(s(full, SPEC), PROMPT, [5]), full
        ),
        "sglang-chat-sglext-start-len": Shape(
            "sglang",
            eb.sglang_openai(s(full, SPEC, START), PROMPT, [5], chat=True),
            full[START:],
            START,
        ),
        "sglang-chat-return-meta-info": Shape(
            "sglang",
            eb.sglang_chat_meta_info([s(full, SPEC), s(short, SPEC)], PROMPT, [5, 3]),
            short,
            choice=1,
            counts=(PROMPT, 3),
        ),
        "sglang-stream-chunk": Shape(
            "sglang", eb.sglang_stream_chunk(s(full, SPEC)), full, counts=(None, None)
        ),
        "lmdeploy-generate-lists": Shape(
            "lmdeploy", eb.lmdeploy_generate(eb.lmdeploy_payload(full, SPEC), PROMPT, 5), full
        ),
        "lmdeploy-chat-lists": Shape(
            "lmdeploy", eb.lmdeploy_chat(eb.lmdeploy_payload(full, SPEC), PROMPT, 5), full
        ),
        "lmdeploy-chat-final-chunk": Shape(
            "lmdeploy",
            eb.lmdeploy_chat(eb.lmdeploy_payload(full, SPEC), PROMPT, 5, final_chunk=True),
            full,
            counts=(None, None),  # the counts ride on the separate usage chunk
        ),
        "lmdeploy-messages": Shape(
            "lmdeploy", eb.lmdeploy_messages(eb.lmdeploy_payload(full, SPEC), PROMPT, 5), full
        ),
    }


@pytest.mark.parametrize("name", list(shapes()))
def test_every_body_shape_decodes_to_its_rows(name: str) -> None:
    shape = shapes()[name]
    body = json.loads(json.dumps(shape.body))  # exactly what an HTTP client hands over
    result = read_response(
        shape.engine, body, shape.spec, choice=shape.choice, start_row=shape.start, where="r"
    )
    assert result.engine is Engine(shape.engine)
    assert (result.prompt_tokens, result.completion_tokens) == shape.counts
    assert result.key is None
    assert result.routes is not None
    routes = result.routes
    assert routes.start_row == shape.start
    assert routes.rows == shape.rows.shape[0]
    assert routes.array.dtype == shape.spec.dtype
    np.testing.assert_array_equal(routes.array, shape.rows)
    assert routes.sha256() == canonical_sha(shape.rows, shape.spec)


def test_a_batched_sglang_list_reads_one_result_per_prompt() -> None:
    full, other = truth(), truth(seed=3)
    batch = [
        eb.sglang_generate(eb.sglang_payload(full, SPEC), PROMPT, 5),
        eb.sglang_generate(eb.sglang_payload(other, SPEC, START), PROMPT, 5),
    ]
    first, second = read_responses("sglang", batch, SPEC, start_rows=[0, START])
    assert first.routes is not None
    assert second.routes is not None
    np.testing.assert_array_equal(first.routes.array, full)
    np.testing.assert_array_equal(second.routes.array, other[START:])
    assert second.routes.start_row == START
    with pytest.raises(MisuseError, match="one start row per element"):
        read_responses("sglang", batch, SPEC, start_rows=[0])
    [single] = read_responses(
        "vllm", eb.vllm_body([eb.vllm_payload(full, SPEC)], PROMPT, [5]), SPEC
    )
    assert single.routes is not None
    assert single.routes.rows == ROWS


@pytest.mark.parametrize(
    ("engine", "chunks", "start"),
    [
        ("sglang", eb.sglang_stream(eb.sglang_payload(truth(), SPEC, START), PROMPT, 5), START),
        ("lmdeploy", eb.lmdeploy_stream(eb.lmdeploy_payload(truth(), SPEC), PROMPT, 5), 0),
    ],
    ids=["sglang-sglext-chunk", "lmdeploy-final-chunk"],
)
def test_a_streamed_answer_reads_its_routing_chunk_and_its_counts(
    engine: str, chunks: list[Any], start: int
) -> None:
    result = read_stream(engine, json.loads(json.dumps(chunks)), SPEC, start_row=start)
    assert (result.prompt_tokens, result.completion_tokens) == (PROMPT, COMPLETION)
    assert result.routes is not None
    assert result.routes.start_row == start
    np.testing.assert_array_equal(result.routes.array, truth()[start:])


def test_a_stream_without_a_routing_chunk_is_refused() -> None:
    chunks = eb.sglang_stream(eb.sglang_payload(truth(), SPEC), PROMPT, 5)
    without = [c for c in chunks if "sglext" not in c]
    with pytest.raises(MalformedPayload, match="no sglang stream chunk carries sglext"):
        read_stream("sglang", without, SPEC)
    with pytest.raises(MalformedPayload, match="no routed_experts"):
        read_stream("lmdeploy", eb.lmdeploy_stream(None, PROMPT, 5), SPEC)


# --------------------------------------------------------------------------- start rows


@pytest.mark.parametrize(
    ("engine", "body", "field"),
    [
        (
            "sglang",
            eb.sglang_generate(eb.sglang_payload(truth(), SPEC, START), PROMPT, 5),
            "routed_experts_start_len",
        ),
        (
            "sglang",
            eb.sglang_openai(eb.sglang_payload(truth(), SPEC, START), PROMPT, [5], chat=True),
            "routed_experts_start_len",
        ),
        (
            "vllm",
            eb.vllm_body([eb.vllm_payload(truth(), SPEC, START)], PROMPT, [5]),
            "routed_experts_prompt_start",
        ),
    ],
    ids=["sglang-generate", "sglang-chat", "vllm-completions"],
)
def test_a_start_row_left_out_is_refused_naming_the_request_field(
    engine: str, body: Any, field: str
) -> None:
    with pytest.raises(RowCountMismatch) as info:
        read_response(engine, body, SPEC)
    message = str(info.value)
    assert f"expected {ROWS} rows" in message
    assert f"found {ROWS - START} rows" in message
    assert f"{field}={START}" in message
    assert f"start_row={START}" in message
    assert f"--start-row {START}" in message


def test_a_wrong_start_row_is_refused_with_the_field_it_stands_for() -> None:
    body = eb.sglang_generate(eb.sglang_payload(truth(), SPEC, START), PROMPT, 5)
    with pytest.raises(RowCountMismatch, match="routed_experts_start_len"):
        read_response("sglang", body, SPEC, start_row=START - 1)


def test_lmdeploy_has_no_start_row() -> None:
    body = eb.lmdeploy_generate(eb.lmdeploy_payload(truth(), SPEC), PROMPT, 5)
    with pytest.raises(MalformedPayload, match="every row"):
        read_response("lmdeploy", body, SPEC, start_row=2)


def test_sglang_openai_routes_carry_the_first_choice_only() -> None:
    body = eb.sglang_openai(eb.sglang_payload(truth(), SPEC), PROMPT, [5, 5])
    with pytest.raises(MalformedPayload, match="first choice only") as info:
        read_response("sglang", body, SPEC, choice=1)
    assert "return_meta_info" in info.value.hint
    first = read_response("sglang", body, SPEC)  # usage sums two choices: no row check
    assert first.routes is not None
    assert first.completion_tokens is None


# --------------------------------------------------------------------------- store keys


@pytest.mark.parametrize(
    ("engine", "body", "namespace", "trailing"),
    [
        ("lmdeploy", eb.lmdeploy_generate(eb.KEY, PROMPT, 5), "lmdeploy", 1),
        ("lmdeploy", eb.lmdeploy_chat(eb.KEY, PROMPT, 5), "lmdeploy", 1),
        ("lmdeploy", eb.lmdeploy_messages(eb.KEY, PROMPT, 5), "lmdeploy", 1),
        ("sglang", eb.sglang_generate(eb.KEY, PROMPT, 5), "sglang", 0),
        ("sglang", eb.sglang_openai(eb.KEY, PROMPT, [5]), "sglang", 0),
    ],
    ids=["lmdeploy-generate", "lmdeploy-chat", "lmdeploy-messages", "sglang-generate", "sglang-v1"],
)
def test_store_keys_become_lazy_engine_keys(
    engine: str, body: Any, namespace: str, trailing: int
) -> None:
    result = read_response(engine, body, SPEC)
    assert result.routes is None
    assert result.key == EngineKey(
        key=eb.KEY, rows=ROWS, namespace=namespace, trailing_rows=trailing
    )
    assert result.key.payload_rows == range(ROWS, ROWS + trailing + 1)


def test_a_key_says_lmdeploy_may_have_kept_the_trimmed_stop_row() -> None:
    key = EngineKey(key=eb.KEY, rows=ROWS, trailing_rows=1)
    assert list(key.payload_rows) == [ROWS, ROWS + 1]
    assert list(EngineKey(key=eb.KEY, rows=ROWS).payload_rows) == [ROWS]


def test_sglang_keys_hold_every_row() -> None:
    with pytest.raises(MalformedPayload, match="every row"):
        read_response("sglang", eb.sglang_generate(eb.KEY, PROMPT, 5), SPEC, start_row=3)


# --------------------------------------------------------------------------- registry


def test_the_registry_names_every_wire_once_and_maps_it_to_its_engine() -> None:
    assert WIRE_NAMES == ("lmdeploy-key", "lmdeploy-inline", "vllm", "sglang")
    assert {w.engine for w in WIRES.values()} == set(Engine)
    assert [name for name in WIRE_NAMES if wire(name).key_store] == ["lmdeploy-key"]
    assert wire("sglang").path == "/generate"
    assert wire("vllm").path == "/v1/completions"
    assert wire("vllm").routing_start(7) == 7
    assert wire("lmdeploy-key").routing_start(7) == 0
    assert engine_wire("lmdeploy-inline") is engine_wire("lmdeploy")
    with pytest.raises(MisuseError):
        wire("trtllm")


@pytest.mark.parametrize("name", WIRE_NAMES)
def test_each_wire_builds_requests_that_ask_for_routing(name: str) -> None:
    fmt = wire(name)
    start = fmt.routing_start(3)
    path, body = fmt.request(
        (1, 2, 3, 4), max_new_tokens=2, temperature=1.0, seed=0, start_row=start
    )
    assert path == fmt.path
    flat = json.dumps(body)
    assert ("routed_experts" in flat) or name == "vllm"  # vLLM: enabled on the server
    if start:
        assert str(start) in flat


# --------------------------------------------------------------------------- properties


@st.composite
def generations(draw: st.DrawFn) -> tuple[RouteSpec, npt.NDArray[Any], int, int, int]:
    spec = draw(dense_specs(), label="spec")
    prompt = draw(st.integers(1, 12), label="prompt")
    completion = draw(st.integers(1, 12), label="completion")
    rows = truth(spec, prompt + completion - 1, draw(seeds, label="seed"))
    start = draw(st.integers(0, prompt), label="start")
    return spec, rows, prompt, completion, start


def _round_trip_bodies(
    spec: RouteSpec, rows: npt.NDArray[Any], prompt: int, completion: int, start: int
) -> list[tuple[str, Any, int]]:
    s = eb.sglang_payload(rows, spec, start)
    return [
        ("vllm", eb.vllm_body([eb.vllm_payload(rows, spec, start)], prompt, [completion]), start),
        ("sglang", eb.sglang_generate(s, prompt, completion), start),
        ("sglang", [eb.sglang_generate(s, prompt, completion)], start),
        ("sglang", eb.sglang_openai(s, prompt, [completion], chat=True), start),
        ("sglang", eb.sglang_chat_meta_info([s], prompt, [completion]), start),
        ("lmdeploy", eb.lmdeploy_messages(eb.lmdeploy_payload(rows, spec), prompt, completion), 0),
        ("lmdeploy", eb.lmdeploy_chat(eb.lmdeploy_payload(rows, spec), prompt, completion), 0),
    ]


@settings(max_examples=40)
@given(case=generations())
def test_every_reader_round_trips(case: tuple[RouteSpec, Any, int, int, int]) -> None:
    spec, rows, prompt, completion, start = case
    for engine, body, first in _round_trip_bodies(spec, rows, prompt, completion, start):
        result = read_response(engine, json.loads(json.dumps(body)), spec, start_row=first)
        assert result.routes is not None, engine
        assert result.routes.start_row == first
        np.testing.assert_array_equal(result.routes.array, rows[first:])
        assert (result.prompt_tokens, result.completion_tokens) == (prompt, completion)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 300)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = st.sampled_from(
    [
        "routed_experts",
        "meta_info",
        "sglext",
        "choices",
        "usage",
        "prompt_tokens",
        "completion_tokens",
        "input_tokens",
        "output_tokens",
        "token_ids",
        "index",
    ]
)
BODIES = st.recursive(
    JSON,
    lambda inner: st.dictionaries(FIELDS, inner, max_size=5) | st.lists(inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300)
@given(
    body=BODIES,
    engine=st.sampled_from([e.value for e in Engine]),
    choice=st.integers(0, 2),
    start=st.integers(0, 3),
)
def test_bad_bodies_raise_only_routeplay_errors(
    body: Any, engine: str, choice: int, start: int
) -> None:
    with contextlib.suppress(RouteplayError):
        read_response(engine, body, SPEC, choice=choice, start_row=start)


@settings(max_examples=100)
@given(case=generations(), data=st.data())
def test_mutated_real_bodies_raise_only_routeplay_errors(
    case: tuple[RouteSpec, Any, int, int, int], data: st.DataObject
) -> None:
    spec, rows, prompt, completion, start = case
    bodies = _round_trip_bodies(spec, rows, prompt, completion, start)
    engine, body, first = data.draw(st.sampled_from(bodies), label="body")
    body = json.loads(json.dumps(body))
    holder = body[0] if isinstance(body, list) else body
    name = data.draw(st.sampled_from(sorted(holder)), label="field")
    holder[name] = data.draw(JSON, label="value")
    with contextlib.suppress(RouteplayError):
        read_response(engine, body, spec, start_row=first)


@settings(max_examples=150)
@given(
    chunks=st.lists(BODIES, max_size=4),
    engine=st.sampled_from([e.value for e in Engine]),
    choice=st.integers(0, 2),
)
def test_bad_streams_raise_only_routeplay_errors(
    chunks: list[Any], engine: str, choice: int
) -> None:
    with contextlib.suppress(RouteplayError):
        read_stream(engine, chunks, SPEC, choice=choice)
