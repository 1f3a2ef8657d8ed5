"""Pull routing and token counts out of one whole engine HTTP response body.

This is where wire field names live: vLLM completions and chat completions,
SGLang ``/generate``, LMDeploy ``/generate`` and chat completions. Each reader returns
an ``EngineRouting``: validated canonical ``Routes`` or, for LMDeploy key mode, an
``EngineKey`` (no data is fetched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.core.handle import EngineKey
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import expected_rows
from routeplay.errors import MalformedPayload

__all__ = ["Engine", "EngineRouting", "read_response"]


class Engine(str, Enum):
    """Engines whose wire formats we read."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LMDEPLOY = "lmdeploy"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class EngineRouting:
    """The routing of one response: data (``routes``) or a reference to it (``key``)."""

    engine: Engine
    """Engine that produced the response."""
    prompt_tokens: int | None
    """Prompt tokens the engine reported, if any."""
    completion_tokens: int | None
    """Generated tokens the engine reported, if any."""
    routes: Routes | None = None
    """Decoded, validated routing when the response carried data."""
    key: EngineKey | None = None
    """Engine-store key when the response carried a reference."""


def read_response(
    engine: Engine | str,
    body: object,
    spec: RouteSpec,
    *,
    choice: int = 0,
    where: str = "",
    start_row: int = 0,
) -> EngineRouting:
    """Decode and validate the routing in ``body`` (a parsed JSON response).

    ``start_row`` is vLLM's ``routed_experts_prompt_start`` (the request's, not echoed in
    the response); SGLang bodies carry their own ``routed_experts_start_len``.
    """
    kind = Engine(engine)
    if isinstance(body, list) and len(body) == 1:
        body = body[0]  # SGLang /generate answers a one-prompt batch with a list
    if not isinstance(body, Mapping):
        raise MalformedPayload(
            f"{kind.value} response body must be a JSON object",
            expected="object",
            found=type(body).__name__,
            where=where,
        )
    if kind is Engine.VLLM:
        return _read_vllm(body, spec, choice, where or kind.value, start_row)
    reader = {Engine.SGLANG: _read_sglang, Engine.LMDEPLOY: _read_lmdeploy}
    return reader[kind](body, spec, choice, where or kind.value)


def _read_vllm(
    body: Mapping[str, Any], spec: RouteSpec, choice: int, where: str, start: int
) -> EngineRouting:
    picked = _choice(body, choice, where)
    path = f"{where} choices[{choice}].routed_experts"
    prompt, completion = _choice_counts(body, picked, where)
    payload = _field(picked, "routed_experts", path)
    expected = _expected(prompt, completion, start)
    routes = vllm.decode(payload, spec, start_row=start, expected=expected, where=path)
    return EngineRouting(
        engine=Engine.VLLM, prompt_tokens=prompt, completion_tokens=completion, routes=routes
    )


def _read_sglang(
    body: Mapping[str, Any], spec: RouteSpec, choice: int, where: str
) -> EngineRouting:
    if "choices" in body:  # OpenAI routes carry routing in each choice's sgl_ext
        picked = _choice(body, choice, where)
        meta = _field(picked, "sgl_ext", f"{where} choices[{choice}].sgl_ext")
        path = f"{where} choices[{choice}].sgl_ext.routed_experts"
        prompt, completion = _choice_counts(body, picked, where)
    else:
        meta = _field(body, "meta_info", f"{where} meta_info")
        path = f"{where} meta_info.routed_experts"
        prompt = _count(meta, "prompt_tokens", where)
        completion = _count(meta, "completion_tokens", where)
    start = _count(meta, "routed_experts_start_len", where) or 0
    routes = sglang.decode(
        _field(meta, "routed_experts", path),
        spec,
        start_row=start,
        expected=_expected(prompt, completion, start),
        where=path,
    )
    return EngineRouting(
        engine=Engine.SGLANG, prompt_tokens=prompt, completion_tokens=completion, routes=routes
    )


def _read_lmdeploy(
    body: Mapping[str, Any], spec: RouteSpec, choice: int, where: str
) -> EngineRouting:
    if "choices" in body:  # OpenAI-style chat/completions: routing on the final chunk's choice
        holder = _choice(body, choice, where)
        path = f"{where} choices[{choice}].routed_experts"
        prompt, completion = _choice_counts(body, holder, where)
    else:
        holder = _field(body, "meta_info", f"{where} meta_info")
        path = f"{where} meta_info.routed_experts"
        prompt = _count(holder, "prompt_tokens", where)
        completion = _count(holder, "completion_tokens", where)
    value = _field(holder, "routed_experts", path)
    expected = _expected(prompt, completion, 0)
    common: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if isinstance(value, str):
        if expected is None:
            raise MalformedPayload(
                "a routing key needs token counts to know its row count",
                expected="prompt_tokens and completion_tokens",
                found="no counts",
                where=path,
            )
        key = lmdeploy.parse_key(value, rows=expected, where=path)
        return EngineRouting(engine=Engine.LMDEPLOY, key=key, **common)
    routes = lmdeploy.decode_lists(value, spec, expected=expected, where=path)
    return EngineRouting(engine=Engine.LMDEPLOY, routes=routes, **common)


def _field(holder: object, name: str, path: str) -> Any:
    if not isinstance(holder, Mapping) or name not in holder or holder[name] is None:
        hint = (
            "Was the engine started with routed-experts return enabled?"
            if name == "routed_experts"
            else ""
        )
        raise MalformedPayload(
            f"response has no {name}",
            expected=f"field {name!r}",
            found="missing" if isinstance(holder, Mapping) else type(holder).__name__,
            where=path,
            hint=hint,
        )
    return holder[name]


def _choice(body: Mapping[str, Any], index: int, where: str) -> Mapping[str, Any]:
    choices = _field(body, "choices", f"{where} choices")
    if not isinstance(choices, Sequence) or not 0 <= index < len(choices):
        raise MalformedPayload(
            "response has no such choice",
            expected=f"choices[{index}]",
            found=f"{len(choices) if isinstance(choices, Sequence) else 0} choices",
            where=where,
        )
    picked = choices[index]
    if not isinstance(picked, Mapping):
        raise MalformedPayload(
            "choice is not an object", expected="object", found=type(picked).__name__, where=where
        )
    return picked


def _choice_counts(
    body: Mapping[str, Any], picked: Mapping[str, Any], where: str
) -> tuple[int | None, int | None]:
    """Prompt and completion tokens of one choice; usage sums over choices, so n>1 needs ids."""
    usage = body.get("usage") or {}
    prompt = _count(usage, "prompt_tokens", where)
    if len(body.get("choices") or ()) == 1:
        return prompt, _count(usage, "completion_tokens", where)
    token_ids = picked.get("token_ids")
    return prompt, len(token_ids) if isinstance(token_ids, list) else None


def _count(holder: Mapping[str, Any], name: str, where: str) -> int | None:
    value = holder.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedPayload(
            f"{name} must be a non-negative integer",
            expected="int >= 0",
            found=repr(value)[:40],
            where=f"{where} {name}",
        )
    return value


def _expected(prompt: int | None, completion: int | None, start: int) -> int | None:
    if prompt is None or completion is None:
        return None
    return expected_rows(prompt, completion, start)
