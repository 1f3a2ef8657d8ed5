"""Live routing drift of a ``MegatronReplay`` session: each replayed router's native choice.

Under ``REPLAY_FORWARD`` Megatron-Core never computes the router's own top-k: its
``RouterReplay.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``
gathers the scores at the given ids instead. The scores it receives are the ones the
router's selection would use (``topk_routing_with_score_function``: softmax before or
after the top-k, or sigmoid plus ``expert_bias``), and ``default_compute_topk`` is that
selection itself (plain or group-limited top-k). ``MegatronDrift`` wraps the method on
each router's ``RouterReplay`` instance, lets Megatron replay as before, and calls
Megatron's own selection on the same scores under ``no_grad``: native ids with every
rule and tie of the router, at the cost of one top-k per replayed layer. Backward
recomputes (``REPLAY_BACKWARD``) and recording are not measured: a recompute repeats its
forward.

Rows: a block's mask is in the rows of the routes it replays (the materializer's order,
or a ``Recording``'s router order) and is put in each router's token order the way the
session puts the ids (BSHD batch-major rows to Megatron's sequence-major flattening, this
TP rank's part with ``sp_scatter``). Per-token figures count a micro-batch once per
replay block, i.e. over the layers of one model chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, RowCountMismatch
from routeplay.integrations.megatron.layout import MegatronLayout
from routeplay.integrations.megatron.recording import Recording
from routeplay.integrations.megatron.routers import MegatronRouter
from routeplay.train.drift import DriftMeter, DriftPass
from routeplay.train.materializer import MicroBatchRoutes
from routeplay.train.replay_core import in_backward

__all__ = ["MegatronDrift", "router_order"]


def router_order(
    rows: torch.Tensor, *, seq: int, batch: int, parts: int = 1, rank: int = 0
) -> torch.Tensor:
    """Per-row values ``[batch * seq * parts, ...]`` (batch-major, the routes' rows) in the
    order a Megatron router sees its ``seq * batch`` tokens (sequence-major; with
    ``parts > 1`` the rows are the CP-local stream and TP rank ``rank`` keeps its part)."""
    tail = rows.shape[1:]
    view = rows.reshape(batch, seq * parts, *tail)
    if parts > 1:
        view = view[:, rank * seq : (rank + 1) * seq]
    return view.transpose(0, 1).reshape(seq * batch, *tail)


@dataclass(slots=True, kw_only=True, eq=False)
class _Block:
    """An open ``session.replay`` block of one chunk, as the drift sees it."""

    mask: torch.Tensor | None
    """Real rows, in the routes' row order (None: every row)."""
    reorder: bool
    """The rows are the materializer's (batch-major): put them in router order."""
    scatter: bool
    """``sp_scatter``: keep this TP rank's part."""
    passes: dict[tuple[int, int], DriftPass] = field(default_factory=dict)
    """One pass per (seq, batch) the chunk's routers saw (one, normally)."""


class MegatronDrift:
    """The drift meter of one session and the ``RouterReplay`` wrappers that feed it.

    Example:
        >>> drift = MegatronDrift(routers, spec, layout)
        >>> with drift.block(chunk=0, routes=mb, scatter=False):
        ...     forward(model_chunks[0], batch)
        >>> drift.meter.drift().as_metrics()
    """

    def __init__(
        self, routers: Sequence[MegatronRouter], spec: RouteSpec, layout: MegatronLayout
    ) -> None:
        self.meter = DriftMeter(spec)
        """Summed over the session's replayed forwards."""
        self._layout = layout
        self._blocks: dict[int, _Block] = {}
        self._shapes: dict[int, tuple[int, int]] = {}
        self._hooks: list[Any] = []
        self._wrapped: list[Any] = []
        try:
            for router in routers:
                self._install(router)
        except BaseException:
            self.close()
            raise

    @contextmanager
    def block(
        self, *, chunk: int, routes: Any, mask: Any = None, scatter: bool = False
    ) -> Iterator[None]:
        """Measure the replayed forwards of ``chunk`` inside the block.

        ``mask`` (bool, one per row of ``routes``) marks the real tokens; by default a
        ``MicroBatchRoutes``' own mask, else every row.
        """
        if mask is None and isinstance(routes, MicroBatchRoutes):
            mask = routes.mask
        tensor = None
        if mask is not None:
            tensor = torch.from_numpy(np.asarray(mask)) if not torch.is_tensor(mask) else mask
            if tensor.dim() != 1 or tensor.dtype != torch.bool:
                raise MisuseError(
                    "the drift mask must be one bool per routing row",
                    expected="a 1-D bool array [tokens]",
                    found=f"{list(tensor.shape)} {tensor.dtype}",
                )
        self._blocks[chunk] = _Block(
            mask=tensor, reorder=not isinstance(routes, Recording), scatter=scatter
        )
        try:
            yield
        finally:
            block = self._blocks.pop(chunk)
            for drift_pass in block.passes.values():
                drift_pass.close()

    def close(self) -> None:
        """Unwrap every ``RouterReplay`` and remove the hooks (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for replay, wrapper in self._wrapped:
            if replay.__dict__.get("get_replay_topk") is wrapper:
                del replay.get_replay_topk  # the class method shows through again
        self._wrapped.clear()
        self._blocks.clear()

    # -- internals ---------------------------------------------------------------------
    def _install(self, router: MegatronRouter) -> None:
        key, replay, forward = id(router), router.replay, router.actions.REPLAY_FORWARD
        original = replay.get_replay_topk  # bound: Megatron's own, whatever its version

        def shape(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not in_backward():
                hidden = args[0] if args else kwargs["input"]
                batch = int(hidden.shape[1]) if hidden.dim() == 3 else 1
                self._shapes[key] = (int(hidden.shape[0]), batch)

        def get_replay_topk(
            scores: torch.Tensor,
            topk: int,
            num_groups: int | None = None,
            group_topk: int | None = None,
            default_compute_topk: Any = None,
        ) -> Any:
            measured = replay.router_replay_action == forward
            result = original(scores, topk, num_groups, group_topk, default_compute_topk)
            block = self._blocks.get(router.chunk)
            if measured and block is not None and default_compute_topk is not None:
                with torch.no_grad():  # Megatron's own selection on the very same scores
                    native = default_compute_topk(
                        scores.detach(), topk, num_groups=num_groups, group_topk=group_topk
                    )[1]
                self._pass(router, block, native).observe(router.moe_layer, native, result[1])
            return result

        self._hooks.append(router.module.register_forward_pre_hook(shape, with_kwargs=True))
        replay.get_replay_topk = get_replay_topk
        self._wrapped.append((replay, get_replay_topk))

    def _pass(self, router: MegatronRouter, block: _Block, native: torch.Tensor) -> DriftPass:
        seq, batch = self._shapes.get(id(router), (int(native.shape[0]), 1))
        drift_pass = block.passes.get((seq, batch))
        if drift_pass is None:
            mask = block.mask
            if mask is not None and block.reorder:
                parts = self._layout.tp_size if block.scatter else 1
                if mask.shape[0] != seq * batch * parts:
                    raise RowCountMismatch(
                        "the drift mask's rows differ from the routes' rows",
                        expected=seq * batch * parts,
                        found=int(mask.shape[0]),
                        where=f"MoE layer {router.moe_layer} ({router.name})",
                        hint="Pass one bool per routing row (the micro-batch's mask).",
                    )
                mask = router_order(
                    mask, seq=seq, batch=batch, parts=parts, rank=self._layout.tp_rank
                )
            drift_pass = block.passes[(seq, batch)] = self.meter.open_pass(mask)
        return drift_pass
