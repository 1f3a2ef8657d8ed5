"""Live routing drift: how far the trainer's own routers are from the routing they replay.

The R3 paper's diagnostic, measured in every replayed forward instead of in a separate
no-replay pass: at each MoE router call under replay, the experts the router would have
chosen itself from the same scores (its *native* top-k: expert bias, group-limited
selection and score function included, ties broken by the router's own kernel, because
it is the router's own selection that computes them) against the experts it is made to
use (the engine's routes for R3, a recording for R2).

``DriftMeter`` owns the figures of one step (or any span the caller picks):

- per MoE layer, over the real tokens (a mask per forward): the share of (token, layer)
  routes whose native expert *set* differs from the replayed one, and the mean overlap
  ``|native ∩ replayed| / K``;
- per token: the share of tokens with at least one differing layer, and the mean number
  of differing layers per real token (``layers_per_token``);
- optionally, from the engine's and the trainer's log-probs of the response tokens: the
  mean k3 estimate of KL(engine || trainer) and the mean ``|logprob gap|``
  (``logprob_gaps``, the one helper the demo's report uses too).

Invariants:
- Everything is summed on the device of the routers, under ``no_grad``, into one small
  float64 buffer (exact for counts below 2**53); nothing is read back while it is fed.
  ``drift()`` synchronises once and returns a frozen ``RoutingDrift``; ``reduce(group)``
  all-reduces a copy of the sums first (``torch.distributed``), otherwise every figure is
  rank-local, and a pipeline stage reports only the layers it holds.
- Sums are mergeable: shares are ratios of sums, so duplicated tokens (TP without
  sequence parallelism) leave them unchanged under ``reduce``.
- Comparisons are order-free per (token, layer) row: the order of a top-k row carries no
  meaning for the experts. Ids in a row are distinct (replay refuses others; a router's
  top-k is distinct), so the overlap is the count of matching pairs.

Why the figures under replay differ a little from a no-replay comparison on the same
tokens: under replay, every layer after the first replayed one sees hidden states
computed with the replayed experts, so its router scores (and native choice) are not
the ones a free-running forward would have produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, RowCountMismatch, SpecMismatch
from routeplay.train.drift_figures import LayerDrift, RoutingDrift

__all__ = [
    "DRIFT_BY_DEFAULT",
    "DriftMeter",
    "DriftPass",
    "LayerDrift",
    "RoutingDrift",
    "differing_routes",
    "logprob_gaps",
    "route_overlap",
]

DRIFT_BY_DEFAULT: Final = True
"""Replays measure drift unless told not to: its cost is far below the 2% bar against one
MoE layer's forward at the Qwen3-30B-A3B shape (``benchmarks/drift_cost.py``; result in
``benchmarks/results/``)."""

_ROUTES, _DIFFERING, _HITS = 0, 1, 2  # columns of the per-layer sums
_TOKENS, _TOKENS_DIFFERING, _LP_TOKENS, _KL, _GAP = 0, 1, 2, 3, 4  # the totals
_TOTALS = 5


# --------------------------------------------------------------------------- helpers


def _tensor(data: npt.NDArray[Any] | torch.Tensor) -> torch.Tensor:
    if isinstance(data, np.ndarray):
        if data.dtype == np.uint16:  # torch kernels for uint16 are barebones: widen on the host
            data = data.astype(np.int32)
        return torch.from_numpy(np.ascontiguousarray(data))
    return data


def route_overlap(
    native: npt.NDArray[Any] | torch.Tensor, replayed: npt.NDArray[Any] | torch.Tensor
) -> torch.Tensor:
    """``|native ∩ replayed|`` per row of two ``[..., K]`` id tensors (int64, ``[...]``).

    ``K * K`` elementwise compares on the device (64 for K=8), no sort; rows hold distinct
    ids, so the count of matching pairs is the size of the intersection.

    Example:
        >>> route_overlap(torch.tensor([[0, 1]]), torch.tensor([[1, 5]]))
        tensor([1])
    """
    a, b = _tensor(native), _tensor(replayed)
    if a.shape != b.shape:
        raise SpecMismatch(
            "the two routings differ in shape",
            expected=list(a.shape),
            found=list(b.shape),
            where="route_overlap",
        )
    b = b.to(device=a.device, dtype=a.dtype)
    return (a[..., :, None] == b[..., None, :]).any(dim=-1).sum(dim=-1)


def differing_routes(
    native: npt.NDArray[Any] | torch.Tensor, replayed: npt.NDArray[Any] | torch.Tensor
) -> torch.Tensor:
    """True per row of ``[..., K]`` ids where the two name different expert sets.

    Example:
        >>> differing_routes(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 4]]))
        tensor([False,  True])
    """
    top_k = _tensor(native).shape[-1]
    return route_overlap(native, replayed) < top_k


def logprob_gaps(
    trainer: npt.NDArray[Any] | torch.Tensor, engine: npt.NDArray[Any] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the k3 estimate of KL(engine || trainer) and ``|trainer - engine|``.

    Both log-probs are of the engine-sampled tokens; with ``r = p_trainer / p_engine``,
    k3 is ``r - 1 - log r`` (unbiased for tokens sampled from the engine, never
    negative). Computed in float64 where the inputs lie.

    Example:
        >>> kl, gap = logprob_gaps(trainer_logprobs, engine_logprobs)
        >>> kl.mean(), gap.mean()
    """
    t, e = _tensor(trainer), _tensor(engine)
    if t.shape != e.shape:
        raise SpecMismatch(
            "trainer and engine log-probs differ in shape",
            expected=list(e.shape),
            found=list(t.shape),
            where="logprob_gaps",
        )
    log_ratio = t.to(torch.float64) - e.to(device=t.device, dtype=torch.float64)
    return torch.expm1(log_ratio) - log_ratio, log_ratio.abs()


# --------------------------------------------------------------------------- the meter


class DriftPass:
    """One forward's tokens: which of them differ in any layer seen so far.

    Opened by the replay hooks (``DriftMeter.open_pass``), fed one router call at a time,
    folded into the meter on ``close()``. A layer seen a second time starts a new forward
    over the same tokens (the same routes replayed again).
    """

    def __init__(self, meter: DriftMeter, mask: torch.Tensor | None) -> None:
        self._meter = meter
        self._mask = mask
        self._any: torch.Tensor | None = None
        self._seen: set[int] = set()
        self._closed = False

    def observe(self, layer: int, native: torch.Tensor, replayed: torch.Tensor) -> None:
        """Compare layer ``layer``'s native ids with the replayed ones (``[tokens, K]``)."""
        if self._closed:
            raise MisuseError("the drift pass is closed", where=f"MoE layer {layer}")
        if layer in self._seen:
            self._fold()
        self._seen.add(layer)
        with torch.no_grad():
            native = native.detach().reshape(-1, self._meter.spec.top_k)
            replayed = replayed.detach().reshape(native.shape)
            rows = native.shape[0]
            mask = self._mask_for(rows, native.device, layer)
            hits = route_overlap(native, replayed)
            differs = hits < self._meter.spec.top_k
            if mask is not None:
                hits = hits * mask
                differs = differs & mask
            self._any = differs if self._any is None else self._any | differs
            self._meter._add_layer(layer, rows if mask is None else mask.sum(), differs, hits)

    def close(self) -> None:
        """Fold this forward's per-token figures into the meter (idempotent)."""
        if not self._closed:
            self._fold()
            self._closed = True

    def _mask_for(self, rows: int, device: torch.device, layer: int) -> torch.Tensor | None:
        if self._mask is None:
            return None
        if self._mask.shape[0] != rows:
            raise RowCountMismatch(
                "the drift mask's rows differ from the tokens this router sees",
                expected=rows,
                found=int(self._mask.shape[0]),
                where=f"MoE layer {layer}",
                hint="Pass one bool per routing row of this forward (the micro-batch's mask).",
            )
        if self._mask.device != device:
            self._mask = self._mask.to(device)
        return self._mask

    def _fold(self) -> None:
        if self._any is not None:
            tokens: torch.Tensor | int = (
                self._any.shape[0] if self._mask is None else self._mask.sum()
            )
            self._meter._add_tokens(tokens, self._any.sum())
        self._any = None
        self._seen.clear()


class DriftMeter:
    """Routing drift and log-prob mismatch of one step, summed on the device.

    Pass it to every replay of the step (``routeplay.train.replay(..., drift=meter)``) or
    read the one a ``MegatronReplay`` session keeps; ``compare`` adds whole ``[T, L, K]``
    routings (e.g. a no-replay forward's recorded routing against the engine's), and
    ``logprobs`` the response tokens' log-probs. Read with ``drift()`` (one sync) or,
    summed over ranks, ``reduce(group)``; ``reset()`` starts a new step.

    Example:
        >>> meter = DriftMeter(model_spec(model))
        >>> for mb in materializer:
        ...     with replay(model, mb.routes, drift=meter, mask=mb.mask):
        ...         logprobs = forward(model, batch)
        ...     meter.logprobs(logprobs.detach(), batch.engine_logprobs, mask=batch.response)
        >>> wandb.log(meter.drift().as_metrics())
    """

    def __init__(self, spec: RouteSpec) -> None:
        self._spec = spec
        self._layers: torch.Tensor | None = None  # [L, 3]: routes, differing, hits
        self._totals: torch.Tensor | None = None  # [5]: see the column names above

    @property
    def spec(self) -> RouteSpec:
        """Geometry of the routes compared."""
        return self._spec

    def open_pass(self, mask: npt.NDArray[np.bool_] | torch.Tensor | None = None) -> DriftPass:
        """A forward's token state (for replay hooks); ``mask`` marks its real rows."""
        if mask is None:
            return DriftPass(self, None)
        tensor = _tensor(mask)
        if tensor.dim() != 1 or tensor.dtype != torch.bool:
            raise MisuseError(
                "the drift mask must be one bool per routing row",
                expected="a 1-D bool array [tokens]",
                found=f"{list(tensor.shape)} {tensor.dtype}",
            )
        return DriftPass(self, tensor)

    @contextmanager
    def forward(
        self, mask: npt.NDArray[np.bool_] | torch.Tensor | None = None
    ) -> Iterator[DriftPass]:
        """``open_pass`` as a block: the pass is folded when the block ends."""
        drift_pass = self.open_pass(mask)
        try:
            yield drift_pass
        finally:
            drift_pass.close()

    def compare(
        self,
        native: npt.NDArray[Any] | torch.Tensor,
        replayed: npt.NDArray[Any] | torch.Tensor,
        *,
        mask: npt.NDArray[np.bool_] | torch.Tensor | None = None,
    ) -> None:
        """Add one forward's whole routings ``[tokens, L, K]`` (e.g. recorded vs engine)."""
        a, b = _tensor(native), _tensor(replayed)
        if a.dim() != 3 or a.shape[1:] != (self._spec.num_layers, self._spec.top_k):
            raise SpecMismatch(
                "routing to compare has the wrong shape",
                expected=f"[tokens, {self._spec.num_layers}, {self._spec.top_k}]",
                found=list(a.shape),
                where="DriftMeter.compare",
            )
        with self.forward(mask) as drift_pass:
            for layer in range(self._spec.num_layers):
                drift_pass.observe(layer, a[:, layer], b[:, layer])

    def logprobs(
        self,
        trainer: npt.NDArray[Any] | torch.Tensor,
        engine: npt.NDArray[Any] | torch.Tensor,
        *,
        mask: npt.NDArray[np.bool_] | torch.Tensor | None = None,
    ) -> None:
        """Add the k3 KL and ``|gap|`` of response tokens (``mask``: which positions count)."""
        with torch.no_grad():
            kl, gap = logprob_gaps(_tensor(trainer).detach(), engine)
            if mask is not None:
                weight = _tensor(mask).to(device=kl.device, dtype=torch.float64)
                if weight.shape != kl.shape:
                    raise SpecMismatch(
                        "the log-prob mask differs in shape from the log-probs",
                        expected=list(kl.shape),
                        found=list(weight.shape),
                        where="DriftMeter.logprobs",
                    )
                count: torch.Tensor | int = weight.sum()
                kl, gap = kl * weight, gap * weight
            else:
                count = kl.numel()
            totals = self._buffers(kl.device)[1]
            totals[_LP_TOKENS] += count
            totals[_KL] += kl.sum()
            totals[_GAP] += gap.sum()

    def drift(self) -> RoutingDrift:
        """The figures so far, rank-local: one device sync."""
        return self._figures(self._flat())

    def reduce(self, group: Any = None) -> RoutingDrift:
        """The figures summed over ``group``'s ranks (``torch.distributed.all_reduce``).

        Every rank of the group must call it (a collective). The meter's own sums stay
        rank-local, so reading twice never counts twice.
        """
        flat = self._flat().clone()
        torch.distributed.all_reduce(flat, group=group)
        return self._figures(flat)

    def reset(self) -> None:
        """Zero every sum (a new step), keeping the buffers."""
        for buffer in (self._layers, self._totals):
            if buffer is not None:
                buffer.zero_()

    # -- internals ---------------------------------------------------------------------
    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._layers is None or self._totals is None:
            self._layers = torch.zeros(self._spec.num_layers, 3, dtype=torch.float64, device=device)
            self._totals = torch.zeros(_TOTALS, dtype=torch.float64, device=device)
        return self._layers, self._totals

    def _add_layer(
        self, layer: int, routes: torch.Tensor | int, differs: torch.Tensor, hits: torch.Tensor
    ) -> None:
        if not 0 <= layer < self._spec.num_layers:
            raise SpecMismatch(
                "MoE layer index out of range",
                expected=f"0 <= layer < {self._spec.num_layers}",
                found=layer,
                where="DriftMeter",
            )
        layers = self._buffers(differs.device)[0]
        row = layers[layer]
        # A python int or a 0-d tensor: no host read either way.
        row[_ROUTES] += routes if isinstance(routes, int) else routes.to(layers.device)
        row[_DIFFERING] += differs.sum().to(layers.device)
        row[_HITS] += hits.sum().to(layers.device)

    def _add_tokens(self, tokens: torch.Tensor | int, differing: torch.Tensor) -> None:
        totals = self._buffers(differing.device)[1]
        totals[_TOKENS] += tokens if isinstance(tokens, int) else tokens.to(totals.device)
        totals[_TOKENS_DIFFERING] += differing.to(totals.device)

    def _flat(self) -> torch.Tensor:
        if self._layers is None or self._totals is None:  # nothing fed: do not pick a device
            return torch.zeros(3 * self._spec.num_layers + _TOTALS, dtype=torch.float64)
        return torch.cat([self._layers.flatten(), self._totals])

    def _figures(self, flat: torch.Tensor) -> RoutingDrift:
        values = flat.cpu().tolist()  # the one sync
        top_k, count = self._spec.top_k, self._spec.num_layers
        rows = [values[3 * i : 3 * i + 3] for i in range(count)]
        totals = values[3 * count :]
        layers = tuple(
            LayerDrift(
                layer=index,
                routes=int(routes),
                differing=int(differing),
                overlap=hits / (routes * top_k) if routes else 1.0,
            )
            for index, (routes, differing, hits) in enumerate(rows)
            if routes
        )
        lp_tokens = int(totals[_LP_TOKENS])
        return RoutingDrift(
            top_k=top_k,
            layers=layers,
            tokens=int(totals[_TOKENS]),
            tokens_differing=int(totals[_TOKENS_DIFFERING]),
            logprob_tokens=lp_tokens,
            kl_k3=totals[_KL] / lp_tokens if lp_tokens else None,
            logprob_gap=totals[_GAP] / lp_tokens if lp_tokens else None,
        )
