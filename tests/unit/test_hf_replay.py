"""Router replay on tiny random transformers MoE models, one per covered family.

For every family: replaying a forward's own routing reproduces its weights and logits
exactly; replaying other routing makes the experts get exactly those ids and changes the
logits; gradients reach the gate; checkpoint recompute replays the same experts.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from routeplay.core.spec import RouteSpec  # noqa: E402
from routeplay.core.validate import canonicalize  # noqa: E402
from routeplay.errors import (  # noqa: E402
    DuplicateExperts,
    ExpertOutOfRange,
    ReplayNotApplied,
    RowCountMismatch,
    SpecMismatch,
)
from routeplay.train.hf import RouterSite, find_routers, model_spec, record, replay  # noqa: E402
from routeplay.train.routers import DENSE_SCORES, FAMILIES  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a busy machine spinning
    # OpenMP workers slow these tests down ~5x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


BATCH, SEQ, VOCAB = 2, 6, 64
TOKENS = BATCH * SEQ

BASE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "num_hidden_layers": 3,
    "max_position_embeddings": 64,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "head_dim": 4,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}
# model_type -> config overrides; every family in routeplay.train.routers.FAMILIES appears.
CASES: dict[str, dict[str, Any]] = {
    "qwen2_moe": {"norm_topk_prob": True},
    "qwen3_moe": {"norm_topk_prob": True},
    "qwen3_next": {},
    "olmoe": {},
    "flex_olmo": {},
    "qwen3_vl_moe_text": {},
    "qwen3_5_moe_text": {},
    "mixtral": {},
    "minimax": {},
    "hunyuan_v1_moe": {},
    "jamba": {"expert_layer_period": 1, "expert_layer_offset": 0},
    "ernie4_5_moe": {},
    "deepseek_v2": {**MLA, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5},
    "mistral4": {**MLA, "routed_scaling_factor": 2.0},
    "gemma4_text": {
        "enable_moe_block": True,
        "top_k_experts": 2,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": VOCAB,
        "global_head_dim": 8,
    },
    "dbrx": {
        "d_model": 32,
        "n_heads": 4,
        "n_layers": 3,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {
            "ffn_hidden_size": 16,
            "moe_num_experts": 8,
            "moe_top_k": 2,
            "moe_normalize_expert_weights": 2.0,
        },
    },
    "gpt_oss": {},
    "granitemoe": {},
    "granitemoeshared": {"shared_intermediate_size": 16},
    "cohere2_moe": {"expert_selection_fn": "sigmoid", "norm_topk_prob": True},
    "deepseek_v3": {**MLA, "routed_scaling_factor": 2.5},
    "glm4_moe": {
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5,
    },
    "glm4_moe_lite": {**MLA},
    "dots1": {
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.0,
    },
    "solar_open": {"routed_scaling_factor": 2.0, "norm_topk_prob": False},
    "exaone_moe": {},
    "mimo_v2_flash": {"routed_scaling_factor": 1.5},
    "minimax_m2": {},
    "laguna": {"moe_router_logit_softcapping": 2.0},
    "afmoe": {"route_scale": 1.7},
    "hy_v3": {},
    "lfm2_moe": {
        "num_dense_layers": 1,
        "routed_scaling_factor": 1.5,
        "layer_types": ["full_attention", "conv", "full_attention"],
    },
    "llama4_text": {"interleave_moe_layer_step": 1, "intermediate_size_mlp": 32},
}
MODEL_TYPES = sorted(CASES)

_MODELS: dict[str, Any] = {}


def tiny_model(model_type: str) -> Any:
    """A tiny random model of ``model_type`` in float32 eval mode (built once per session)."""
    if model_type not in _MODELS:
        config = transformers.AutoConfig.for_model(model_type, **{**BASE, **CASES[model_type]})
        torch.manual_seed(0)
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # text towers of multimodal families have no causal-LM head
            model = transformers.AutoModel.from_config(config)
        model.float().eval()
        _spread_routers(model)
        _MODELS[model_type] = model
    return _MODELS[model_type]


def _spread_routers(model: Any) -> None:
    # Zero-initialized gates (several families) tie every expert: give routers real logits,
    # and random selection biases, which must change the choice but never the weights.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for site in find_routers(model).sites:
            block = model.get_submodule(site.name.rpartition(".")[0])
            tensors = [
                *site.module.named_parameters(),
                *site.module.named_buffers(),
                *block.named_parameters(recurse=False),
                *block.named_buffers(recurse=False),
            ]
            for name, tensor in tensors:
                if "experts" in name or not tensor.is_floating_point():
                    continue
                if name.endswith(("weight", "scale")) or "bias" in name:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)


def inputs() -> Any:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def output(model: Any, ids: Any) -> Any:
    out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def random_routes(spec: RouteSpec, seed: int) -> Any:
    """Distinct random ids per (token, layer), canonical dtype, in the engine's form."""
    rng = np.random.default_rng(seed)
    keys = rng.random((TOKENS, spec.num_layers, spec.num_experts))
    ids = np.argsort(keys, axis=-1)[..., : spec.top_k]
    return canonicalize(ids.astype(np.int64), spec).array


@pytest.fixture(params=MODEL_TYPES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


class Observed:
    """The ids and weights every MoE layer's experts actually received, per forward."""

    def __init__(self, model: Any) -> None:
        self.calls: dict[int, list[tuple[Any, Any]]] = {}
        self._handles = [self._watch(model, site) for site in find_routers(model).sites]

    def _watch(self, model: Any, site: RouterSite) -> Any:
        layer = site.layer
        if site.family.layout is DENSE_SCORES:  # Llama-4 scales inputs by dense scores

            def dense(module: Any, args: Any, out: Any) -> None:
                scores = out[0]
                ids = torch.nonzero(scores > 0)[:, 1].reshape(scores.shape[0], -1)
                self.calls.setdefault(layer, []).append((ids, scores))

            return site.module.register_forward_hook(dense)
        parent = model.get_submodule(site.name.rpartition(".")[0])
        experts = getattr(site.module, "experts", None) or parent.experts

        def pre(module: Any, args: Any, kwargs: Any) -> None:
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            self.calls.setdefault(layer, []).append((ids.detach(), weights.detach()))

        return experts.register_forward_pre_hook(pre, with_kwargs=True)

    def last(self, layer: int) -> tuple[Any, Any]:
        return self.calls[layer][-1]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@pytest.fixture
def observed(model: Any) -> Iterator[Observed]:
    watcher = Observed(model)
    yield watcher
    watcher.close()


def sorted_ids(ids: Any) -> Any:
    return torch.sort(ids.reshape(TOKENS, -1), dim=-1).values


# --------------------------------------------------------------------------- coverage


def test_every_family_has_a_tiny_model() -> None:
    tested = {type(site.module).__name__ for t in MODEL_TYPES for site in _sites(t)}
    for family in FAMILIES:
        assert set(family.classes) <= tested, f"{family.name}: untested router classes"


def _sites(model_type: str) -> tuple[RouterSite, ...]:
    return find_routers(tiny_model(model_type)).sites


def test_router_map_matches_the_module_tree(model: Any) -> None:
    routers = find_routers(model)
    spec = routers.spec
    assert spec.top_k == 2
    assert spec.num_experts == 8
    assert [site.layer for site in routers.sites] == list(range(spec.num_layers))
    assert tuple(site.decoder_layer for site in routers.sites) == spec.moe_layer_indices()
    assert model_spec(model) == spec


# --------------------------------------------------------------------------- replay


def test_own_routing_reproduces_weights_and_logits_exactly(model: Any, observed: Observed) -> None:
    ids = inputs()
    with torch.no_grad(), record(model) as rec:
        native = output(model, ids)
    routes = rec.routes()
    spec = model_spec(model)
    assert routes.shape == (TOKENS, spec.num_layers, spec.top_k)
    assert routes.dtype == np.uint8
    with torch.no_grad(), replay(model, routes) as source:
        replayed = output(model, ids)
    assert source.stats().calls == spec.num_layers
    for layer in range(spec.num_layers):
        (native_ids, native_w), (ids_r, weights_r) = observed.calls[layer]
        assert torch.equal(native_ids, ids_r)
        assert weights_r.dtype == native_w.dtype
        assert torch.equal(native_w, weights_r), f"layer {layer}: weights differ"
    assert torch.equal(native, replayed)


def test_own_routing_reproduces_bfloat16_logits_exactly(model: Any) -> None:
    # Each rule mirrors its router's casts, so mixed precision is bit-exact too.
    half = copy.deepcopy(model).to(torch.bfloat16)
    ids = inputs()
    with torch.no_grad(), record(half) as rec:
        native = output(half, ids)
    with torch.no_grad(), replay(half, rec.routes()):
        replayed = output(half, ids)
    assert native.dtype == torch.bfloat16
    assert torch.equal(native, replayed)


def test_replayed_experts_are_the_given_ids(model: Any, observed: Observed) -> None:
    spec = model_spec(model)
    routes = random_routes(spec, seed=3)
    ids = inputs()
    with torch.no_grad():
        native = output(model, ids)
        with replay(model, routes), record(model) as rec:
            forced = output(model, ids)
    # What the routers handed on (Llama-4's dense scores keep the set, not the order).
    assert np.array_equal(np.sort(rec.routes(), axis=-1), np.sort(routes, axis=-1))
    for layer in range(spec.num_layers):
        used, _ = observed.last(layer)  # what the experts got
        want = torch.from_numpy(routes[:, layer, :].astype(np.int64))
        assert torch.equal(sorted_ids(used), torch.sort(want, dim=-1).values)
    assert not torch.allclose(native, forced)


def test_gradients_reach_every_gate(model: Any) -> None:
    spec = model_spec(model)
    model.zero_grad(set_to_none=True)
    with replay(model, random_routes(spec, seed=4)):
        output(model, inputs()).float().square().mean().backward()
    for site in find_routers(model).sites:
        gate = getattr(site.module, "router", site.module)  # DBRX hooks the block
        grads = [p.grad for p in gate.parameters() if p.requires_grad]
        assert grads, site.name
        assert all(g is not None and bool(g.abs().sum() > 0) for g in grads), site.name
    model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- checkpointing


def checkpointing_enable(model: Any) -> None:
    """HF activation checkpointing (non-reentrant: recompute runs inside the backward)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    (enable or model.gradient_checkpointing_enable)()


def checkpointing_disable(model: Any) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable or model.gradient_checkpointing_disable)()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpoint_recompute_replays_the_same_experts_with_drift_on(model_type: str) -> None:
    """Every family, under non-reentrant and reentrant activation checkpointing, with the
    drift meter on (the default): the recompute replays the forward's experts, the meter
    saves nothing for backward (torch compares what a forward and its recompute save:
    Llama 4's top-k on grad-tracked scores broke that), every parameter's gradient equals
    the run without checkpointing, and the drift figures are the same."""
    model = tiny_model(model_type)
    spec = model_spec(model)
    routes = random_routes(spec, seed=5)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(reentrant: bool | None) -> tuple[list[Any], Any, Any]:
        model.zero_grad(set_to_none=True)
        model.train()
        if reentrant is not None:
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        try:
            with replay(model, routes) as source:
                output(model, inputs()).square().mean().backward()
        finally:
            checkpointing_disable(model)
            model.eval()
        assert source.drift is not None  # drift is on by default
        found = [None if p.grad is None else p.grad.clone() for p in params]
        return found, source.stats(), source.drift.drift()

    plain, plain_stats, plain_drift = grads(None)
    assert plain_stats.recomputes == 0
    assert plain_drift.routes == spec.num_layers * TOKENS
    for reentrant in (False, True):
        checkpointed, stats, drift = grads(reentrant)
        assert stats.recomputes == spec.num_layers  # every MoE layer ran again in the backward
        assert drift == plain_drift  # each forward measured once, recomputes never
        for a, b in zip(plain, checkpointed, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    model.zero_grad(set_to_none=True)


def test_record_ignores_checkpoint_recompute() -> None:
    model = tiny_model("qwen3_moe")
    model.train()
    checkpointing_enable(model)
    try:
        with record(model) as rec:
            output(model, inputs()).square().mean().backward()
    finally:
        checkpointing_disable(model)
        model.eval()
        model.zero_grad(set_to_none=True)
    stats = rec.stats()
    assert stats.forwards == 1
    assert stats.skipped_recomputes == model_spec(model).num_layers


# --------------------------------------------------------------------------- modes and misuse


def test_r2_replays_the_recorded_tensor_without_a_host_trip() -> None:
    model = tiny_model("mixtral")
    ids = inputs()
    with torch.no_grad(), record(model) as rec:
        old = output(model, ids)
    with torch.no_grad(), replay(model, rec.tensor()):
        new = output(model, ids)
    assert torch.equal(old, new)


def test_record_keeps_one_array_per_forward() -> None:
    model = tiny_model("qwen3_moe")
    with torch.no_grad(), record(model) as rec:
        output(model, inputs())
        output(model, inputs()[:1, :3])
    first, second = rec.forwards()
    assert first.shape[0] == TOKENS
    assert second.shape[0] == 3
    assert rec.routes().shape[0] == TOKENS + 3
    assert np.array_equal(rec.routes()[:TOKENS], first)
    rec.clear()
    assert rec.stats().forwards == 0


def test_patches_are_removed_on_exit_and_on_error() -> None:
    model = tiny_model("qwen3_moe")
    sites = find_routers(model).sites
    spec = model_spec(model)
    short = random_routes(spec, seed=6)[:-1]
    with pytest.raises(RowCountMismatch, match="MoE layer 0"), replay(model, short):
        output(model, inputs())
    assert all("forward" not in site.module.__dict__ for site in sites)
    with replay(model, random_routes(spec, seed=6)):
        assert all("forward" in site.module.__dict__ for site in sites)
        output(model, inputs())
    assert all("forward" not in site.module.__dict__ for site in sites)
    # A block no router used is a replay that did not happen: refused, patches removed.
    with pytest.raises(ReplayNotApplied, match="no MoE router"), replay(model, short):
        pass
    assert all("forward" not in site.module.__dict__ for site in sites)


def test_blocks_nest_and_close_in_any_order() -> None:
    model = tiny_model("olmoe")
    spec = model_spec(model)
    routes = random_routes(spec, seed=9)
    site = find_routers(model).sites[0]
    forced, rec = replay(model, routes), record(model)
    forced.__enter__()
    recorder = rec.__enter__()
    with torch.no_grad():
        output(model, inputs())  # replayed, and recorded as replayed
    assert np.array_equal(recorder.routes(), routes)
    recorder.clear()
    forced.__exit__(None, None, None)  # the outer block closes first
    with torch.no_grad():
        output(model, inputs())  # recorded, no longer replayed
    rec.__exit__(None, None, None)
    assert "forward" not in site.module.__dict__
    assert not np.array_equal(recorder.routes(), routes)


def _self_routing_block(block: Any, *, call_gate: bool) -> Any:
    """A Qwen3-MoE block patched the way a custom or fused MoE block behaves: it takes
    the experts from the gate's own top-k of its logits, ignoring the ids its router
    returned (``call_gate``), or never calls the router's forward at all."""
    top_k = block.gate.top_k

    def forward(hidden_states: Any) -> Any:
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.view(-1, hidden)
        if call_gate:
            logits = block.gate(flat)[0]  # the (replayed) ids it returns are dropped
        else:
            logits = torch.nn.functional.linear(flat, block.gate.weight)
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        return block.experts(flat, ids, weights).reshape(batch, seq, hidden)

    return forward


@pytest.mark.parametrize(
    ("call_gate", "message"), [(True, "did not send"), (False, "never called")]
)
def test_a_block_that_routes_by_itself_fails_the_first_forward(
    call_gate: bool, message: str
) -> None:
    """A replay no router used is an error, raised in the first forward, naming the layer:
    never a quiet no-op with native routing (the drift meter would see nothing)."""
    config = transformers.AutoConfig.for_model("qwen3_moe", **{**BASE, **CASES["qwen3_moe"]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    spec = model_spec(model)
    block = model.model.layers[1].mlp
    routes = random_routes(spec, seed=8)
    with torch.no_grad(), replay(model, routes):
        output(model, inputs())  # every block takes its router's output: fine
    block.forward = _self_routing_block(block, call_gate=call_gate)
    with (
        pytest.raises(ReplayNotApplied, match=message) as refused,
        torch.no_grad(),
        replay(model, routes),
    ):
        output(model, inputs())
    assert "MoE layer 1 (model.layers.1.mlp.gate)" in str(refused.value)
    assert "forward" not in block.gate.__dict__  # the patch is gone after the error


def test_routes_for_another_geometry_are_refused() -> None:
    model = tiny_model("qwen3_moe")
    spec = model_spec(model)
    routes = random_routes(spec, seed=7)
    with pytest.raises(SpecMismatch, match="routing shape"), replay(model, routes[:, :, :1]):
        pass
    other = RouteSpec(num_layers=3, top_k=2, num_experts=16)
    with pytest.raises(SpecMismatch, match="does not match"), replay(model, routes, spec=other):
        pass
    bad = routes.copy()
    bad[0, 0, 0] = 8
    with pytest.raises(ExpertOutOfRange), replay(model, bad):
        pass


def test_rows_naming_an_expert_twice_are_refused_before_any_router_runs() -> None:
    model = tiny_model("qwen3_moe")
    routes = random_routes(model_spec(model), seed=8)
    zero = routes.copy()
    zero[-1] = 0  # zero-filled padding: expert 0 K times, in every layer
    with pytest.raises(DuplicateExperts, match="twice"), replay(model, zero):
        pass
    with pytest.raises(DuplicateExperts), replay(model, torch.from_numpy(zero)):
        pass
    # A provider is checked when its layer asks: inside the forward, before the experts run.
    with pytest.raises(DuplicateExperts), replay(model, lambda layer: zero[:, layer]):
        output(model, inputs())
    bad = routes.copy()
    bad[2, 1, 0] = 200
    with pytest.raises(ExpertOutOfRange), replay(model, lambda layer: bad[:, layer]):
        output(model, inputs())


def test_subclassed_routers_still_match() -> None:
    # FSDP2's fully_shard swaps a module's class for a generated FSDP<Class> subclass.
    model = copy.deepcopy(tiny_model("qwen3_moe"))
    for site in find_routers(model).sites:
        cls = type(site.module)
        site.module.__class__ = type(f"FSDP{cls.__name__}", (cls,), {})
    routes = random_routes(model_spec(model), seed=10)
    with torch.no_grad(), replay(model, routes), record(model) as rec:
        output(model, inputs())
    assert np.array_equal(rec.routes(), routes)


def test_router_logits_output_still_works_under_replay() -> None:
    model = tiny_model("mixtral")
    routes = random_routes(model_spec(model), seed=11)
    with torch.no_grad(), replay(model, routes):
        out = model(input_ids=inputs(), output_router_logits=True)
    assert len(out.router_logits) == model_spec(model).num_layers
    assert out.router_logits[0].shape == (TOKENS, 8)
    assert out.aux_loss is not None


def test_dense_layers_are_skipped_by_the_layer_map() -> None:
    model = tiny_model("deepseek_v3")  # decoder layer 0 is dense
    spec = model_spec(model)
    assert spec.layer_map == (1, 2)
    full = np.zeros((TOKENS, spec.decoder_layers, spec.top_k), dtype=np.uint8)
    moe = random_routes(spec, seed=8)
    full[:, list(spec.moe_layer_indices()), :] = moe
    full[:, 0, :] = np.arange(spec.top_k)  # whatever an engine sends for a dense layer
    with torch.no_grad(), replay(model, full), record(model) as rec:
        output(model, inputs())
    assert np.array_equal(rec.routes(), moe)


def test_model_without_a_covered_router_is_refused() -> None:
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=16, num_attention_heads=2,
        num_hidden_layers=1, vocab_size=VOCAB,
    )  # fmt: skip
    dense = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(SpecMismatch, match="no supported MoE router"):
        find_routers(dense)
