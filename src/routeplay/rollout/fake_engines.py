"""Fake engines: each answers in its real engine's wire format, from a known ground-truth
routing array, so adapters (and the conformance test every adapter runs) can be checked
end to end without a GPU or a model.

A fake builds its body with its engine's body builder (``routeplay.core.wires``), the
same code path as the reference engine's server. ``truth`` is the canonical
``[T, L, K]`` array of a sample's full sequence; a fake returns the rows a real engine
would for ``prompt_tokens + completion_tokens`` tokens, from ``start_row`` where the
engine has a start field (the caller passes the same start to the adapter: engines never
echo it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy.typing as npt

from routeplay.core.spec import RouteSpec
from routeplay.core.wires import Answer, BodyOptions, Engine, wire_layers
from routeplay.core.wires import lmdeploy as lmdeploy_wire
from routeplay.core.wires import sglang as sglang_wire
from routeplay.core.wires import vllm as vllm_wire

__all__ = [
    "FAKE_ENGINES",
    "FakeEngine",
    "FakeLmdeployInline",
    "FakeLmdeployKey",
    "FakeSglang",
    "FakeVllmHttp",
    "FakeVllmInProcess",
    "wire_layers",
]


class FakeEngine(Protocol):
    """An engine stand-in that answers in its wire format."""

    adapter: str
    """Name of the adapter (``routeplay.rollout.adapters.ADAPTERS``) that reads it."""
    supports_start: bool
    """True when it can return only rows from a start (SGLang, vLLM)."""

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any: ...


def _answer(truth: npt.NDArray[Any], prompt_tokens: int, completion_tokens: int) -> Answer:
    return Answer(
        prompt_tokens=prompt_tokens,
        token_ids=tuple(range(completion_tokens)),
        logprobs=(0.0,) * completion_tokens,
        finish_reason="length",
        routing=truth[: prompt_tokens + completion_tokens - 1],
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeVllmHttp:
    """vLLM ``/v1/completions``: base64 ``.npy`` rows from ``routed_experts_prompt_start``."""

    spec: RouteSpec
    """Model geometry."""
    adapter: str = Engine.VLLM.value
    supports_start: bool = True

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        """A completions body for the first ``prompt + completion - 1`` rows."""
        options = BodyOptions(endpoint="completions", start_row=start_row)
        answer = _answer(truth, prompt_tokens, completion_tokens)
        return vllm_wire.WIRE.build_body([answer], self.spec, options)


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeVllmInProcess:
    """vLLM in process: a ``RequestOutput`` with prompt and completion routing arrays."""

    spec: RouteSpec
    """Model geometry."""
    adapter: str = "vllm-inprocess"
    supports_start: bool = False

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        """A ``RequestOutput`` look-alike (every row: in process there is no start)."""
        answer = _answer(truth, prompt_tokens, completion_tokens)
        return vllm_wire.WIRE.build_output(answer, self.spec)


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeSglang:
    """SGLang ``/generate``: base64 raw int32 rows from ``routed_experts_start_len``."""

    spec: RouteSpec
    """Model geometry."""
    adapter: str = Engine.SGLANG.value
    supports_start: bool = True

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        """A ``/generate`` body (the start row is not echoed, as SGLang's is not)."""
        options = BodyOptions(endpoint="generate", start_row=start_row)
        answer = _answer(truth, prompt_tokens, completion_tokens)
        return sglang_wire.WIRE.build_body([answer], self.spec, options)


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeLmdeployInline:
    """LMDeploy without Ray: nested lists in the ``/generate`` body."""

    spec: RouteSpec
    """Model geometry."""
    adapter: str = Engine.LMDEPLOY.value
    supports_start: bool = False

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        """A ``/generate`` body with every row inline."""
        answer = _answer(truth, prompt_tokens, completion_tokens)
        return lmdeploy_wire.WIRE.build_body([answer], self.spec, BodyOptions(endpoint="generate"))


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeLmdeployKey:
    """LMDeploy on Ray: the uint16 array goes to the engine store, the body carries the key."""

    spec: RouteSpec
    """Model geometry."""
    put: Callable[[npt.NDArray[Any]], str] = field(compare=False)
    """The engine store's put (returns the key)."""
    adapter: str = Engine.LMDEPLOY.value
    supports_start: bool = False

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        """A ``/generate`` body carrying the key of the stored rows."""
        answer = _answer(truth, prompt_tokens, completion_tokens)
        options = BodyOptions(endpoint="generate", put=self.put)
        return lmdeploy_wire.WIRE.build_body([answer], self.spec, options)


FAKE_ENGINES = ("vllm", "vllm-inprocess", "sglang", "lmdeploy-inline", "lmdeploy-key")
