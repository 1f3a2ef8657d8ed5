"""Presets and spec derivation, checked against transformers' own config classes."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from routeplay.core import PRESETS, RouteSpec, preset, spec_from_hf_config
from routeplay.errors import SpecMismatch

# Presets whose published config is also the default of a transformers config class.
CONFIG_DEFAULTS = {
    "deepseek-v3": "DeepseekV3Config",
    "gpt-oss-120b": "GptOssConfig",
    "mixtral-8x7b": "MixtralConfig",
    "qwen3-next-80b-a3b": "Qwen3NextConfig",
    "olmoe-1b-7b": "OlmoeConfig",
    "qwen1.5-moe-a2.7b": "Qwen2MoeConfig",
    "glm-4.5-air": "Glm4MoeConfig",
    "minimax-m2": "MiniMaxM2Config",
    "llama-4-scout": "Llama4TextConfig",
}


@pytest.mark.parametrize(("name", "config_class"), sorted(CONFIG_DEFAULTS.items()))
def test_preset_matches_transformers_default_config(name: str, config_class: str) -> None:
    config = getattr(transformers, config_class)()
    assert spec_from_hf_config(config) == preset(name)


@pytest.mark.parametrize(
    ("name", "layers", "top_k", "experts", "row_bytes"),
    [
        ("qwen3-30b-a3b", 48, 8, 128, 384),
        ("qwen3-235b-a22b", 94, 8, 128, 752),
        ("deepseek-v3", 58, 8, 256, 464),
        ("qwen3-next-80b-a3b", 48, 10, 512, 960),
    ],
)
def test_design_numbers(name: str, layers: int, top_k: int, experts: int, row_bytes: int) -> None:
    spec = preset(name)
    assert (spec.num_layers, spec.top_k, spec.num_experts) == (layers, top_k, experts)
    assert spec.row_nbytes == row_bytes


def test_32k_qwen3_235b_sample_is_24_6_mb_as_uint8() -> None:
    assert preset("qwen3-235b-a22b").nbytes(32 * 1024) == 24_641_536


@pytest.mark.parametrize(("experts", "dtype"), [(1, np.uint8), (256, np.uint8), (257, np.uint16)])
def test_dtype_follows_num_experts_only(experts: int, dtype: type) -> None:
    assert RouteSpec(num_layers=1, top_k=1, num_experts=experts).dtype == np.dtype(dtype)


def test_every_preset_is_consistent() -> None:
    for name, spec in PRESETS.items():
        assert spec.name == name
        assert len(spec.moe_layer_indices()) == spec.num_layers
        assert spec.decoder_layers >= spec.num_layers


def test_qwen_mlp_only_layers_and_sparse_step_become_a_layer_map() -> None:
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=16
    )
    spec = spec_from_hf_config(config)
    assert spec.layer_map == (1, 5)
    assert spec.decoder_layers == 6
    # Decoder layer -> payload column, as routers indexed by decoder layer ask for it.
    assert [spec.moe_layer(d) for d in range(6)] == [None, 0, None, None, None, 1]
    assert [preset("deepseek-v3").moe_layer(d) for d in (0, 2, 3, 60)] == [None, None, 0, 57]
    with pytest.raises(SpecMismatch, match="out of range"):
        spec.moe_layer(6)
    plain = RouteSpec(num_layers=3, top_k=1, num_experts=4)
    assert [plain.moe_layer(d) for d in range(3)] == [0, 1, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "top_k": 1, "num_experts": 4},
        {"num_layers": 2, "top_k": 5, "num_experts": 4},
        {"num_layers": 2, "top_k": 1, "num_experts": 70_000},
        {"num_layers": 2, "top_k": 1, "num_experts": 4, "layer_map": (1, 1), "total_layers": 3},
        {"num_layers": 2, "top_k": 1, "num_experts": 4, "total_layers": 3},
        {"num_layers": 2, "top_k": 1, "num_experts": 4, "layer_map": (0, 1, 2)},
    ],
)
def test_invalid_specs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(SpecMismatch):
        RouteSpec(**kwargs)  # type: ignore[arg-type]


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(SpecMismatch, match="qwen3-30b-a3b"):
        preset("no-such-model")


def test_dense_model_config_is_refused() -> None:
    with pytest.raises(SpecMismatch, match="MoE"):
        spec_from_hf_config(transformers.LlamaConfig())
