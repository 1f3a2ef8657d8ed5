"""Fake engines: each answers exactly in its real engine's wire format, from a known
ground-truth routing array, so adapters (and the conformance test every adapter runs)
can be checked end to end without a GPU or a model.

``truth`` is the canonical ``[T, L, K]`` array of a sample's full sequence; a fake
returns the rows a real engine would for ``prompt_tokens + completion_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from routeplay.core.formats import lmdeploy, sglang, vllm
from routeplay.core.spec import RouteSpec

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
    """True when it can return only rows from a start (SGLang start_len)."""

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any: ...


def wire_layers(truth: npt.NDArray[Any], spec: RouteSpec, dtype: str) -> npt.NDArray[Any]:
    """Rows as engines send them: every decoder layer (dense ones zero), in ``dtype``."""
    wire = np.zeros((truth.shape[0], spec.decoder_layers, spec.top_k), dtype=dtype)
    wire[:, list(spec.moe_layer_indices()), :] = truth
    return wire


def _rows(truth: npt.NDArray[Any], prompt_tokens: int, completion_tokens: int) -> npt.NDArray[Any]:
    return truth[: prompt_tokens + completion_tokens - 1]


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeVllmHttp:
    """vLLM ``/v1/completions``: base64 ``.npy`` in ``choices[0].routed_experts``."""

    spec: RouteSpec
    adapter: str = "vllm"
    supports_start: bool = False

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        rows = wire_layers(_rows(truth, prompt_tokens, completion_tokens), self.spec, "uint8")
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return {"choices": [{"routed_experts": vllm.encode(rows, self.spec)}], "usage": usage}


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeVllmInProcess:
    """vLLM in process: a ``RequestOutput`` with prompt and completion routing arrays."""

    spec: RouteSpec
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
        rows = wire_layers(_rows(truth, prompt_tokens, completion_tokens), self.spec, "int16")
        completion = SimpleNamespace(
            token_ids=list(range(completion_tokens)), routed_experts=rows[prompt_tokens:]
        )
        return SimpleNamespace(
            prompt_token_ids=list(range(prompt_tokens)),
            prompt_routed_experts=rows[:prompt_tokens],
            outputs=[completion],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeSglang:
    """SGLang ``/generate``: base64 raw int32, rows from ``routed_experts_start_len``."""

    spec: RouteSpec
    adapter: str = "sglang"
    supports_start: bool = True

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        rows = wire_layers(_rows(truth, prompt_tokens, completion_tokens), self.spec, "int32")
        meta = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "routed_experts": sglang.encode(rows, start_row=start_row),
        }
        if start_row:
            meta["routed_experts_start_len"] = start_row
        return {"text": "", "meta_info": meta}


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeLmdeployInline:
    """LMDeploy without Ray: nested lists in ``meta_info.routed_experts``."""

    spec: RouteSpec
    adapter: str = "lmdeploy"
    supports_start: bool = False

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        rows = wire_layers(_rows(truth, prompt_tokens, completion_tokens), self.spec, "uint16")
        meta = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return {"text": "", "meta_info": {**meta, "routed_experts": lmdeploy.encode_lists(rows)}}


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeLmdeployKey:
    """LMDeploy on Ray: the uint16 array goes to the engine store, the body carries the key."""

    spec: RouteSpec
    put: Callable[[npt.NDArray[Any]], str] = field(compare=False)
    adapter: str = "lmdeploy"
    supports_start: bool = False

    def respond(
        self,
        truth: npt.NDArray[Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        start_row: int = 0,
    ) -> Any:
        rows = wire_layers(_rows(truth, prompt_tokens, completion_tokens), self.spec, "uint16")
        meta = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return {"text": "", "meta_info": {**meta, "routed_experts": self.put(rows)}}


FAKE_ENGINES = ("vllm", "vllm-inprocess", "sglang", "lmdeploy-inline", "lmdeploy-key")
