"""Independent encoders of every engine body shape, written from how each engine builds
its body (never by calling routeplay's own body builders or codecs), for the readers'
tests and the reference server's conformance test.

Facts they follow:
- vLLM: ``choices[i].routed_experts`` = base64 of ``np.save`` of rows
  ``[routed_experts_prompt_start, T)``, every decoder layer, uint8 if E <= 256 else
  uint16; counts in ``usage`` (summed over choices), ids per choice in ``token_ids``.
- SGLang: base64 of raw little-endian int32 rows ``[routed_experts_start_len, T)``, every
  decoder layer, start never echoed. ``/generate``: ``meta_info.routed_experts`` (a
  batched request answers a list); OpenAI routes: response-level ``sglext`` from the first
  choice; chat with ``return_meta_info``: ``choices[i].meta_info``; streaming: a chunk
  with ``choices: []`` and ``sglext``. XTuner's patch: a 56-hex key instead.
- LMDeploy: nested lists (uint16 values) or a 56-hex key; ``/generate``:
  ``meta_info``; chat: ``choices[i].routed_experts`` (final chunk when streaming);
  ``/v1/messages``: top level, counts in ``usage.input_tokens/output_tokens``.
  Completion fields from LMDeploy's source (``serve/openai/endpoints/generate.py``,
  ``serve/openai/protocol.py``, ``serve/openai/chat_completions/serving.py``): a
  ``/generate`` body is ``GenerateReqOutput`` (``text``, ``output_ids``, ``meta_info``) with
  ``GenerateReqMetaOutput`` (``prompt_tokens``, ``completion_tokens``, ``finish_reason``
  as ``{"type": reason}``, ``output_token_logprobs`` as ``[[logprob, id], ...]`` or null
  without ``return_logprob``, ``routed_experts``), every field dumped, nulls included;
  a stream sends one such object per engine yield (that yield's ids and pairs, counts so
  far, ``finish_reason`` and routing on the last). Chat is ``model_dump()`` of
  ``ChatCompletionResponse``: each choice has ``message``, ``logprobs``,
  ``output_token_logprobs``, ``finish_reason``, ``output_ids`` (``return_token_ids``),
  ``routed_experts``; a stream chunk is ``model_dump(exclude_none=True)`` with ``delta``,
  and ``include_usage`` adds a last chunk with ``choices: []`` and ``usage``.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core import RouteSpec

KEY = "5f" * 28
"""A well-formed store key (56 lowercase hex characters)."""


def every_layer(rows: npt.NDArray[Any], spec: RouteSpec, dtype: str) -> npt.NDArray[Any]:
    """``[T, num_hidden_layers, K]``: MoE rows at their decoder layer, dense layers zero."""
    out = np.zeros((rows.shape[0], spec.decoder_layers, spec.top_k), dtype=dtype)
    for moe, layer in enumerate(spec.moe_layer_indices()):
        out[:, layer, :] = rows[:, moe, :]
    return out


def vllm_payload(rows: npt.NDArray[Any], spec: RouteSpec, start: int = 0) -> str:
    dtype = "uint8" if spec.num_experts <= 256 else "uint16"
    buffer = io.BytesIO()
    np.save(buffer, every_layer(rows[start:], spec, dtype))
    return base64.b64encode(buffer.getvalue()).decode()


def sglang_payload(rows: npt.NDArray[Any], spec: RouteSpec, start: int = 0) -> str:
    raw = every_layer(rows[start:], spec, "<i4").tobytes()
    return base64.b64encode(raw).decode()


def lmdeploy_payload(rows: npt.NDArray[Any], spec: RouteSpec) -> list[Any]:
    lists: list[Any] = every_layer(rows, spec, "uint16").tolist()
    return lists


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# --------------------------------------------------------------------------- vLLM


def vllm_body(
    routed: list[object], prompt: int, completions: list[int], *, chat: bool = False
) -> dict[str, Any]:
    """A completions (or chat) body with one choice per payload."""
    choices = []
    for index, (payload, generated) in enumerate(zip(routed, completions, strict=True)):
        choice: dict[str, Any] = {"index": index, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x"}
        else:
            choice["text"] = "x"
        choice["token_ids"] = list(range(generated))
        choice["routed_experts"] = payload
        choices.append(choice)
    return {
        "id": "cmpl-1",
        "object": "chat.completion" if chat else "text_completion",
        "model": "m",
        "choices": choices,
        "usage": _usage(prompt, sum(completions)),
    }


# --------------------------------------------------------------------------- SGLang


def sglang_meta(routed: object, prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "r",
        "finish_reason": {"type": "length", "length": completion},
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": 0,
        "routed_experts": routed,
    }


def sglang_generate(routed: object, prompt: int, completion: int) -> dict[str, Any]:
    """``/generate`` for one prompt."""
    return {
        "text": "x",
        "output_ids": list(range(completion)),
        "meta_info": sglang_meta(routed, prompt, completion),
    }


def sglang_openai(
    first_routed: object, prompt: int, completions: list[int], *, chat: bool = False
) -> dict[str, Any]:
    """``/v1/completions`` or ``/v1/chat/completions``: ``sglext`` at the response level."""
    choices = []
    for index in range(len(completions)):
        choice: dict[str, Any] = {"index": index, "finish_reason": "length", "matched_stop": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x"}
        else:
            choice["text"] = "x"
        choices.append(choice)
    return {
        "id": "c",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": "m",
        "choices": choices,
        "usage": _usage(prompt, sum(completions)),
        "sglext": {"routed_experts": first_routed},
    }


def sglang_chat_meta_info(routed: list[object], prompt: int, completions: list[int]) -> Any:
    """Chat with ``return_meta_info``: each choice's own ``meta_info``, no ``sglext``."""
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": "x"},
            "finish_reason": "length",
            "meta_info": sglang_meta(payload, prompt, generated),
        }
        for index, (payload, generated) in enumerate(zip(routed, completions, strict=True))
    ]
    return {
        "id": "c",
        "object": "chat.completion",
        "model": "m",
        "choices": choices,
        "usage": _usage(prompt, sum(completions)),
    }


def sglang_stream_chunk(routed: object, *, chat: bool = True) -> dict[str, Any]:
    """The separate streaming chunk that carries routing."""
    return {
        "id": "c",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": "m",
        "choices": [],
        "sglext": {"routed_experts": routed},
    }


# --------------------------------------------------------------------------- LMDeploy


def lmdeploy_pairs(ids: list[int], logprobs: list[float]) -> list[list[Any]] | None:
    """``output_token_logprobs``: ``(tok_logprobs[tok], tok)`` per output id, JSON lists;
    an empty list is sent as null (``output_token_logprobs or None``)."""
    return [[lp, tok] for tok, lp in zip(ids, logprobs, strict=True)] or None


def _lmdeploy_tokens(completion: int) -> tuple[list[int], list[float]]:
    ids = [100 + 3 * i for i in range(completion)]
    return ids, [-0.125 * (i + 1) for i in range(completion)]


def lmdeploy_generate(
    routed: object,
    prompt: int,
    completion: int,
    *,
    finish: str | None = "length",
    logprobs: bool = True,
    tokens: tuple[list[int], list[float]] | None = None,
) -> dict[str, Any]:
    """``GenerateReqOutput`` of a non-streaming ``/generate`` (``_inner_call``);
    ``tokens``: the generated (ids, log-probabilities), else made-up ones."""
    ids, lps = _lmdeploy_tokens(completion) if tokens is None else tokens
    return {
        "text": "x" * completion,
        "output_ids": ids,
        "meta_info": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "finish_reason": None if finish is None else {"type": finish},
            "output_token_logprobs": lmdeploy_pairs(ids, lps) if logprobs else None,
            "routed_experts": routed,
        },
    }


def lmdeploy_generate_stream(
    routed: object, prompt: int, completion: int, *, finish: str = "length"
) -> list[dict[str, Any]]:
    """``generate_stream_generator``: one ``GenerateReqOutput`` per engine yield (here one
    token each), ``finish_reason`` and routing on the last yield only; the counts are
    cumulative (``generate_token_len``)."""
    ids, lps = _lmdeploy_tokens(completion)
    chunks = []
    for i in range(completion):
        last = i == completion - 1
        chunks.append(
            {
                "text": "x",
                "output_ids": [ids[i]],
                "meta_info": {
                    "prompt_tokens": prompt,
                    "completion_tokens": i + 1,
                    "finish_reason": {"type": finish} if last else None,
                    "output_token_logprobs": [[lps[i], ids[i]]],
                    "routed_experts": routed if last else None,
                },
            }
        )
    return chunks


def lmdeploy_chat(
    routed: object,
    prompt: int,
    completion: int,
    *,
    final_chunk: bool = False,
    finish: str = "length",
    token_ids: bool = True,
    pairs: bool = True,
    openai_logprobs: bool = False,
) -> dict[str, Any]:
    """A non-streaming chat body (``ChatCompletionResponse.model_dump()``), or with
    ``final_chunk`` the last chunk of a stream (``exclude_none``, no usage: that comes in
    its own chunk) carrying the whole answer's ids as one engine yield."""
    ids, lps = _lmdeploy_tokens(completion)
    choice: dict[str, Any] = {"index": 0}
    if final_chunk:
        choice["delta"] = {"role": "assistant", "content": "x"}
    else:
        choice["message"] = {
            "role": "assistant",
            "content": "x",
            "reasoning_content": None,
            "tool_calls": None,
        }
    choice["logprobs"] = (
        {
            "content": [
                {"token": "x", "bytes": [120], "logprob": lp, "top_logprobs": []} for lp in lps
            ]
        }
        if openai_logprobs
        else None
    )
    choice["output_token_logprobs"] = lmdeploy_pairs(ids, lps) if pairs else None
    choice["finish_reason"] = finish
    choice["output_ids"] = ids if token_ids else None
    choice["routed_experts"] = routed
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk" if final_chunk else "chat.completion",
        "created": 1,
        "model": "internlm",
        "choices": [choice],
    }
    if final_chunk:
        body["choices"] = [{k: v for k, v in choice.items() if v is not None}]
        return body
    usage = {**_usage(prompt, completion), "prompt_tokens_details": None}
    usage["completion_tokens_details"] = None
    return {**body, "usage": usage, "service_tier": None}


def lmdeploy_messages(routed: object, prompt: int, completion: int) -> dict[str, Any]:
    """Anthropic protocol ``/v1/messages``."""
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "internlm",
        "content": [{"type": "text", "text": "x"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": completion},
        "routed_experts": routed,
    }


# --------------------------------------------------------------------------- streams


def _delta_chunk(index: int, text: str, *, chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": None}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return {"id": "c", "object": "chat.completion.chunk", "choices": [choice], "usage": None}


def sglang_stream(routed: object, prompt: int, completion: int) -> list[dict[str, Any]]:
    """A chat stream with ``include_usage``: content deltas, the routing chunk, usage."""
    content = [_delta_chunk(0, "x", chat=True) for _ in range(completion)]
    usage = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": _usage(prompt, completion),
    }
    return [*content, sglang_stream_chunk(routed), usage]


def lmdeploy_stream(routed: object, prompt: int, completion: int) -> list[dict[str, Any]]:
    """A chat stream with ``return_token_ids``, ``return_logprob`` and ``include_usage``:
    one chunk per token (its id and pair), ``finish_reason`` and routing on the last,
    then the usage chunk (``choices: []``)."""
    ids, lps = _lmdeploy_tokens(completion)
    chunks: list[dict[str, Any]] = []
    for i in range(completion):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": "x"},
            "output_token_logprobs": [[lps[i], ids[i]]],
            "output_ids": [ids[i]],
        }
        if i == completion - 1:
            choice["finish_reason"] = "length"
            choice["routed_experts"] = routed
        if routed is None:
            choice.pop("routed_experts", None)
        chunks.append(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "internlm",
                "choices": [choice],
                "usage": None,
            }
        )
    usage = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "internlm",
        "choices": [],
        "usage": _usage(prompt, completion),
    }
    return [*chunks, usage]
