"""Every engine's wire protocol, one module per engine, and the one registry of wires.

``routeplay.core.wires.vllm`` / ``sglang`` / ``lmdeploy`` each own their engine's field
names: where routing sits in every endpoint's body and streaming chunk, the codec
(``routeplay.core.formats``), the token counts, the request fields that matter (start
row, ``n``, return flags), a request builder, a completion reader and a body builder
that answers the way that engine does (used by the reference server and the fakes).
No module outside this package names a field of an engine body (a test pins it).

``WIRES`` names the wire formats the reference engine and the demo speak, once.

Example:
    >>> from routeplay.core.wires import read_response
    >>> routing = read_response("sglang", body, spec, start_row=12)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from routeplay.core.spec import RouteSpec
from routeplay.core.wires import lmdeploy, sglang, vllm
from routeplay.core.wires.base import (
    Answer,
    BodyOptions,
    Completion,
    Engine,
    EngineRouting,
    KeyPut,
    wire_layers,
)
from routeplay.errors import MisuseError

__all__ = [
    "ENGINES",
    "WIRES",
    "WIRE_NAMES",
    "Answer",
    "BodyOptions",
    "Completion",
    "Engine",
    "EngineRouting",
    "EngineWire",
    "KeyPut",
    "WireFormat",
    "engine_wire",
    "read_response",
    "read_responses",
    "read_stream",
    "wire",
    "wire_layers",
]


class EngineWire(Protocol):
    """What one engine module offers (``vllm.WIRE``, ``sglang.WIRE``, ``lmdeploy.WIRE``)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def endpoints(self) -> Mapping[str, str]: ...

    @property
    def start_field(self) -> str | None: ...

    def read(
        self, body: object, spec: RouteSpec, *, choice: int, start_row: int, where: str
    ) -> EngineRouting: ...

    def read_completion(
        self, body: object, *, where: str, require_logprobs: bool = True
    ) -> Completion: ...

    def join_stream(self, chunks: Sequence[object], *, where: str) -> Any: ...

    def request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        extra: Mapping[str, Any],
        start_row: int,
    ) -> tuple[str, dict[str, Any]]: ...

    def build_body(
        self, answers: Sequence[Answer], spec: RouteSpec, options: BodyOptions
    ) -> Any: ...


ENGINES: Final[dict[Engine, EngineWire]] = {
    Engine.VLLM: vllm.WIRE,
    Engine.SGLANG: sglang.WIRE,
    Engine.LMDEPLOY: lmdeploy.WIRE,
}
"""Each engine's protocol module."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WireFormat:
    """One wire format the reference engine serves and the demo's rollout workers speak.

    Example:
        >>> wire("sglang").request((1, 2, 3), max_new_tokens=4, temperature=1.0, seed=0)
        ... # doctest: +SKIP
    """

    name: str
    """Wire name (``lmdeploy-key``, ``lmdeploy-inline``, ``vllm``, ``sglang``)."""
    engine: Engine
    """Engine whose protocol it is."""
    endpoint: str
    """Endpoint the reference engine serves it on."""
    key_store: bool = False
    """Routing goes into an engine-side store and the body carries its key."""

    @property
    def protocol(self) -> EngineWire:
        """The engine's protocol module."""
        return ENGINES[self.engine]

    @property
    def path(self) -> str:
        """URL path of the endpoint."""
        return self.protocol.endpoints[self.endpoint]

    def routing_start(self, history_rows: int) -> int:
        """First routing row to ask for when a request continues ``history_rows`` rows:
        the history's end where the engine has a start field, else 0 (every row)."""
        return history_rows if self.protocol.start_field is not None else 0

    def request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        stop_after: int | None = None,
        start_row: int = 0,
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) asking the engine to continue ``prompt_ids``. ``stop_after``
        is the reference engine's interruption (a partial rollout)."""
        extra: dict[str, Any] = {} if stop_after is None else {"stop_after": stop_after}
        return self.protocol.request(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            extra=extra,
            start_row=start_row,
        )

    def read_completion(
        self, body: object, *, where: str = "", require_logprobs: bool = True
    ) -> Completion:
        """Generated ids, log-probabilities and finish reason of one answer body. A body
        without log-probabilities is refused, naming the missing field, unless
        ``require_logprobs`` is False: then it reads with ``has_logprobs=False``.

        Example:
            >>> done = wire("lmdeploy-key").read_completion(body)  # doctest: +SKIP
            >>> done.token_ids, done.logprobs, done.finish_reason  # doctest: +SKIP
            ((17, 4), (-0.25, -1.5), 'length')
        """
        return self.protocol.read_completion(
            body, where=where or self.name, require_logprobs=require_logprobs
        )


WIRES: Final[dict[str, WireFormat]] = {
    w.name: w
    for w in (
        WireFormat(
            name="lmdeploy-key", engine=Engine.LMDEPLOY, endpoint="generate", key_store=True
        ),
        WireFormat(name="lmdeploy-inline", engine=Engine.LMDEPLOY, endpoint="generate"),
        WireFormat(name="vllm", engine=Engine.VLLM, endpoint="completions"),
        WireFormat(name="sglang", engine=Engine.SGLANG, endpoint="generate"),
    )
}
"""Every wire format, by name: the one list of names."""
WIRE_NAMES: Final[tuple[str, ...]] = tuple(WIRES)


def wire(name: str) -> WireFormat:
    """The wire format called ``name``; unknown names are refused.

    Example:
        >>> wire("sglang").path
        '/generate'
    """
    if name not in WIRES:
        raise MisuseError("unknown engine wire format", expected=WIRE_NAMES, found=name)
    return WIRES[name]


def engine_wire(engine: Engine | str) -> EngineWire:
    """The protocol of an engine (``vllm``, ``sglang``, ``lmdeploy``) or of a wire's engine.

    Example:
        >>> engine_wire("lmdeploy-key").start_field is None  # LMDeploy sends every row
        True
    """
    if isinstance(engine, str) and engine in WIRES:
        return WIRES[engine].protocol
    try:
        return ENGINES[Engine(engine)]
    except ValueError as exc:
        raise MisuseError(
            "unknown engine",
            expected=[e.value for e in Engine] + list(WIRE_NAMES),
            found=engine,
        ) from exc


def read_response(
    engine: Engine | str,
    body: object,
    spec: RouteSpec,
    *,
    choice: int = 0,
    start_row: int = 0,
    where: str = "",
) -> EngineRouting:
    """Decode and validate the routing in ``body`` (a parsed JSON response or chunk).

    ``engine`` names the engine (or a wire). ``choice`` picks an OpenAI choice or an
    element of SGLang's batched list. ``start_row`` is the first routing row the
    *request* asked for (SGLang ``routed_experts_start_len``, vLLM
    ``routed_experts_prompt_start``): engines never echo it.

    Example:
        >>> routing = read_response("vllm", body, spec, start_row=10)  # doctest: +SKIP
        >>> routing.routes.start_row  # doctest: +SKIP
        10
    """
    protocol = engine_wire(engine)
    if start_row < 0 or choice < 0:
        raise MisuseError(
            "start_row and choice are non-negative",
            expected=">= 0",
            found=f"start_row {start_row}, choice {choice}",
        )
    return protocol.read(
        body, spec, choice=choice, start_row=start_row, where=where or protocol.engine.value
    )


def read_stream(
    engine: Engine | str,
    chunks: Sequence[object],
    spec: RouteSpec,
    *,
    choice: int = 0,
    start_row: int = 0,
    where: str = "",
) -> EngineRouting:
    """Decode the routing of a streamed answer from its parsed chunks (SSE ``data:``
    lines, ``[DONE]`` left out): the chunk that carries routing and the one with counts.

    Example:
        >>> chunks = [json.loads(line[6:]) for line in sse if line != "data: [DONE]"]
        ... # doctest: +SKIP
        >>> routing = read_stream("sglang", chunks, spec)  # doctest: +SKIP
    """
    protocol = engine_wire(engine)
    where = where or protocol.engine.value
    body = protocol.join_stream(chunks, where=where)
    return read_response(engine, body, spec, choice=choice, start_row=start_row, where=where)


def read_responses(
    engine: Engine | str,
    body: object,
    spec: RouteSpec,
    *,
    start_rows: Sequence[int] | int = 0,
    where: str = "",
) -> tuple[EngineRouting, ...]:
    """One result per element of a batched body (SGLang ``/generate`` with a list of
    prompts answers a JSON list); a single object gives one result. ``start_rows``: one
    per element, or one for all.

    Example:
        >>> [r.routes.rows for r in read_responses("sglang", batch, spec)]  # doctest: +SKIP
    """
    entries = len(body) if isinstance(body, list) else 1
    starts = [start_rows] * entries if isinstance(start_rows, int) else list(start_rows)
    if len(starts) != entries:
        raise MisuseError(
            "one start row per element", expected=entries, found=len(starts), where=where
        )
    return tuple(
        read_response(engine, body, spec, choice=i, start_row=start, where=where)
        for i, start in enumerate(starts)
    )
