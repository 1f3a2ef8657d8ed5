"""What every engine wire module shares: the result types, the engine-neutral answer a
body is built from, and the few helpers that walk a parsed JSON body safely.

Engine-specific field names live in each engine's module; the only ones here are the
OpenAI envelope several engines share (``choices``, ``usage`` and its counts). Every
helper refuses a wrong shape with ``MalformedPayload`` (never ``KeyError``,
``TypeError`` or ``AttributeError``), naming the path it was reading.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from routeplay.core.formats.lmdeploy import parse_key
from routeplay.core.handle import EngineKey
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import expected_rows
from routeplay.errors import MalformedPayload, RowCountMismatch, describe

__all__ = [
    "Answer",
    "BodyOptions",
    "Completion",
    "Engine",
    "EngineRouting",
    "KeyPut",
    "completion",
    "count",
    "field",
    "item",
    "join_choice_stream",
    "mapping",
    "openai_choice_counts",
    "row_count_refusal",
    "rows_expected",
    "sequence",
    "store_key",
    "wire_layers",
]

MAX_COUNT = 2**63
"""Token counts above this are refused: no real sequence is that long, and bounding them
keeps every derived row count a 64-bit number (numpy-sized, printable)."""

KeyPut: TypeAlias = Callable[[npt.NDArray[Any]], str]
"""Puts one routing array into an engine-side store and returns its key (``ref.hex()``)."""


class Engine(str, Enum):
    """Engines whose wire formats we read."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LMDEPLOY = "lmdeploy"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class EngineRouting:
    """The routing of one response: data (``routes``) or a reference to it (``key``).

    Example:
        >>> routing = read_response("vllm", body, spec)  # doctest: +SKIP
        >>> routing.routes.rows if routing.routes is not None else routing.key.rows
    """

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

    def summary(self) -> dict[str, Any]:
        """A flat, JSON-ready description (what ``routeplay inspect`` prints)."""
        counts = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.key is not None:
            key = self.key
            return {
                "kind": "key",
                "key": key.key,
                "rows": key.rows,
                "trailing_rows": key.trailing_rows,
                "namespace": key.namespace,
                **counts,
            }
        routes = self.routes
        assert routes is not None  # a reader returns data or a key
        return {
            "kind": "routes",
            "rows": routes.rows,
            "start_row": routes.start_row,
            "layers": routes.spec.num_layers,
            "top_k": routes.spec.top_k,
            "dtype": routes.spec.dtype.name,
            "source_dtype": routes.source_dtype,
            "nbytes": routes.nbytes,
            "sha256": routes.sha256(),
            **counts,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """The generated part of one answer (routing aside)."""

    token_ids: tuple[int, ...]
    """Generated ids, in order."""
    logprobs: tuple[float, ...]
    """Engine log-probability of each generated id (empty when ``has_logprobs`` is False)."""
    finish_reason: str
    """``stop``, ``length`` or ``abort`` (interrupted by ``stop_after``)."""
    has_logprobs: bool = True
    """False when the body carried no log-probabilities and the caller read it with
    ``require_logprobs=False``; ``logprobs`` is then empty, whatever ``token_ids`` holds."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Answer:
    """One finished generation, engine-neutral: what a body builder turns into a body.

    Example:
        >>> Answer(prompt_tokens=4, token_ids=(7, 8), logprobs=(-0.1, -0.2),
        ...        finish_reason="length", routing=rows)  # doctest: +SKIP
    """

    prompt_tokens: int
    """Tokens of the prompt."""
    token_ids: tuple[int, ...]
    """Generated ids (a stop token included, as the model produced it)."""
    logprobs: tuple[float, ...]
    """Log-probability of each generated id."""
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    routing: npt.NDArray[Any]
    """Canonical ``[prompt_tokens + len(token_ids) - 1, L, K]`` rows (MoE layers only)."""
    weight_version: int = 0
    """Policy weight version that generated it (SGLang echoes it in ``meta_info``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BodyOptions:
    """How a body builder answers: the endpoint and the request fields that shape a body.

    Example:
        >>> BodyOptions(endpoint="generate", start_row=3)  # doctest: +SKIP
    """

    endpoint: str
    """Endpoint name of the engine (``generate``, ``completions``, ``chat``, ``messages``)."""
    start_row: int = 0
    """First routing row the request asked for (SGLang ``start_len``, vLLM ``prompt_start``)."""
    return_routing: bool = True
    """Whether the request asked for routing at all."""
    put: KeyPut | None = None
    """Engine-store put (key mode: LMDeploy on Ray, XTuner-patched SGLang); None: inline."""
    include_stop: bool = True
    """LMDeploy ``include_stop_str_in_output``: False trims the stop token from the answer."""
    return_logprob: bool = True
    """LMDeploy ``return_logprob``: False answers ``output_token_logprobs: null``."""
    return_meta_info: bool = False
    """SGLang chat ``return_meta_info``: routing in each choice's ``meta_info``."""
    stream: bool = False
    """Answer as the streaming chunk that carries routing instead of a whole body."""
    batched: bool = False
    """SGLang ``/generate`` with a list of prompts: answer a JSON list."""


def wire_layers(truth: npt.NDArray[Any], spec: RouteSpec, dtype: str) -> npt.NDArray[Any]:
    """Rows as engines send them: every decoder layer (dense ones zero), in ``dtype``."""
    wire = np.zeros((truth.shape[0], spec.decoder_layers, spec.top_k), dtype=dtype)
    wire[:, list(spec.moe_layer_indices()), :] = truth
    return wire


# --------------------------------------------------------------------------- reading


def mapping(value: object, what: str, where: str) -> Mapping[str, Any]:
    """``value`` as a JSON object, or a refusal naming ``what`` was expected."""
    if not isinstance(value, Mapping):
        raise MalformedPayload(
            f"{what} must be a JSON object",
            expected="object",
            found=type(value).__name__,
            where=where,
        )
    return value


def field(holder: object, name: str, path: str, *, routing: bool = False) -> Any:
    """``holder[name]``; missing, null or a non-object holder is refused."""
    if not isinstance(holder, Mapping) or holder.get(name) is None:
        raise MalformedPayload(
            f"response has no {name}",
            expected=f"field {name!r}",
            found="missing" if isinstance(holder, Mapping) else type(holder).__name__,
            where=path,
            hint="Was the engine started with routed-experts return enabled?" if routing else "",
        )
    return holder[name]


def item(values: object, index: int, what: str, where: str) -> Mapping[str, Any]:
    """``values[index]`` of a JSON list, as an object."""
    listed = sequence(values, what, where)
    if not 0 <= index < len(listed):
        raise MalformedPayload(
            f"response has no {what}[{index}]",
            expected=f"{what}[{index}]",
            found=f"{len(listed)} {what}",
            where=where,
        )
    picked = listed[index]
    if not isinstance(picked, Mapping):
        raise MalformedPayload(
            f"{what}[{index}] is not an object",
            expected="object",
            found=type(picked).__name__,
            where=where,
        )
    return picked


def count(holder: object, name: str, where: str) -> int | None:
    """A token count, or None when absent (no holder, or no such field); a holder that is
    not an object, or a count that is not a non-negative 64-bit int, is refused."""
    if holder is None:
        return None
    if not isinstance(holder, Mapping):
        raise MalformedPayload(
            f"the object holding {name} must be a JSON object",
            expected="object",
            found=type(holder).__name__,
            where=f"{where} {name}",
        )
    value = holder.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise MalformedPayload(
            f"{name} must be a non-negative integer",
            expected="int in [0, 2**63)",
            found=describe(value),
            where=f"{where} {name}",
        )
    return value


def openai_choice_counts(
    body: Mapping[str, Any], picked: Mapping[str, Any], where: str, *, ids: str = "token_ids"
) -> tuple[int | None, int | None]:
    """Prompt and completion tokens of one choice: ``usage`` sums over choices, so with
    several choices the completion count comes from the choice's own generated ids
    (``ids``: vLLM's ``token_ids``, LMDeploy's ``output_ids``)."""
    usage = body.get("usage")
    prompt = count(usage, "prompt_tokens", where)
    choices = body.get("choices")
    if isinstance(choices, list) and len(choices) == 1:
        return prompt, count(usage, "completion_tokens", where)
    token_ids = picked.get(ids)
    return prompt, len(token_ids) if isinstance(token_ids, list) else None


def join_choice_stream(
    chunks: Sequence[object], routing: str, what: str, where: str
) -> dict[str, Any]:
    """One body from streamed chunks whose routing rides on a choice of the final chunk
    (LMDeploy chat, vLLM): each choice index keeps its last entry that carries routing,
    and the last chunk with usage supplies the counts."""
    picked: dict[int, Mapping[str, Any]] = {}
    usage: object = None
    for number, chunk in enumerate(chunks):
        top = mapping(chunk, f"{what} stream chunk {number}", where)
        usage = top.get("usage") or usage
        choices = top.get("choices")
        for entry in choices if isinstance(choices, list) else ():
            if isinstance(entry, Mapping) and entry.get(routing) is not None:
                index = entry.get("index", 0)
                picked[index if isinstance(index, int) else 0] = entry
    if not picked:
        raise MalformedPayload(
            f"no {what} stream chunk carries {routing}",
            expected=f"a final chunk whose choices carry {routing}",
            found=f"{len(chunks)} chunks without it",
            where=where,
            hint="Was the engine started with routed-experts return enabled?",
        )
    return {"choices": [picked[i] for i in sorted(picked)], "usage": usage}


def store_key(
    payload: object,
    *,
    rows: int | None,
    namespace: str,
    trailing_rows: int,
    path: str,
) -> EngineKey:
    """The ``EngineKey`` behind a 56-hex routing string; its row count comes from the
    body's token counts, so a body without them is refused."""
    if rows is None:
        raise MalformedPayload(
            "a routing key needs token counts to know its row count",
            expected="prompt and completion token counts in the body",
            found="no counts",
            where=path,
        )
    if rows < 0:
        raise RowCountMismatch(
            "the token counts imply a negative row count for the routing key",
            expected="prompt + completion >= 1 (rows = prompt + completion - 1)",
            found=f"{rows} rows",
            where=path,
        )
    return parse_key(
        payload, rows=rows, namespace=namespace, trailing_rows=trailing_rows, where=path
    )


def rows_expected(prompt: int | None, completion: int | None, start: int) -> int | None:
    """Rows a body must carry from ``start``, or None when a count is missing."""
    if prompt is None or completion is None:
        return None
    return expected_rows(prompt, completion, start)


def row_count_refusal(
    exc: RowCountMismatch, *, start_row: int, expected: int | None, start_field: str | None
) -> RowCountMismatch:
    """``exc`` again, with a hint naming the request field that explains missing rows."""
    found = _found_rows(exc)
    if start_field is None:
        hint = exc.hint
    elif start_row == 0 and expected is not None and found is not None and found < expected:
        missing = expected - found
        hint = (
            f"The body holds {missing} rows fewer than the token counts imply: did the request "
            f"set {start_field}={missing}? It is never echoed in the response; pass "
            f"start_row={missing} (routeplay inspect --start-row {missing})."
        )
    else:
        hint = f"{exc.hint} The body's rows start at the request's {start_field} ({start_row})."
    return RowCountMismatch(
        exc.summary, expected=exc.expected, found=exc.found, where=exc.where, hint=hint
    )


def _found_rows(exc: RowCountMismatch) -> int | None:
    # check_row_count writes found as "<rows> rows"; the row count is not kept apart.
    text = str(exc.found).split(" ", 1)[0]
    return int(text) if text.isdigit() else None


def completion(ids: object, logprobs: object, reason: object, *, where: str) -> Completion:
    """A ``Completion`` from the raw JSON values, or a refusal (never a raw TypeError).
    ``logprobs`` None: the body carried none (``has_logprobs`` False), read only when the
    caller said it does not need them."""
    if not isinstance(reason, str):
        raise MalformedPayload(
            "finish reason must be a string", expected="str", found=describe(reason), where=where
        )
    id_list = sequence(ids, "generated ids", where)
    logprob_list = () if logprobs is None else sequence(logprobs, "log-probabilities", where)
    # Ints only (a bool, float or string id is a broken body, not something to coerce);
    # log-probabilities may be any JSON number.
    if not all(type(i) is int for i in id_list) or not all(
        type(p) in (int, float) for p in logprob_list
    ):
        raise MalformedPayload(
            "generated ids or log-probabilities are not numbers",
            expected="integer ids and numeric log-probabilities",
            found=f"ids {describe(id_list)}, log-probabilities {describe(logprob_list)}",
            where=where,
        )
    try:
        floats = tuple(float(p) for p in logprob_list)
    except OverflowError as exc:  # a JSON integer beyond the float range
        raise MalformedPayload(
            "a log-probability is out of the float range",
            expected="finite numbers",
            found=describe(logprob_list),
            where=where,
        ) from exc
    done = Completion(
        token_ids=tuple(id_list),
        logprobs=floats,
        finish_reason=reason,
        has_logprobs=logprobs is not None,
    )
    if done.has_logprobs and len(done.logprobs) != len(done.token_ids):
        raise MalformedPayload(
            "one log-probability per generated id",
            expected=len(done.token_ids),
            found=len(done.logprobs),
            where=where,
        )
    return done


def sequence(value: object, what: str, where: str) -> Sequence[Any]:
    """``value`` as a JSON list (strings are not lists)."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise MalformedPayload(
            f"{what} must be a JSON list", expected="list", found=type(value).__name__, where=where
        )
    return value
