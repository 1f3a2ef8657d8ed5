"""LMDeploy's protocol: where routing and the generated tokens sit in each body, the
request fields that matter, and a body builder that answers the way LMDeploy's API server
does. Every field below is named from LMDeploy's own source (InternLM/lmdeploy main, read
at commit ``1263d5c``; facts only, no code copied).

``/generate``: ``lmdeploy/serve/openai/endpoints/generate.py`` (``generate``: its
non-streaming ``_inner_call`` and ``generate_stream_generator``; ``api_server.py``
mounts the route), models ``GenerateReqInput`` / ``GenerateReqOutput`` /
``GenerateReqMetaOutput`` in ``lmdeploy/serve/openai/protocol.py``:

- ``output_ids`` (``GenerateReqOutput.output_ids``): the generated ids, every engine
  yield's ``token_ids`` concatenated (a stream chunk: that yield's ids only);
- ``meta_info.output_token_logprobs`` (``GenerateReqMetaOutput``, ``(logprob,
  token_id)`` tuples, JSON ``[[logprob, id], ...]``): ``(tok_logprobs[tok], tok)`` over
  ``zip(output_ids, logprobs)``; ``null`` unless the request set ``return_logprob``
  (and for an empty list: ``logprobs or None``). The reader checks each pair's id
  against ``output_ids`` at the same position;
- ``meta_info.finish_reason``: ``{"type": reason}`` (``dict(type=res.finish_reason)``),
  ``null`` on every stream chunk but the last. ``reason`` is ``GenOut.finish_reason`` of
  ``AsyncEngine.generate`` (``lmdeploy/serve/core/async_engine.py``): ``stop`` (the last
  token is a stop id), ``length``, ``abort`` (cancelled, or aborted before it started);
- ``meta_info.prompt_tokens`` / ``completion_tokens`` (``input_token_len`` /
  ``generate_token_len``): the counts, ``completion_tokens == len(output_ids)``;
- ``meta_info.routed_experts`` (on the final stream chunk only), and ``text``.

Chat, ``/v1/chat/completions``: ``lmdeploy/serve/openai/chat_completions/serving.py``
(``ChatCompletionResponseChoice``, streaming ``ChatCompletionResponseStreamChoice``),
``chat_completions/logprobs.py`` (``_create_output_token_logprobs``,
``_create_chat_completion_logprobs``), ``chat_completions/fanout.py``
(``_collate_responses``: ``n > 1`` as one choice per index, ``usage`` summed):

- ``choices[i].message`` (``delta`` in a stream chunk);
- ``choices[i].output_ids``: only with ``return_token_ids`` (a stream chunk: one yield's);
- ``choices[i].output_token_logprobs``: the same pairs, with ``return_logprob``;
- ``choices[i].logprobs.content[j].logprob``: OpenAI log-probabilities (``logprobs``),
  read when the pairs are absent (they carry token text, not ids);
- ``choices[i].finish_reason``: ``stop``, ``length``, ``abort``; ``tool_calls`` (a
  ``stop`` relabelled when the tool parser found calls: read as ``stop``);
  ``parse_error`` (a ``stop`` or ``length`` relabelled when the response parser rejected
  the text under ``return_token_ids`` / ``return_routed_experts``) and ``error`` are
  refused: the sample's end is unknown;
- ``choices[i].routed_experts`` (streaming: the chunk with ``finish_reason``), counts in
  ``usage`` (streaming: a separate ``choices: []`` chunk with ``include_usage``).

``/v1/messages`` (Anthropic protocol, XTuner's session server): ``routed_experts`` at
the top level, counts in ``usage.input_tokens`` / ``usage.output_tokens``.

Requests (``GenerateReqInput``): ``input_ids``, ``max_tokens``, ``temperature``,
``stop_token_ids``, ``return_logprob``, ``return_routed_experts``,
``include_stop_str_in_output``. ``seed`` is not one of LMDeploy's ``/generate`` fields
(LMDeploy ignores it; the reference engine uses it).

Finish reasons map to routeplay's ``stop`` / ``length`` / ``abort`` (``abort`` makes an
ABORTED sample that a partial rollout resumes), the same three the vLLM and SGLang wires
pass through; anything else is a ``MalformedPayload`` naming the field.

Routing is nested lists ``[T][L][K]`` without Ray, or (Ray executor) the 56-hex key of a
uint16 array in the ``shared_store`` actor. With ``include_stop_str_in_output=False``
(LMDeploy's default) the stop token is trimmed from the answer (``output_ids``, the
pairs, ``completion_tokens``) and from inline lists (``routed_experts[:-1]`` in
``AsyncEngine.generate``) but not from the stored array, so a key's payload may hold one
row more than the counts imply: the ``EngineKey`` says so (``trailing_rows=1``) and only
rows ``[0, rows)`` are the sample's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
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
    mapping,
    openai_choice_counts,
    rows_expected,
    sequence,
    store_key,
    wire_layers,
)
from routeplay.errors import EngineUnavailable, MalformedPayload, MisuseError, describe

__all__ = [
    "CHAT_FINISH",
    "ENDPOINTS",
    "GENERATE_FINISH",
    "INCLUDE_STOP_FIELD",
    "KEY_NAMESPACE",
    "RETURN_FIELD",
    "RETURN_LOGPROB_FIELD",
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
RETURN_LOGPROB_FIELD: Final = "return_logprob"
"""Request flag asking for ``output_token_logprobs`` (LMDeploy's default: none)."""
INCLUDE_STOP_FIELD: Final = "include_stop_str_in_output"
"""Request flag: keep the stop token in the answer (LMDeploy's default: False)."""
GENERATE_FINISH: Final[dict[str, str]] = {"stop": "stop", "length": "length", "abort": "abort"}
"""``/generate`` ``meta_info.finish_reason.type`` -> routeplay's finish reason."""
CHAT_FINISH: Final[dict[str, str]] = {**GENERATE_FINISH, "tool_calls": "stop"}
"""Chat ``choices[i].finish_reason`` -> routeplay's finish reason."""
ROUTING: Final = "routed_experts"
META: Final = "meta_info"
OUTPUT_IDS: Final = "output_ids"
PAIRS: Final = "output_token_logprobs"
FINISH: Final = "finish_reason"
CHOICES: Final = "choices"
USAGE: Final = "usage"
LOGPROBS: Final = "logprobs"
_REFUSED_REASONS: Final[dict[str, str]] = {
    "parse_error": (
        "LMDeploy relabels stop or length as parse_error when its response parser rejects "
        "the text (return_token_ids / return_routed_experts): the end is unknown; retry the "
        "sample or drop it."
    ),
    "error": "The engine failed this request: retry the sample or drop it.",
}
_NO_LOGPROBS_HINT: Final = (
    "Ask with return_logprob=true (LMDeploy also needs --logprobs-mode), or read with "
    "require_logprobs=False if the log-probabilities are computed elsewhere."
)


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

    def read_completion(
        self, body: object, *, where: str, require_logprobs: bool = True
    ) -> Completion:
        """Generated ids, log-probabilities and finish reason of a ``/generate`` body or
        of a chat body's first choice (a stream: join its chunks first, ``join_stream``).

        Refused (``MalformedPayload``, naming the field): a pair whose id differs from
        ``output_ids`` at its position, a pair count other than the id count, a finish
        reason other than those in ``GENERATE_FINISH`` / ``CHAT_FINISH``, a
        ``completion_tokens`` other than ``len(output_ids)``, a chat choice without
        ``output_ids``, and a body without log-probabilities while ``require_logprobs``
        (one that generated nothing reads with none).

        Example:
            >>> body = {"text": "", "output_ids": [17, 4], "meta_info": {
            ...     "prompt_tokens": 3, "completion_tokens": 2,
            ...     "finish_reason": {"type": "length"},
            ...     "output_token_logprobs": [[-0.25, 17], [-1.5, 4]]}}
            >>> WIRE.read_completion(body, where="sample 0").token_ids
            (17, 4)
        """
        top = mapping(body, "lmdeploy response body", where)
        if CHOICES in top:
            return _chat_completion(top, where, require_logprobs)
        return _generate_completion(top, where, require_logprobs)

    def join_stream(self, chunks: Sequence[object], *, where: str) -> Any:
        """One body from the parsed chunks of a streamed answer (``[DONE]`` left out):
        ``/generate`` chunks (``output_ids`` and pairs concatenated, the last chunk's
        ``meta_info``, routing from the chunk carrying it) or chat chunks (per choice
        index: ids, pairs and OpenAI log-probabilities concatenated, the finish reason
        and routing of the final chunk; counts from the chunk with ``usage``). A chunk
        with ``error`` (LMDeploy's ``request_error_payload``) is refused."""
        tops = [mapping(c, f"lmdeploy stream chunk {n}", where) for n, c in enumerate(chunks)]
        for number, top in enumerate(tops):
            if top.get("error") is not None:
                raise EngineUnavailable(
                    "LMDeploy ended the stream with an error",
                    expected="chunks of an answer",
                    found=describe(top["error"]),
                    where=f"{where} chunk {number}",
                )
        if not tops:
            raise MalformedPayload(
                "an empty lmdeploy stream",
                expected="at least one chunk",
                found="no chunks",
                where=where,
            )
        if any(CHOICES in top for top in tops):
            return _join_chat(tops, where)
        return _join_generate(tops, where)

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
        no such field). It asks for the pairs (``return_logprob``) and keeps the stop
        token in the answer (as XTuner asks), so a stored payload's rows match the counts
        exactly."""
        if start_row:
            raise MisuseError(
                "LMDeploy sends every routing row", expected="start_row 0", found=start_row
            )
        return ENDPOINTS["generate"], {
            "input_ids": list(prompt_ids),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            RETURN_LOGPROB_FIELD: True,
            RETURN_FIELD: True,
            INCLUDE_STOP_FIELD: True,
            **extra,
        }

    # -- bodies --------------------------------------------------------------------------

    def build_body(self, answers: Sequence[Answer], spec: RouteSpec, options: BodyOptions) -> Any:
        """The body LMDeploy sends for ``answers`` (several only for chat's ``n``): every
        field its pydantic model has, ``null`` where LMDeploy sends ``null``."""
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
            meta: dict[str, Any] = {  # GenerateReqMetaOutput, field by field
                "prompt_tokens": answer.prompt_tokens,
                "completion_tokens": len(ids),
                FINISH: {"type": answer.finish_reason},
                PAIRS: _pairs(ids, logprobs, options),
                ROUTING: _routing(answer, spec, options) if options.return_routing else None,
            }
            return {"text": "", OUTPUT_IDS: ids, META: meta}
        if options.endpoint == "messages":
            return _messages(answers[0], shown[0][0], spec, options)
        return _chat(answers, shown, spec, options)


# --------------------------------------------------------------------------- reading


def _locate(
    top: Mapping[str, Any], choice: int, where: str
) -> tuple[Mapping[str, Any], str, int | None, int | None]:
    """The object holding routing, its path, and the prompt and completion counts."""
    if CHOICES in top:  # chat completions, or the final chunk of a stream
        holder = item(field(top, CHOICES, where), choice, CHOICES, where)
        prompt, generated = openai_choice_counts(top, holder, where, ids=OUTPUT_IDS)
        return holder, f"{where} {CHOICES}[{choice}].{ROUTING}", prompt, generated
    if choice:
        raise MalformedPayload(
            "this body has one result", expected="choice 0", found=choice, where=where
        )
    if META in top:  # /generate
        meta = mapping(field(top, META, f"{where} {META}"), META, where)
        prompt = count(meta, "prompt_tokens", where)
        return meta, f"{where} {META}.{ROUTING}", prompt, count(meta, "completion_tokens", where)
    usage = top.get(USAGE)  # /v1/messages (Anthropic protocol)
    prompt = count(usage, "input_tokens", where)
    return top, f"{where} {ROUTING}", prompt, count(usage, "output_tokens", where)


def _generate_completion(top: Mapping[str, Any], where: str, required: bool) -> Completion:
    meta = mapping(field(top, META, f"{where} {META}"), META, f"{where} {META}")
    ids = _ids(field(top, OUTPUT_IDS, f"{where} {OUTPUT_IDS}"), f"{where} {OUTPUT_IDS}")
    logprobs = _pair_logprobs(meta.get(PAIRS), ids, f"{where} {META}.{PAIRS}", required)
    finish_path = f"{where} {META}.{FINISH}"
    finish = mapping(_finished(meta, finish_path), FINISH, finish_path)
    reason = _reason(field(finish, "type", f"{finish_path}.type"), GENERATE_FINISH, finish_path)
    _same_count(count(meta, "completion_tokens", where), ids, f"{where} {META}")
    return completion(ids, logprobs, reason, where=where)


def _chat_completion(top: Mapping[str, Any], where: str, required: bool) -> Completion:
    choices = sequence(field(top, CHOICES, f"{where} {CHOICES}"), CHOICES, where)
    picked = item(choices, 0, CHOICES, where)
    path = f"{where} {CHOICES}[0]"
    if picked.get(OUTPUT_IDS) is None:
        raise MalformedPayload(
            f"response has no {OUTPUT_IDS}",
            expected=f"field {OUTPUT_IDS!r}",
            found="missing",
            where=f"{path}.{OUTPUT_IDS}",
            hint="LMDeploy's chat route sends the generated ids only when asked with "
            "return_token_ids=true.",
        )
    ids = _ids(picked[OUTPUT_IDS], f"{path}.{OUTPUT_IDS}")
    if picked.get(PAIRS) is None and picked.get(LOGPROBS) is not None:
        logprobs: list[Any] | None = _openai_logprobs(picked[LOGPROBS], ids, f"{path}.{LOGPROBS}")
    else:
        logprobs = _pair_logprobs(picked.get(PAIRS), ids, f"{path}.{PAIRS}", required)
    reason = _reason(_finished(picked, f"{path}.{FINISH}"), CHAT_FINISH, f"{path}.{FINISH}")
    if len(choices) == 1:  # usage sums over the choices of a fan-out
        _same_count(count(top.get(USAGE), "completion_tokens", where), ids, f"{where} {USAGE}")
    return completion(ids, logprobs, reason, where=where)


def _ids(value: object, path: str) -> Sequence[Any]:
    ids = sequence(value, OUTPUT_IDS, path)
    for index, token in enumerate(ids):
        if type(token) is not int:
            raise MalformedPayload(
                f"{OUTPUT_IDS} must hold integer token ids",
                expected="int",
                found=describe(token),
                where=f"{path}[{index}]",
            )
    return ids


def _pair_logprobs(
    value: object, ids: Sequence[int], path: str, required: bool
) -> list[Any] | None:
    """The log-probability of each ``[logprob, token id]`` pair, each id checked against
    ``output_ids``; None (no log-probabilities) when absent and not required."""
    if value is None:
        if not ids:  # LMDeploy sends null for an empty list (``logprobs or None``)
            return []
        if required:
            raise MalformedPayload(
                f"response has no {PAIRS}",
                expected=f"[[logprob, token id], ...], one pair per {OUTPUT_IDS} entry",
                found="missing or null",
                where=path,
                hint=_NO_LOGPROBS_HINT,
            )
        return None
    pairs = sequence(value, PAIRS, path)
    if len(pairs) != len(ids):
        raise MalformedPayload(
            f"one [logprob, token id] pair per {OUTPUT_IDS} entry",
            expected=f"{len(ids)} pairs",
            found=f"{len(pairs)} pairs",
            where=path,
        )
    logprobs = []
    for index, (pair, token) in enumerate(zip(pairs, ids, strict=True)):
        here = f"{path}[{index}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise MalformedPayload(
                f"{PAIRS} entries are [logprob, token id]",
                expected="a list of two numbers",
                found=describe(pair),
                where=here,
            )
        logprob, named = pair
        if type(logprob) not in (int, float) or type(named) is not int:
            raise MalformedPayload(
                f"{PAIRS} entries are [logprob, token id]",
                expected="[number, int]",
                found=describe(pair),
                where=here,
            )
        if named != token:
            raise MalformedPayload(
                f"{PAIRS} names another token than {OUTPUT_IDS} at the same position",
                expected=f"token id {describe(token)} ({OUTPUT_IDS}[{index}])",
                found=f"token id {describe(named)}",
                where=here,
                hint="The pairs and the ids come from one generation, in order: a body "
                "stitched from two answers, or reordered, cannot be trusted.",
            )
        logprobs.append(logprob)
    return logprobs


def _openai_logprobs(value: object, ids: Sequence[int], path: str) -> list[Any]:
    """``logprobs.content[j].logprob`` of a chat choice, one per output id."""
    content = sequence(field(mapping(value, LOGPROBS, path), "content", path), "content", path)
    if len(content) != len(ids):
        raise MalformedPayload(
            f"one log-probability per {OUTPUT_IDS} entry",
            expected=f"{len(ids)} entries",
            found=f"{len(content)} entries",
            where=f"{path}.content",
        )
    return [
        field(mapping(entry, "logprobs.content entry", path), "logprob", f"{path}.content[{j}]")
        for j, entry in enumerate(content)
    ]


def _finished(holder: Mapping[str, Any], path: str) -> Any:
    if holder.get(FINISH) is None:
        raise MalformedPayload(
            f"response has no {FINISH}",
            expected="the finish reason of a finished answer",
            found="missing or null",
            where=path,
            hint="LMDeploy sends it on the last chunk of a stream only: join the chunks "
            "first (join_stream).",
        )
    return holder[FINISH]


def _reason(value: object, table: Mapping[str, str], path: str) -> str:
    if isinstance(value, str) and value in table:
        return table[value]
    raise MalformedPayload(
        "LMDeploy finish reason routeplay cannot read",
        expected=f"one of {sorted(table)}",
        found=describe(value),
        where=path,
        hint=_REFUSED_REASONS.get(value, "") if isinstance(value, str) else "",
    )


def _same_count(reported: int | None, ids: Sequence[int], path: str) -> None:
    if reported is not None and reported != len(ids):
        raise MalformedPayload(
            f"completion_tokens and {OUTPUT_IDS} disagree",
            expected=f"completion_tokens == len({OUTPUT_IDS}) == {len(ids)}",
            found=f"completion_tokens {reported}",
            where=path,
        )


def _join_generate(tops: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
    ids: list[Any] = []
    pairs: list[Any] = []
    texts: list[str] = []
    any_pairs = False
    routing: object = None
    meta: Mapping[str, Any] = {}
    for number, top in enumerate(tops):
        here = f"{where} chunk {number}"
        meta = mapping(field(top, META, f"{here} {META}"), META, f"{here} {META}")
        if top.get(OUTPUT_IDS) is not None:
            ids.extend(sequence(top[OUTPUT_IDS], OUTPUT_IDS, f"{here} {OUTPUT_IDS}"))
        if meta.get(PAIRS) is not None:
            any_pairs = True
            pairs.extend(sequence(meta[PAIRS], PAIRS, f"{here} {META}.{PAIRS}"))
        routing = meta.get(ROUTING) if meta.get(ROUTING) is not None else routing
        text = top.get("text")
        texts.append(text if isinstance(text, str) else "")
    joined = {**meta, PAIRS: pairs if any_pairs else None, ROUTING: routing}
    return {"text": "".join(texts), OUTPUT_IDS: ids, META: joined}


@dataclass(slots=True)
class _JoinedChoice:
    """What the chunks of one choice index add up to (None: no chunk carried it)."""

    ids: list[Any] | None = None
    pairs: list[Any] | None = None
    entries: list[Any] | None = None  # OpenAI logprobs.content
    finish: object = None
    routing: object = None
    texts: list[str] = dataclass_field(default_factory=list)

    def add(self, entry: Mapping[str, Any], here: str) -> None:
        if entry.get(OUTPUT_IDS) is not None:
            self.ids = self.ids or []
            self.ids.extend(sequence(entry[OUTPUT_IDS], OUTPUT_IDS, here))
        if entry.get(PAIRS) is not None:
            self.pairs = self.pairs or []
            self.pairs.extend(sequence(entry[PAIRS], PAIRS, here))
        if entry.get(LOGPROBS) is not None:
            content = field(mapping(entry[LOGPROBS], LOGPROBS, here), "content", here)
            self.entries = self.entries or []
            self.entries.extend(sequence(content, "content", here))
        if entry.get(FINISH) is not None:
            self.finish = entry[FINISH]
        if entry.get(ROUTING) is not None:
            self.routing = entry[ROUTING]
        delta = entry.get("delta")
        text = delta.get("content") if isinstance(delta, Mapping) else None
        self.texts.append(text if isinstance(text, str) else "")

    def body(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(self.texts)},
            LOGPROBS: None if self.entries is None else {"content": self.entries},
            PAIRS: self.pairs,
            FINISH: self.finish,
            OUTPUT_IDS: self.ids,
            ROUTING: self.routing,
        }


def _join_chat(tops: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
    joined: dict[int, _JoinedChoice] = {}
    usage: object = None
    for number, top in enumerate(tops):
        here = f"{where} chunk {number}"
        usage = top.get(USAGE) or usage
        for entry in sequence(top.get(CHOICES, []), CHOICES, here):
            picked = mapping(entry, "choice", here)
            index = picked.get("index", 0)
            if type(index) is not int:
                raise MalformedPayload(
                    "a stream choice's index must be an integer",
                    expected="int",
                    found=describe(index),
                    where=f"{here} {CHOICES}",
                )
            joined.setdefault(index, _JoinedChoice()).add(picked, here)
    return {CHOICES: [joined[i].body(i) for i in sorted(joined)], USAGE: usage}


# --------------------------------------------------------------------------- bodies


def _visible(answer: Answer, options: BodyOptions) -> tuple[list[int], list[float], int]:
    """Ids, log-probs and row count the answer shows (the stop token trimmed unless
    ``include_stop_str_in_output``)."""
    rows = answer.routing.shape[0]
    if options.include_stop or answer.finish_reason != "stop":
        return list(answer.token_ids), list(answer.logprobs), rows
    return list(answer.token_ids[:-1]), list(answer.logprobs[:-1]), rows - 1


def _pairs(ids: list[int], logprobs: list[float], options: BodyOptions) -> list[Any] | None:
    """``output_token_logprobs``: ``(logprob, id)`` per output id, or None when not asked
    for or empty (LMDeploy's ``output_token_logprobs or None``)."""
    if not options.return_logprob:
        return None
    return [[logprob, token] for logprob, token in zip(logprobs, ids, strict=True)] or None


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
        USAGE: {"input_tokens": answer.prompt_tokens, "output_tokens": len(ids)},
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
    """``ChatCompletionResponse`` (``model_dump``: every field), one choice per answer as
    the fan-out collates them, asked with ``return_token_ids``; streaming: the final
    chunk (``model_dump(exclude_none=True)``: one engine yield holding every id; the
    counts come in a separate ``include_usage`` chunk)."""
    choices = []
    for index, (answer, (ids, logprobs, _)) in enumerate(zip(answers, shown, strict=True)):
        choice: dict[str, Any] = {"index": index}
        if options.stream:
            choice["delta"] = {"role": "assistant", "content": ""}
        else:
            choice["message"] = {
                "role": "assistant",
                "content": "",
                "reasoning_content": None,
                "tool_calls": None,
            }
        choice[LOGPROBS] = None
        choice[PAIRS] = _pairs(ids, logprobs, options)
        choice[FINISH] = answer.finish_reason
        choice[OUTPUT_IDS] = ids
        choice[ROUTING] = _routing(answer, spec, options) if options.return_routing else None
        if options.stream:
            choice = {k: v for k, v in choice.items() if v is not None}
        choices.append(choice)
    prompt = answers[0].prompt_tokens
    generated = sum(len(ids) for ids, _, _ in shown)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + generated,
        "completion_tokens": generated,
    }
    top: dict[str, Any] = {
        "id": "chatcmpl-routeplay",
        "object": "chat.completion.chunk" if options.stream else "chat.completion",
        "created": 0,
        "model": "routeplay-reference",
        CHOICES: choices,
    }
    if options.stream:  # the counts come in their own chunk (include_usage)
        return top
    usage.update(prompt_tokens_details=None, completion_tokens_details=None)
    return {**top, USAGE: usage, "service_tier": None}


WIRE: Final = LmdeployWire()
