"""LMDeploy's protocol: where routing sits in each body, the request fields that matter,
and a body builder that answers the way LMDeploy's API server does.

- ``/generate``: ``meta_info.routed_experts``, counts in ``meta_info``;
- ``/v1/chat/completions``: ``choices[i].routed_experts`` (streaming: on the final chunk),
  counts in ``usage``;
- ``/v1/messages`` (Anthropic protocol, XTuner's session server): ``routed_experts`` at
  the top level, counts in ``usage.input_tokens`` / ``usage.output_tokens``.

Routing is nested lists ``[T][L][K]`` without Ray, or (Ray executor) the 56-hex key of a
uint16 array in the ``shared_store`` actor. With ``include_stop_str_in_output=False``
(LMDeploy's default) the stop token is trimmed from the answer and from inline lists but
not from the stored array, so a key's payload may hold one row more than the counts
imply: the ``EngineKey`` says so (``trailing_rows=1``) and only rows ``[0, rows)`` are the
sample's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from routeplay.core.formats import lmdeploy as codec
from routeplay.core.spec import RouteSpec
from routeplay.core.wires.base import (
    Answer,
    BodyOptions,
    Completion,
    Engine,
    EngineRouting,
    completion,
    count,
    field,
    item,
    join_choice_stream,
    mapping,
    openai_choice_counts,
    rows_expected,
    store_key,
    wire_layers,
)
from routeplay.errors import MalformedPayload, MisuseError

__all__ = [
    "ENDPOINTS",
    "INCLUDE_STOP_FIELD",
    "KEY_NAMESPACE",
    "RETURN_FIELD",
    "TRAILING_KEY_ROWS",
    "WIRE",
    "LmdeployWire",
]

ENDPOINTS: Final[dict[str, str]] = {
    "generate": "/generate",
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
}
KEY_NAMESPACE: Final = "lmdeploy"
"""Ray namespace of LMDeploy's ``shared_store`` actor."""
TRAILING_KEY_ROWS: Final = 1
"""Rows a stored payload may hold beyond the counts (the trimmed stop token's row)."""
RETURN_FIELD: Final = "return_routed_experts"
"""Request flag asking for routing."""
INCLUDE_STOP_FIELD: Final = "include_stop_str_in_output"
"""Request flag: keep the stop token in the answer (LMDeploy's default: False)."""
ROUTING: Final = "routed_experts"
META: Final = "meta_info"


class LmdeployWire:
    """LMDeploy over HTTP: ``/generate``, chat completions and Anthropic messages."""

    engine: Final = Engine.LMDEPLOY
    endpoints: Final = ENDPOINTS
    start_field: Final[str | None] = None  # LMDeploy always sends every row

    # -- reading -------------------------------------------------------------------------

    def read(
        self, body: object, spec: RouteSpec, *, choice: int, start_row: int, where: str
    ) -> EngineRouting:
        """Routing of one ``/generate``, chat (or its final chunk) or messages body."""
        top = mapping(body, "lmdeploy response body", where)
        if start_row:
            raise MalformedPayload(
                "LMDeploy has no routing start row: every body holds every row",
                expected="start_row 0",
                found=f"start_row {start_row}",
                where=where,
            )
        holder, path, prompt, generated = _locate(top, choice, where)
        value = field(holder, ROUTING, path, routing=True)
        expected = rows_expected(prompt, generated, 0)
        common: dict[str, Any] = {
            "engine": Engine.LMDEPLOY,
            "prompt_tokens": prompt,
            "completion_tokens": generated,
        }
        if isinstance(value, str):
            key = store_key(
                value,
                rows=expected,
                namespace=KEY_NAMESPACE,
                trailing_rows=TRAILING_KEY_ROWS,
                path=path,
            )
            return EngineRouting(key=key, **common)
        routes = codec.decode_lists(value, spec, expected=expected, where=path)
        return EngineRouting(routes=routes, **common)

    def read_completion(self, body: object, *, where: str) -> Completion:
        """Generated ids, log-probabilities and finish reason of a ``/generate`` body."""
        top = mapping(body, "lmdeploy response body", where)
        return completion(
            field(top, "token_ids", where),
            field(top, "logprobs", where),
            field(top, "finish_reason", where),
            where=where,
        )

    def join_stream(self, chunks: Sequence[object], *, where: str) -> Any:
        """One body from the chunks of a streamed answer: routing rides on the final
        chunk's choices, counts on the chunk with ``usage``."""
        return join_choice_stream(chunks, ROUTING, self.engine.value, where)

    # -- requests ------------------------------------------------------------------------

    def request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        extra: Mapping[str, Any],
        start_row: int,
    ) -> tuple[str, dict[str, Any]]:
        """(path, body) of a ``/generate`` request; ``start_row`` must be 0 (LMDeploy has
        no such field). The stop token stays in the answer (as XTuner asks), so a stored
        payload's rows match the counts exactly."""
        if start_row:
            raise MisuseError(
                "LMDeploy sends every routing row", expected="start_row 0", found=start_row
            )
        return ENDPOINTS["generate"], {
            "input_ids": list(prompt_ids),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            RETURN_FIELD: True,
            INCLUDE_STOP_FIELD: True,
            **extra,
        }

    # -- bodies --------------------------------------------------------------------------

    def build_body(self, answers: Sequence[Answer], spec: RouteSpec, options: BodyOptions) -> Any:
        """The body LMDeploy sends for ``answers`` (several only for chat's ``n``)."""
        if options.endpoint not in ENDPOINTS or options.start_row:
            raise MisuseError(
                "no such LMDeploy endpoint, or a start row LMDeploy does not have",
                expected=f"endpoint in {sorted(ENDPOINTS)}, start_row 0",
                found=options,
            )
        if options.endpoint != "chat" and len(answers) != 1:
            raise MisuseError("one answer per body", expected=1, found=len(answers))
        shown = [_visible(a, options) for a in answers]
        if options.endpoint == "generate":
            answer, (ids, logprobs, _) = answers[0], shown[0]
            meta: dict[str, Any] = {
                "prompt_tokens": answer.prompt_tokens,
                "completion_tokens": len(ids),
            }
            if options.return_routing:
                meta[ROUTING] = _routing(answer, spec, options)
            return {
                "text": "",
                "token_ids": ids,
                "logprobs": logprobs,
                "finish_reason": answer.finish_reason,
                META: meta,
            }
        if options.endpoint == "messages":
            return _messages(answers[0], shown[0][0], spec, options)
        return _chat(answers, shown, spec, options)


def _locate(
    top: Mapping[str, Any], choice: int, where: str
) -> tuple[Mapping[str, Any], str, int | None, int | None]:
    """The object holding routing, its path, and the prompt and completion counts."""
    if "choices" in top:  # chat completions, or the final chunk of a stream
        holder = item(field(top, "choices", where), choice, "choices", where)
        prompt, generated = openai_choice_counts(top, holder, where)
        return holder, f"{where} choices[{choice}].{ROUTING}", prompt, generated
    if choice:
        raise MalformedPayload(
            "this body has one result", expected="choice 0", found=choice, where=where
        )
    if META in top:  # /generate
        meta = mapping(field(top, META, f"{where} {META}"), META, where)
        prompt = count(meta, "prompt_tokens", where)
        return meta, f"{where} {META}.{ROUTING}", prompt, count(meta, "completion_tokens", where)
    usage = top.get("usage")  # /v1/messages (Anthropic protocol)
    prompt = count(usage, "input_tokens", where)
    return top, f"{where} {ROUTING}", prompt, count(usage, "output_tokens", where)


def _visible(answer: Answer, options: BodyOptions) -> tuple[list[int], list[float], int]:
    """Ids, log-probs and row count the answer shows (the stop token trimmed unless
    ``include_stop_str_in_output``)."""
    rows = answer.routing.shape[0]
    if options.include_stop or answer.finish_reason != "stop":
        return list(answer.token_ids), list(answer.logprobs), rows
    return list(answer.token_ids[:-1]), list(answer.logprobs[:-1]), rows - 1


def _routing(answer: Answer, spec: RouteSpec, options: BodyOptions) -> object:
    rows = wire_layers(answer.routing, spec, str(codec.WIRE_DTYPE))
    if options.put is not None:  # the stored array keeps every row, the stop token's too
        return options.put(rows)
    return codec.encode_lists(rows[: _visible(answer, options)[2]])


def _messages(
    answer: Answer, ids: list[int], spec: RouteSpec, options: BodyOptions
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "msg-routeplay",
        "type": "message",
        "role": "assistant",
        "model": "routeplay-reference",
        "content": [{"type": "text", "text": ""}],
        "stop_reason": "end_turn" if answer.finish_reason == "stop" else "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": len(ids)},
    }
    if options.return_routing:
        body[ROUTING] = _routing(answer, spec, options)
    return body


def _chat(
    answers: Sequence[Answer],
    shown: Sequence[tuple[list[int], list[float], int]],
    spec: RouteSpec,
    options: BodyOptions,
) -> dict[str, Any]:
    choices = []
    for index, (answer, (ids, _, _)) in enumerate(zip(answers, shown, strict=True)):
        choice: dict[str, Any] = {"index": index, "finish_reason": answer.finish_reason}
        choice["delta" if options.stream else "message"] = {"role": "assistant", "content": ""}
        choice["token_ids"] = ids
        if options.return_routing:
            choice[ROUTING] = _routing(answer, spec, options)
        choices.append(choice)
    prompt = answers[0].prompt_tokens
    generated = sum(len(ids) for ids, _, _ in shown)
    return {
        "id": "chatcmpl-routeplay",
        "object": "chat.completion.chunk" if options.stream else "chat.completion",
        "model": "routeplay-reference",
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        },
    }


WIRE: Final = LmdeployWire()
