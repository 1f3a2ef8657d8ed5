"""Conformance: the bodies routeplay builds (the wire modules' body builders, used by the
reference server and the fakes) decode exactly like the independent encoders' bodies for
the same generation, endpoint by endpoint; and the reference server's own answers do."""

from __future__ import annotations

import json
from typing import Any

import engine_bodies as eb
import numpy as np
import numpy.typing as npt
import pytest
from strategies import random_routing

from routeplay import read_response
from routeplay.core import RouteSpec
from routeplay.core.wires import WIRE_NAMES, Answer, BodyOptions, EngineRouting, engine_wire, wire

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 2), total_layers=3)
PROMPT, COMPLETION, START = 6, 5, 4


def answer(generated: int = COMPLETION, seed: int = 0, finish: str = "length") -> Answer:
    rows = random_routing(SPEC, PROMPT + generated - 1, seed)
    return Answer(
        prompt_tokens=PROMPT,
        token_ids=tuple(range(10, 10 + generated)),
        logprobs=tuple(-0.1 * i for i in range(generated)),
        finish_reason=finish,
        routing=rows,
    )


def same(ours: EngineRouting, theirs: EngineRouting) -> None:
    assert (ours.prompt_tokens, ours.completion_tokens) == (
        theirs.prompt_tokens,
        theirs.completion_tokens,
    )
    assert ours.key == theirs.key
    if theirs.routes is None:
        assert ours.routes is None
        return
    assert ours.routes is not None
    assert ours.routes.start_row == theirs.routes.start_row
    assert ours.routes.sha256() == theirs.routes.sha256()


def _decode(engine: str, body: Any, *, start: int = 0, choice: int = 0) -> EngineRouting:
    return read_response(engine, json.loads(json.dumps(body)), SPEC, start_row=start, choice=choice)


# (engine, options, answers, independent body, start, choice)
def cases() -> dict[str, tuple[str, BodyOptions, list[Answer], Any, int, int]]:
    a, b = answer(), answer(3, seed=1)
    ra, rb = a.routing, b.routing
    s, v, lm = eb.sglang_payload, eb.vllm_payload, eb.lmdeploy_payload
    return {
        "vllm-completions": (
            "vllm",
            BodyOptions(endpoint="completions", start_row=START),
            [a],
            eb.vllm_body([v(ra, SPEC, START)], PROMPT, [5]),
            START,
            0,
        ),
        "vllm-chat-n2": (
            "vllm",
            BodyOptions(endpoint="chat"),
            [a, b],
            eb.vllm_body([v(ra, SPEC), v(rb, SPEC)], PROMPT, [5, 3], chat=True),
            0,
            1,
        ),
        "sglang-generate": (
            "sglang",
            BodyOptions(endpoint="generate", start_row=START),
            [a],
            eb.sglang_generate(s(ra, SPEC, START), PROMPT, 5),
            START,
            0,
        ),
        "sglang-batched": (
            "sglang",
            BodyOptions(endpoint="generate", batched=True),
            [a, b],
            [
                eb.sglang_generate(s(ra, SPEC), PROMPT, 5),
                eb.sglang_generate(s(rb, SPEC), PROMPT, 3),
            ],
            0,
            1,
        ),
        "sglang-completions": (
            "sglang",
            BodyOptions(endpoint="completions", start_row=START),
            [a],
            eb.sglang_openai(s(ra, SPEC, START), PROMPT, [5]),
            START,
            0,
        ),
        "sglang-chat-return-meta-info": (
            "sglang",
            BodyOptions(endpoint="chat", return_meta_info=True),
            [a, b],
            eb.sglang_chat_meta_info([s(ra, SPEC), s(rb, SPEC)], PROMPT, [5, 3]),
            0,
            1,
        ),
        "sglang-stream-chunk": (
            "sglang",
            BodyOptions(endpoint="chat", stream=True),
            [a],
            eb.sglang_stream_chunk(s(ra, SPEC)),
            0,
            0,
        ),
        "lmdeploy-generate": (
            "lmdeploy",
            BodyOptions(endpoint="generate"),
            [a],
            eb.lmdeploy_generate(lm(ra, SPEC), PROMPT, 5),
            0,
            0,
        ),
        "lmdeploy-chat-final-chunk": (
            "lmdeploy",
            BodyOptions(endpoint="chat", stream=True),
            [a],
            eb.lmdeploy_chat(lm(ra, SPEC), PROMPT, 5, final_chunk=True),
            0,
            0,
        ),
        "lmdeploy-messages": (
            "lmdeploy",
            BodyOptions(endpoint="messages"),
            [a],
            eb.lmdeploy_messages(lm(ra, SPEC), PROMPT, 5),
            0,
            0,
        ),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_body_builders_decode_like_the_engines_bodies(name: str) -> None:
    engine, options, answers, theirs, start, choice = cases()[name]
    ours = engine_wire(engine).build_body(answers, SPEC, options)
    same(
        _decode(engine, ours, start=start, choice=choice),
        _decode(engine, theirs, start=start, choice=choice),
    )


def test_sglang_return_meta_info_sends_no_sglext_and_the_start_is_never_echoed() -> None:
    chat = engine_wire("sglang").build_body(
        [answer()], SPEC, BodyOptions(endpoint="chat", return_meta_info=True, start_row=2)
    )
    generate = engine_wire("sglang").build_body(
        [answer()], SPEC, BodyOptions(endpoint="generate", start_row=2)
    )
    assert "sglext" not in chat
    assert "routed_experts_start_len" not in json.dumps([chat, generate])


def test_lmdeploy_trims_the_stop_token_from_the_answer_but_not_from_the_stored_array() -> None:
    stopped = answer(finish="stop")
    stored: dict[str, npt.NDArray[Any]] = {}

    def put(array: npt.NDArray[Any]) -> str:
        stored[eb.KEY] = array
        return eb.KEY

    lmdeploy = engine_wire("lmdeploy")
    trimmed = BodyOptions(endpoint="generate", include_stop=False)
    inline = lmdeploy.build_body([stopped], SPEC, trimmed)
    keyed = lmdeploy.build_body(
        [stopped], SPEC, BodyOptions(endpoint="generate", include_stop=False, put=put)
    )
    done = engine_wire("lmdeploy").read_completion(inline, where="trimmed")
    assert done.token_ids == stopped.token_ids[:-1]  # ids, pairs and counts lose it
    assert done.logprobs == stopped.logprobs[:-1]
    rows = PROMPT + COMPLETION - 2  # the counts lost the stop token
    routes = read_response("lmdeploy", inline, SPEC).routes
    assert routes is not None
    assert routes.rows == rows
    np.testing.assert_array_equal(routes.array, stopped.routing[:rows])
    key = read_response("lmdeploy", keyed, SPEC).key
    assert key is not None
    assert key.rows == rows
    assert stored[eb.KEY].shape[0] == rows + 1  # the stop token's row is still stored
    assert stored[eb.KEY].shape[0] in key.payload_rows
    kept = lmdeploy.build_body([stopped], SPEC, BodyOptions(endpoint="generate", put=put))
    kept_key = read_response("lmdeploy", kept, SPEC).key
    assert kept_key is not None
    assert kept_key.rows == stored[eb.KEY].shape[0]  # include_stop: counts and array agree


# --------------------------------------------------------------------------- the server


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from routeplay.engine import EngineConfig, ReferenceEngine, WireHandler  # noqa: E402

TINY = EngineConfig(hidden_size=32, num_layers=2, num_experts=8, top_k=2, vocab_size=64, seed=7)


class _Put:
    def __init__(self) -> None:
        self.stored: dict[str, npt.NDArray[Any]] = {}

    def remote(self, array: npt.NDArray[Any]) -> str:
        key = f"{len(self.stored) + 1:056x}"
        self.stored[key] = array.copy()
        return key


class _Store:
    def __init__(self) -> None:
        self.put = _Put()


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TINY)


def _independent(name: str, gen: Any, start: int, key: str | None, spec: RouteSpec) -> Any:
    rows, prompt, generated = gen.routing, gen.prompt_tokens, gen.completion_tokens
    if name == "vllm":
        return eb.vllm_body([eb.vllm_payload(rows, spec, start)], prompt, [generated])
    if name == "sglang":
        return eb.sglang_generate(eb.sglang_payload(rows, spec, start), prompt, generated)
    routed = key if key is not None else eb.lmdeploy_payload(rows, spec)
    tokens = (list(gen.token_ids), list(gen.logprobs))
    return eb.lmdeploy_generate(routed, prompt, generated, finish=gen.finish_reason, tokens=tokens)


def _fields(value: Any) -> Any:
    """The field names of a body at every level of objects (values aside)."""
    if isinstance(value, dict):
        return {name: _fields(inner) for name, inner in value.items()}
    return type(value).__name__ if value is None else "value"


@pytest.mark.parametrize("name", WIRE_NAMES)
@pytest.mark.parametrize("history", [0, 5])
def test_the_reference_server_answers_like_the_engine_it_imitates(
    engine: ReferenceEngine, name: str, history: int
) -> None:
    fmt = wire(name)
    store = _Store() if fmt.key_store else None
    handler = WireHandler(engine, name, engine_store=store)
    prompt = [5, 9, 17, 3, 44, 8, 21, 60]
    start = fmt.routing_start(history)
    _, request = fmt.request(prompt, max_new_tokens=6, temperature=0.8, seed=3, start_row=start)
    body = handler(request)
    gen = engine.generate(prompt, max_new_tokens=6, temperature=0.8, seed=3)
    key = None
    if store is not None:
        [key] = store.put.stored
        np.testing.assert_array_equal(
            store.put.stored[key], eb.every_layer(gen.routing, engine.spec, "uint16")
        )
    theirs = _independent(name, gen, start, key, engine.spec)
    engine_name = fmt.engine.value
    ours = read_response(engine_name, body, engine.spec, start_row=start)
    same(ours, read_response(engine_name, theirs, engine.spec, start_row=start))
    assert fmt.read_completion(body).token_ids == gen.token_ids
    if fmt.engine.value == "lmdeploy":  # LMDeploy's real body, field by field
        sent = json.loads(json.dumps(body))
        assert _fields(sent) == _fields(theirs)
        assert fmt.read_completion(sent) == fmt.read_completion(theirs)
        assert fmt.read_completion(sent).logprobs == pytest.approx(gen.logprobs)
