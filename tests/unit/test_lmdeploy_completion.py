"""The LMDeploy completion reader on LMDeploy's real bodies (``/generate``, chat, and both
streamed), written by the independent encoders in ``engine_bodies`` from LMDeploy's
source: what it reads, and what it refuses (typed, naming the field)."""

from __future__ import annotations

import json
from typing import Any

import engine_bodies as eb
import numpy as np
import pytest
from strategies import random_routing

from routeplay import read_response, read_stream
from routeplay.core import RouteSpec
from routeplay.core.wires import Completion, engine_wire, wire
from routeplay.errors import EngineUnavailable, MalformedPayload

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 2), total_layers=3)
PROMPT, COMPLETION = 6, 4
IDS = [100, 103, 106, 109]
LOGPROBS = (-0.125, -0.25, -0.375, -0.5)
LMDEPLOY = engine_wire("lmdeploy")


def rows() -> Any:
    return random_routing(SPEC, PROMPT + COMPLETION - 1, 0)


def read(body: Any, **kwargs: Any) -> Completion:
    """As an HTTP client hands it over (through JSON), on the key wire's reader."""
    return wire("lmdeploy-key").read_completion(json.loads(json.dumps(body)), **kwargs)


def generate(**kwargs: Any) -> dict[str, Any]:
    return eb.lmdeploy_generate(eb.lmdeploy_payload(rows(), SPEC), PROMPT, COMPLETION, **kwargs)


# --------------------------------------------------------------------------- /generate


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
@pytest.mark.parametrize("name", ["lmdeploy-key", "lmdeploy-inline"])
def test_the_real_generate_body_reads_ids_logprobs_and_finish_reason(
    name: str, reason: str
) -> None:
    done = wire(name).read_completion(json.loads(json.dumps(generate(finish=reason))))
    assert done == Completion(token_ids=tuple(IDS), logprobs=LOGPROBS, finish_reason=reason)


def test_a_generate_body_with_a_key_reads_its_completion_and_its_routing() -> None:
    body = eb.lmdeploy_generate(eb.KEY, PROMPT, COMPLETION)
    assert read(body).token_ids == tuple(IDS)
    key = read_response("lmdeploy", body, SPEC).key
    assert key is not None
    assert key.rows == PROMPT + COMPLETION - 1


def test_a_pair_naming_another_token_is_refused_where_it_sits() -> None:
    body = generate()
    body["meta_info"]["output_token_logprobs"][2][1] = 7
    with pytest.raises(MalformedPayload, match="another token") as caught:
        read(body)
    assert caught.value.where.endswith("meta_info.output_token_logprobs[2]")
    assert "106" in str(caught.value.expected)


def test_pairs_in_another_order_are_refused() -> None:
    body = generate()
    body["meta_info"]["output_token_logprobs"].reverse()
    with pytest.raises(MalformedPayload, match="another token"):
        read(body)


@pytest.mark.parametrize(
    "pairs",
    [
        [[-0.1, 100]],  # fewer pairs than ids
        [[-0.1, 100, "a"], [-0.1, 103], [-0.1, 106], [-0.1, 109]],  # SGLang's triple
        [[-0.1], [-0.1, 103], [-0.1, 106], [-0.1, 109]],
        [["-0.1", 100], [-0.1, 103], [-0.1, 106], [-0.1, 109]],
        [[-0.1, 100.0], [-0.1, 103], [-0.1, 106], [-0.1, 109]],
        [[-0.1, True], [-0.1, 103], [-0.1, 106], [-0.1, 109]],
        [{"logprob": -0.1, "id": 100}] * 4,
        "[-0.1, 100]",
        {"0": [-0.1, 100]},
    ],
    ids=["short", "triple", "one", "str-logprob", "float-id", "bool-id", "objects", "str", "obj"],
)
def test_malformed_pairs_are_refused(pairs: Any) -> None:
    body = generate()
    body["meta_info"]["output_token_logprobs"] = pairs
    with pytest.raises(MalformedPayload) as caught:
        read(body)
    assert "output_token_logprobs" in caught.value.where


def test_a_body_without_logprobs_is_refused_by_name_or_read_when_not_required() -> None:
    body = generate(logprobs=False)  # the request did not set return_logprob
    with pytest.raises(MalformedPayload, match="no output_token_logprobs") as caught:
        read(body)
    assert caught.value.where.endswith("meta_info.output_token_logprobs")
    assert "return_logprob" in caught.value.hint
    done = read(body, require_logprobs=False)
    assert (done.token_ids, done.logprobs, done.has_logprobs) == (tuple(IDS), (), False)
    assert read(generate(), require_logprobs=False).logprobs == LOGPROBS


def test_an_answer_aborted_before_its_first_token_reads_with_no_logprobs() -> None:
    # AsyncEngine.generate yields token_ids=[] and finish_reason abort; LMDeploy sends
    # output_token_logprobs null for the empty list.
    body = eb.lmdeploy_generate(None, PROMPT, 0, finish="abort")
    assert body["meta_info"]["output_token_logprobs"] is None
    done = read(body)
    assert (done.token_ids, done.logprobs, done.finish_reason) == ((), (), "abort")
    assert done.has_logprobs


@pytest.mark.parametrize(
    ("finish", "match"),
    [
        ({"type": "error"}, "finish reason"),
        ({"type": "eos"}, "finish reason"),
        ({"type": "tool_calls"}, "finish reason"),  # a chat-only relabel
        ({"type": 3}, "finish reason"),
        ({"type": ["stop"]}, "finish reason"),
        ({"matched": 2}, "no type"),
        ("stop", "must be a JSON object"),  # the chat shape where /generate has an object
        (None, "no finish_reason"),  # a non-final stream chunk
    ],
)
def test_bad_finish_reasons_are_refused(finish: Any, match: str) -> None:
    body = generate()
    body["meta_info"]["finish_reason"] = finish
    with pytest.raises(MalformedPayload, match=match) as caught:
        read(body)
    assert "finish_reason" in caught.value.where


def test_a_final_chunk_missing_from_a_stream_says_to_join_it() -> None:
    with pytest.raises(MalformedPayload, match="no finish_reason") as caught:
        read(generate(finish=None))
    assert "join_stream" in caught.value.hint


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("output_ids",), "100 103"),
        (("output_ids",), [100, 103.0, 106, 109]),
        (("output_ids",), [100, True, 106, 109]),
        (("output_ids",), None),
        (("meta_info",), [1]),
        (("meta_info",), None),
        (("meta_info", "completion_tokens"), 5),  # disagrees with output_ids
        (("meta_info", "completion_tokens"), "4"),
    ],
)
def test_wrong_types_and_counts_are_refused(path: tuple[str, ...], value: Any) -> None:
    body = generate()
    holder = body
    for name in path[:-1]:
        holder = holder[name]
    holder[path[-1]] = value
    with pytest.raises(MalformedPayload):
        read(body)


@pytest.mark.parametrize("body", [None, [], "{}", 3, [eb.lmdeploy_generate(None, 1, 1)]])
def test_a_body_that_is_not_an_object_is_refused(body: Any) -> None:
    with pytest.raises(MalformedPayload):
        read(body)


# --------------------------------------------------------------------------- chat


def chat(**kwargs: Any) -> dict[str, Any]:
    return eb.lmdeploy_chat(eb.lmdeploy_payload(rows(), SPEC), PROMPT, COMPLETION, **kwargs)


def test_the_real_chat_body_reads_ids_pairs_and_finish_reason() -> None:
    assert read(chat()) == Completion(
        token_ids=tuple(IDS), logprobs=LOGPROBS, finish_reason="length"
    )
    routing = read_response("lmdeploy", chat(), SPEC).routes
    assert routing is not None
    np.testing.assert_array_equal(routing.array, rows())


def test_chat_reads_openai_logprobs_when_the_pairs_are_absent() -> None:
    done = read(chat(pairs=False, openai_logprobs=True))
    assert (done.token_ids, done.logprobs) == (tuple(IDS), LOGPROBS)
    body = chat(pairs=False, openai_logprobs=True)
    body["choices"][0]["logprobs"]["content"].pop()
    with pytest.raises(MalformedPayload, match="one log-probability per output_ids"):
        read(body)


@pytest.mark.parametrize(("reason", "read_as"), [("tool_calls", "stop"), ("abort", "abort")])
def test_chat_finish_reasons_map_to_routeplays(reason: str, read_as: str) -> None:
    assert read(chat(finish=reason)).finish_reason == read_as


@pytest.mark.parametrize("reason", ["parse_error", "error", "content_filter"])
def test_chat_finish_reasons_with_an_unknown_end_are_refused(reason: str) -> None:
    with pytest.raises(MalformedPayload, match="finish reason") as caught:
        read(chat(finish=reason))
    assert caught.value.where.endswith("choices[0].finish_reason")
    if reason == "parse_error":
        assert "response parser" in caught.value.hint


def test_chat_without_output_ids_names_return_token_ids() -> None:
    with pytest.raises(MalformedPayload, match="no output_ids") as caught:
        read(chat(token_ids=False))
    assert "return_token_ids" in caught.value.hint


def test_chat_pairs_are_checked_against_output_ids() -> None:
    body = chat()
    body["choices"][0]["output_token_logprobs"][0][1] = 1
    with pytest.raises(MalformedPayload, match="another token") as caught:
        read(body)
    assert caught.value.where.endswith("choices[0].output_token_logprobs[0]")


def test_a_fanned_out_chat_counts_each_choice_by_its_output_ids() -> None:
    # fanout._collate_responses: one choice per index, usage summed over them.
    first = chat()
    second = eb.lmdeploy_chat(
        eb.lmdeploy_payload(random_routing(SPEC, PROMPT + 2 - 1, 1), SPEC), PROMPT, 2
    )
    body = {**first, "choices": [first["choices"][0], {**second["choices"][0], "index": 1}]}
    body["usage"] = {**first["usage"], "completion_tokens": COMPLETION + 2}
    routing = read_response("lmdeploy", body, SPEC, choice=1)
    assert (routing.prompt_tokens, routing.completion_tokens) == (PROMPT, 2)
    assert read(body).token_ids == tuple(IDS)  # the first choice, not held to the sum


# --------------------------------------------------------------------------- streams


def test_a_generate_stream_joins_into_the_whole_answer() -> None:
    chunks = eb.lmdeploy_generate_stream(eb.lmdeploy_payload(rows(), SPEC), PROMPT, COMPLETION)
    joined = LMDEPLOY.join_stream(json.loads(json.dumps(chunks)), where="s")
    assert read(joined) == Completion(
        token_ids=tuple(IDS), logprobs=LOGPROBS, finish_reason="length"
    )
    routing = read_stream("lmdeploy", chunks, SPEC).routes
    assert routing is not None
    np.testing.assert_array_equal(routing.array, rows())


def test_a_chat_stream_joins_ids_pairs_and_counts() -> None:
    chunks = eb.lmdeploy_stream(eb.lmdeploy_payload(rows(), SPEC), PROMPT, COMPLETION)
    joined = LMDEPLOY.join_stream(json.loads(json.dumps(chunks)), where="s")
    assert read(joined) == Completion(
        token_ids=tuple(IDS), logprobs=LOGPROBS, finish_reason="length"
    )
    routing = read_stream("lmdeploy", chunks, SPEC)
    assert (routing.prompt_tokens, routing.completion_tokens) == (PROMPT, COMPLETION)


def test_a_stream_cut_before_its_last_chunk_is_refused() -> None:
    chunks = eb.lmdeploy_generate_stream(None, PROMPT, COMPLETION)[:-1]
    with pytest.raises(MalformedPayload, match="no finish_reason"):
        read(LMDEPLOY.join_stream(chunks, where="s"))


def test_a_stream_ending_in_an_error_chunk_is_refused() -> None:
    chunks = [*eb.lmdeploy_generate_stream(None, PROMPT, 2)[:1], {"error": {"code": 500}}]
    with pytest.raises(EngineUnavailable, match="with an error") as caught:
        LMDEPLOY.join_stream(chunks, where="s")
    assert caught.value.where == "s chunk 1"
    with pytest.raises(MalformedPayload, match="empty"):
        LMDEPLOY.join_stream([], where="s")


# --------------------------------------------------------------------------- requests


def test_the_request_asks_for_the_pairs_routing_and_the_stop_token() -> None:
    path, body = wire("lmdeploy-key").request([1, 2], max_new_tokens=3, temperature=1.0, seed=0)
    assert path == "/generate"
    assert body["return_logprob"] is True
    assert body["return_routed_experts"] is True
    assert body["include_stop_str_in_output"] is True
