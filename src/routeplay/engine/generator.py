"""The reference engine: token generation with routing recording on a tiny HF MoE model.

Decoding is incremental with the HF KV cache (prefill, then one token per forward), and
the sampled tokens, their log-probs and the routing all come from that decode, as in a
real engine (vLLM, SGLang and LMDeploy capture the router's choice inside the very passes
that produce the tokens).

Invariant: ``Generation.routing`` is what the routers chose in the passes that produced
``Generation.token_ids``: the prefill's ``P`` prompt rows, then one row per KV-cache decode
step, ``P + C - 1`` rows in all (the last generated token is never fed back, so it has no
row). A decode step and a full forward run different kernel shapes, so in bf16 the router's
top-k can flip at near-ties between the two; a trainer that recomputes a full forward
therefore sees other experts on a few rows even in engine precision, which is what replay
is for. As a diagnostic, ``ReferenceEngine(config, compare_full_forward=True)`` also runs
one full forward per request and counts the (token, layer) pairs where it chose otherwise
in ``EngineStats.full_forward_divergent_rows``; the reported routing never comes from it.

Prefix caching, as vLLM and SGLang do it: the prefill of a prompt seen again under the
same weights (the members of a GRPO group, a retried sample) is not recomputed. Its KV
cache, last logits and routing rows are kept for the last few prompts, so a repeated
prompt's routing rows are the first request's, exactly, as an engine with a prefix cache
returns them. A prompt that extends a kept one under the same weights (a session's next
turn: the last prompt, its answer and a tool's output) computes only its new tokens,
from the kept KV cache: its first rows are the earlier request's, the rest come from that
one pass (``EngineStats.cached_prompt_tokens`` counts the tokens not computed), so what
a request returns can depend on what the engine still keeps, as in vLLM and SGLang.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache, PreTrainedModel

from routeplay.core.spec import RouteSpec
from routeplay.engine.model import EngineConfig, build_model
from routeplay.errors import MisuseError
from routeplay.train.hf import model_spec, record

__all__ = ["FINISH_REASONS", "EngineStats", "Generation", "ReferenceEngine"]

_PREFIXES_KEPT: Final = 4
"""Prompts whose prefill the engine keeps (a group's members arrive close together)."""

FINISH_REASONS = ("stop", "length", "abort")
"""``stop``: the stop token was sampled (and is the last token); ``length``: ``max_new_tokens``
reached; ``abort``: interrupted after ``stop_after`` tokens (a partial rollout)."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Generation:
    """One request's result: the completion, its engine log-probs and the routing."""

    token_ids: tuple[int, ...]
    """Generated tokens only (a sampled stop token included)."""
    logprobs: tuple[float, ...]
    """Engine log-prob of each generated token: log-softmax of the raw logits (temperature
    does not change it), computed in float32 from the engine-precision logits."""
    routing: npt.NDArray[np.unsignedinteger]
    """Canonical ``[prompt_tokens + completion_tokens - 1, L, K]`` (uint8/uint16), read-only."""
    finish_reason: str
    """One of ``FINISH_REASONS``."""
    prompt_tokens: int
    """Tokens in the prompt."""
    completion_tokens: int
    """Tokens generated (``len(token_ids)``)."""
    weight_version: int
    """Version of the weights that generated every token."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """What the engine did so far (a snapshot)."""

    generations: int
    """Requests served."""
    prompt_tokens: int
    """Prompt tokens processed, summed over requests."""
    cached_prompt_tokens: int
    """Of those, the tokens whose prefill came from the prefix cache (not computed), like
    OpenAI's ``usage.prompt_tokens_details.cached_tokens`` (counted here per token)."""
    completion_tokens: int
    """Tokens generated, summed over requests."""
    full_forward_divergent_rows: int | None
    """(token, layer) pairs where a full forward over the same tokens chose other experts
    than the reported (decode-pass) routing; ``None`` unless the engine was built with
    ``compare_full_forward=True``."""
    weight_version: int
    """Current weight version."""


class ReferenceEngine:
    """A tiny MoE model that generates while recording routing; thread-safe (one lock).

    ``compare_full_forward`` (off by default: it costs one more forward per request) counts
    how often a full forward would have chosen other experts than the decode did.

    Example:
        >>> engine = ReferenceEngine(EngineConfig(hidden_size=32, vocab_size=64))
        >>> gen = engine.generate([1, 2, 3], max_new_tokens=4, seed=0)
        >>> gen.routing.shape  # 3 prompt rows + 3 fed-back generated tokens
        (6, 2, 2)
    """

    def __init__(self, config: EngineConfig, *, compare_full_forward: bool = False) -> None:
        self._config = config
        self._model: PreTrainedModel = build_model(config)
        self._spec = model_spec(self._model)
        self._lock = threading.Lock()
        self._weight_version = 0
        self._generations = self._prompt_tokens = self._completion_tokens = 0
        self._cached_tokens = 0
        self._divergent: int | None = 0 if compare_full_forward else None
        # (weight version, prompt) -> the prefill's KV cache, last logits, routing rows
        self._prefills: OrderedDict[tuple[int, tuple[int, ...]], _Prefill] = OrderedDict()

    @property
    def config(self) -> EngineConfig:
        """The config the engine was built from."""
        return self._config

    @property
    def spec(self) -> RouteSpec:
        """Routing geometry of the model (what ``Generation.routing`` is laid out by)."""
        return self._spec

    @property
    def weight_version(self) -> int:
        """Version of the weights now loaded (0: the seed's initial weights)."""
        return self._weight_version

    @property
    def model(self) -> PreTrainedModel:
        """The engine's model. Use it only while no request runs (e.g. for inspection)."""
        return self._model

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        stop_after: int | None = None,
        eos_id: int | Collection[int] | None = None,
    ) -> Generation:
        """Sample up to ``max_new_tokens`` tokens after ``prompt_ids``.

        Sampling draws from a ``torch.Generator`` seeded with ``seed`` (``temperature`` 0 is
        greedy), so a request is reproducible for given weights and the same prefix-cache
        content: a prompt that extends a kept one is prefilled in two passes, whose bf16
        numbers can pick other experts or tokens at near-ties than one pass would, as in
        an engine with prefix caching. ``stop_after`` interrupts
        after that many tokens with finish reason ``"abort"`` (a partial rollout to resume
        later); ``eos_id`` (one id or several) ends it with ``"stop"``.
        """
        prompt = self._check_request(prompt_ids, max_new_tokens, temperature, stop_after)
        _check_seed(seed)
        stops = self._stop_ids(eos_id)
        with self._lock:
            tokens, logprobs, finish, routing = self._decode(
                prompt, max_new_tokens, temperature, seed, stop_after, stops
            )
            if self._divergent is not None:
                full = self._full_forward_routing(prompt + tokens[:-1])
                self._divergent += _count_divergent(routing, full)
            self._generations += 1
            self._prompt_tokens += len(prompt)
            self._completion_tokens += len(tokens)
            version = self._weight_version
        assert routing.shape[0] == len(prompt) + len(tokens) - 1
        routing.setflags(write=False)
        return Generation(
            token_ids=tuple(tokens),
            logprobs=tuple(logprobs),
            routing=routing,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(tokens),
            weight_version=version,
        )

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy a full state dict (any precision, any device) into the engine's precision.

        ``version`` must exceed the current ``weight_version``; requests in flight finish
        on the old weights, later ones run on the new.
        """
        with self._lock:
            if version <= self._weight_version:
                raise MisuseError(
                    "weight versions must increase",
                    expected=f"> {self._weight_version}",
                    found=version,
                    where="ReferenceEngine.load_weights",
                )
            try:
                self._model.load_state_dict(dict(state_dict), strict=True)
            except RuntimeError as exc:  # torch reports missing/unexpected keys and shapes so
                raise MisuseError(
                    "the state dict does not fit the engine's model",
                    expected=f"the {len(self._model.state_dict())} tensors of build_model(config)",
                    found=str(exc).splitlines()[0][:300],
                    where="ReferenceEngine.load_weights",
                ) from exc
            self._weight_version = version
            self._prefills.clear()  # cached prefills belong to the old weights

    def stats(self) -> EngineStats:
        """Counters so far."""
        with self._lock:
            return EngineStats(
                generations=self._generations,
                prompt_tokens=self._prompt_tokens,
                cached_prompt_tokens=self._cached_tokens,
                completion_tokens=self._completion_tokens,
                full_forward_divergent_rows=self._divergent,
                weight_version=self._weight_version,
            )

    # ------------------------------------------------------------------ internals

    def _decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        stop_after: int | None,
        stops: frozenset[int],
    ) -> tuple[list[int], list[float], str, npt.NDArray[np.unsignedinteger]]:
        model = self._model
        generator = torch.Generator().manual_seed(seed)
        limit = max_new_tokens if stop_after is None else min(stop_after, max_new_tokens)
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        with torch.inference_mode():
            prefill = self._prefill(prompt)
            cache, logits = copy.deepcopy(prefill.cache), prefill.logits
            with record(model) as recorder:
                while True:
                    token = _sample(logits, temperature, generator)
                    tokens.append(token)
                    logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
                    if token in stops:
                        finish = "stop"
                        break
                    if len(tokens) >= limit:
                        finish = "length" if len(tokens) >= max_new_tokens else "abort"
                        break
                    step_input = torch.tensor([[token]], dtype=torch.long)
                    out = model(input_ids=step_input, cache=cache, use_cache=True)
                    logits = out.logits[0, -1].float()
                # One row per token fed back; the last sampled token never was: with the
                # prefill's P rows, P + C - 1 rows.
                decoded = recorder.routes() if len(tokens) > 1 else prefill.routing[:0]
        return tokens, logprobs, finish, np.concatenate([prefill.routing, decoded])

    def _prefill(self, prompt: list[int]) -> _Prefill:
        """The prompt's prefill, from the prefix cache or computed (and kept): a prompt
        that extends a kept one (a later turn, a resume) computes only its new tokens."""
        key = (self._weight_version, tuple(prompt))
        kept = self._prefills.get(key)
        if kept is not None:
            self._prefills.move_to_end(key)
            self._cached_tokens += len(prompt)
            return kept
        model, prefix = self._model, self._longest_kept_prefix(key)
        cache = DynamicCache(config=model.config) if prefix is None else copy.deepcopy(prefix.cache)
        done = 0 if prefix is None else prefix.routing.shape[0]  # one row per kept token
        self._cached_tokens += done
        with record(model) as recorder:
            new = torch.tensor([prompt[done:]], dtype=torch.long)
            out = model(input_ids=new, cache=cache, use_cache=True, logits_to_keep=1)
            routing = recorder.routes()
        if prefix is not None:  # the kept rows, as the first request's pass chose them
            routing = np.concatenate([prefix.routing, routing])
        routing.setflags(write=False)
        kept = _Prefill(cache=cache, logits=out.logits[0, -1].float(), routing=routing)
        self._prefills[key] = kept
        while len(self._prefills) > _PREFIXES_KEPT:
            self._prefills.popitem(last=False)
        return kept

    def _longest_kept_prefix(self, key: tuple[int, tuple[int, ...]]) -> _Prefill | None:
        """The kept prefill of the longest prompt that ``key``'s prompt starts with (same
        weights), as an engine's prefix cache finds it; None when there is none."""
        version, prompt = key
        best: tuple[int, ...] = ()
        for kept_version, kept_prompt in self._prefills:
            longer = len(best) < len(kept_prompt) < len(prompt)
            if kept_version == version and longer and prompt[: len(kept_prompt)] == kept_prompt:
                best = kept_prompt
        if not best:
            return None
        self._prefills.move_to_end((version, best))
        return self._prefills[(version, best)]

    def _full_forward_routing(self, ids: list[int]) -> npt.NDArray[np.unsignedinteger]:
        with torch.inference_mode(), record(self._model) as recorder:
            self._model(
                input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False, logits_to_keep=1
            )
            return recorder.routes()

    def _check_request(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float,
        stop_after: int | None,
    ) -> list[int]:
        where = "ReferenceEngine.generate"
        vocab = self._config.vocab_size
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise MisuseError("the prompt is empty", expected=">= 1 token", found=0, where=where)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise MisuseError(
                "prompt token ids outside the vocabulary",
                expected=f"ids in [0, {vocab})",
                found=bad[:8],
                where=where,
            )
        if isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise MisuseError(
                "max_new_tokens must be positive",
                expected=">= 1",
                found=max_new_tokens,
                where=where,
            )
        room = self._config.max_positions - len(prompt)
        if max_new_tokens > room:
            raise MisuseError(
                "prompt + max_new_tokens exceeds the model's positions",
                expected=f"max_new_tokens <= {room} for a {len(prompt)}-token prompt",
                found=max_new_tokens,
                where=where,
                hint="Raise EngineConfig.max_positions or shorten the request.",
            )
        if not 0.0 <= temperature < math.inf:  # also refuses NaN
            raise MisuseError(
                "temperature must be finite and >= 0 (0 is greedy)",
                expected="0 <= temperature < inf",
                found=temperature,
                where=where,
            )
        if stop_after is not None and stop_after < 1:
            raise MisuseError(
                "stop_after must be positive",
                expected=">= 1 or None",
                found=stop_after,
                where=where,
            )
        return prompt

    def _stop_ids(self, eos_id: int | Collection[int] | None) -> frozenset[int]:
        ids = (
            frozenset()
            if eos_id is None
            else frozenset((eos_id,) if isinstance(eos_id, int) else (int(t) for t in eos_id))
        )
        vocab = self._config.vocab_size
        bad = sorted(t for t in ids if not 0 <= t < vocab)
        if bad:
            raise MisuseError(
                "stop token ids outside the vocabulary",
                expected=f"ids in [0, {vocab})",
                found=bad[:8],
                where="ReferenceEngine.generate",
            )
        return ids


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Prefill:
    """A prompt's prefill: what decoding continues from (the cache is copied per use)."""

    cache: DynamicCache
    """KV cache after the prompt."""
    logits: torch.Tensor
    """Logits of the prompt's last position (the first sampled token's)."""
    routing: npt.NDArray[np.unsignedinteger]
    """The prompt's ``P`` routing rows."""


def _count_divergent(a: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger]) -> int:
    # (row, layer) pairs whose expert *sets* differ: the order inside a top-k row carries
    # no meaning for replay.
    return int((np.sort(a, axis=2) != np.sort(b, axis=2)).any(axis=2).sum())


SEED_RANGE: Final = range(-(2**63), 2**64)
"""Seeds ``torch.Generator.manual_seed`` accepts."""


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed not in SEED_RANGE:
        raise MisuseError(
            "seed must be a 64-bit integer",
            expected="an int in [-2**63, 2**64)",
            found=seed,
            where="ReferenceEngine.generate",
        )


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if not bool(torch.isfinite(scaled).all()):
        # A tiny temperature overflows logits / T (inf / inf = NaN probabilities). Shift by
        # the max in float64 first: every scaled logit is then <= 0, the best exactly 0,
        # the rest -inf or finite, so the distribution is the T -> 0 limit it should be.
        scaled = (logits.double() - logits.max().double()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
