"""The reference engine behind each real engine's wire format, in process and over HTTP.

``WireHandler`` turns one request body (parsed JSON) into the response body a real engine
would send, built by that engine's body builder (``routeplay.core.wires``: the same code
path as the fake engines), every decoder layer on the wire. ``EngineServer`` serves a
handler with FastAPI/uvicorn on a loopback address, in a background thread. Each wire of
``routeplay.core.wires.WIRES`` is served on its endpoint (``WireFormat.path``); its
request fields are parsed by ``routeplay.engine.requests``.

Every server also answers ``GET /health``. Every bad request gets a 4xx with
``{"error": {"type": ..., "message": ...}}``, never a 500: 400 for a body that does not
parse (bad JSON, nesting deeper than the parser's stack, 5,000-digit integers) or does not
validate (wrong types, seeds beyond 64 bits, infinite or NaN temperatures); 413 for a body
over ``ServerLimits.max_body_bytes`` (refused from its ``Content-Length`` or while it
streams in, before it is parsed). A request that runs past
``ServerLimits.request_timeout_s`` gets 504; a failing engine store gets 503.
Prompts are token ids: the reference engine has no tokenizer, so ``text`` is always "".
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from routeplay.core.formats import lmdeploy as key_format
from routeplay.core.wires import WIRE_NAMES, Answer, BodyOptions, WireFormat
from routeplay.core.wires import wire as wire_format
from routeplay.engine.generator import Generation, ReferenceEngine
from routeplay.engine.requests import Job, parse_request
from routeplay.errors import LifetimeError, MisuseError, RoutesDataError, describe

__all__ = ["WIRES", "EngineServer", "ServerLimits", "ServerStats", "WireHandler", "build_app"]

WIRES: Final = WIRE_NAMES
"""Wire formats a server can speak (``routeplay.core.wires.WIRE_NAMES``)."""


# --------------------------------------------------------------------------- handler


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerStats:
    """Requests a handler answered so far (a snapshot)."""

    requests: int
    """Requests answered with a body."""
    refused: int
    """Requests refused as bad (400)."""
    keys_put: int
    """Payloads put into the engine store (key-store wires)."""
    engine_objects: int = 0
    """Object-store objects the engine side wrote for those payloads: its answer's array
    and the engine store's copy of it (LMDeploy's ``shared_store.put`` re-puts its
    argument), two per key, counted apart from what routeplay writes."""
    engine_bytes: int = 0
    """Their payload bytes (the engine's uint16 array, twice per key)."""


class WireHandler:
    """One wire format in process: request body in, the engine's response body out.

    ``engine_store`` (key-store wires only) is the ``shared_store`` actor handle, or any
    object whose ``put.remote(array)`` returns an ObjectRef of the key (a Ray actor) or the
    key itself (an in-process fake). Bad requests raise ``MisuseError``.

    Example:
        >>> handler = WireHandler(engine, "sglang")  # doctest: +SKIP
        >>> body = handler({"input_ids": [1, 2, 3], "return_routed_experts": True})
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        wire: str,
        *,
        engine_store: Any = None,
        put_timeout_s: float = 60.0,
    ) -> None:
        if wire not in WIRE_NAMES:
            raise MisuseError("unknown wire format", expected=f"one of {WIRE_NAMES}", found=wire)
        self.format: WireFormat = wire_format(wire)
        if self.format.key_store != (engine_store is not None):
            raise MisuseError(
                "an engine store goes with a key-store wire, and only with it",
                expected="engine_store for lmdeploy-key, None otherwise",
                found=f"wire {wire!r}, engine_store {type(engine_store).__name__}",
                hint="Start one with routeplay.store.start_engine_store().",
            )
        self.engine = engine
        self._store = engine_store
        self._put_timeout_s = put_timeout_s
        self._lock = threading.Lock()
        self._requests = self._refused = self._keys = 0
        self._engine_objects = self._engine_bytes = 0

    @property
    def wire(self) -> str:
        """The wire format's name."""
        return self.format.name

    @property
    def path(self) -> str:
        """The endpoint this wire is served on."""
        return self.format.path

    def __call__(self, body: object) -> Any:
        """Generate for one request body and answer as the real engine would."""
        try:
            if not isinstance(body, dict):
                raise MisuseError(
                    "the request body must be a JSON object",
                    expected="object",
                    found=type(body).__name__,
                    where=self.path,
                )
            job = parse_request(self.format, body)
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
            return ServerStats(
                requests=self._requests,
                refused=self._refused,
                keys_put=self._keys,
                engine_objects=self._engine_objects,
                engine_bytes=self._engine_bytes,
            )

    def _answer(self, job: Job, gen: Generation) -> Any:
        answer = Answer(
            prompt_tokens=gen.prompt_tokens,
            token_ids=tuple(gen.token_ids),
            logprobs=tuple(gen.logprobs),
            finish_reason=gen.finish_reason,
            routing=gen.routing,
            weight_version=gen.weight_version,
        )
        options = BodyOptions(
            endpoint=self.format.endpoint,
            start_row=job.start,
            return_routing=job.routing,
            put=self._put if self.format.key_store else None,
            include_stop=job.include_stop,
            return_logprob=job.logprobs,
        )
        return self.format.protocol.build_body([answer], self.engine.spec, options)

    def _put(self, rows: npt.NDArray[np.uint16]) -> str:
        import ray  # needed only for key-store wires

        from routeplay.store.remote import ray_calls

        written = 0
        if isinstance(self._store, ray.actor.ActorHandle):
            # Written explicitly (Ray would do it only above 100 KiB), so the engine's own
            # writes are known exactly: this one, and the store actor's copy of it.
            answer = self._store.put.remote(ray.put(rows))
            answer = ray_calls.get(answer, timeout_s=self._put_timeout_s, what="shared_store.put")
            written = 2
        else:  # an in-process fake answers with the key itself
            answer = self._store.put.remote(rows)
        if not key_format.is_key(answer):
            raise MisuseError(
                "the engine store answered put with something other than a key",
                expected="56 lowercase hex characters (ObjectRef.hex())",
                found=describe(answer),
                where="shared_store.put",
            )
        with self._lock:
            self._keys += 1
            self._engine_objects += written
            self._engine_bytes += written * int(rows.nbytes)
        return str(answer)


# --------------------------------------------------------------------------- HTTP


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """What one HTTP request may cost the server.

    Example:
        >>> ServerLimits(max_body_bytes=1 << 20, request_timeout_s=10.0).max_body_bytes
        1048576
    """

    max_body_bytes: int = 16 << 20
    """Largest request body accepted (413 beyond); 16 MiB holds a 1M-token prompt."""
    request_timeout_s: float = 120.0
    """Time one request may take, queueing for the engine included (504 beyond). The
    generation thread cannot be interrupted: it finishes in the background, bounded by
    the model's positions, and its answer is dropped."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or not self.request_timeout_s > 0:
            raise MisuseError(
                "server limits must be positive",
                expected="max_body_bytes >= 1, request_timeout_s > 0",
                found=self,
            )


class _Refusal(Exception):
    """An HTTP error answer, raised while reading the request."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def build_app(handler: WireHandler, limits: ServerLimits | None = None) -> FastAPI:
    """A FastAPI app serving ``handler`` (and ``GET /health``) under ``limits``.

    Example:
        >>> app = build_app(WireHandler(engine, "sglang"))  # doctest: +SKIP
        >>> httpx.AsyncClient(transport=httpx.ASGITransport(app=app))  # doctest: +SKIP
    """
    limits = limits or ServerLimits()
    app = FastAPI(title=f"routeplay reference engine ({handler.wire})", docs_url=None)

    @app.get("/health")
    def health() -> dict[str, Any]:
        engine = handler.engine
        return {"status": "ok", "wire": handler.wire, "weight_version": engine.weight_version}

    @app.post(handler.path)
    async def generate(request: Request) -> JSONResponse:
        try:
            body = _parse_json(await _read_body(request, limits.max_body_bytes))
            # Generation is CPU-bound and serialized by the engine's lock: off the event loop.
            answer = await asyncio.wait_for(
                run_in_threadpool(handler, body), timeout=limits.request_timeout_s
            )
        except _Refusal as refusal:
            return _error(refusal.status, refusal.kind, refusal.message)
        except (MisuseError, RoutesDataError) as exc:
            return _error(400, type(exc).__name__, str(exc))
        except LifetimeError as exc:
            return _error(503, type(exc).__name__, str(exc))
        except TimeoutError:
            return _error(
                504,
                "EngineUnavailable",
                f"the request took longer than {limits.request_timeout_s}s",
            )
        return JSONResponse(answer)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it exceeds ``limit`` (declared or streamed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _Refusal(413, "MisuseError", f"the request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # chunked uploads, or a Content-Length that lied
            raise _Refusal(413, "MisuseError", f"the request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        why = "it nests deeper than the parser's stack"
    except UnicodeDecodeError:
        why = "it is not UTF-8"
    except json.JSONDecodeError as exc:
        why = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except ValueError as exc:  # integers beyond sys.get_int_max_str_digits()
        why = str(exc)[:160]
    raise _Refusal(400, "MisuseError", f"the request body is not JSON: {why}")


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


class EngineServer:
    """``ReferenceEngine`` over HTTP on a loopback address, in a background thread.

    ``allow_remote=True`` lets ``host`` be one IP of this node (a multi-node cluster's
    rollout workers must reach it); wildcard addresses are always refused.

    ``port=0`` picks a free port; ``url`` says which. ``limits`` caps each request's
    body size and time. ``close()`` (idempotent, also on leaving a ``with`` block) stops
    the server and joins its thread.

    Example:
        >>> with EngineServer(engine, "sglang") as server:  # doctest: +SKIP
        ...     httpx.post(server.endpoint, json={"input_ids": [1, 2]}).json()
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
        limits: ServerLimits | None = None,
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
            build_app(self.handler, limits),
            log_level="warning",
            access_log=False,
            lifespan="off",
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
    if address is not None:
        # ::ffff:0.0.0.0 binds every IPv4 interface although ipaddress does not call it
        # unspecified: judge an IPv4-mapped address by the IPv4 address it maps.
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        judged = mapped if mapped is not None else address
        wildcard = judged.is_unspecified or address.is_unspecified
        if not wildcard and (judged.is_loopback or allow_remote):
            return socket.AF_INET6 if address.version == 6 else socket.AF_INET
    raise MisuseError(
        "the reference engine binds a loopback address unless told otherwise",
        expected="127.0.0.1, ::1 or localhost; with allow_remote=True one IP of this node",
        found=host,
        hint="Multi-node clusters: pass allow_remote=True and the node's IP (never 0.0.0.0).",
    )
