"""RouteSpec: the routing geometry of one model, and the canonical dtype it implies.

Invariant: the canonical dtype depends on ``num_experts`` only (uint8 up to 256
experts, uint16 up to 65,536), never on the ids a batch happens to contain, so every
payload of a model has one dtype and one byte size per row.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from routeplay.core.degenerate import DEFAULT_DEGENERATE, DegenerateCheck
from routeplay.errors import SpecMismatch

__all__ = ["MAX_EXPERTS", "RouteSpec", "canonical_dtype"]

MAX_EXPERTS: Final = 1 << 16


def canonical_dtype(num_experts: int) -> np.dtype[np.unsignedinteger]:
    """The narrowest unsigned dtype that holds ids ``0 .. num_experts - 1``."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise SpecMismatch(
            "num_experts is out of the supported range",
            expected=f"1 <= num_experts <= {MAX_EXPERTS}",
            found=num_experts,
        )
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class RouteSpec:
    """Routing geometry: every payload of a model is ``[tokens - 1, num_layers, top_k]``."""

    num_layers: int
    """MoE layers that route tokens (dense decoder layers excluded)."""
    top_k: int
    """Experts chosen per token and layer."""
    num_experts: int
    """Routed experts per MoE layer; ids lie in ``[0, num_experts)``."""
    layer_map: tuple[int, ...] | None = None
    """Decoder-layer index of each MoE layer; None means MoE layer i is decoder layer i."""
    total_layers: int | None = None
    """Decoder layers in the model, dense ones included; None means the last mapped layer + 1."""
    mtp_layers: int = field(default=0, compare=False)
    """Multi-token-prediction layers after the decoder layers (DeepSeek-V3's and XTuner's
    MTP blocks: decoder indices ``decoder_layers`` .. ``decoder_layers + mtp_layers - 1``).
    Engines record no routing for them, so a replay leaves them to their own router
    (``ReplaySource.decoder_ids`` answers None); not part of the payload or of equality."""
    name: str = field(default="", compare=False)
    """Human label (a preset name); not part of equality."""
    degenerate: DegenerateCheck = field(default=DEFAULT_DEGENERATE, compare=False)
    """Which engine-bug captures validation refuses (``routeplay.core.degenerate``:
    fill rows, a frozen layer); a setting, not part of the geometry or of equality."""

    def __post_init__(self) -> None:
        for label, value in (("num_layers", self.num_layers), ("top_k", self.top_k)):
            if value < 1:
                raise SpecMismatch(f"{label} must be positive", expected=">= 1", found=value)
        if self.top_k > self.num_experts:
            raise SpecMismatch(
                "top_k cannot exceed num_experts",
                expected=f"top_k <= {self.num_experts}",
                found=self.top_k,
            )
        canonical_dtype(self.num_experts)
        if self.mtp_layers < 0:
            raise SpecMismatch(
                "mtp_layers cannot be negative", expected=">= 0", found=self.mtp_layers
            )
        self._check_layer_map()

    def _check_layer_map(self) -> None:
        total = self.decoder_layers
        if total < self.num_layers:
            raise SpecMismatch(
                "total_layers is smaller than num_layers",
                expected=f">= {self.num_layers}",
                found=total,
            )
        if not self.layer_map:
            if total != self.num_layers:
                raise SpecMismatch(
                    "dense layers need a layer_map naming the MoE layers",
                    expected=f"layer_map of {self.num_layers} decoder indices",
                    found=None,
                )
            return
        layer_map = self.layer_map
        if len(layer_map) != self.num_layers:
            raise SpecMismatch(
                "layer_map must name one decoder layer per MoE layer",
                expected=self.num_layers,
                found=len(layer_map),
            )
        increasing = all(a < b for a, b in itertools.pairwise(layer_map))
        if not increasing or layer_map[0] < 0 or layer_map[-1] >= total:
            raise SpecMismatch(
                "layer_map must be strictly increasing decoder indices",
                expected=f"indices in [0, {total})",
                found=layer_map,
            )

    @property
    def dtype(self) -> np.dtype[np.unsignedinteger]:
        """Canonical element type, derived from ``num_experts`` alone."""
        return canonical_dtype(self.num_experts)

    @property
    def decoder_layers(self) -> int:
        """Decoder layers in the model, dense ones included."""
        if self.total_layers is not None:
            return self.total_layers
        return self.num_layers if not self.layer_map else self.layer_map[-1] + 1

    @property
    def row_shape(self) -> tuple[int, int]:
        """Shape of one token row: ``(num_layers, top_k)``."""
        return (self.num_layers, self.top_k)

    @property
    def row_nbytes(self) -> int:
        """Canonical bytes per token row."""
        return self.num_layers * self.top_k * self.dtype.itemsize

    def nbytes(self, rows: int) -> int:
        """Canonical bytes of ``rows`` token rows."""
        return rows * self.row_nbytes

    def moe_layer_indices(self) -> tuple[int, ...]:
        """Decoder-layer index of every MoE layer, in order."""
        return self.layer_map if self.layer_map is not None else tuple(range(self.num_layers))

    def moe_layer(self, decoder_layer: int) -> int | None:
        """MoE layer index (the payload's layer column) of a decoder layer; None when that
        decoder layer is dense. Refuses an index outside the model's decoder layers.

        Example:
            >>> spec = RouteSpec(num_layers=2, top_k=2, num_experts=8, layer_map=(1, 3))
            >>> [spec.moe_layer(d) for d in range(4)]
            [None, 0, None, 1]
        """
        if not 0 <= decoder_layer < self.decoder_layers:
            raise SpecMismatch(
                "decoder layer index out of range",
                expected=f"0 <= decoder layer < {self.decoder_layers}",
                found=decoder_layer,
                hint="Index by decoder layer over every decoder layer, dense ones included.",
            )
        layers = self.moe_layer_indices()
        column = bisect.bisect_left(layers, decoder_layer)  # the layer map is increasing
        return column if column < len(layers) and layers[column] == decoder_layer else None

    def is_mtp_layer(self, decoder_layer: int) -> bool:
        """True for a multi-token-prediction layer's index (past the decoder layers, within
        ``mtp_layers``): XTuner numbers its MTP blocks' ``MoEDecoderLayer`` from
        ``num_hidden_layers`` on.

        Example:
            >>> spec = RouteSpec(num_layers=2, top_k=2, num_experts=8, mtp_layers=1)
            >>> [spec.is_mtp_layer(d) for d in range(4)]
            [False, False, True, False]
        """
        return self.decoder_layers <= decoder_layer < self.decoder_layers + self.mtp_layers

    def __repr__(self) -> str:
        return f"RouteSpec({self.describe()})"

    def describe(self) -> str:
        """One line for logs and the CLI."""
        label = f"{self.name}: " if self.name else ""
        dense = self.decoder_layers - self.num_layers
        extra = f" (+{dense} dense)" if dense else ""
        extra += f" (+{self.mtp_layers} MTP)" if self.mtp_layers else ""
        return (
            f"{label}L={self.num_layers}{extra} K={self.top_k} E={self.num_experts} "
            f"dtype={self.dtype.name} {self.row_nbytes} B/token"
        )
