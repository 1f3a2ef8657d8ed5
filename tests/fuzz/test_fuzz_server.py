"""Fuzzing the reference engine server's request parsing, in process: ``WireHandler``
(body in, body or ``RouteplayError`` out) and the FastAPI app through starlette's
``TestClient`` (every malformed request a 4xx with a JSON error, never a 500).

Requests are the real request builders' bodies for every wire, mutated (seeds beyond 64
bits, tiny, infinite and NaN temperatures, wrong types at every path, JSON nested 100,000
deep, long prompts), plus raw bytes. Settings and replaying a failure: see
``test_fuzz_decoders``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from fuzzing import REFUSED, check, materialize, mutated, scaled, to_json_bytes
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from routeplay.core.wires import WIRE_NAMES, wire
from routeplay.engine import EngineConfig, ReferenceEngine, WireHandler
from routeplay.engine.server import ServerLimits, build_app

TINY = EngineConfig(
    hidden_size=16, num_layers=2, num_experts=8, top_k=2, vocab_size=64, max_positions=48, seed=3
)
"""A model small enough that any request it accepts answers in milliseconds."""
LIMITS = ServerLimits(max_body_bytes=256 << 10, request_timeout_s=4.0)
WIRES = [name for name in WIRE_NAMES if not wire(name).key_store]


class ServerBroke(AssertionError):
    """The app answered a request with a 5xx, or with something other than JSON."""


@cache
def _engine() -> ReferenceEngine:
    import torch

    torch.set_num_threads(1)
    return ReferenceEngine(TINY)


@cache
def _handler(name: str) -> WireHandler:
    return WireHandler(_engine(), name)


@cache
def _client(name: str) -> TestClient:
    return TestClient(build_app(_handler(name), LIMITS), raise_server_exceptions=True)


def _request(name: str, draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(st.lists(st.integers(0, 63), min_size=1, max_size=6))
    start = draw(st.integers(0, len(prompt))) if wire(name).protocol.start_field else 0
    _, body = wire(name).request(
        prompt,
        max_new_tokens=draw(st.integers(1, 4)),
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
        seed=draw(st.integers(0, 2**16)),
        stop_after=draw(st.one_of(st.none(), st.integers(1, 3))),
        start_row=start,
    )
    return body


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(st.sampled_from(WIRES))
    body = _request(name, draw)
    hostile = st.sampled_from(
        [2**64, -(2**63) - 1, 10**30, 1e-39, 1e-320, float("inf"), float("nan"), -1.0]
    )
    choice = draw(st.integers(0, 3))
    if choice == 0:  # a sampling field set to a number just outside what it takes
        holder = body.get("sampling_params", body)
        holder[draw(st.sampled_from(["seed", "temperature"]))] = draw(hostile)
    elif choice in (1, 2):
        body = draw(mutated(body))
    return name, body


def handle(name: str, body: Any) -> object:
    return _handler(name)(materialize(body))


def post(name: str, raw: bytes) -> str:
    answer = _client(name).post(
        wire(name).path, content=raw, headers={"content-type": "application/json"}
    )
    if answer.status_code >= 500:
        raise ServerBroke(f"{answer.status_code}: {answer.text[:300]}")
    payload = answer.json()
    if answer.status_code >= 400 and not isinstance(payload.get("error"), dict):
        raise ServerBroke(f"{answer.status_code} without a JSON error: {answer.text[:300]}")
    return "ok" if answer.status_code == 200 else REFUSED


@scaled(30)
@given(requests())
def test_handler_parses_every_request(case: tuple[str, Any]) -> None:
    name, body = case
    check(f"handler-{name}", lambda: handle(name, body))


@scaled(30)
@given(requests())
def test_app_answers_every_request_with_json(case: tuple[str, Any]) -> None:
    name, body = case
    raw = to_json_bytes(body)
    check(f"app-{name}", lambda: post(name, raw))


@scaled(15)
@given(st.binary(max_size=300), st.sampled_from(WIRES))
def test_app_answers_raw_bytes_with_json(raw: bytes, name: str) -> None:
    check("app-bytes", lambda: post(name, raw))
