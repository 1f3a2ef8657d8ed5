"""What ``docs/xtuner.md`` runs against besides XTuner's own classes: a BPE tokenizer
trained here (no download), an LMDeploy server answering from LMDeploy 0.18's own code,
XTuner's ``LMDeployWorker`` without its GPU server, and XTuner's trace-store actor class
served in this process.

Only the parts that need a GPU, a port or a model are stood in for; each stand-in says
what of the partner's code it runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import ray
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from routeplay.core import RouteSpec
from routeplay.core.wires import wire_layers

SPECIAL = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n",
    "<|im_start|>user\nAnd 7*6?<|im_end|>\n<|im_start|>assistant\nThat is 42.<|im_end|>\n",
    "The answer is four. The sum of two and two is four. More please, one more time.",
    "Sure, here is more: the answer is 42, and the question is 7 times 6.",
)


def build_bpe_tokenizer(folder: Path) -> Path:
    """A byte-level BPE (300 ids) trained on a few chat lines, saved as a transformers
    tokenizer with a chat template, so ``AutoTokenizer.from_pretrained(folder)`` loads it
    as XTuner's SessionServer and rollout worker load a model's."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(CORPUS) * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL[1],
        pad_token=SPECIAL[1],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(folder))
    return folder


def true_routing(tokens: Sequence[int], spec: RouteSpec) -> npt.NDArray[np.uint8]:
    """The toy engine's routing of ``tokens``: row ``i`` depends on the tokens up to ``i``
    only, so a resume or a later turn routes the rows it shares the same way and a check
    knows every sample's exact rows. Ids of a row are distinct."""
    ids = np.asarray(tokens[:-1], dtype=np.int64)
    base = (np.arange(len(ids)) * 7 + ids * 3)[:, None, None]
    layers = 5 * np.arange(spec.num_layers)[None, :, None]
    return ((base + layers + np.arange(spec.top_k)) % spec.num_experts).astype(np.uint8)


class LmdeployServer:
    """LMDeploy's API server with the Ray executor, as XTuner's worker and SessionServer
    reach it: ``/generate`` and ``/v1/chat/completions`` answer LMDeploy 0.18's own
    protocol models (``GenerateReqOutput``, ``ChatCompletionResponse``); the routing of
    every decoder layer goes through LMDeploy's own ``EngineInstance._get_extra_outputs``
    into the ``shared_store`` actor (routeplay's engine store, started under that name)
    and the body names its key.

    The model: ``answer`` (a text) when given, else a deterministic function of the
    context, emitted one byte token at a time (a sampled sequence need not be the
    tokenizer's own encoding of its text); ``abort_after`` aborts every request still
    running after that many new tokens, as XTuner's controller does for partial rollout."""

    def __init__(self, spec: Callable[[], RouteSpec], tokenizer: Any) -> None:
        from lmdeploy.pytorch.engine import engine_instance

        self._spec, self.tokenizer = spec, tokenizer
        self.eos = int(tokenizer.convert_tokens_to_ids(SPECIAL[1]))
        self.abort_after: int | None = None
        self.answers: list[str] = []
        self._engine_instance = engine_instance

    @property
    def spec(self) -> RouteSpec:
        """The model's geometry (read when first needed: the page computes it)."""
        return self._spec()

    def routing(self, tokens: Sequence[int]) -> npt.NDArray[np.uint8]:
        """What this engine routed for ``tokens`` (rows ``[0, len(tokens) - 1)``)."""
        return true_routing(tokens, self.spec)

    def transport(self) -> httpx.MockTransport:
        """The server behind an ``httpx`` client (XTuner's worker posts with one)."""
        return httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        import json

        payload = json.loads(request.content)
        if request.url.path.endswith("/generate"):
            return httpx.Response(200, json=self.generate(payload))
        return httpx.Response(200, json=self.chat(payload))

    def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST ``/generate`` (``GenerateReqInput`` in, ``GenerateReqOutput`` out)."""
        from lmdeploy.serve.openai.protocol import GenerateReqMetaOutput, GenerateReqOutput

        context = list(payload["input_ids"])
        seed = int(payload.get("sampling_seed") or 0)
        ids, logprobs, reason = self._decode(context, int(payload["max_tokens"]), seed)
        meta = GenerateReqMetaOutput(
            prompt_tokens=len(context),
            completion_tokens=len(ids),
            finish_reason={"type": reason},
            output_token_logprobs=[[lp, t] for lp, t in zip(logprobs, ids, strict=True)],
            routed_experts=self._capture(context + ids),
        )
        text = self.tokenizer.decode(ids)
        return GenerateReqOutput(text=text, output_ids=ids, meta_info=meta).model_dump()

    def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST ``/v1/chat/completions`` with ``input_ids`` (XTuner's SessionServer sends
        them and ``include_stop_str_in_output``): the choice carries ``output_ids``,
        ``output_token_logprobs`` and ``routed_experts``."""
        from lmdeploy.serve.openai.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatMessage,
            UsageInfo,
        )

        context = list(payload["input_ids"])
        ids, logprobs, reason = self._decode(context, int(payload.get("max_tokens") or 32), 0)
        choice = ChatCompletionResponseChoice(
            index=0,
            message=ChatMessage(role="assistant", content=self.tokenizer.decode(ids)),
            finish_reason=reason,
            output_ids=ids,
            output_token_logprobs=[[lp, t] for lp, t in zip(logprobs, ids, strict=True)],
            routed_experts=self._capture(context + ids),
        )
        usage = UsageInfo(
            prompt_tokens=len(context),
            completion_tokens=len(ids),
            total_tokens=len(context) + len(ids),
        )
        body = ChatCompletionResponse(model="tiny", choices=[choice], usage=usage)
        return body.model_dump()

    def _decode(
        self, context: list[int], max_tokens: int, seed: int
    ) -> tuple[list[int], list[float], str]:
        if self.answers:
            # One byte token per character: a sequence the tokenizer encodes otherwise.
            ids = [
                self.tokenizer.convert_tokens_to_ids(t) for t in self._bytes(self.answers.pop(0))
            ]
            ids.append(self.eos)
            return ids, [-0.5] * len(ids), "stop"
        ids: list[int] = []
        while len(ids) < max_tokens:
            if self.abort_after is not None and len(ids) == self.abort_after:
                return ids, [-0.5] * len(ids), "abort"
            h = (seed * 1_000_006 + len(context) * 7_919 + context[-1] * 31) % 2**31
            token = self.eos if h % 5 == 0 and ids else 30 + h % 60
            ids.append(token)
            context = [*context, token]
            if token == self.eos:
                return ids, [-0.5] * len(ids), "stop"
        return ids, [-0.5] * len(ids), "length"

    def _bytes(self, text: str) -> list[str]:
        return [t for ch in text for t in self.tokenizer.tokenize(ch)]

    def _capture(self, tokens: list[int]) -> str:
        """LMDeploy's engine finishing the request: every decoder layer's routing, one row
        per token, cut to ``tokens - 1`` rows and put into ``shared_store`` by LMDeploy's
        own code; the key goes into the body."""
        from lmdeploy.messages import ResponseType
        from lmdeploy.pytorch.engine.request import Response

        engine = self._engine_instance
        engine._lazy_create_ray_store()
        rows = wire_layers(true_routing([*tokens, 0], self.spec), self.spec, "uint16")
        response = Response(
            type=ResponseType.FINISH, sender_id=0, event=None, data={"routed_experts": rows}
        )
        instance = SimpleNamespace(_enable_transfer_obj_ref=True)
        outputs = engine.EngineInstance._get_extra_outputs(instance, response, len(tokens))
        return str(outputs["routed_experts"])


def xtuner_lmdeploy_worker(server: LmdeployServer, tokenizer: Any) -> Any:
    """XTuner's own ``LMDeployWorker`` without its GPU server: the attributes its
    ``__init__`` sets, its HTTP client sending to ``server``, partial rollout on."""
    from xtuner.v1.rl.rollout.lmdeploy import LMDeployWorker
    from xtuner.v1.rl.rollout.utils import PartialRolloutHandler
    from xtuner.v1.utils import get_logger

    worker = LMDeployWorker.__new__(LMDeployWorker)
    worker.config = SimpleNamespace(max_retry_per_sample=1, api_key="", rollout_timeout=60)
    worker.rank = 0
    worker.server_url = "http://lmdeploy"
    worker.endpoints = {"generate": "generate", "v1/chat/completions": "v1/chat/completions"}
    worker.client = httpx.AsyncClient(transport=server.transport())
    worker.logger = get_logger()
    worker.tokenizer = tokenizer
    worker.model_name = "tiny"
    worker.eos_token = [server.eos]
    worker.receive_abort_request = threading.Event()
    worker.enable_return_routed_experts = True
    worker.enable_partial_rollout = True
    worker.partial_rollout_handler = PartialRolloutHandler()
    worker.lmdeploy_actor = None
    return worker


class Submitted:
    """What ``handle.method.remote(...)`` returns: the call already made (as Ray submits
    it at once), its result awaitable or dropped."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def __await__(self) -> Any:
        yield from asyncio.sleep(0).__await__()
        return self._result


class InProcessActor:
    """An actor handle's face over a plain object in this process: ``h.m.remote(*args)``
    runs ``m`` now on copies of the arguments and gives a copy of its result, pickled as
    a Ray actor call pickles them (so a lease in a node value crosses as a copy)."""

    def __init__(self, instance: Any) -> None:
        self._instance = instance

    def __getattr__(self, name: str) -> SimpleNamespace:
        method: Callable[..., Any] = getattr(self._instance, name)

        def remote(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            args, kwargs = _copy((args, kwargs))
            return Submitted(_copy(method(*args, **kwargs)))

        return SimpleNamespace(remote=remote)


def _copy(value: Any) -> Any:
    return ray.cloudpickle.loads(ray.cloudpickle.dumps(value))
