"""Router replay in torch: expert weights from live logits at given expert ids.

Owns three things, none of which knows transformers (``routeplay.train.hf`` wires them
into models):

- the weighting functions: given a router's logits (or probabilities) and the expert ids
  to use, the weights that router would have produced had it chosen those ids itself;
- ``ReplaySource``: the routing to replay, kept compact (``[tokens, L, K]`` uint8/uint16,
  or a per-layer provider) and widened to int64 one MoE layer at a time, on the device of
  that layer's logits;
- ``RouteRecorder``: the routing a forward chose, captured compactly per layer.

Invariants:
- Replay is stateless per call: every time layer ``l``'s router runs, ``ReplaySource.ids``
  reads ``routes[:, l, :]`` afresh (no cursor), so the recompute of an activation-checkpointed
  layer in the backward pass replays the very ids its forward used.
- Only the layer being replayed is widened (uint8/uint16 -> int64, 8x or 4x), and only on
  the device: the host never holds an int64 copy of the payload.
- Weights are computed from the live logits with autograd on, so the gate keeps its gradient;
  only the choice of experts is forced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from routeplay.core.layers import LayerSubset
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import check_distinct, check_dtype, check_range, check_shape
from routeplay.errors import (
    DtypeError,
    DuplicateExperts,
    ExpertOutOfRange,
    MisuseError,
    RowCountMismatch,
    SpecMismatch,
)

if TYPE_CHECKING:
    from routeplay.train.drift import DriftMeter

__all__ = [
    "LayerProvider",
    "RecorderStats",
    "ReplaySource",
    "ReplayStats",
    "RouteRecorder",
    "RoutesLike",
    "check_ids_of",
    "dense_sigmoid_scores",
    "in_backward",
    "sigmoid_topk_weights",
    "softmax_topk_weights",
    "topk_softmax_weights",
]

LayerProvider: TypeAlias = Callable[[int], "npt.NDArray[Any] | torch.Tensor"]
"""MoE layer index -> that layer's ids ``[tokens, K]`` (numpy or torch, any integer dtype)."""

RoutesLike: TypeAlias = "Routes | npt.NDArray[Any] | torch.Tensor | LayerProvider"
"""What replay accepts: canonical ``Routes``, an array/tensor ``[tokens, L, K]``, or a provider."""

_TORCH_TO_NUMPY: dict[torch.dtype, np.dtype[Any]] = {
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
}
_Data = TypeVar("_Data", npt.NDArray[Any], torch.Tensor)

# numpy kinds torch.from_numpy takes and CUDA widens natively; uint16 travels as int16 bits.
_DIRECT = {np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64)}


# --------------------------------------------------------------------------- weights


def softmax_topk_weights(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    renormalize: bool = False,
    eps: float = 0.0,
    min_sum: float | None = None,
    scale: float | None = None,
    dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """Softmax over all experts, then the probabilities at ``ids`` (Qwen-MoE, Mixtral, OLMoE...).

    ``renormalize`` divides by the sum of the K picked probabilities (``+ eps``, or clamped
    to ``min_sum``), ``scale`` multiplies the result, ``dtype`` is the softmax precision
    (None: the logits' own dtype). The operation order mirrors transformers' routers so that
    replaying a router's own choice reproduces its weights bit for bit.
    """
    probs = torch.softmax(logits, dim=-1, dtype=dtype)
    return _normalize(probs.gather(-1, ids), renormalize, eps, min_sum, scale)


def sigmoid_topk_weights(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    renormalize: bool = False,
    eps: float = 0.0,
    scale: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """Sigmoid scores at ``ids`` (DeepSeek-V3, GLM-4.5, MiniMax-M2...).

    A selection bias (``e_score_correction_bias``) only ever changes which experts are
    picked, never their weights, so it has no place here. ``upcast`` computes the sigmoid
    in float32 when the logits are narrower.
    """
    scores = torch.sigmoid(logits.float() if upcast else logits)
    return _normalize(scores.gather(-1, ids), renormalize, eps, None, scale)


def topk_softmax_weights(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax over the K logits at ``ids`` only (gpt-oss, Granite-MoE)."""
    picked = logits.gather(-1, ids)
    weights = torch.softmax(picked, dim=-1, dtype=dtype if dtype is not None else picked.dtype)
    return weights * scale if scale is not None else weights


def dense_sigmoid_scores(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Llama-4's dense ``[tokens, E]`` scores: sigmoid of the logit at ``ids``, 0 elsewhere."""
    scores = torch.full_like(logits, float("-inf")).scatter(-1, ids, logits.gather(-1, ids))
    return torch.sigmoid(scores.float()).to(scores.dtype)


def _normalize(
    picked: torch.Tensor,
    renormalize: bool,
    eps: float,
    min_sum: float | None,
    scale: float | None,
) -> torch.Tensor:
    if renormalize:
        total = picked.sum(dim=-1, keepdim=True)
        if min_sum is not None:
            total = total.clamp(min=min_sum)
        elif eps:
            total = total + eps
        picked = picked / total
    return picked * scale if scale is not None else picked


# --------------------------------------------------------------------------- replay source


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayStats:
    """What a replay did so far (a snapshot)."""

    calls: int
    """Router calls whose experts were replaced (forward and recompute)."""
    recomputes: int
    """Of those, calls made inside a backward pass (activation-checkpoint recompute)."""
    rows: int
    """Token rows widened, summed over calls."""
    peak_ids_bytes: int
    """Largest int64 ids tensor built for one layer: the only widened copy alive per router."""


class ReplaySource:
    """The routing to replay, compact until a layer asks for its ids.

    Accepts canonical ``Routes`` (already validated at ingest: only the spec is compared),
    a numpy array or torch tensor ``[tokens, L, K]`` (``L`` may also count every decoder
    layer, dense ones included, as some engines send: the spec's layer map then picks the
    MoE columns), or a provider ``layer -> [tokens, K]``. Arrays are checked once here
    (shape, dtype, and with ``check_ids`` the id range and that no row names an expert
    twice); a provider's blocks get the same checks each time a layer asks for them; token
    rows are checked per layer against the router's input, since only the model knows how
    many tokens it flattened. A repeated id would run that expert twice for the token and
    drop one of its K experts (zero padding rows do exactly this), so it is refused, never
    replayed. ``check_ids=False`` skips the id checks for routes already validated
    (canonical ``Routes`` are never re-checked). ``layers`` says which MoE layer each
    column of an array is, when a pipeline stage read only its own
    (``MicroBatchRoutes.layers``); a router of another layer is refused. ``ids`` takes a
    MoE layer index,
    ``decoder_ids`` a decoder layer index (for routers a framework indexes over every
    decoder layer, as XTuner's do; a multi-token-prediction layer of the spec gets None,
    as XTuner's own guard leaves it to its router).

    ``mask`` (``[tokens]``, True for a sample's row) marks the rows that are routing: a
    trainer's own padding (XTuner's zero rows for SP, random ids for pad sequences) is
    replayed as the trainer laid it, only checked for range; a real row with a repeated
    id is refused as before. Without a mask every row is routing.

    Example:
        >>> source = ReplaySource(mb.routes, spec)
        >>> ids = source.ids(0, device=logits.device, rows=logits.shape[0])
    """

    def __init__(
        self,
        routes: RoutesLike,
        spec: RouteSpec,
        *,
        check_ids: bool = True,
        drift: DriftMeter | None = None,
        layers: Sequence[int] | None = None,
        mask: npt.NDArray[np.bool_] | torch.Tensor | None = None,
    ) -> None:
        self.drift = drift
        """The meter this replay's routing drift goes to (None: not measured)."""
        self._spec = spec
        self._check_ids = check_ids
        self._mask = _checked_mask(mask)
        self._array: npt.NDArray[Any] | None = None
        self._tensor: torch.Tensor | None = None
        self._provider: LayerProvider | None = None
        self._columns: dict[int, int] = {layer: layer for layer in range(spec.num_layers)}
        self._subset = None if layers is None else LayerSubset.of(layers, spec)
        if self._subset is not None:
            self._columns = {layer: c for c, layer in enumerate(self._subset.layers)}
        self._lock = threading.Lock()
        self._calls = self._recomputes = self._rows = self._peak = 0
        if isinstance(routes, Routes):
            if self._subset is not None and not self._subset.whole:
                raise MisuseError(
                    "canonical Routes hold every MoE layer: give no layer subset",
                    found=list(self._subset.layers),
                    hint="layers= describes a stage's read (MicroBatchRoutes.layers).",
                )
            if routes.spec != spec:
                raise SpecMismatch(
                    "the routes were validated for another model spec",
                    expected=spec.describe(),
                    found=routes.spec.describe(),
                    hint="Replay routes decoded with this model's RouteSpec.",
                )
            self._array = routes.array
        elif isinstance(routes, np.ndarray):
            self._array = routes
            self._check(routes.shape, routes.dtype)
            if check_ids:
                check_ids_of(self._moe_columns(routes), spec, mask=self._row_mask(routes))
        elif isinstance(routes, torch.Tensor):
            self._tensor = routes
            dtype = _TORCH_TO_NUMPY.get(routes.dtype)
            if dtype is None:
                raise DtypeError(
                    "routing must be an integer tensor",
                    expected="an integer dtype",
                    found=str(routes.dtype),
                    where="replay routes",
                )
            self._check(tuple(routes.shape), dtype)
            if check_ids:
                check_ids_of(self._moe_columns(routes), spec, mask=self._row_mask(routes))
        elif callable(routes):
            self._provider = routes
        else:
            raise DtypeError(
                "cannot replay this object",
                expected="Routes, a numpy array, a torch tensor or a callable layer -> ids",
                found=type(routes).__name__,
            )

    @property
    def spec(self) -> RouteSpec:
        """The geometry the routes were checked against."""
        return self._spec

    @property
    def rows(self) -> int | None:
        """Token rows of an array source; None for a provider."""
        data = self._array if self._array is not None else self._tensor
        return int(data.shape[0]) if data is not None else None

    def ids(self, layer: int, *, device: torch.device, rows: int, where: str = "") -> torch.Tensor:
        """MoE layer ``layer``'s expert ids as int64 ``[rows, K]`` on ``device``.

        Reads the routes afresh on every call (see the module invariants) and moves the
        compact bytes before widening, so the transfer stays 1 or 2 bytes per id.
        """
        where = where or f"MoE layer {layer}"
        block = self._block(layer)
        shape = tuple(block.shape)
        if len(shape) != 2 or shape[1] != self._spec.top_k:
            raise SpecMismatch(
                "a layer's routing has the wrong shape",
                expected=f"[{rows}, {self._spec.top_k}]",
                found=list(shape),
                where=where,
            )
        if shape[0] != rows:
            raise RowCountMismatch(
                "routing rows differ from the tokens this router sees",
                expected=f"{rows} rows (batch * sequence, flattened as the MoE block does)",
                found=f"{shape[0]} rows",
                where=where,
                hint="Routes must cover exactly the tokens of this forward, padding included.",
            )
        if self._provider is not None and self._check_ids:
            self._check_block(block, where, shape[0])
        ids = _widen(block, device)
        with self._lock:
            self._calls += 1
            self._recomputes += int(in_backward())
            self._rows += rows
            self._peak = max(self._peak, ids.numel() * ids.element_size())
        return ids

    def moe_layer(self, decoder_layer: int) -> int | None:
        """MoE layer index of decoder layer ``decoder_layer`` (``RouteSpec.moe_layer``:
        the spec's layer map); None for a dense decoder layer. Refuses an index outside
        the model's decoder layers (``SpecMismatch``).

        Example:
            >>> [source.moe_layer(i) for i in range(3)]   # layer_map=(1, 2)
            [None, 0, 1]
        """
        return self._spec.moe_layer(decoder_layer)

    def decoder_ids(
        self, decoder_layer: int, *, device: torch.device, rows: int, where: str = ""
    ) -> torch.Tensor | None:
        """Decoder layer ``decoder_layer``'s expert ids as int64 ``[rows, K]`` on ``device``;
        None for a multi-token-prediction layer of the spec (``RouteSpec.mtp_layers``).

        The accessor for routers a framework owns and indexes by decoder layer (XTuner's
        ``GreedyRouter`` / ``NoAuxRouter``, called with ``rollout_routed_experts`` by each
        ``MoEDecoderLayer`` over all ``num_hidden_layers``): the spec's layer map picks the
        MoE column, then ``ids`` widens it on the device with every replay check (rows,
        shape, and for a provider range and distinct ids; arrays were checked when the
        source was built). A dense decoder layer has no routing: ``SpecMismatch``. XTuner
        numbers its MTP blocks' MoE layers from ``num_hidden_layers`` on and replays only
        ``layer_idx < rollout_routed_experts.shape[1]``: an engine records no routing for
        them, so they get None (the router chooses, as it does in XTuner); an index past
        the MTP layers is refused.

        Example:
            >>> source = ReplaySource(mb.routes, spec)
            >>> # in MoEDecoderLayer.forward, before self.gate(hidden_states, ids):
            >>> ids = source.decoder_ids(self.layer_idx, device=h.device, rows=h.shape[0])
        """
        if self._spec.is_mtp_layer(decoder_layer):
            return None
        moe = self.moe_layer(decoder_layer)
        if moe is None:
            raise SpecMismatch(
                "decoder layer is dense in the spec: it has no routing to replay",
                expected=f"a MoE decoder layer of {self._spec.moe_layer_indices()}",
                found=decoder_layer,
                where=where or f"decoder layer {decoder_layer}",
                hint="Check the spec's layer_map against the model (XTuner: "
                "first_k_dense_replace dense layers come first).",
            )
        return self.ids(
            moe,
            device=device,
            rows=rows,
            where=where or f"decoder layer {decoder_layer} (MoE layer {moe})",
        )

    def column(self, layer: int) -> int:
        """Column of MoE layer ``layer`` in the routes (a stage's read holds only its
        layers; an engine may send every decoder layer). Refuses a layer the routes lack.

        Example:
            >>> ReplaySource(mb.routes, spec, layers=mb.layers).column(10)
            2
        """
        column = self._columns.get(layer)
        if column is not None:
            return column
        if self._subset is None or not 0 <= layer < self._spec.num_layers:
            raise SpecMismatch(
                "MoE layer index out of range",
                expected=f"0 <= layer < {self._spec.num_layers}",
                found=layer,
            )
        raise MisuseError(
            "these routes hold other MoE layers than the one a router asked for",
            expected=f"one of MoE layers {list(self._subset.layers)} (the layers read)",
            found=layer,
            where=f"MoE layer {layer}",
            hint="Read the layers of every model chunk this rank runs: "
            "Materializer(layers=layout.moe_layers(spec)).",
        )

    def stats(self) -> ReplayStats:
        """Calls, recomputes and widened bytes so far."""
        with self._lock:
            return ReplayStats(
                calls=self._calls,
                recomputes=self._recomputes,
                rows=self._rows,
                peak_ids_bytes=self._peak,
            )

    def _block(self, layer: int) -> npt.NDArray[Any] | torch.Tensor:
        if not 0 <= layer < self._spec.num_layers:
            raise SpecMismatch(
                "MoE layer index out of range",
                expected=f"0 <= layer < {self._spec.num_layers}",
                found=layer,
            )
        if self._provider is not None:
            block = self._provider(layer)
            integer = (
                block.dtype in _TORCH_TO_NUMPY
                if isinstance(block, torch.Tensor)
                else np.dtype(block.dtype).kind in "iu"
            )
            if not integer:
                raise DtypeError(
                    "a layer provider returned non-integer ids",
                    expected="an integer dtype",
                    found=str(block.dtype),
                    where=f"MoE layer {layer}",
                )
            return block
        column = self.column(layer)
        if self._array is not None:
            return self._array[:, column, :]
        assert self._tensor is not None
        return self._tensor[:, column, :]

    def _check(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        check_dtype(dtype, self._spec, where="replay routes")
        if self._subset is not None:
            _check_subset_shape(shape, self._subset, self._spec)
            return
        check_shape(shape, self._spec, where="replay routes")
        if shape[1] != self._spec.num_layers:  # every decoder layer was sent
            self._columns = dict(enumerate(self._spec.moe_layer_indices()))

    def _moe_columns(self, data: _Data) -> _Data:
        # Indexing copies: skip it when every column is a MoE layer.
        if len(self._columns) == data.shape[1]:
            return data
        return data[:, list(self._columns.values()), :]

    def _check_block(self, block: npt.NDArray[Any] | torch.Tensor, where: str, rows: int) -> None:
        """Range and distinct ids of one provider block ``[rows, K]`` (real rows only)."""
        mask = None if self._mask is None else self._row_mask(block)
        check_ids_of(block[:, None, :], self._spec, where=where, mask=mask)

    def _row_mask(
        self, routes: npt.NDArray[Any] | torch.Tensor
    ) -> npt.NDArray[np.bool_] | torch.Tensor | None:
        """The mask, checked against the routes' rows (None: every row is routing)."""
        if self._mask is None:
            return None
        if tuple(self._mask.shape) != (int(routes.shape[0]),):
            raise RowCountMismatch(
                "the padding mask does not cover the routes' rows",
                expected=f"a mask of [{int(routes.shape[0])}] (one flag per token row)",
                found=list(self._mask.shape),
                where="replay routes",
                hint="Pass the mask of the same rows (MicroBatchRoutes.mask for a rank's).",
            )
        if isinstance(routes, np.ndarray) and isinstance(self._mask, torch.Tensor):
            return self._mask.cpu().numpy()  # numpy routes are checked on the host
        return self._mask


def _checked_mask(
    mask: npt.NDArray[np.bool_] | torch.Tensor | None,
) -> npt.NDArray[np.bool_] | torch.Tensor | None:
    """``mask`` if it is one bool per row (numpy or torch), else ``MisuseError``."""
    if mask is None:
        return None
    found: object = mask  # typed as a mask, but a caller's value: check it whatever it is
    if isinstance(found, torch.Tensor):
        ok = found.dim() == 1 and found.dtype == torch.bool
        shape, dtype = list(found.shape), str(found.dtype)
    elif isinstance(found, np.ndarray):
        ok = found.ndim == 1 and found.dtype == np.bool_
        shape, dtype = list(found.shape), str(found.dtype)
    else:
        ok, shape, dtype = False, [], type(found).__name__
    if not ok:
        raise MisuseError(
            "the padding mask must be one bool per routing row",
            expected="a 1-D bool numpy array or torch tensor [tokens]",
            found=f"{shape} {dtype}",
            where="replay routes",
        )
    return mask


def _check_subset_shape(shape: tuple[int, ...], subset: LayerSubset, spec: RouteSpec) -> None:
    if len(shape) != 3 or shape[1] != len(subset.layers) or shape[2] != spec.top_k:
        raise SpecMismatch(
            "routing shape does not match the layers read",
            expected=f"[rows, {len(subset.layers)}, {spec.top_k}] (MoE layers "
            f"{list(subset.layers)})",
            found=list(shape),
            where="replay routes",
        )


def check_ids_of(
    routes: npt.NDArray[Any] | torch.Tensor,
    spec: RouteSpec,
    *,
    where: str = "replay routes",
    mask: npt.NDArray[np.bool_] | torch.Tensor | None = None,
) -> None:
    """Refuse ``[rows, L, K]`` ids that would misroute: out of range (any row), or
    repeated in a row that is routing (``mask`` True, or every row without a mask:
    padding rows repeat ids harmlessly, XTuner pads with zeros and random ids).

    Numpy arrays use the vectorized ingest checks; tensors are checked where they lie
    (one device sync per check). Raises ``ExpertOutOfRange`` or ``DuplicateExperts``.

    Example:
        >>> check_ids_of(mb.routes, spec)                  # before handing routes to a router
        >>> check_ids_of(xtuner_rows, spec, mask=mb.mask)  # its own padding left as it is
    """
    if isinstance(routes, np.ndarray):
        check_range(routes, spec, where=where)
        real = routes if mask is None else routes[np.asarray(mask, dtype=bool)]
        check_distinct(real, where=where if mask is None else f"{where} (real rows)")
    else:
        _check_tensor_range(routes, spec, where=where)
        if mask is not None:
            flags = torch.as_tensor(mask, dtype=torch.bool, device=routes.device)
            routes, where = routes[flags], f"{where} (real rows)"
        _check_tensor_distinct(routes, where=where)


def _readable(tensor: torch.Tensor) -> torch.Tensor:
    """The ids as a dtype with min/max/sort kernels everywhere (uint16 has barebones support)."""
    if tensor.dtype == torch.uint16:  # read its bits wider
        return tensor.view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
    if tensor.dtype in (torch.uint32, torch.uint64):
        return tensor.to(torch.int64)
    return tensor


def _check_tensor_range(tensor: torch.Tensor, spec: RouteSpec, *, where: str) -> None:
    """Refuse ids outside ``[0, num_experts)`` in ``[rows, L, K]``; one device sync."""
    if tensor.numel() == 0:
        return
    tensor = _readable(tensor)
    low, high = int(tensor.min()), int(tensor.max())  # one sync per replay, not per layer
    if low < 0 or high >= spec.num_experts:
        raise ExpertOutOfRange(
            "expert id out of range",
            expected=f"ids in [0, {spec.num_experts})",
            found=f"ids in [{low}, {high}]",
            where=where,
        )


def _check_tensor_distinct(tensor: torch.Tensor, *, where: str) -> None:
    """Refuse any ``(token, layer)`` row of ``[rows, L, K]`` naming an expert twice.

    ``K * (K - 1) / 2`` elementwise compares of id columns on the device (28 for K=8,
    cheaper than sorting each row), one sync for the verdict; locating the first bad row
    costs more only when one exists.
    """
    top_k = tensor.shape[-1]
    if tensor.numel() == 0 or top_k < 2:
        return
    ids = _readable(tensor)
    clash = torch.zeros(ids.shape[:-1], dtype=torch.bool, device=ids.device)  # [rows, L]
    for i in range(top_k):
        for j in range(i + 1, top_k):
            clash |= ids[..., i] == ids[..., j]
    if not bool(clash.any()):
        return
    row, layer = (int(i) for i in clash.nonzero()[0])
    zero_rows = int((_readable(tensor) == 0).all(dim=-1).sum())
    hint = f"{int(clash.sum())} rows repeat an expert"
    hint += f", {zero_rows} are all zeros (padding?)." if zero_rows else "."
    raise DuplicateExperts(
        "an expert appears twice in one top-k row",
        expected=f"{tensor.shape[-1]} distinct ids",
        found=_readable(tensor[row, layer]).tolist(),
        where=f"{where}, row {row}, MoE layer {layer}",
        hint=hint + " Pad with distinct ids (routeplay.train.padding_rows), or mark a"
        " trainer's own padding rows False in ReplaySource(mask=...).",
    )


def _widen(block: npt.NDArray[Any] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Compact ``[rows, K]`` ids -> int64 on ``device``; the copy moves the compact bytes."""
    if isinstance(block, np.ndarray):
        if block.dtype == np.uint16:
            bits = np.array(block, dtype=np.uint16, order="C").view(np.int16)
            return _unsigned16(torch.from_numpy(bits), device)
        if block.dtype not in _DIRECT:
            block = block.astype(np.int64)  # uint32/uint64: rare, never canonical
        # A fresh C-ordered copy of one layer (a strided column of [T, L, K]): cheap, writable.
        tensor = torch.from_numpy(np.array(block, order="C"))
        return tensor.to(device=device).to(torch.int64)
    if block.dtype == torch.uint16:
        return _unsigned16(block.view(torch.int16), device)
    if block.dtype in (torch.uint32, torch.uint64):
        block = block.to(torch.int64)  # rare, never canonical: widen where it lies
    moved = block.to(device=device, non_blocking=block.device.type == "cpu" and block.is_pinned())
    return moved.to(torch.int64)


def _unsigned16(bits: torch.Tensor, device: torch.device) -> torch.Tensor:
    # uint16 has only barebones support on accelerators; int16 bits + a mask widen anywhere.
    return bits.to(device=device).to(torch.int64).bitwise_and_(0xFFFF)


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------- recorder


@dataclass(frozen=True, slots=True, kw_only=True)
class RecorderStats:
    """What a recorder holds (a snapshot)."""

    forwards: int
    """Complete forwards captured (every MoE layer ran once)."""
    rows: int
    """Token rows captured over those forwards."""
    nbytes: int
    """Compact bytes held (on the capture device)."""
    skipped_recomputes: int
    """Router calls ignored because they were a backward-pass recompute."""


class RouteRecorder:
    """Captures the experts every MoE layer chose, compactly, forward by forward.

    One forward is one call of each MoE layer, in order; ids stay on their device as
    uint8 (or int32 when ``E > 256``: narrowed to uint16 on the host) until asked for.
    Router calls made inside a backward pass (checkpoint recompute) are not captured: they
    repeat a forward already recorded.
    """

    def __init__(self, spec: RouteSpec) -> None:
        self._spec = spec
        self._device_dtype = torch.uint8 if spec.num_experts <= 256 else torch.int32
        self._layers: list[list[torch.Tensor]] = [[] for _ in range(spec.num_layers)]
        self._skipped = 0
        self._lock = threading.Lock()

    @property
    def spec(self) -> RouteSpec:
        """Geometry of what is recorded."""
        return self._spec

    def capture(self, layer: int, ids: torch.Tensor) -> None:
        """Keep MoE layer ``layer``'s chosen ids ``[tokens, K]`` (any integer dtype)."""
        if in_backward():
            with self._lock:
                self._skipped += 1
            return
        if ids.dim() != 2 or ids.shape[1] != self._spec.top_k:
            raise SpecMismatch(
                "a router chose a different number of experts than the spec",
                expected=f"[tokens, {self._spec.top_k}]",
                found=list(ids.shape),
                where=f"MoE layer {layer}",
            )
        compact = ids.detach().to(self._device_dtype)
        with self._lock:
            self._layers[layer].append(compact)

    def forwards(self) -> list[npt.NDArray[np.unsignedinteger]]:
        """One canonical ``[tokens, L, K]`` array per recorded forward, in order."""
        return [self._to_numpy(stacked) for stacked in self._stacked()]

    def routes(self) -> npt.NDArray[np.unsignedinteger]:
        """Every recorded forward, rows concatenated: canonical ``[tokens, L, K]``."""
        return self._to_numpy(self.tensor())

    def tensor(self) -> torch.Tensor:
        """The same rows as a compact tensor on the capture device (R2: replay it as is)."""
        stacked = self._stacked()
        if not stacked:
            shape = (0, self._spec.num_layers, self._spec.top_k)
            return torch.empty(shape, dtype=self._device_dtype)
        return torch.cat(stacked, dim=0) if len(stacked) > 1 else stacked[0]

    def clear(self) -> None:
        """Drop everything captured (idempotent)."""
        with self._lock:
            self._layers = [[] for _ in range(self._spec.num_layers)]
            self._skipped = 0

    close = clear

    def stats(self) -> RecorderStats:
        """Forwards, rows and bytes held now."""
        with self._lock:
            complete = min(len(calls) for calls in self._layers)
            rows = sum(int(ids.shape[0]) for ids in self._layers[0][:complete])
            nbytes = sum(
                ids.numel() * ids.element_size() for calls in self._layers for ids in calls
            )
            return RecorderStats(
                forwards=complete, rows=rows, nbytes=nbytes, skipped_recomputes=self._skipped
            )

    def __enter__(self) -> RouteRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stacked(self) -> list[torch.Tensor]:
        with self._lock:
            layers = [list(calls) for calls in self._layers]
        counts = {len(calls) for calls in layers}
        if len(counts) != 1:
            raise MisuseError(
                "the recording holds an incomplete forward",
                expected="every MoE layer captured the same number of times",
                found=[len(calls) for calls in layers],
                hint="A forward failed midway; clear() the recorder and record again.",
            )
        forwards = []
        for index, calls in enumerate(zip(*layers, strict=True)):
            rows = {int(ids.shape[0]) for ids in calls}
            if len(rows) != 1:
                raise MisuseError(
                    "the MoE layers of one forward saw different token counts",
                    expected="one token count per forward",
                    found=sorted(rows),
                    where=f"forward {index}",
                )
            forwards.append(torch.stack(calls, dim=1))
        return forwards

    def _to_numpy(self, stacked: torch.Tensor) -> npt.NDArray[np.unsignedinteger]:
        array = stacked.cpu().numpy()
        return np.ascontiguousarray(array.astype(self._spec.dtype, copy=False))
