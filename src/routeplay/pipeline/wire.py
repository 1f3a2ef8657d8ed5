"""The request and token fields of each engine wire format the demo speaks.

Routing is read by the rollout adapters (``routeplay.rollout.ADAPTERS``); this module
owns the rest of a round trip: which path and JSON body ask for a completion (with
``stop_after`` for an interruption, and a routing start row so that a resume or a later
turn gets only the rows its history lacks: SGLang ``routed_experts_start_len``, vLLM
``routed_experts_prompt_start``; LMDeploy always sends every row), and where the
generated ids, their log-probabilities and the finish reason sit in the answer.

The wire names mirror ``routeplay.engine.server.WIRES``; they are repeated here because
rollout workers import this module and must not pull in torch with the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from routeplay.errors import MalformedPayload

__all__ = [
    "ADAPTER_OF",
    "WIRES",
    "Completion",
    "Wire",
    "adapter_name",
    "read_completion",
    "request",
    "routing_start",
]

Wire: TypeAlias = Literal["lmdeploy-key", "lmdeploy-inline", "vllm", "sglang"]
WIRES: Final[tuple[Wire, ...]] = ("lmdeploy-key", "lmdeploy-inline", "vllm", "sglang")
ADAPTER_OF: Final[dict[str, str]] = {
    "lmdeploy-key": "lmdeploy",
    "lmdeploy-inline": "lmdeploy",
    "vllm": "vllm",
    "sglang": "sglang",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """The generated part of one answer (routing aside)."""

    token_ids: tuple[int, ...]
    """Generated ids, in order."""
    logprobs: tuple[float, ...]
    """Engine log-probability of each generated id."""
    finish_reason: str
    """``stop``, ``length`` or ``abort`` (interrupted by ``stop_after``)."""


def adapter_name(wire: str) -> str:
    """The ``ADAPTERS`` entry that reads a wire format's routing."""
    if wire not in ADAPTER_OF:
        raise MalformedPayload("unknown engine wire format", expected=WIRES, found=wire)
    return ADAPTER_OF[wire]


def request(
    wire: str,
    prompt_ids: tuple[int, ...],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    stop_after: int | None = None,
    start_len: int = 0,
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) asking the engine to continue ``prompt_ids``; ``start_len`` is
    the first routing row wanted (ignored by LMDeploy, which has no such field)."""
    prompt = list(prompt_ids)
    extra: dict[str, Any] = {} if stop_after is None else {"stop_after": stop_after}
    if wire == "vllm":
        body = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": temperature}
        if start_len:
            body["routed_experts_prompt_start"] = start_len
        return "/v1/completions", {**body, "seed": seed, **extra}
    if wire == "sglang":
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        body = {"input_ids": prompt, "sampling_params": {**params, **extra}}
        body["return_routed_experts"] = True
        if start_len:
            body["routed_experts_start_len"] = start_len
        return "/generate", body
    adapter_name(wire)  # refuses unknown names
    body = {"input_ids": prompt, "max_tokens": max_new_tokens, "temperature": temperature}
    return "/generate", {**body, "seed": seed, "return_routed_experts": True, **extra}


def routing_start(wire: str, history_rows: int) -> int:
    """First routing row an answer carries when the request continues ``history_rows``."""
    return history_rows if wire in ("vllm", "sglang") else 0


def read_completion(wire: str, body: object, *, where: str = "") -> Completion:
    """Generated ids, log-probabilities and finish reason of one answer body."""
    where = where or wire
    try:
        if wire == "vllm":
            choice = _mapping(body)["choices"][0]
            ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            reason = choice["finish_reason"]
        elif wire == "sglang":
            meta = _mapping(body)["meta_info"]
            ids = _mapping(body)["output_ids"]
            logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
            reason = meta["finish_reason"]["type"]
        else:
            ids, logprobs = _mapping(body)["token_ids"], _mapping(body)["logprobs"]
            reason = _mapping(body)["finish_reason"]
        completion = Completion(
            token_ids=tuple(int(i) for i in ids),
            logprobs=tuple(float(p) for p in logprobs),
            finish_reason=str(reason),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise MalformedPayload(
            "the engine answer lacks generated ids, log-probabilities or a finish reason",
            expected=f"a {wire} completion body",
            found=f"{type(exc).__name__}: {exc}",
            where=where,
        ) from exc
    if len(completion.logprobs) != len(completion.token_ids):
        raise MalformedPayload(
            "one log-probability per generated id",
            expected=len(completion.token_ids),
            found=len(completion.logprobs),
            where=where,
        )
    return completion


def _mapping(body: object) -> Mapping[str, Any]:
    if isinstance(body, list) and len(body) == 1:
        body = body[0]  # SGLang answers a one-prompt batch with a list
    if not isinstance(body, Mapping):
        raise TypeError(f"a JSON object, not {type(body).__name__}")
    return body
