"""The reference engine: weights, generation, routing, precision, and every wire over HTTP.

The routing an engine reports must be what its routers chose in the passes that produced
the tokens (the prefill's prompt rows, then one row per KV-cache decode step), as a real
engine captures it; each wire format must decode (``read_response``) back to exactly that
routing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
DynamicCache = transformers.DynamicCache
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from routeplay.core import read_response  # noqa: E402
from routeplay.core.wires import wire as wire_format  # noqa: E402
from routeplay.engine import (  # noqa: E402
    WIRES,
    EngineConfig,
    EngineServer,
    ReferenceEngine,
    WireHandler,
    build_model,
)
from routeplay.errors import MisuseError  # noqa: E402
from routeplay.train.hf import model_spec, record, replay  # noqa: E402

TINY = EngineConfig(hidden_size=32, num_layers=2, num_experts=8, top_k=2, vocab_size=64, seed=7)
# Deep and wide enough that a full forward and the KV-cache decode pick other experts on a
# few (token, layer) pairs (2 of 428 for PROMPT, 100 tokens, seed 1), as real engines do.
DEEPER = EngineConfig(hidden_size=32, num_layers=4, num_experts=16, top_k=4, vocab_size=64, seed=7)
PROMPT = [5, 9, 17, 3, 44, 8, 21, 60]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads; spinning OpenMP workers slow them down.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TINY)


def _full_forward_routing(model: Any, ids: list[int]) -> np.ndarray:
    with torch.inference_mode(), record(model) as recorder:
        model(input_ids=torch.tensor([ids]))
        return recorder.routes()


# --------------------------------------------------------------------------- model


def test_same_seed_gives_the_same_weights_in_any_precision() -> None:
    full = build_model(TINY, dtype="float32")
    half = build_model(TINY)  # the config's bfloat16
    assert half.dtype == torch.bfloat16
    assert full.dtype == torch.float32
    pairs = list(zip(full.state_dict().items(), half.state_dict().items(), strict=True))
    assert pairs
    for (name, a), (other, b) in pairs:
        assert name == other
        assert torch.equal(a.to(torch.bfloat16), b), name
    reseeded = build_model(EngineConfig(hidden_size=32, vocab_size=64, seed=8), dtype="float32")
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(reseeded.state_dict()[gate], full.state_dict()[gate])


def test_build_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(TINY)
    assert torch.equal(torch.rand(3), expected)


def test_the_model_is_an_eval_mode_qwen3_moe_with_the_configured_geometry() -> None:
    model = build_model(TINY)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not model.training
    spec = model_spec(model)
    assert (spec.num_layers, spec.top_k, spec.num_experts) == (2, 2, 8)


def test_bad_configs_are_refused() -> None:
    with pytest.raises(MisuseError, match="top_k"):
        EngineConfig(num_experts=2, top_k=3)
    with pytest.raises(MisuseError, match="precision"):
        EngineConfig(dtype="bf15")


# --------------------------------------------------------------------------- generation


def test_generation_is_deterministic_for_a_seed(engine: ReferenceEngine) -> None:
    first = engine.generate(PROMPT, max_new_tokens=12, seed=3)
    again = engine.generate(PROMPT, max_new_tokens=12, seed=3)
    other = engine.generate(PROMPT, max_new_tokens=12, seed=4)
    assert first.token_ids == again.token_ids
    assert first.logprobs == again.logprobs
    assert np.array_equal(first.routing, again.routing)
    assert other.token_ids != first.token_ids
    greedy = [engine.generate(PROMPT, max_new_tokens=6, temperature=0.0, seed=s) for s in (1, 2)]
    assert greedy[0].token_ids == greedy[1].token_ids


def _step_by_step_routing(model: Any, prompt: list[int], fed: list[int]) -> np.ndarray:
    """The routing of a prefill over ``prompt``, then of feeding ``fed`` one token at a time."""
    rows = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        for step in [prompt] + [[token] for token in fed]:
            with record(model) as recorder:
                model(input_ids=torch.tensor([step]), cache=cache, use_cache=True)
                rows.append(recorder.routes())
    return np.concatenate(rows)


def test_two_engines_of_one_config_agree_bit_for_bit() -> None:
    first, second = ReferenceEngine(DEEPER), ReferenceEngine(DEEPER)
    a = first.generate(PROMPT, max_new_tokens=30, seed=9)
    b = second.generate(PROMPT, max_new_tokens=30, seed=9)
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs  # exact floats, not approximately
    assert np.array_equal(a.routing, b.routing)


def test_routing_is_what_the_prefill_and_each_decode_step_chose() -> None:
    engine = ReferenceEngine(DEEPER, compare_full_forward=True)
    gen = engine.generate(PROMPT, max_new_tokens=100, seed=1)
    prompt, completion = len(PROMPT), gen.completion_tokens
    assert (gen.prompt_tokens, completion, len(gen.token_ids)) == (prompt, 100, 100)
    assert gen.routing.shape == (prompt + completion - 1, 4, 4)
    assert gen.routing.dtype == engine.spec.dtype == np.uint8
    assert not gen.routing.flags.writeable
    fed = list(gen.token_ids[:-1])  # the last sampled token is never fed back
    # Row i is the routing of input token i: prompt rows from the prefill, then one per step.
    assert np.array_equal(gen.routing, _step_by_step_routing(engine.model, PROMPT, fed))
    # Not a full forward's routing: that one differs on a few rows, and the opt-in
    # diagnostic counts exactly those.
    full = _full_forward_routing(engine.model, PROMPT + fed)
    differ = (np.sort(full, axis=2) != np.sort(gen.routing, axis=2)).any(axis=2)
    assert int(differ.sum()) > 0
    assert engine.stats().full_forward_divergent_rows == int(differ.sum())
    assert ReferenceEngine(TINY).stats().full_forward_divergent_rows is None  # off by default
    assert len(gen.logprobs) == completion
    assert all(lp <= 0.0 for lp in gen.logprobs)


def test_replaying_the_routing_in_a_full_forward_gives_the_engine_logprobs() -> None:
    engine = ReferenceEngine(DEEPER)
    gen = engine.generate(PROMPT, max_new_tokens=60, seed=4)
    ids = torch.tensor([PROMPT + list(gen.token_ids[:-1])])
    with torch.inference_mode(), replay(engine.model, gen.routing) as source:
        logits = engine.model(input_ids=ids).logits[0, len(PROMPT) - 1 :].float()
    assert source.stats().calls == DEEPER.num_layers
    replayed = torch.log_softmax(logits, dim=-1)[torch.arange(60), torch.tensor(gen.token_ids)]
    # Same experts on every row; only bf16 kernel shapes differ between decode and forward.
    assert np.allclose(replayed.numpy(), np.array(gen.logprobs), atol=1e-2)


def test_bf16_engine_and_fp32_trainer_pick_different_experts(engine: ReferenceEngine) -> None:
    # The premise of routing replay: same weights, other precision, other experts for some
    # (token, layer). Measured here: 2 of 430 on this config, about 1.4% on the default one.
    gen = engine.generate(PROMPT, max_new_tokens=200, seed=1)
    trainer = build_model(TINY, dtype="float32")
    theirs = _full_forward_routing(trainer, PROMPT + list(gen.token_ids[:-1]))
    differ = (np.sort(theirs, axis=2) != np.sort(gen.routing, axis=2)).any(axis=2)
    assert theirs.shape == gen.routing.shape
    assert 0 < int(differ.sum()) < differ.size // 10


def test_stop_after_aborts_a_partial_rollout(engine: ReferenceEngine) -> None:
    whole = engine.generate(PROMPT, max_new_tokens=10, seed=2)
    part = engine.generate(PROMPT, max_new_tokens=10, seed=2, stop_after=4)
    assert whole.finish_reason == "length"
    assert part.finish_reason == "abort"
    assert part.token_ids == whole.token_ids[:4]
    assert part.routing.shape[0] == len(PROMPT) + 4 - 1
    capped = engine.generate(PROMPT, max_new_tokens=4, seed=2, stop_after=9)
    assert capped.finish_reason == "length"


def test_a_sampled_stop_token_ends_the_generation(engine: ReferenceEngine) -> None:
    whole = engine.generate(PROMPT, max_new_tokens=10, seed=2)
    stop = whole.token_ids[3]
    first = whole.token_ids.index(stop)
    ended = engine.generate(PROMPT, max_new_tokens=10, seed=2, eos_id=stop)
    assert ended.finish_reason == "stop"
    assert ended.token_ids == whole.token_ids[: first + 1]
    assert ended.routing.shape[0] == len(PROMPT) + first


def test_load_weights_bumps_the_version_and_changes_outputs() -> None:
    engine = ReferenceEngine(TINY)
    before = engine.generate(PROMPT, max_new_tokens=16, seed=0)
    trainer = build_model(TINY, dtype="float32")
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine.load_weights(trainer.state_dict(), version=1)
    after = engine.generate(PROMPT, max_new_tokens=16, seed=0)
    assert (before.weight_version, after.weight_version, engine.weight_version) == (0, 1, 1)
    assert after.token_ids != before.token_ids or not np.array_equal(after.routing, before.routing)
    gate = "model.layers.0.mlp.gate.weight"
    loaded = engine.model.state_dict()[gate]
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded, trainer.state_dict()[gate].to(torch.bfloat16))
    with pytest.raises(MisuseError, match="increase"):
        engine.load_weights(trainer.state_dict(), version=1)
    with pytest.raises(MisuseError, match="does not fit"):
        engine.load_weights({gate: trainer.state_dict()[gate]}, version=2)
    assert engine.weight_version == 1


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ([], {"max_new_tokens": 3}, "empty"),
        ([1, 64], {"max_new_tokens": 3}, "vocabulary"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], {"max_new_tokens": 5000}, "positions"),
        ([1, 2], {"max_new_tokens": 3, "temperature": -1.0}, "temperature"),
        ([1, 2], {"max_new_tokens": 3, "stop_after": 0}, "stop_after"),
        ([1, 2], {"max_new_tokens": 3, "eos_id": 99}, "stop token"),
    ],
)
def test_bad_requests_are_refused(
    engine: ReferenceEngine, prompt: list[int], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(MisuseError, match=match):
        engine.generate(prompt, **kwargs)


def test_concurrent_requests_match_sequential_ones(engine: ReferenceEngine) -> None:
    expected = {s: engine.generate(PROMPT, max_new_tokens=8, seed=s).token_ids for s in range(4)}
    found: dict[int, tuple[int, ...]] = {}

    def run(seed: int) -> None:
        found[seed] = engine.generate(PROMPT, max_new_tokens=8, seed=seed).token_ids

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == expected


def test_another_moe_family_builds_and_generates() -> None:
    engine = ReferenceEngine(EngineConfig(model_type="mixtral", hidden_size=32, vocab_size=64))
    gen = engine.generate(PROMPT, max_new_tokens=5)
    assert gen.routing.shape == (len(PROMPT) + 4, 2, 2)


# --------------------------------------------------------------------------- wire formats


class _FakePut:
    """``put.remote(array) -> key``, as the in-process engine store answers."""

    def __init__(self) -> None:
        self.stored: dict[str, np.ndarray] = {}

    def remote(self, array: np.ndarray) -> str:
        key = f"{len(self.stored) + 1:056x}"
        self.stored[key] = array.copy()
        return key


class _FakeEngineStore:
    def __init__(self) -> None:
        self.put = _FakePut()


def _request(wire: str, prompt: list[int], start: int = 0, **sampling: Any) -> dict[str, Any]:
    if wire == "vllm":
        return {"prompt": prompt, "routed_experts_prompt_start": start, **sampling}
    if wire == "sglang":
        params = {"max_new_tokens": sampling.pop("max_tokens"), **sampling}
        return {
            "input_ids": prompt,
            "sampling_params": params,
            "return_routed_experts": True,
            "routed_experts_start_len": start,
        }
    return {"input_ids": prompt, "return_routed_experts": True, **sampling}


# LMDeploy always sends every row; vLLM and SGLang can omit a known prefix.
WIRE_CASES = [(wire, 0) for wire in WIRES] + [("vllm", 5), ("sglang", 5)]


@pytest.mark.parametrize(("wire", "start"), WIRE_CASES)
def test_each_wire_over_http_decodes_to_the_generation_routing(
    engine: ReferenceEngine, wire: str, start: int
) -> None:
    store = _FakeEngineStore() if wire == "lmdeploy-key" else None
    with EngineServer(engine, wire, engine_store=store) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        body = _request(wire, PROMPT, start, max_tokens=9, seed=11, temperature=0.8)
        response = httpx.post(server.endpoint, json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    payload = response.json()
    expected = engine.generate(PROMPT, max_new_tokens=9, seed=11, temperature=0.8)
    read = read_response(wire_format(wire).engine, payload, engine.spec, start_row=start)
    assert (read.prompt_tokens, read.completion_tokens) == (len(PROMPT), 9)
    if store is not None:
        assert read.key is not None
        assert read.routes is None
        wire_array = store.put.stored[read.key.key]
        assert wire_array.dtype == np.uint16
        assert read.key.rows == expected.routing.shape[0]
        assert np.array_equal(wire_array, expected.routing)
    else:
        assert read.routes is not None
        assert read.routes.start_row == start
        assert np.array_equal(read.routes.array, expected.routing[start:])
    tokens = {
        "vllm": lambda b: b["choices"][0]["token_ids"],
    }.get(wire, lambda b: b["output_ids"])(payload)  # SGLang's and LMDeploy's /generate
    assert tuple(tokens) == expected.token_ids


def test_sglang_follow_up_turn_sends_only_new_rows(engine: ReferenceEngine) -> None:
    with EngineServer(engine, "sglang") as server:
        first = httpx.post(server.endpoint, json=_request("sglang", PROMPT, max_tokens=6)).json()
        history = len(PROMPT) + 6 - 1
        context = PROMPT + first["output_ids"] + [30, 31]
        body = _request("sglang", context, start=history, max_tokens=5, stop_after=3)
        second = httpx.post(server.endpoint, json=body).json()
    assert second["meta_info"]["finish_reason"]["type"] == "abort"
    assert "routed_experts_start_len" not in second["meta_info"]  # SGLang never echoes it
    read = read_response("sglang", second, engine.spec, start_row=history)
    assert read.routes is not None
    assert (read.routes.start_row, read.routes.stop_row) == (history, len(context) + 3 - 1)
    full = engine.generate(context, max_new_tokens=5, stop_after=3)
    assert np.array_equal(read.routes.array, full.routing[history:])


def test_the_in_process_handler_answers_like_the_server(engine: ReferenceEngine) -> None:
    handler = WireHandler(engine, "lmdeploy-inline")
    body = handler(_request("lmdeploy-inline", PROMPT, max_tokens=4))
    read = read_response("lmdeploy", body, engine.spec)
    assert read.routes is not None
    assert np.array_equal(read.routes.array, engine.generate(PROMPT, max_new_tokens=4).routing)
    assert handler.stats().requests == 1


@pytest.mark.parametrize(
    ("wire", "body"),
    [
        ("vllm", {"prompt": "a text prompt", "max_tokens": 3}),
        ("vllm", {"prompt": [1, 2], "max_tokens": 3, "routed_experts_prompt_start": 3}),
        ("sglang", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}),
        ("lmdeploy-inline", {"input_ids": [1, 999], "max_tokens": 3}),
        ("lmdeploy-inline", {"input_ids": [1, True], "max_tokens": 3}),
        ("lmdeploy-inline", [1, 2, 3]),
    ],
)
def test_bad_http_requests_get_400_with_a_json_error(
    engine: ReferenceEngine, wire: str, body: Any
) -> None:
    with EngineServer(engine, wire) as server:
        response = httpx.post(server.endpoint, json=body)
        garbled = httpx.post(server.endpoint, content=b"{not json")
        assert server.stats().refused == 1
    for answer in (response, garbled):
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "MisuseError"


def test_the_server_binds_loopback_only_and_checks_its_wire(engine: ReferenceEngine) -> None:
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(MisuseError, match="loopback"):
            EngineServer(engine, "vllm", host=host)
    with pytest.raises(MisuseError, match="loopback"):
        EngineServer(engine, "vllm", host="0.0.0.0", allow_remote=True)
    with pytest.raises(MisuseError, match="wire"):
        EngineServer(engine, "trtllm")
    with pytest.raises(MisuseError, match="engine store"):
        EngineServer(engine, "lmdeploy-key")
    server = EngineServer(engine, "vllm")
    server.close()
    server.close()  # idempotent
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2.0)


def test_a_repeated_prompt_reuses_its_prefill_exactly_and_new_weights_do_not() -> None:
    cached, fresh = ReferenceEngine(DEEPER), ReferenceEngine(DEEPER)
    prompt = list(range(3, 40))
    first = cached.generate(prompt, max_new_tokens=5, seed=1)
    again = cached.generate(prompt, max_new_tokens=5, seed=2)  # served from the prefix cache
    alone = fresh.generate(prompt, max_new_tokens=5, seed=2)  # the same request, computed
    assert again.token_ids == alone.token_ids
    assert again.logprobs == pytest.approx(alone.logprobs, abs=0.0)
    np.testing.assert_array_equal(again.routing, alone.routing)
    np.testing.assert_array_equal(again.routing[: len(prompt)], first.routing[: len(prompt)])
    # New weights: the cached prefill is gone, the prompt's rows are recomputed by them.
    weights = {k: v * 1.5 for k, v in build_model(DEEPER, dtype="float32").state_dict().items()}
    cached.load_weights(weights, version=1)
    fresh.load_weights(weights, version=1)
    after, expected = (e.generate(prompt, max_new_tokens=2, seed=3) for e in (cached, fresh))
    np.testing.assert_array_equal(after.routing, expected.routing)
    assert not np.array_equal(after.routing[: len(prompt)], first.routing[: len(prompt)])


def test_a_prompt_extending_a_kept_one_computes_only_its_new_tokens() -> None:
    # A session's next turn: the first prompt, its answer and a tool's output.
    engine, fresh = ReferenceEngine(DEEPER), ReferenceEngine(DEEPER)
    first = engine.generate(PROMPT, max_new_tokens=6, seed=1)
    turn = PROMPT + list(first.token_ids) + [11, 12, 13, 14, 15]
    fed_lengths: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _, args, kwargs: fed_lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    second = engine.generate(turn, max_new_tokens=4, seed=2)
    hook.remove()
    assert fed_lengths == [len(turn) - len(PROMPT), 1, 1, 1]  # the new tokens, then decode
    assert engine.stats().cached_prompt_tokens == len(PROMPT)
    # The kept prefill was extended on a copy: the first prompt is served as before.
    again = engine.generate(PROMPT, max_new_tokens=6, seed=1)
    assert (again.token_ids, again.logprobs) == (first.token_ids, first.logprobs)
    np.testing.assert_array_equal(again.routing, first.routing)
    # Its first rows are the first request's prefill rows; the rest are one pass over the
    # new tokens from the kept KV cache (a chunked prefill), then the decode.
    np.testing.assert_array_equal(second.routing[: len(PROMPT)], first.routing[: len(PROMPT)])
    new, fed = turn[len(PROMPT) :], list(second.token_ids[:-1])
    rows = []
    with torch.inference_mode():
        cache = DynamicCache(config=engine.model.config)
        for step in [PROMPT, new] + [[token] for token in fed]:
            with record(engine.model) as recorder:
                engine.model(input_ids=torch.tensor([step]), cache=cache, use_cache=True)
                rows.append(recorder.routes())
    np.testing.assert_array_equal(second.routing, np.concatenate(rows))
    # Another engine computes the whole prompt: same tokens asked, none cached.
    alone = fresh.generate(turn, max_new_tokens=4, seed=2)
    assert alone.routing.shape == second.routing.shape
    assert fresh.stats().cached_prompt_tokens == 0
    # A prompt that only shares a beginning with a kept one (not all of it) is computed.
    engine.generate([*PROMPT[:-1], 63], max_new_tokens=2, seed=3)
    assert engine.stats().cached_prompt_tokens == 2 * len(PROMPT)  # the repeat above only
