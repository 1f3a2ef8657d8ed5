"""The reference engine server under bad requests: every one a 4xx with a JSON error
(never a 500), a body-size limit (413), a per-request deadline (504), and binds that
never reach every interface. Through the real FastAPI app (starlette's TestClient)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from starlette.testclient import TestClient  # noqa: E402

from routeplay.engine import (  # noqa: E402
    EngineConfig,
    EngineServer,
    ReferenceEngine,
    ServerLimits,
    WireHandler,
)
from routeplay.engine.server import build_app  # noqa: E402
from routeplay.errors import MisuseError  # noqa: E402

TINY = EngineConfig(hidden_size=16, num_layers=2, num_experts=8, top_k=2, vocab_size=64, seed=5)


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TINY)


@pytest.fixture
def client(engine: ReferenceEngine) -> Iterator[TestClient]:
    app = build_app(WireHandler(engine, "sglang"), ServerLimits(max_body_bytes=4096))
    with TestClient(app) as test_client:
        yield test_client


def _body(**sampling: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 2, **sampling}
    return {"input_ids": [1, 2, 3], "sampling_params": params, "return_routed_experts": True}


def _refused(answer: Any, status: int = 400) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"type", "message"}
    return str(error["message"])


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_beyond_64_bits_is_400(client: TestClient, seed: int) -> None:
    assert "seed" in _refused(client.post("/generate", json=_body(seed=seed)))


@pytest.mark.parametrize("text", ["Infinity", "NaN", "-Infinity", "-1.0", '"hot"'])
def test_an_infinite_nan_or_negative_temperature_is_400(client: TestClient, text: str) -> None:
    raw = json.dumps(_body()).replace(
        '"max_new_tokens": 2', f'"max_new_tokens": 2, "temperature": {text}'
    )
    answer = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert "temperature" in _refused(answer)


@pytest.mark.parametrize("temperature", [1e-39, 1e-320, 5e-324])
def test_a_tiny_temperature_samples_the_best_token(client: TestClient, temperature: float) -> None:
    greedy = client.post("/generate", json=_body(temperature=0.0, max_new_tokens=3))
    tiny = client.post("/generate", json=_body(temperature=temperature, max_new_tokens=3))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["output_ids"] == greedy.json()["output_ids"]


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000 + b"]" * 100_000, b'{"input_ids": [' + b"9" * 5000 + b"]}", b"\xff\xfe"],
    ids=["nested-100000", "int-5000-digits", "not-utf8"],
)
def test_json_the_parser_cannot_hold_is_400(engine: ReferenceEngine, raw: bytes) -> None:
    app = build_app(WireHandler(engine, "sglang"), ServerLimits(max_body_bytes=1 << 20))
    with TestClient(app) as test_client:
        answer = test_client.post("/generate", content=raw)
    assert "not JSON" in _refused(answer)


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [[1]]},
        {"input_ids": "abc"},
        {"input_ids": [1], "sampling_params": [1]},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}},
        {"input_ids": [1], "routed_experts_start_len": -1},
        {"input_ids": [1], "sampling_params": {"stop_token_ids": [10**30]}},
        {"input_ids": [10**30]},
        ["not", "an", "object"],
        "text",
    ],
)
def test_wrong_types_are_400(client: TestClient, body: Any) -> None:
    _refused(client.post("/generate", json=body))


def test_a_body_over_the_limit_is_413_declared_or_streamed(client: TestClient) -> None:
    big = json.dumps({"input_ids": [1] * 3000}).encode()
    assert "4096 bytes" in _refused(client.post("/generate", content=big), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused while it streams in
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    assert "4096 bytes" in _refused(client.post("/generate", content=chunks()), 413)
    assert client.post("/generate", json=_body()).status_code == 200


def test_a_request_past_the_deadline_is_504_and_the_server_goes_on(
    engine: ReferenceEngine,
) -> None:
    app = build_app(WireHandler(engine, "sglang"), ServerLimits(request_timeout_s=0.001))
    with TestClient(app) as test_client:
        slow = test_client.post("/generate", json=_body(max_new_tokens=200))
        assert "longer than" in _refused(slow, 504)
    relaxed = build_app(WireHandler(engine, "sglang"), ServerLimits(request_timeout_s=60.0))
    with TestClient(relaxed) as test_client:
        assert test_client.post("/generate", json=_body()).status_code == 200


def test_limits_must_be_positive() -> None:
    with pytest.raises(MisuseError):
        ServerLimits(max_body_bytes=0)
    with pytest.raises(MisuseError):
        ServerLimits(request_timeout_s=0.0)


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0", "::", "::ffff:0.0.0.0", "0:0:0:0:0:ffff:0:0", "::0", "0::0:0"],
)
def test_wildcards_are_refused_even_with_allow_remote(engine: ReferenceEngine, host: str) -> None:
    with pytest.raises(MisuseError, match="loopback"):
        EngineServer(engine, "vllm", host=host, allow_remote=True)


def test_an_ipv4_mapped_loopback_is_loopback(engine: ReferenceEngine) -> None:
    with EngineServer(engine, "vllm", host="::ffff:127.0.0.1") as server:
        assert server.url.startswith("http://[::ffff:127.0.0.1]:")
