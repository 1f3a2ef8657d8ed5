"""SGLang's protocol: where routing sits in each body, the request fields that matter, and a
body builder that answers the way SGLang's HTTP server does.

- ``/generate``: ``meta_info.routed_experts`` is base64 raw int32 (``core.formats.sglang``),
  counts in ``meta_info.prompt_tokens`` / ``completion_tokens``. A batched request (a
  list of prompts) answers a JSON list, one object per prompt.
- ``/v1/completions`` and ``/v1/chat/completions``: a response-level
  ``sglext.routed_experts`` built from the first choice only; counts in ``usage``. Chat
  with ``return_meta_info``: each ``choices[i].meta_info.routed_experts``, no ``sglext``.
  Streaming: a separate chunk with ``choices: []`` carries ``sglext``.
- ``routed_experts_start_len`` is a request parameter, never echoed: the body holds rows
  ``[start_len, T)`` and the caller passes the start back as ``start_row``.
- The layer axis is ``num_hidden_layers`` (dense layers as zero rows).
- XTuner-patched SGLang puts the array into a Ray actor store (namespace ``sglang``) and
  sends its 56-hex key instead: read as a lazy ``EngineKey``, like LMDeploy's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from routeplay.core.formats import sglang as codec
from routeplay.core.formats.lmdeploy import is_key
from routeplay.core.handle import EngineKey
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import check_row_count
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
    row_count_refusal,
    rows_expected,
    sequence,
    store_key,
    wire_layers,
)
from routeplay.errors import MalformedPayload, MisuseError, RowCountMismatch

__all__ = ["ENDPOINTS", "KEY_NAMESPACE", "RETURN_FIELD", "START_FIELD", "WIRE", "SglangWire"]

ENDPOINTS: Final[dict[str, str]] = {
    "generate": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
START_FIELD: Final = "routed_experts_start_len"
"""Request parameter: the first routing row the body carries (never echoed)."""
KEY_NAMESPACE: Final = "sglang"
"""Ray namespace of XTuner's patched SGLang routing store (its actor has LMDeploy's name,
``shared_store``, and the same put/get protocol)."""
RETURN_FIELD: Final = "return_routed_experts"
"""Request flag asking for routing."""
ROUTING: Final = "routed_experts"
META: Final = "meta_info"
EXT: Final = "sglext"


class SglangWire:
    """SGLang over HTTP: native ``/generate`` and the OpenAI routes."""

    engine: Final = Engine.SGLANG
    endpoints: Final = ENDPOINTS
    start_field: Final[str | None] = START_FIELD

    # -- reading -------------------------------------------------------------------------

    def read(
        self, body: object, spec: RouteSpec, *, choice: int, start_row: int, where: str
    ) -> EngineRouting:
        """Routing of one body: ``choice`` picks the element of a batched list or the
        choice of an OpenAI body."""
        if isinstance(body, list):
            picked = item(body, choice, "batched /generate list", where)
            return self._read_generate(picked, spec, start_row, f"{where}[{choice}]")
        top = mapping(body, "sglang response body", where)
        if META in top or not ({"choices", EXT} & top.keys()):
            if choice != 0:
                raise MalformedPayload(
                    "a single /generate body has one result",
                    expected="choice 0 (batched requests answer a list)",
                    found=f"choice {choice}",
                    where=where,
                )
            return self._read_generate(top, spec, start_row, where)
        return self._read_openai(top, spec, choice, start_row, where)

    def _read_generate(
        self, top: Mapping[str, Any], spec: RouteSpec, start: int, where: str
    ) -> EngineRouting:
        meta = field(top, META, f"{where} {META}")
        prompt = count(meta, "prompt_tokens", where)
        generated = count(meta, "completion_tokens", where)
        payload = field(meta, ROUTING, f"{where} {META}.{ROUTING}", routing=True)
        return _routing(payload, spec, prompt, generated, start, f"{where} {META}.{ROUTING}")

    def _read_openai(
        self, top: Mapping[str, Any], spec: RouteSpec, choice: int, start: int, where: str
    ) -> EngineRouting:
        choices = sequence(field(top, "choices", f"{where} choices"), "choices", where)
        usage = top.get("usage")
        if choices and isinstance(choices[0], Mapping) and META in choices[0]:
            picked = item(choices, choice, "choices", where)  # chat with return_meta_info
            meta = field(picked, META, f"{where} choices[{choice}].{META}")
            path = f"{where} choices[{choice}].{META}.{ROUTING}"
            prompt = count(meta, "prompt_tokens", where)
            generated = count(meta, "completion_tokens", where)
            payload = field(meta, ROUTING, path, routing=True)
            return _routing(payload, spec, prompt, generated, start, path)
        if choice != 0:
            raise MalformedPayload(
                "SGLang's OpenAI routes return the routing of the first choice only",
                expected="choice 0",
                found=f"choice {choice} of {len(choices)}",
                where=f"{where} {EXT}",
                hint="Send n=1 requests, or chat with return_meta_info=true for every choice.",
            )
        path = f"{where} {EXT}.{ROUTING}"
        payload = field(
            field(top, EXT, f"{where} {EXT}", routing=True), ROUTING, path, routing=True
        )
        prompt = count(usage, "prompt_tokens", where)
        # usage sums over choices: the first choice's own count is known only when alone
        generated = count(usage, "completion_tokens", where) if len(choices) == 1 else None
        return _routing(payload, spec, prompt, generated, start, path)

    def read_completion(
        self, body: object, *, where: str, require_logprobs: bool = True
    ) -> Completion:
        """Generated ids, log-probabilities and finish reason of a ``/generate`` body; one
        without ``output_token_logprobs`` is refused unless ``require_logprobs`` is False."""
        if isinstance(body, list) and len(body) == 1:
            body = body[0]  # a one-prompt batch answers a list
        top = mapping(body, "sglang response body", where)
        meta = field(top, META, where)
        logprobs = None
        if require_logprobs or _get(meta, "output_token_logprobs") is not None:
            pairs = field(meta, "output_token_logprobs", where)
            listed = sequence(pairs, "output_token_logprobs", where)
            logprobs = [_first(p, where) for p in listed]
        reason = field(field(meta, "finish_reason", where), "type", where)
        return completion(field(top, "output_ids", where), logprobs, reason, where=where)

    def join_stream(self, chunks: Sequence[object], *, where: str) -> Any:
        """One body from the chunks of a streamed OpenAI answer: the separate chunk with
        ``sglext`` (and ``choices: []``), the choices seen in the other chunks, and the
        counts of the chunk with ``usage``."""
        routing: Mapping[str, Any] | None = None
        usage: object = None
        indices: set[int] = set()
        for number, chunk in enumerate(chunks):
            top = mapping(chunk, f"sglang stream chunk {number}", where)
            usage = top.get("usage") or usage
            if top.get(EXT) is not None:
                routing = top
            choices = top.get("choices")
            for entry in choices if isinstance(choices, list) else ():
                index = entry.get("index") if isinstance(entry, Mapping) else None
                indices.add(index if isinstance(index, int) else 0)
        if routing is None:
            raise MalformedPayload(
                f"no sglang stream chunk carries {EXT}",
                expected=f"a chunk with choices [] and {EXT}.{ROUTING}",
                found=f"{len(chunks)} chunks without it",
                where=where,
                hint="Was the request sent with return_routed_experts?",
            )
        choices = [{"index": i} for i in sorted(indices or {0})]
        return {**routing, "choices": choices, "usage": usage}

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
        """(path, body) of a ``/generate`` request for token ids, routing asked for."""
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        body: dict[str, Any] = {
            "input_ids": list(prompt_ids),
            "sampling_params": {**params, **extra},
            RETURN_FIELD: True,
        }
        if start_row:
            body[START_FIELD] = start_row
        return ENDPOINTS["generate"], body

    # -- bodies --------------------------------------------------------------------------

    def build_body(self, answers: Sequence[Answer], spec: RouteSpec, options: BodyOptions) -> Any:
        """The body (or routing chunk) SGLang sends for ``answers``: one per prompt of a
        batched ``/generate``, one per choice (``n``) of an OpenAI route."""
        if options.endpoint not in ENDPOINTS:
            raise MisuseError(
                "no such SGLang endpoint", expected=sorted(ENDPOINTS), found=options.endpoint
            )
        if options.endpoint == "generate":
            metas = [_generate(a, spec, options) for a in answers]
            return metas if options.batched or len(metas) > 1 else metas[0]
        return _openai(answers, spec, options)


def _routing(
    payload: object,
    spec: RouteSpec,
    prompt: int | None,
    generated: int | None,
    start: int,
    path: str,
) -> EngineRouting:
    common: dict[str, Any] = {
        "engine": Engine.SGLANG,
        "prompt_tokens": prompt,
        "completion_tokens": generated,
    }
    expected = rows_expected(prompt, generated, start)
    if is_key(payload):  # 42 bytes as base64: never whole int32 rows, so unambiguous
        return EngineRouting(key=_key(payload, prompt, generated, start, path), **common)
    if not isinstance(payload, (str, bytes)):
        raise MalformedPayload(
            "SGLang routing must be a base64 string (or a routing-store key)",
            expected="str",
            found=type(payload).__name__,
            where=path,
        )
    try:
        on_wire = _rows_on_wire(payload, spec)
        if expected is not None and on_wire is not None:
            check_row_count(on_wire, expected, where=path)
        # SGLang's layer axis is num_hidden_layers: the row count steers the codec to it
        # (a byte length may also split into whole rows of the MoE layers only).
        hint = on_wire if on_wire is not None else expected
        routes = codec.decode(payload, spec, start_row=start, expected=hint, where=path)
    except RowCountMismatch as exc:
        raise row_count_refusal(
            exc, start_row=start, expected=expected, start_field=START_FIELD
        ) from exc
    return EngineRouting(routes=routes, **common)


def _rows_on_wire(payload: str | bytes, spec: RouteSpec) -> int | None:
    """Rows of every decoder layer the base64 text holds, read from its length alone; None
    when that is not a whole number of rows (the codec then says what is wrong)."""
    text = payload.decode("latin-1") if isinstance(payload, bytes) else payload
    if len(text) % 4:
        return None
    nbytes = len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))
    row_bytes = spec.decoder_layers * spec.top_k * codec.WIRE_DTYPE.itemsize
    return nbytes // row_bytes if nbytes % row_bytes == 0 else None


def _key(
    payload: object, prompt: int | None, generated: int | None, start: int, path: str
) -> EngineKey:
    if start:
        raise MalformedPayload(
            "a routing-store key holds every row of the sequence",
            expected=f"start_row 0 ({START_FIELD} does not apply to store keys)",
            found=f"start_row {start}",
            where=path,
        )
    rows = rows_expected(prompt, generated, 0)
    return store_key(payload, rows=rows, namespace=KEY_NAMESPACE, trailing_rows=0, path=path)


def _get(holder: object, name: str) -> object:
    return holder.get(name) if isinstance(holder, Mapping) else None


def _first(entry: object, where: str) -> object:
    if not isinstance(entry, list) or not entry:
        raise MalformedPayload(
            "output_token_logprobs entries are [logprob, token id, text]",
            expected="a non-empty list",
            found=type(entry).__name__,
            where=where,
        )
    return entry[0]


def _encoded(answer: Answer, spec: RouteSpec, options: BodyOptions) -> str:
    rows = wire_layers(answer.routing, spec, str(codec.WIRE_DTYPE))
    if options.put is not None:  # XTuner's patched SGLang: every row into the store
        return options.put(rows)
    return codec.encode(rows, start_row=options.start_row)


def _finish(answer: Answer) -> dict[str, Any]:
    finish: dict[str, Any] = {"type": answer.finish_reason}
    if answer.finish_reason == "stop":
        finish["matched"] = answer.token_ids[-1]
    elif answer.finish_reason == "length":
        finish["length"] = len(answer.token_ids)
    else:
        finish["message"] = "stop_after"
    return finish


def _meta(answer: Answer, spec: RouteSpec, options: BodyOptions) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": "routeplay",
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": len(answer.token_ids),
        "finish_reason": _finish(answer),
        "output_token_logprobs": [
            [lp, tok, None] for lp, tok in zip(answer.logprobs, answer.token_ids, strict=True)
        ],
        "weight_version": answer.weight_version,
    }
    if options.return_routing:
        meta[ROUTING] = _encoded(answer, spec, options)
    return meta


def _generate(answer: Answer, spec: RouteSpec, options: BodyOptions) -> dict[str, Any]:
    return {"text": "", "output_ids": list(answer.token_ids), META: _meta(answer, spec, options)}


def _openai(answers: Sequence[Answer], spec: RouteSpec, options: BodyOptions) -> dict[str, Any]:
    chat = options.endpoint == "chat"
    kind = "chat.completion" if chat else "text_completion"
    top: dict[str, Any] = {"id": "routeplay", "model": "routeplay-reference"}
    routing = options.return_routing and not (chat and options.return_meta_info)
    ext = {ROUTING: _encoded(answers[0], spec, options)} if routing else None
    if options.stream:  # the routing chunk: response-level, no choices
        if ext is None:
            raise MisuseError(
                "SGLang streams a routing chunk only when routing is asked for without "
                "return_meta_info",
                expected="return_routing and not return_meta_info",
                found=options,
            )
        return {**top, "object": f"{kind}.chunk" if chat else kind, "choices": [], EXT: ext}
    choices = []
    for index, answer in enumerate(answers):
        choice: dict[str, Any] = {"index": index, "finish_reason": answer.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": ""}
            if options.return_meta_info:
                choice[META] = _meta(answer, spec, options)
        else:
            choice["text"] = ""
        choices.append(choice)
    prompt = answers[0].prompt_tokens
    generated = sum(len(a.token_ids) for a in answers)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }
    body = {**top, "object": kind, "choices": choices, "usage": usage}
    if ext is not None:
        body[EXT] = ext
    return body


WIRE: Final = SglangWire()
