"""Which Megatron-Core routers a rank holds, and which MoE column of the routes each replays.

A ``TopKRouter`` knows its global decoder layer (``layer_number``, 1-based, set by the
``TransformerLayer`` that builds it, pipeline and virtual-stage offsets included), so the
routers of a rank's model chunks map to MoE columns of the routes through the spec's layer
map, whatever the pipeline split, dense layers or ``moe_layer_freq``. Megatron's own
``RouterReplay.set_replay_data`` instead indexes *every* instance of the process in
construction order (all chunks, and any other model built with replay on, e.g. a reference
model), which is why the adapter fills instances one by one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, SpecMismatch
from routeplay.integrations.megatron.layout import MegatronLayout

__all__ = ["MegatronRouter", "find_megatron_routers", "replay_actions"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MegatronRouter:
    """One router this rank holds."""

    chunk: int
    """Model chunk (virtual stage) holding it: index into the model list."""
    moe_layer: int
    """MoE layer index: column of the routes (axis 1)."""
    decoder_layer: int
    """Global decoder layer, 0-based (``router.layer_number - 1``)."""
    name: str
    """Module path inside its chunk, e.g. ``decoder.layers.3.mlp.router``."""
    module: torch.nn.Module
    """The ``TopKRouter``."""
    replay: Any
    """Its ``RouterReplay`` instance (``router.router_replay``)."""
    actions: Any
    """The ``RouterReplayAction`` enum that instance compares its action with: the one of
    the module defining its class (megatron-core's, or verl's patched ``RouterReplay``,
    which brings an enum of its own)."""


def find_megatron_routers(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    spec: RouteSpec,
    *,
    layout: MegatronLayout | None = None,
) -> tuple[MegatronRouter, ...]:
    """Every ``TopKRouter`` in this rank's model chunks, in chunk then layer order.

    ``model`` is one module or the list of model chunks Megatron builds with virtual
    pipeline stages (``chunk`` indexes it). Each router needs a ``RouterReplay``
    (``TransformerConfig.moe_enable_routing_replay=True``) and a layer number; its decoder
    layer must be a MoE layer of ``spec`` and, if ``layout`` knows ``num_layers``, one that
    chunk builds. Routers inside multi-token-prediction layers (a ``MultiTokenPrediction``
    block or layer, or a module with a true ``is_mtp_layer``) are left out: engines route no
    rows for them, so they keep routing natively.

    Example:
        >>> routers = find_megatron_routers(model_chunks, spec, layout=layout)
        >>> [r.moe_layer for r in routers if r.chunk == 0]
        [0, 1, 2, 3, 4, 5]
    """
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    columns = {decoder: column for column, decoder in enumerate(spec.moe_layer_indices())}
    found: list[MegatronRouter] = []
    mtp_types = _mtp_types()
    for chunk, module in enumerate(chunks):
        mtp: list[str] = []  # multi-token-prediction layers route natively (no engine rows)
        for name, sub in module.named_modules():
            if isinstance(sub, mtp_types) or getattr(sub, "is_mtp_layer", False):
                mtp.append(name + ".")
            elif isinstance(sub, TopKRouter) and not any(name.startswith(p) for p in mtp):
                found.append(_site(chunk, name, sub, columns, spec))
    if not found:
        raise SpecMismatch(
            "no Megatron-Core TopKRouter in the model",
            expected="MoE layers built from megatron.core.transformer.moe",
            found=[type(m).__name__ for m in chunks],
        )
    if layout is not None and layout.num_layers is not None:
        _check_ownership(found, layout)
    layers = [r.moe_layer for r in found]
    if len(set(layers)) != len(layers):
        raise SpecMismatch(
            "two routers claim the same MoE layer",
            expected="one router per layer_number",
            found=sorted(layers),
        )
    return tuple(sorted(found, key=lambda r: (r.chunk, r.decoder_layer)))


REPLAY_FEATURES = (
    "router_replay_action",
    "set_router_replay_action",
    "clear_router_replay_action",
    "target_topk_idx",
    "recorded_topk_idx",
    "replay_backward_list",
)
"""What ``MegatronReplay`` reads and sets on each router's ``RouterReplay``: checked by
feature, not by version (``docs/megatron.md``)."""

REPLAY_ACTIONS = ("RECORD", "REPLAY_FORWARD", "REPLAY_BACKWARD")
"""Members the ``RouterReplayAction`` enum beside a ``RouterReplay`` class must have."""


def replay_actions(replay: Any, *, where: str = "") -> type[Enum]:
    """The ``RouterReplayAction`` enum ``replay`` compares its action with.

    A ``RouterReplay`` tests ``self.router_replay_action == RouterReplayAction.X`` against
    the enum of its own module, and an enum member only equals itself: megatron-core's
    ``REPLAY_FORWARD`` set on verl's patched ``RouterReplay`` (``apply_router_replay_patch``)
    matches none of verl's members, so the router silently routes natively. The enum is
    therefore taken from the instance's class module; a class with no such enum is refused.

    Example:
        >>> replay_actions(router.router_replay).REPLAY_FORWARD  # doctest: +SKIP
        <RouterReplayAction.REPLAY_FORWARD: 'replay_forward'>
    """
    cls = type(replay)
    module = sys.modules.get(cls.__module__)
    actions = getattr(module, "RouterReplayAction", None)
    members = getattr(actions, "__members__", {})
    if (
        isinstance(actions, type)
        and issubclass(actions, Enum)
        and set(REPLAY_ACTIONS) <= set(members)
    ):
        return actions
    raise MisuseError(
        "the router's RouterReplay has no RouterReplayAction enum beside its class",
        expected=f"an Enum RouterReplayAction with {', '.join(REPLAY_ACTIONS)} in {cls.__module__}",
        found=f"{cls.__module__}.{cls.__qualname__} with "
        f"{'no RouterReplayAction' if actions is None else sorted(members)}",
        where=where,
        hint="routeplay drives megatron-core's RouterReplay and verl's patched one; another "
        "patch must keep its action enum in the module of its RouterReplay class.",
    )


def _mtp_types() -> tuple[type, ...]:
    """Megatron's multi-token-prediction modules, where this release has them.

    Megatron-Core 0.16 marks MTP layers by type only (``MultiTokenPredictionBlock`` /
    ``Layer``); later releases also pass ``is_mtp_layer`` to the router, read above.
    """
    try:
        from megatron.core.transformer import multi_token_prediction as mtp
    except ImportError:
        return ()
    names = ("MultiTokenPredictionBlock", "MultiTokenPredictionLayer")
    return tuple(getattr(mtp, n) for n in names if isinstance(getattr(mtp, n, None), type))


def _site(
    chunk: int, name: str, router: Any, columns: dict[int, int], spec: RouteSpec
) -> MegatronRouter:
    where = f"chunk {chunk}, {name or type(router).__name__}"
    replay = getattr(router, "router_replay", None)
    if replay is None:
        raise MisuseError(
            "the router was built without a RouterReplay",
            where=where,
            hint="Build the model with TransformerConfig(moe_enable_routing_replay=True).",
        )
    missing = [name for name in REPLAY_FEATURES if not hasattr(replay, name)]
    if missing:
        raise MisuseError(
            "this megatron-core's RouterReplay lacks what the session drives",
            expected=list(REPLAY_FEATURES),
            found=f"missing {missing}",
            where=where,
            hint="routeplay is tested with megatron-core 0.16.1; use a release whose "
            "RouterReplay has per-instance actions and a backward FIFO.",
        )
    if router.layer_number is None:
        raise MisuseError(
            "the router has no layer number",
            where=where,
            hint="Routers get it from their TransformerLayer; call set_layer_number() "
            "when building MoE layers by hand.",
        )
    decoder = int(router.layer_number) - 1
    if decoder not in columns:
        raise SpecMismatch(
            "the router's decoder layer is not a MoE layer of the routes",
            expected=f"one of decoder layers {sorted(columns)}",
            found=decoder,
            where=where,
            hint="Give the RouteSpec the model's layer_map (dense layers excluded).",
        )
    if router.topk != spec.top_k or router.num_experts != spec.num_experts:
        raise SpecMismatch(
            "the router's geometry differs from the spec",
            expected=f"top_k={spec.top_k}, experts={spec.num_experts}",
            found=f"top_k={router.topk}, experts={router.num_experts}",
            where=where,
        )
    return MegatronRouter(
        chunk=chunk,
        moe_layer=columns[decoder],
        decoder_layer=decoder,
        name=name,
        module=router,
        replay=replay,
        actions=replay_actions(replay, where=where),
    )


def _check_ownership(routers: Sequence[MegatronRouter], layout: MegatronLayout) -> None:
    for router in routers:
        owned = layout.chunk_layers(router.chunk)
        if router.decoder_layer not in owned:
            raise SpecMismatch(
                "a router sits in a layer its model chunk does not build",
                expected=f"decoder layers [{owned.start}, {owned.stop}) for chunk {router.chunk}",
                found=router.decoder_layer,
                where=f"pp_rank {layout.pp_rank}, {router.name}",
                hint="Pass the model chunks in virtual-stage order and the layout of this rank.",
            )
