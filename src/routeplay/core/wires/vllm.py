"""vLLM's protocol: where routing sits in each body, the request fields that matter, and a
body builder that answers the way vLLM's OpenAI server does.

- ``/v1/completions`` and ``/v1/chat/completions`` (and ``/inference/v1/generate``):
  ``choices[i].routed_experts`` is base64 ``.npy`` (``core.formats.vllm``) of rows
  ``[routed_experts_prompt_start, T)``, every decoder layer; counts in ``usage``
  (summed over choices, so ``n > 1`` needs each choice's ``token_ids``).
- ``routed_experts_prompt_start`` is a request field, never echoed: the caller passes it
  back as ``start_row``.
- In process: ``RequestOutput.prompt_routed_experts`` + ``CompletionOutput.routed_experts``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, Final

from routeplay.core.formats import vllm as codec
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import expected_rows
from routeplay.core.wires.base import (
    Answer,
    BodyOptions,
    Completion,
    Engine,
    EngineRouting,
    completion,
    field,
    item,
    join_choice_stream,
    mapping,
    openai_choice_counts,
    row_count_refusal,
    rows_expected,
    wire_layers,
)
from routeplay.errors import MalformedPayload, MisuseError, RowCountMismatch

__all__ = ["ENDPOINTS", "START_FIELD", "WIRE", "VllmWire"]

ENDPOINTS: Final[dict[str, str]] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
"""Endpoints whose bodies we build (readers also take ``/inference/v1/generate``)."""
START_FIELD: Final = "routed_experts_prompt_start"
"""Request field: the first routing row the body carries."""
ROUTING: Final = "routed_experts"


class VllmWire:
    """vLLM over HTTP (and its in-process ``RequestOutput``)."""

    engine: Final = Engine.VLLM
    endpoints: Final = ENDPOINTS
    start_field: Final[str | None] = START_FIELD

    # -- reading -------------------------------------------------------------------------

    def read(
        self, body: object, spec: RouteSpec, *, choice: int, start_row: int, where: str
    ) -> EngineRouting:
        """Routing of ``choices[choice]`` of one completions or chat body."""
        top = mapping(body, "vllm response body", where)
        picked = item(field(top, "choices", f"{where} choices"), choice, "choices", where)
        path = f"{where} choices[{choice}].{ROUTING}"
        prompt, generated = openai_choice_counts(top, picked, where)
        expected = rows_expected(prompt, generated, start_row)
        payload = field(picked, ROUTING, path, routing=True)
        try:
            routes = codec.decode(payload, spec, start_row=start_row, expected=expected, where=path)
        except RowCountMismatch as exc:
            raise row_count_refusal(
                exc, start_row=start_row, expected=expected, start_field=START_FIELD
            ) from exc
        return EngineRouting(
            engine=Engine.VLLM, prompt_tokens=prompt, completion_tokens=generated, routes=routes
        )

    def read_output(
        self, output: Any, spec: RouteSpec, *, choice: int = 0, where: str = ""
    ) -> EngineRouting:
        """Routing of one in-process ``RequestOutput`` (prompt rows + the choice's rows)."""
        where = where or "vllm RequestOutput"
        try:
            picked = output.outputs[choice]
            prompt_ids, token_ids = output.prompt_token_ids, picked.token_ids
            parts = (output.prompt_routed_experts, picked.routed_experts)
        except (AttributeError, IndexError, TypeError) as exc:
            raise MalformedPayload(
                "not a vLLM RequestOutput with routed experts",
                expected=f"outputs[{choice}] with token_ids and routed_experts",
                found=f"{type(exc).__name__}: {exc}",
                where=where,
            ) from exc
        prompt, generated = len(prompt_ids), len(token_ids)
        routes = codec.from_outputs(
            *parts, spec, expected=expected_rows(prompt, generated), where=where
        )
        return EngineRouting(
            engine=Engine.VLLM, prompt_tokens=prompt, completion_tokens=generated, routes=routes
        )

    def read_completion(
        self, body: object, *, where: str, require_logprobs: bool = True
    ) -> Completion:
        """Generated ids, log-probabilities and finish reason of a completions body; a
        choice without ``logprobs`` is refused unless ``require_logprobs`` is False."""
        top = mapping(body, "vllm response body", where)
        picked = item(field(top, "choices", where), 0, "choices", where)
        logprobs = None
        if require_logprobs or picked.get("logprobs") is not None:
            logprobs = field(field(picked, "logprobs", where), "token_logprobs", where)
        ids = field(picked, "token_ids", where)
        return completion(ids, logprobs, field(picked, "finish_reason", where), where=where)

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
        """(path, body) of a ``/v1/completions`` request for token ids."""
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            "return_token_ids": True,
            **extra,
        }
        if start_row:
            body[START_FIELD] = start_row
        return ENDPOINTS["completions"], body

    # -- bodies --------------------------------------------------------------------------

    def build_body(self, answers: Sequence[Answer], spec: RouteSpec, options: BodyOptions) -> Any:
        """The body vLLM's OpenAI server sends for ``answers`` (one per choice, ``n``)."""
        if options.endpoint not in ENDPOINTS or options.stream or options.put is not None:
            raise MisuseError(
                "vLLM answers completions or chat bodies inline",
                expected=f"endpoint in {sorted(ENDPOINTS)}, no stream, no store",
                found=options,
            )
        chat = options.endpoint == "chat"
        choices = [_choice(i, a, spec, options, chat) for i, a in enumerate(answers)]
        prompt = answers[0].prompt_tokens
        generated = sum(len(a.token_ids) for a in answers)
        return {
            "id": "chatcmpl-routeplay" if chat else "cmpl-routeplay",
            "object": "chat.completion" if chat else "text_completion",
            "model": "routeplay-reference",
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": generated,
                "total_tokens": prompt + generated,
            },
        }

    def build_output(self, answer: Answer, spec: RouteSpec) -> Any:
        """What vLLM's ``LLM.generate`` returns in process: a ``RequestOutput`` look-alike
        whose prompt rows and completion rows are separate int16 arrays."""
        rows = wire_layers(answer.routing, spec, "int16")
        prompt = answer.prompt_tokens
        generated = SimpleNamespace(token_ids=list(answer.token_ids), routed_experts=rows[prompt:])
        return SimpleNamespace(
            prompt_token_ids=list(range(prompt)),
            prompt_routed_experts=rows[:prompt],
            outputs=[generated],
        )


def _choice(
    index: int, answer: Answer, spec: RouteSpec, options: BodyOptions, chat: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["text"] = ""
    out["token_ids"] = list(answer.token_ids)
    out["logprobs"] = {"token_logprobs": list(answer.logprobs)}
    out["finish_reason"] = answer.finish_reason
    if options.return_routing:
        rows = wire_layers(answer.routing, spec, str(codec.wire_dtype(spec)))
        out[ROUTING] = codec.encode(rows[options.start_row :], spec)
    return out


WIRE: Final = VllmWire()
