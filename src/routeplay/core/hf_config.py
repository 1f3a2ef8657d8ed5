"""Derive a RouteSpec from a Hugging Face model config (duck-typed: no transformers import).

Engines send one routing row per decoder layer or per MoE layer; which decoder layers
are MoE differs by family, so the rules below mirror each family's modeling code.
"""

from __future__ import annotations

from typing import Any

from routeplay.core.spec import RouteSpec
from routeplay.errors import SpecMismatch

__all__ = ["MAX_LAYERS", "moe_layers", "mtp_layers", "spec_from_hf_config"]

MAX_LAYERS = 4096
"""Most decoder (or MTP) layers a config may claim: layer lists are built from the count,
so a hostile ``config.json`` must not size them (the largest MoE models have about 100)."""

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k_experts")


def spec_from_hf_config(config: Any, *, name: str = "") -> RouteSpec:
    """The routing geometry of a transformers ``PretrainedConfig`` (or a nested text
    config). A config whose routing fields do not parse (a count that is not a positive
    integer, a period of 0, more than ``MAX_LAYERS`` layers) is refused: ``SpecMismatch``.

    Example:
        >>> spec_from_hf_config(Qwen3MoeConfig(num_hidden_layers=4)).num_layers  # doctest: +SKIP
        4
    """
    config = getattr(config, "text_config", None) or config
    try:
        return _spec(config, name)
    except SpecMismatch:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError, ZeroDivisionError) as exc:
        raise SpecMismatch(
            "the model config's routing fields do not parse",
            expected="integer layer counts, top-k and expert counts; periods >= 1",
            found=f"{type(exc).__name__}: {exc}"[:200],
            where=str(getattr(config, "model_type", None) or type(config).__name__),
        ) from exc


def _spec(config: Any, name: str) -> RouteSpec:
    total = _bounded(
        "num_hidden_layers", _first(config, ("num_hidden_layers", "num_layers", "n_layers"))
    )
    experts = int(_first(config, _EXPERT_KEYS))
    top_k = int(_first(config, _TOP_K_KEYS))
    layers = moe_layers(config, total)
    layer_map = None if len(layers) == total else tuple(layers)
    return RouteSpec(
        num_layers=len(layers),
        top_k=top_k,
        num_experts=experts,
        layer_map=layer_map,
        total_layers=total,
        mtp_layers=mtp_layers(config),
        name=name or str(getattr(config, "model_type", None) or ""),
    )


def mtp_layers(config: Any) -> int:
    """Multi-token-prediction layers numbered after the decoder layers: HF's
    ``num_nextn_predict_layers`` (DeepSeek-V3, GLM-4.5, MiMo), or XTuner's ``mtp_config``
    (``num_layers`` blocks, one physical layer when ``share_weights``)."""
    nextn = getattr(config, "num_nextn_predict_layers", None)
    if nextn is not None:
        return _bounded("num_nextn_predict_layers", nextn, low=0)
    mtp = getattr(config, "mtp_config", None)
    if mtp is None:
        return 0
    if getattr(mtp, "share_weights", False):
        return 1
    return _bounded("mtp_config.num_layers", mtp.num_layers, low=0)


def _bounded(field: str, value: Any, *, low: int = 1) -> int:
    """``value`` as an int in ``[low, MAX_LAYERS]``, else ``SpecMismatch`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_LAYERS:
        raise SpecMismatch(
            f"the model config's {field} is not a layer count",
            expected=f"an integer in [{low}, {MAX_LAYERS}]",
            found=repr(value)[:80],
        )
    return value


def moe_layers(config: Any, total: int) -> list[int]:
    """Decoder-layer indices whose MLP is a routed MoE block."""
    explicit = getattr(config, "moe_layers", None)  # Llama-4 lists them
    if isinstance(explicit, (list, tuple)):
        return sorted(int(i) for i in explicit)
    kinds = getattr(config, "mlp_layer_types", None)  # Laguna, HY-V3, MiMo-V2, GLM-4.7-Lite
    if isinstance(kinds, (list, tuple)) and len(kinds) == total:
        return [i for i, kind in enumerate(kinds) if kind == "sparse"]
    if getattr(config, "moe_layer_interval", None) is not None:  # ERNIE 4.5
        return _ernie_layers(config, total)
    period = getattr(config, "expert_layer_period", None)  # Jamba
    if period is not None:
        period = _bounded("expert_layer_period", period)
        offset = int(getattr(config, "expert_layer_offset", 0))
        return [i for i in range(total) if i >= offset and (i - offset) % period == 0]
    # DeepSeek-V2/V3, Kimi-K2, GLM-4.5: the first k layers are dense.
    first_dense = getattr(config, "first_k_dense_replace", None)
    if first_dense is None:
        first_dense = getattr(config, "num_dense_layers", None)  # AFMoE, LFM2-MoE
    if first_dense is not None:
        freq = int(getattr(config, "moe_layer_freq", 1) or 1)
        return [i for i in range(total) if i >= first_dense and i % freq == 0]
    # Qwen2/3-MoE family: every decoder_sparse_step-th layer unless listed as MLP-only.
    step = getattr(config, "decoder_sparse_step", None)
    if step is not None:
        step = _bounded("decoder_sparse_step", step)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        return [i for i in range(total) if i not in dense and (i + 1) % step == 0]
    return list(range(total))


def _ernie_layers(config: Any, total: int) -> list[int]:
    interval = _bounded("moe_layer_interval", config.moe_layer_interval)
    start = int(getattr(config, "moe_layer_start_index", 0))
    end = getattr(config, "moe_layer_end_index", None)
    stop = total - 1 if end is None or int(end) < 0 else int(end)
    return [i for i in range(total) if (i + 1) % interval == 0 and start <= i <= stop]


def _first(config: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    raise SpecMismatch(
        "the model config has no MoE routing field",
        expected=f"one of {', '.join(keys)}",
        found=f"{type(config).__name__} without them",
        hint="Is this a MoE model? Build a RouteSpec by hand if its config is unusual.",
    )
