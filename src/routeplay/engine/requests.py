"""Request bodies the reference engine accepts, one model per engine, parsed into a
``Job`` in the engine's own terms.

Routing-related request fields are named by ``routeplay.core.wires`` (pydantic aliases),
so this module never spells an engine's field. Unknown fields are ignored (clients send
model names, stream flags...). Beyond the real engines' fields every request takes
``stop_after`` (interrupt after that many tokens: a partial rollout) and
``stop_token_ids``; a missing ``seed`` means 0, so every request is reproducible. Seeds
outside 64 bits and infinite or NaN temperatures are refused here, as bad requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from routeplay.core.wires import WireFormat
from routeplay.core.wires import lmdeploy as lmdeploy_wire
from routeplay.core.wires import sglang as sglang_wire
from routeplay.core.wires import vllm as vllm_wire
from routeplay.core.wires.base import Engine
from routeplay.errors import MisuseError

__all__ = ["Job", "parse_request"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A validated request, in the engine's terms."""

    prompt: list[int]
    """Prompt token ids."""
    max_new_tokens: int
    """Tokens to generate at most."""
    temperature: float
    """Sampling temperature."""
    seed: int
    """Sampling seed."""
    stop_after: int | None
    """Interrupt after this many tokens (finish reason ``abort``)."""
    stops: list[int] | None
    """Stop token ids."""
    start: int = 0
    """First routing row asked for."""
    routing: bool = True
    """Whether routing was asked for."""
    include_stop: bool = True
    """LMDeploy: keep the stop token in the answer."""
    logprobs: bool = True
    """Whether log-probabilities were asked for (LMDeploy ``return_logprob``, off by
    default as in LMDeploy; the other engines' bodies always carry them)."""


Seed = Annotated[StrictInt | None, Field(ge=-(2**63), lt=2**64)]
"""What ``torch.Generator.manual_seed`` takes; beyond it the engine would fail."""
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
"""Finite and non-negative (0 is greedy); NaN and infinity are refused."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _VllmRequest(_Body):
    prompt: list[StrictInt] = Field(min_length=1)
    max_tokens: StrictInt = 16
    temperature: Temperature = 1.0
    seed: Seed = None
    stop_after: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    start: StrictInt = Field(0, ge=0, alias=vllm_wire.START_FIELD)


class _SglangSampling(_Body):
    max_new_tokens: StrictInt = 128
    temperature: Temperature = 1.0
    seed: Seed = None
    stop_after: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None


class _SglangRequest(_Body):
    input_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: _SglangSampling = Field(default_factory=_SglangSampling)
    routing: bool = Field(False, alias=sglang_wire.RETURN_FIELD)
    start: StrictInt = Field(0, ge=0, alias=sglang_wire.START_FIELD)


class _LmdeployRequest(_Body):
    input_ids: list[StrictInt] = Field(min_length=1)
    max_tokens: StrictInt = 128
    temperature: Temperature = 1.0
    seed: Seed = None
    stop_after: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    routing: bool = Field(False, alias=lmdeploy_wire.RETURN_FIELD)
    include_stop: bool = Field(False, alias=lmdeploy_wire.INCLUDE_STOP_FIELD)
    logprobs: bool = Field(False, alias=lmdeploy_wire.RETURN_LOGPROB_FIELD)


def parse_request(wire: WireFormat, body: dict[str, Any]) -> Job:
    """The ``Job`` a request body of ``wire`` asks for; a bad body is a ``MisuseError``."""
    if wire.engine is Engine.VLLM:
        v: _VllmRequest = _validate(wire, _VllmRequest, body)
        return Job(
            prompt=v.prompt,
            max_new_tokens=v.max_tokens,
            temperature=v.temperature,
            seed=v.seed or 0,
            stop_after=v.stop_after,
            stops=v.stop_token_ids,
            start=v.start,
        )
    if wire.engine is Engine.SGLANG:
        s: _SglangRequest = _validate(wire, _SglangRequest, body)
        params = s.sampling_params
        return Job(
            prompt=s.input_ids,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            seed=params.seed or 0,
            stop_after=params.stop_after,
            stops=params.stop_token_ids,
            start=s.start,
            routing=s.routing,
        )
    m: _LmdeployRequest = _validate(wire, _LmdeployRequest, body)
    return Job(
        prompt=m.input_ids,
        max_new_tokens=m.max_tokens,
        temperature=m.temperature,
        seed=m.seed or 0,
        stop_after=m.stop_after,
        stops=m.stop_token_ids,
        routing=m.routing,
        include_stop=m.include_stop,
        logprobs=m.logprobs,
    )


def _validate(wire: WireFormat, model: type[_Body], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
            for err in exc.errors()[:5]
        )
        raise MisuseError(
            f"bad {wire.name} request",
            expected=f"a {wire.name} request body (token ids, no text prompts)",
            found=problems,
            where=wire.path,
        ) from exc
