"""Router replay and recording for Hugging Face transformers MoE models.

``with replay(model, routes):`` makes every MoE router of the model use the given expert
ids (weights recomputed from its live logits by the family's rule, so the gate keeps its
gradient); ``with record(model) as rec:`` captures the ids the routers chose. Both find the
routers by class name (``routeplay.train.routers``), map them to MoE layer indices in
decoder order, and patch one method per router *on the instance*; leaving the block,
normally or by an exception, restores it. No transformers import: any module tree works.

Modes (see docs/replay.md):
- R3: ``replay(model, engine_routes)`` around the training forward *and its backward*.
- R2: ``record`` around the old-logprob forward, then ``replay(model, rec.tensor())``
  around the update.
- record-only: ``record`` around any forward (the reference engine's routing).

Drift (``routeplay.train.drift``): under replay each router still runs its own forward
first, so its native choice (expert bias, group-limited selection, score function and
ties all the family's own) is at hand for free; every replayed forward compares it with
the replayed ids on the device, into the ``DriftMeter`` passed as ``drift=`` (one per
step), or into one of the block's own (``source.drift``). Recomputes are not counted.

Blocks nest and may close in any order: each patched method holds one dispatcher with a
stack of interceptors (the newest outermost), removed when the last block closes.

Fail closed (``routeplay.train.replay_check``): the first forward of each ``replay`` block
checks that every MoE layer ran its hooked method and that its experts received the
replayed ids (``ReplayNotApplied`` otherwise); a block no router used is refused when it
ends. Diagnostics (drift, recording) run under ``no_grad`` on detached outputs, so they
never change what autograd saves (activation checkpointing compares the saved tensors of
a forward and its recompute).

Invariant: the patched method reads layer ``l``'s ids from the routes on every call, so
activation-checkpoint recompute in the backward pass replays the same experts, provided
the backward runs inside the ``replay`` block (after it, the native router is back).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from routeplay.core.hf_config import spec_from_hf_config
from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, SpecMismatch
from routeplay.train.drift import DRIFT_BY_DEFAULT, DriftMeter, DriftPass
from routeplay.train.replay_check import ReplayCheck
from routeplay.train.replay_core import ReplaySource, RouteRecorder, RoutesLike, in_backward
from routeplay.train.routers import FAMILIES, RouterFamily, family_of

__all__ = ["RouterMap", "RouterSite", "find_routers", "model_spec", "record", "replay"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RouterSite:
    """One MoE layer's hook point."""

    layer: int
    """MoE layer index: axis 1 of the routes."""
    decoder_layer: int
    """Index of the decoder layer holding it."""
    name: str
    """Dotted module path, e.g. ``model.layers.3.mlp.gate``."""
    module: torch.nn.Module
    """The hooked module (a router, or the MoE block for DBRX)."""
    family: RouterFamily
    """Its family's rule and layout."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RouterMap:
    """Every MoE router of a model, in decoder order, and the routing geometry they imply."""

    spec: RouteSpec
    """Layers, top_k, experts and layer map, as found in the model."""
    sites: tuple[RouterSite, ...]
    """One per MoE layer; ``sites[l].layer == l``."""


def find_routers(model: torch.nn.Module, *, prefix: str | None = None) -> RouterMap:
    """Locate the MoE routers of ``model`` (under module path ``prefix`` if given).

    The MoE layers and their decoder indices come from the module tree itself, so the map
    is right even for families whose config the engine-side rules do not know; top_k and
    num_experts come from the config (``spec_from_hf_config``) and must agree with every
    router that carries them.
    """
    found: list[tuple[str, int, str, torch.nn.Module, RouterFamily]] = []
    for name, module in model.named_modules():
        family = family_of(module)
        if family is None or (prefix is not None and not name.startswith(prefix)):
            continue
        stack, decoder = _decoder_position(name)
        found.append((stack, decoder, name, module, family))
    if not found:
        raise SpecMismatch(
            "no supported MoE router in the model",
            expected="a router of a covered family",
            found=_router_like(model) or type(model).__name__,
            hint="Covered: " + "; ".join(f.name for f in FAMILIES) + ". See docs/replay.md.",
        )
    stacks = sorted({stack for stack, *_ in found})
    if len(stacks) > 1:
        raise SpecMismatch(
            "MoE routers live in more than one layer stack",
            expected="one decoder stack",
            found=stacks,
            hint="Pass prefix= naming the stack whose routing is replayed.",
        )
    found.sort(key=lambda item: item[1])
    decoders = [decoder for _, decoder, *_ in found]
    if len(set(decoders)) != len(decoders):
        raise SpecMismatch(
            "more than one router in a decoder layer",
            expected="one router per MoE layer",
            found=[name for _, _, name, *_ in found],
        )
    spec = _spec(model, decoders, [module for *_, module, _ in found])
    sites = tuple(
        RouterSite(layer=index, decoder_layer=decoder, name=name, module=module, family=family)
        for index, (_, decoder, name, module, family) in enumerate(found)
    )
    return RouterMap(spec=spec, sites=sites)


def model_spec(model: torch.nn.Module, *, prefix: str | None = None) -> RouteSpec:
    """The routing geometry replay expects for ``model`` (``find_routers(model).spec``)."""
    return find_routers(model, prefix=prefix).spec


@contextmanager
def replay(
    model: torch.nn.Module,
    routes: RoutesLike,
    *,
    spec: RouteSpec | None = None,
    check_ids: bool = True,
    prefix: str | None = None,
    drift: DriftMeter | bool | None = None,
    mask: Any = None,
    layers: Sequence[int] | None = None,
) -> Iterator[ReplaySource]:
    """Make every MoE router of ``model`` use ``routes`` inside the block.

    ``routes`` is ``[tokens, L, K]`` for this forward's flattened tokens (batch-major, as
    the MoE blocks flatten hidden states), canonical ``Routes``, or a callable
    ``layer -> [tokens, K]``. ``spec``, if given, must equal the model's (a guard against
    routes decoded for another model). Yields the ``ReplaySource``; its ``stats()`` counts
    replayed calls and checkpoint recomputes. Run the backward inside the block.

    ``drift``: a ``DriftMeter`` (the step's) receives the routing drift of the block's
    forwards; None (``DRIFT_BY_DEFAULT``) or True gives the block its own; False measures
    nothing. Either way the meter is ``source.drift``. ``mask`` (bool ``[tokens]``, the
    micro-batch's real rows) limits the figures to real tokens. ``layers`` names the MoE
    layer of each column of ``routes`` when only some were read (``mb.layers``: a model
    that holds part of the layers reads only those, ``Materializer(layers=...)``); every
    MoE router of ``model`` must find its layer there.

    Example:
        >>> meter = DriftMeter(model_spec(model))                    # once per step
        >>> with replay(model, mb.routes, drift=meter, mask=mb.mask):
        ...     loss = forward(model, batch); loss.backward()
        >>> wandb.log(meter.drift().as_metrics())
    """
    routers = find_routers(model, prefix=prefix)
    if spec is not None and spec != routers.spec:
        raise SpecMismatch(
            "the given spec does not match the model's routers",
            expected=routers.spec.describe(),
            found=spec.describe(),
        )
    meter = _meter(drift, routers.spec, mask)
    source = ReplaySource(routes, routers.spec, check_ids=check_ids, drift=meter, layers=layers)
    for site in routers.sites:
        source.column(site.layer)  # a router whose layer was not read: refused before any runs
    drift_pass = meter.open_pass(mask) if meter is not None else None
    check = ReplayCheck(model, [(site.layer, site.name, site.module) for site in routers.sites])
    try:
        with _patched(routers, lambda site: _replaying(site, source, drift_pass, check)):
            yield source
        check.finished()
    finally:
        check.close()
        if drift_pass is not None:
            drift_pass.close()


def _meter(drift: DriftMeter | bool | None, spec: RouteSpec, mask: Any) -> DriftMeter | None:
    if isinstance(drift, DriftMeter):
        geometry = (spec.num_layers, spec.top_k, spec.num_experts)
        if (drift.spec.num_layers, drift.spec.top_k, drift.spec.num_experts) != geometry:
            raise SpecMismatch(
                "the drift meter was made for another model spec",
                expected=spec.describe(),
                found=drift.spec.describe(),
            )
        return drift
    on = DRIFT_BY_DEFAULT if drift is None else drift
    if not on and mask is not None:
        raise MisuseError(
            "a drift mask was given with drift measuring off",
            hint="Drop mask=, or pass drift=True or a DriftMeter.",
        )
    return DriftMeter(spec) if on else None


@contextmanager
def record(
    model: torch.nn.Module,
    *,
    recorder: RouteRecorder | None = None,
    prefix: str | None = None,
) -> Iterator[RouteRecorder]:
    """Capture the experts every MoE router of ``model`` chooses inside the block.

    Yields a ``RouteRecorder`` (a fresh one unless ``recorder`` is given, e.g. to keep
    appending across micro-batches); it keeps its data after the block until ``clear()``.
    Nested inside ``replay``, it records the replayed ids (what the experts really got).
    """
    routers = find_routers(model, prefix=prefix)
    if recorder is None:
        recorder = RouteRecorder(routers.spec)
    elif recorder.spec != routers.spec:
        raise SpecMismatch(
            "the recorder was made for another model spec",
            expected=routers.spec.describe(),
            found=recorder.spec.describe(),
        )
    rec = recorder
    with _patched(routers, lambda site: _recording(site, rec)):
        yield rec


# --------------------------------------------------------------------------- hooks

_Method = Callable[..., Any]
_Interceptor = Callable[[_Method, tuple[Any, ...], dict[str, Any]], Any]
"""(the method it wraps, args, kwargs) -> output."""


def _replaying(
    site: RouterSite, source: ReplaySource, drift_pass: DriftPass | None, check: ReplayCheck
) -> _Interceptor:
    family, layer, module = site.family, site.layer, site.module
    where = f"MoE layer {layer} ({site.name})"

    def replayed(inner: _Method, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = inner(*args, **kwargs)  # the router's own forward: its native choice included
        logits = family.layout.source(out, args)
        logits = logits.reshape(-1, logits.shape[-1])
        ids = source.ids(layer, device=logits.device, rows=logits.shape[0], where=where)
        if not in_backward():  # a recompute repeats its forward
            check.note_replayed(layer, ids)
            if drift_pass is not None:
                # Diagnostics save nothing for backward: a top-k on grad-tracked scores
                # (Llama 4) would save tensors in the forward that a checkpoint's
                # recompute (where no drift is measured) does not, and torch refuses that.
                with torch.no_grad():
                    native = family.layout.chosen(module, _detached(out), args)
                drift_pass.observe(layer, native, ids)
        return family.layout.replace(out, family.weights(module, logits, ids), ids)

    return replayed


def _detached(out: Any) -> Any:
    """A router's output with every tensor detached (for diagnostics only)."""
    if torch.is_tensor(out):
        return out.detach()
    if isinstance(out, tuple):
        return tuple(_detached(item) for item in out)
    return out


def _recording(site: RouterSite, recorder: RouteRecorder) -> _Interceptor:
    family, layer, module = site.family, site.layer, site.module

    def recorded(inner: _Method, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = inner(*args, **kwargs)
        with torch.no_grad():  # what the router chose; nothing of it is trained
            recorder.capture(layer, family.layout.chosen(module, _detached(out), args))
        return out

    return recorded


class _Chain:
    """The interceptors active on one method of one module; the newest runs outermost.

    One dispatcher per method sits on the instance while any block is open, so blocks
    may close in any order (a stack of nested wrappers could only unwind in order).
    """

    def __init__(self, module: torch.nn.Module, attr: str) -> None:
        self.module, self.attr = module, attr
        self.previous = module.__dict__.get(attr, _ABSENT)
        self.original: _Method = getattr(module, attr)
        self.interceptors: list[_Interceptor] = []
        setattr(module, attr, self.dispatch)  # an instance attribute shadows the class method

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(len(self.interceptors) - 1, args, kwargs)

    def _call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index < 0:
            return self.original(*args, **kwargs)

        def inner(*a: Any, **k: Any) -> Any:
            return self._call(index - 1, a, k)

        return self.interceptors[index](inner, args, kwargs)

    def restore(self) -> None:
        if self.module.__dict__.get(self.attr) != self.dispatch:
            return  # someone patched over us: our dispatcher, now empty, just passes through
        if self.previous is _ABSENT:
            delattr(self.module, self.attr)
        else:
            setattr(self.module, self.attr, self.previous)


_ABSENT = object()
_CHAINS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, _Chain]] = weakref.WeakKeyDictionary()


@contextmanager
def _patched(routers: RouterMap, make: Callable[[RouterSite], _Interceptor]) -> Iterator[None]:
    installed: list[tuple[_Chain, _Interceptor]] = []
    try:
        for site in routers.sites:
            chains = _CHAINS.setdefault(site.module, {})
            attr = site.family.method
            chain = chains.get(attr)
            if chain is None:
                chain = chains[attr] = _Chain(site.module, attr)
            interceptor = make(site)
            chain.interceptors.append(interceptor)
            installed.append((chain, interceptor))
        yield
    finally:
        for chain, interceptor in reversed(installed):
            chain.interceptors.remove(interceptor)
            if not chain.interceptors:
                chain.restore()
                del _CHAINS[chain.module][chain.attr]


# --------------------------------------------------------------------------- geometry


def _decoder_position(name: str) -> tuple[str, int]:
    parts = name.split(".")
    for index in range(len(parts) - 1, -1, -1):
        if parts[index].isdigit():
            return ".".join(parts[:index]), int(parts[index])
    raise SpecMismatch(
        "a router sits outside any numbered layer list",
        expected="a path like model.layers.<i>.mlp.gate",
        found=name,
    )


def _spec(model: torch.nn.Module, decoders: list[int], modules: list[torch.nn.Module]) -> RouteSpec:
    config = getattr(model, "config", None)
    try:
        base: RouteSpec | None = spec_from_hf_config(config)
    except SpecMismatch:
        base = None  # an unusual config (DBRX nests its MoE fields): trust the routers
    top_k, experts = _router_geometry(modules)
    if base is not None:
        for label, ours, theirs in (
            ("top_k", top_k, base.top_k),
            ("experts", experts, base.num_experts),
        ):
            if ours is not None and ours != theirs:
                raise SpecMismatch(
                    f"the config and the routers disagree on {label}",
                    expected=f"{theirs} (config)",
                    found=f"{ours} (routers)",
                )
        top_k, experts = base.top_k, base.num_experts
    if top_k is None or experts is None:
        raise SpecMismatch(
            "cannot tell top_k and num_experts for this model",
            expected="a transformers config with MoE fields, or routers with top_k/num_experts",
            found=type(model).__name__,
        )
    total = base.decoder_layers if base is not None else _decoder_count(config, decoders)
    layer_map = None if decoders == list(range(total)) else tuple(decoders)
    name = base.name if base is not None else str(getattr(config, "model_type", ""))
    spec = RouteSpec(
        num_layers=len(decoders),
        top_k=top_k,
        num_experts=experts,
        layer_map=layer_map,
        total_layers=total,
        name=name,
    )
    return spec


def _router_geometry(modules: list[torch.nn.Module]) -> tuple[int | None, int | None]:
    values: dict[str, set[int]] = {"top_k": set(), "num_experts": set()}
    for module in modules:
        for attr in values:
            value = getattr(module, attr, None)
            if value is None:  # a block hook (DBRX) knows its experts through its children
                value = getattr(getattr(module, "experts", None), attr, None)
            if isinstance(value, int):
                values[attr].add(value)
    for attr, seen in values.items():
        if len(seen) > 1:
            raise SpecMismatch(
                f"routers differ in {attr}",
                expected=f"one {attr} for every MoE layer",
                found=sorted(seen),
            )
    top_k = next(iter(values["top_k"]), None)
    experts = next(iter(values["num_experts"]), None)
    return top_k, experts


def _decoder_count(config: Any, decoders: list[int]) -> int:
    config = getattr(config, "text_config", None) or config
    for key in ("num_hidden_layers", "num_layers", "n_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return decoders[-1] + 1


def _router_like(model: torch.nn.Module) -> list[str]:
    names = {
        type(module).__name__
        for module in model.modules()
        if any(word in type(module).__name__ for word in ("Router", "Gate", "MoE", "Moe"))
    }
    return sorted(names)[:8]
