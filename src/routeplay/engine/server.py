"""The reference engine behind each real engine's wire format, in process and over HTTP.

``WireHandler`` turns one request body (parsed JSON) into the response body a real engine
would send, routing encoded by ``routeplay.core.formats`` exactly as that engine encodes it,
every decoder layer on the wire (``wire_layers``). ``EngineServer`` serves a handler with
FastAPI/uvicorn on a loopback address, in a background thread.

- ``vllm``: ``POST /v1/completions``; ``choices[0].routed_experts`` is base64 ``.npy`` of
  rows ``[routed_experts_prompt_start, T)``;
- ``sglang``: ``POST /generate``; ``meta_info.routed_experts`` is base64 raw int32 of rows
  ``[routed_experts_start_len, T)``;
- ``lmdeploy-inline``: ``POST /generate``; ``meta_info.routed_experts`` is nested lists
  ``[T][L][K]``;
- ``lmdeploy-key``: ``POST /generate``; ``meta_info.routed_experts`` is the key of the
  uint16 ``[T, L, K]`` array put into the ``shared_store`` engine store.

Every server also answers ``GET /health``. A bad request gets 400 with
``{"error": {"type": ..., "message": ...}}``; a failing engine store gets 503.
Prompts are token ids: the reference engine has no tokenizer, so ``text`` is always "".
Beyond the real engines' fields, every wire takes ``stop_after`` (interrupt after that many
tokens, finish reason ``abort``: a partial rollout) and ``stop_token_ids``; a missing
``seed`` means 0, so every request is reproducible. SGLang answers also carry
``meta_info.weight_version``, as SGLang's do.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from starlette.concurrency import run_in_threadpool

from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.engine.generator import Generation, ReferenceEngine
from routeplay.errors import LifetimeError, MisuseError, RoutesDataError
from routeplay.rollout.fake_engines import wire_layers

__all__ = ["ENGINE_OF", "WIRES", "EngineServer", "ServerStats", "WireHandler"]

WIRES: Final = ("lmdeploy-key", "lmdeploy-inline", "vllm", "sglang")
"""Wire formats a server can speak."""

ENGINE_OF: Final[dict[str, str]] = {
    "lmdeploy-key": "lmdeploy",
    "lmdeploy-inline": "lmdeploy",
    "vllm": "vllm",
    "sglang": "sglang",
}
"""Wire -> the engine name ``routeplay.core.read_response`` reads it with."""

_PATHS: Final[dict[str, str]] = {
    "lmdeploy-key": "/generate",
    "lmdeploy-inline": "/generate",
    "vllm": "/v1/completions",
    "sglang": "/generate",
}


# --------------------------------------------------------------------------- requests


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send model names, stream flags...


class _VllmRequest(_Body):
    prompt: list[StrictInt] = Field(min_length=1)
    max_tokens: StrictInt = 16
    temperature: float = 1.0
    seed: StrictInt | None = None
    stop_after: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    routed_experts_prompt_start: StrictInt = Field(0, ge=0)


class _SglangSampling(_Body):
    max_new_tokens: StrictInt = 128
    temperature: float = 1.0
    seed: StrictInt | None = None
    stop_after: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None


class _SglangRequest(_Body):
    input_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: _SglangSampling = Field(default_factory=_SglangSampling)
    return_routed_experts: bool = False
    routed_experts_start_len: StrictInt = Field(0, ge=0)


class _LmdeployRequest(_Body):
    input_ids: list[StrictInt] = Field(min_length=1)
    max_tokens: StrictInt = 128
    temperature: float = 1.0
    seed: StrictInt | None = None
    stop_after: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    return_routed_experts: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """A validated request, in the engine's terms."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    seed: int
    stop_after: int | None
    stops: list[int] | None
    start: int = 0
    routing: bool = True


# --------------------------------------------------------------------------- handler


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerStats:
    """Requests a handler answered so far (a snapshot)."""

    requests: int
    """Requests answered with a body."""
    refused: int
    """Requests refused as bad (400)."""
    keys_put: int
    """Payloads put into the engine store (``lmdeploy-key``)."""


class WireHandler:
    """One wire format in process: request body in, the engine's response body out.

    ``engine_store`` (``lmdeploy-key`` only) is the ``shared_store`` actor handle, or any
    object whose ``put.remote(array)`` returns an ObjectRef of the key (a Ray actor) or the
    key itself (an in-process fake). Bad requests raise ``MisuseError``.
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        wire: str,
        *,
        engine_store: Any = None,
        put_timeout_s: float = 60.0,
    ) -> None:
        if wire not in WIRES:
            raise MisuseError("unknown wire format", expected=f"one of {WIRES}", found=wire)
        if (wire == "lmdeploy-key") != (engine_store is not None):
            raise MisuseError(
                "an engine store goes with the lmdeploy-key wire, and only with it",
                expected="engine_store for lmdeploy-key, None otherwise",
                found=f"wire {wire!r}, engine_store {type(engine_store).__name__}",
                hint="Start one with routeplay.store.start_engine_store().",
            )
        self.engine = engine
        self.wire = wire
        self._store = engine_store
        self._put_timeout_s = put_timeout_s
        self._lock = threading.Lock()
        self._requests = self._refused = self._keys = 0
        parse: dict[str, Callable[[dict[str, Any]], _Job]] = {
            "vllm": self._parse_vllm,
            "sglang": self._parse_sglang,
            "lmdeploy-key": self._parse_lmdeploy,
            "lmdeploy-inline": self._parse_lmdeploy,
        }
        answer: dict[str, Callable[[_Job, Generation], dict[str, Any]]] = {
            "vllm": self._answer_vllm,
            "sglang": self._answer_sglang,
            "lmdeploy-key": self._answer_lmdeploy,
            "lmdeploy-inline": self._answer_lmdeploy,
        }
        self._parse, self._answer = parse[wire], answer[wire]

    @property
    def path(self) -> str:
        """The endpoint this wire is served on."""
        return _PATHS[self.wire]

    def __call__(self, body: object) -> dict[str, Any]:
        """Generate for one request body and answer as the real engine would."""
        try:
            if not isinstance(body, dict):
                raise MisuseError(
                    "the request body must be a JSON object",
                    expected="object",
                    found=type(body).__name__,
                    where=self.path,
                )
            job = self._parse(body)
            if job.start > len(job.prompt):
                raise MisuseError(
                    "the routing start row lies beyond the prompt",
                    expected=f"0 <= start <= {len(job.prompt)} (the prompt's tokens)",
                    found=job.start,
                    where=self.path,
                )
            generation = self.engine.generate(
                job.prompt,
                max_new_tokens=job.max_new_tokens,
                temperature=job.temperature,
                seed=job.seed,
                stop_after=job.stop_after,
                eos_id=job.stops,
            )
        except (MisuseError, RoutesDataError):
            with self._lock:
                self._refused += 1
            raise
        body_out = self._answer(job, generation)
        with self._lock:
            self._requests += 1
        return body_out

    def stats(self) -> ServerStats:
        """Counters so far."""
        with self._lock:
            return ServerStats(requests=self._requests, refused=self._refused, keys_put=self._keys)

    # -- parsing -----------------------------------------------------------------------

    def _validate(self, model: type[_Body], body: dict[str, Any]) -> Any:
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                for err in exc.errors()[:5]
            )
            raise MisuseError(
                f"bad {self.wire} request",
                expected=f"a {self.wire} request body (token ids, no text prompts)",
                found=problems,
                where=self.path,
            ) from exc

    def _parse_vllm(self, body: dict[str, Any]) -> _Job:
        req: _VllmRequest = self._validate(_VllmRequest, body)
        return _Job(
            prompt=req.prompt,
            max_new_tokens=req.max_tokens,
            temperature=req.temperature,
            seed=req.seed or 0,
            stop_after=req.stop_after,
            stops=req.stop_token_ids,
            start=req.routed_experts_prompt_start,
        )

    def _parse_sglang(self, body: dict[str, Any]) -> _Job:
        req: _SglangRequest = self._validate(_SglangRequest, body)
        params = req.sampling_params
        return _Job(
            prompt=req.input_ids,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            seed=params.seed or 0,
            stop_after=params.stop_after,
            stops=params.stop_token_ids,
            start=req.routed_experts_start_len,
            routing=req.return_routed_experts,
        )

    def _parse_lmdeploy(self, body: dict[str, Any]) -> _Job:
        req: _LmdeployRequest = self._validate(_LmdeployRequest, body)
        return _Job(
            prompt=req.input_ids,
            max_new_tokens=req.max_tokens,
            temperature=req.temperature,
            seed=req.seed or 0,
            stop_after=req.stop_after,
            stops=req.stop_token_ids,
            routing=req.return_routed_experts,
        )

    # -- answering ---------------------------------------------------------------------

    def _wire(self, generation: Generation, dtype: str) -> npt.NDArray[Any]:
        return wire_layers(generation.routing, self.engine.spec, dtype)

    def _answer_vllm(self, job: _Job, gen: Generation) -> dict[str, Any]:
        rows = self._wire(gen, str(vllm.wire_dtype(self.engine.spec)))[job.start :]
        choice = {
            "index": 0,
            "text": "",
            "token_ids": list(gen.token_ids),
            "logprobs": {"token_logprobs": list(gen.logprobs)},
            "finish_reason": gen.finish_reason,
            "routed_experts": vllm.encode(rows, self.engine.spec),
        }
        usage = {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        }
        return {"object": "text_completion", "choices": [choice], "usage": usage}

    def _answer_sglang(self, job: _Job, gen: Generation) -> dict[str, Any]:
        finish: dict[str, Any] = {"type": gen.finish_reason}
        if gen.finish_reason == "stop":
            finish["matched"] = gen.token_ids[-1]
        elif gen.finish_reason == "length":
            finish["length"] = gen.completion_tokens
        else:
            finish["message"] = "stop_after"
        meta: dict[str, Any] = {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion_tokens,
            "finish_reason": finish,
            "output_token_logprobs": [
                [lp, tok, None] for lp, tok in zip(gen.logprobs, gen.token_ids, strict=True)
            ],
            "weight_version": gen.weight_version,
        }
        if job.routing:
            meta["routed_experts"] = sglang.encode(self._wire(gen, "int32"), start_row=job.start)
            meta["routed_experts_start_len"] = job.start
        return {"text": "", "output_ids": list(gen.token_ids), "meta_info": meta}

    def _answer_lmdeploy(self, job: _Job, gen: Generation) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion_tokens,
        }
        if job.routing:
            rows = self._wire(gen, str(lmdeploy.WIRE_DTYPE))
            meta["routed_experts"] = (
                self._put(rows) if self.wire == "lmdeploy-key" else lmdeploy.encode_lists(rows)
            )
        return {
            "text": "",
            "token_ids": list(gen.token_ids),
            "logprobs": list(gen.logprobs),
            "finish_reason": gen.finish_reason,
            "meta_info": meta,
        }

    def _put(self, rows: npt.NDArray[np.uint16]) -> str:
        answer = self._store.put.remote(rows)
        if not isinstance(answer, str):  # an ObjectRef: resolve it as LMDeploy does
            from routeplay.store import ray_calls  # Ray is needed only in this mode

            answer = ray_calls.get(answer, timeout_s=self._put_timeout_s, what="shared_store.put")
        if not lmdeploy.is_key(answer):
            raise MisuseError(
                "the engine store answered put with something other than a key",
                expected="56 lowercase hex characters (ObjectRef.hex())",
                found=repr(answer)[:80],
                where="shared_store.put",
            )
        with self._lock:
            self._keys += 1
        return str(answer)


# --------------------------------------------------------------------------- HTTP


def build_app(handler: WireHandler) -> FastAPI:
    """A FastAPI app serving ``handler`` (and ``GET /health``)."""
    app = FastAPI(title=f"routeplay reference engine ({handler.wire})", docs_url=None)

    @app.get("/health")
    def health() -> dict[str, Any]:
        engine = handler.engine
        return {"status": "ok", "wire": handler.wire, "weight_version": engine.weight_version}

    @app.post(handler.path)
    async def generate(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, "MisuseError", f"the request body is not JSON: {exc}")
        try:
            # Generation is CPU-bound and serialized by the engine's lock: off the event loop.
            answer = await run_in_threadpool(handler, body)
        except (MisuseError, RoutesDataError) as exc:
            return _error(400, type(exc).__name__, str(exc))
        except LifetimeError as exc:
            return _error(503, type(exc).__name__, str(exc))
        return JSONResponse(answer)

    return app


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


class EngineServer:
    """``ReferenceEngine`` over HTTP on a loopback address, in a background thread.

    ``allow_remote=True`` lets ``host`` be one IP of this node (a multi-node cluster's
    rollout workers must reach it); wildcard addresses are always refused.

    ``port=0`` picks a free port; ``url`` says which. ``close()`` (idempotent, also on
    leaving a ``with`` block) stops the server and joins its thread.
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        wire: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        engine_store: Any = None,
        allow_remote: bool = False,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.handler = WireHandler(engine, wire, engine_store=engine_store)
        family = _bind_family(host, allow_remote)
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise MisuseError(
                "cannot bind the engine server", expected=f"{host}:{port} free", found=str(exc)
            ) from exc
        bound_host, bound_port = self._socket.getsockname()[:2]
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        self._url = f"http://{shown}:{bound_port}"
        config = uvicorn.Config(
            build_app(self.handler), log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"routeplay-engine-{wire}",
            daemon=True,
        )
        self._closed = False
        self._thread.start()
        self._wait_started(start_timeout_s)

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``."""
        return self._url

    @property
    def wire(self) -> str:
        """The wire format served."""
        return self.handler.wire

    @property
    def endpoint(self) -> str:
        """Full URL of the generation endpoint."""
        return self._url + self.handler.path

    def stats(self) -> ServerStats:
        """The handler's counters."""
        return self.handler.stats()

    def close(self) -> None:
        """Stop serving and join the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._socket.close()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise MisuseError(
                    "the engine server did not start",
                    expected=f"uvicorn serving within {timeout_s}s",
                    found="thread exited" if not self._thread.is_alive() else "timeout",
                    where=self._url,
                )
            time.sleep(0.01)


def _bind_family(host: str, allow_remote: bool) -> socket.AddressFamily:
    # The reference engine answers anyone who can reach it, unauthenticated: loopback by
    # default; one named address of this machine only when the caller opts in.
    if host == "localhost":
        return socket.AF_INET
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and (
        address.is_loopback or (allow_remote and not address.is_unspecified)
    ):
        return socket.AF_INET6 if address.version == 6 else socket.AF_INET
    raise MisuseError(
        "the reference engine binds a loopback address unless told otherwise",
        expected="127.0.0.1, ::1 or localhost; with allow_remote=True one IP of this node",
        found=host,
        hint="Multi-node clusters: pass allow_remote=True and the node's IP (never 0.0.0.0).",
    )
