"""Checking that an HF replay really happened: every router used the replayed experts.

``routeplay.train.hf.replay`` replaces what each router's hooked method returns. That is
a replay only if the model then routes with what the method returned: a MoE block that
computes its own top-k from the gate's weights, calls another method, or never reaches
the hooked module leaves the replay a quiet no-op (the drift meter then sees nothing,
and the step trains without R3). ``ReplayCheck`` proves the effect once per ``replay``
block, on its first forward, at the cost of one comparison per layer:

- the experts module of each site (the sibling ``experts`` of a router, a block's own
  ``experts``), called as transformers v5 calls it, ``experts(hidden, ids, weights)``,
  must receive exactly the ids the site handed out (Llama 4's experts take dense scores
  instead: there the router's own output is the route, and it is ours);
- when the model's forward returns, every MoE layer must have run its hooked method.

A failure raises ``ReplayNotApplied`` naming the layer, inside the forward. A block left
without any router having run is refused too (a replay that did not happen). Recomputes
in the backward are not checked: they repeat a checked forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from routeplay.errors import ReplayNotApplied
from routeplay.train.replay_core import in_backward

__all__ = ["ReplayCheck"]


class ReplayCheck:
    """The first-forward check of one ``replay`` block (see the module docstring).

    ``sites`` are ``(layer, name, module)`` of the model's routers (``RouterSite``'s
    fields); ``note_replayed`` is called by each site's interceptor with the ids it
    handed out; ``close()`` removes the hooks (idempotent).

    Example:
        >>> check = ReplayCheck(model, [(s.layer, s.name, s.module) for s in routers.sites])
        >>> check.note_replayed(0, ids)       # from the router's interceptor
        >>> check.finished()                  # the block ended normally
        >>> check.close()
    """

    def __init__(self, model: torch.nn.Module, sites: Sequence[tuple[int, str, Any]]) -> None:
        self._names = {layer: name for layer, name, _ in sites}
        self._ran: set[int] = set()
        self._handed: dict[int, torch.Tensor] = {}  # first forward: ids awaiting their experts
        self._checked = False  # the first forward of the block was checked
        self._hooks: list[Any] = []
        try:
            for layer, name, module in sites:
                experts = _experts_of(model, name, module)
                if experts is not None:
                    self._hooks.append(
                        experts.register_forward_pre_hook(
                            self._experts_hook(layer), with_kwargs=True
                        )
                    )
            self._hooks.append(model.register_forward_hook(self._model_done))
        except BaseException:
            self.close()
            raise

    def note_replayed(self, layer: int, ids: torch.Tensor) -> None:
        """Layer ``layer``'s router returned ``ids`` (a forward, not a recompute)."""
        self._ran.add(layer)
        if not self._checked:
            self._handed[layer] = ids

    def finished(self) -> None:
        """The block ended normally: refuse it if no router ever used its routes."""
        if not self._ran:
            raise ReplayNotApplied(
                "no MoE router used the replayed routes in this replay block",
                expected=f"{len(self._names)} routers replayed by a forward inside the block",
                found="no router call",
                hint="Run the forward (and its backward) inside `with replay(model, routes):`, "
                "on the model (or a module holding the routers) given to replay().",
            )
        self._check_all_ran()

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._handed.clear()

    # -- hooks ---------------------------------------------------------------------------
    def _experts_hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            handed = self._handed.pop(layer, None)
            if handed is None or in_backward():
                return
            used = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if not torch.is_tensor(used) or used.is_floating_point():
                return  # dense scores (Llama 4): the router's own output is the route
            if used.numel() != handed.numel():
                return  # a layout of its own: the all-ran check still holds
            used = used.reshape(handed.shape).to(handed.device)
            differ = (used.sort(dim=-1).values != handed.sort(dim=-1).values).any(dim=-1)
            if bool(differ.any()):
                row = int(differ.nonzero()[0, 0])
                raise ReplayNotApplied(
                    "a MoE block did not send its tokens to the replayed experts",
                    expected=sorted(handed[row].tolist()),
                    found=sorted(used[row].tolist()),
                    where=f"MoE layer {layer} ({self._names[layer]}), token {row} "
                    f"({int(differ.sum())} of {differ.shape[0]} differ)",
                    hint="The block chose experts itself instead of taking its router's "
                    "output (a patched or custom MoE block); replay cannot force it.",
                )

        return hook

    def _model_done(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._checked or in_backward():
            return
        self._checked = True
        self._handed.clear()
        self._check_all_ran()

    def _check_all_ran(self) -> None:
        missing = sorted(set(self._names) - self._ran)
        if missing:
            first = missing[0]
            raise ReplayNotApplied(
                "a MoE layer's router was never called in the forward",
                expected=f"every one of {len(self._names)} routers called in the forward",
                found=f"MoE layers {missing} never called",
                where=f"MoE layer {first} ({self._names[first]})",
                hint="Such a block routes without calling the hooked method (a fused or "
                "custom MoE block): its experts were chosen natively.",
            )


def _experts_of(model: torch.nn.Module, name: str, module: Any) -> torch.nn.Module | None:
    """The experts module a router's choice feeds: the block's own (a hooked block), or
    the ``experts`` beside the router in its parent block."""
    own = getattr(module, "experts", None)
    if isinstance(own, torch.nn.Module):
        return own
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    sibling = getattr(parent, "experts", None)
    return sibling if isinstance(sibling, torch.nn.Module) else None
