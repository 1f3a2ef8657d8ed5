"""``LayerSubset``: the MoE layers one reader replays (a pipeline stage's), as columns.

A payload is ``[rows, L, K]`` over every MoE layer. A pipeline stage's routers need only
the columns of its own layers (with virtual stages, a few ranges of them): at PP=8 a
rank that copied every column would copy and hold 8x the routing it replays. A
``LayerSubset`` names those layers in order and copies just their columns, range by
range (numpy slices, no gather temporaries); column ``i`` of the result is MoE layer
``layers[i]``.

Example:
    >>> subset = LayerSubset.of([0, 1, 6, 7], spec)   # chunks 0 and 1 of a PP=4, VP=2 rank
    >>> subset.runs                                  # (first, stop, output column)
    ((0, 2, 0), (6, 8, 2))
    >>> subset.take(rows).shape                      # rows: [T, L, K]
    (T, 4, K)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.spec import RouteSpec
from routeplay.errors import SpecMismatch

__all__ = ["LayerSubset"]


@dataclass(frozen=True, slots=True)
class LayerSubset:
    """MoE layer indices (increasing, distinct) whose columns a reader takes."""

    layers: tuple[int, ...]
    """The MoE layers, in column order of what is read."""
    of_layers: int
    """MoE layers of the model (columns of a stored payload)."""
    runs: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)
    """Contiguous column ranges: ``(first, stop, output column of first)`` (derived)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", _runs(self.layers))  # computed once, kept

    @classmethod
    def of(cls, layers: Iterable[int], spec: RouteSpec) -> LayerSubset:
        """The subset of ``spec``'s MoE layers named by ``layers``, checked.

        Example:
            LayerSubset.of(layout.moe_layers(spec), spec)
        """
        chosen = tuple(int(layer) for layer in layers)
        ordered = tuple(sorted(set(chosen)))
        if not chosen or chosen != ordered or not 0 <= chosen[0] <= chosen[-1] < spec.num_layers:
            raise SpecMismatch(
                "a layer subset must name distinct MoE layers of the model, in order",
                expected=f"increasing MoE layer indices in [0, {spec.num_layers})",
                found=list(chosen),
                hint="A pipeline stage's MoE layers: MegatronLayout.moe_layers(spec).",
            )
        return cls(layers=chosen, of_layers=spec.num_layers)

    @property
    def whole(self) -> bool:
        """True when every MoE layer is in the subset (a plain row copy does)."""
        return len(self.layers) == self.of_layers

    def column(self, layer: int) -> int | None:
        """Column of MoE layer ``layer`` in what is read; None when not in the subset."""
        for first, stop, at in self.runs:
            if first <= layer < stop:
                return at + layer - first
        return None

    def take(self, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The subset's columns of ``rows`` (``[T, L, K]``): a view when they are one range."""
        runs = self.runs
        if len(runs) == 1:
            first, stop, _ = runs[0]
            return rows[:, first:stop]
        out = np.empty((rows.shape[0], len(self.layers), *rows.shape[2:]), rows.dtype)
        self.copy(rows, out)
        return out

    def copy(self, rows: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
        """Copy the subset's columns of ``rows`` into ``out`` (``[T, len(layers), K]``)."""
        for first, stop, at in self.runs:
            out[:, at : at + stop - first] = rows[:, first:stop]

    def concatenate(self, parts: list[npt.NDArray[Any]], out: npt.NDArray[Any]) -> None:
        """Row blocks ``parts`` (each ``[t, L, K]``) end to end into ``out``, subset columns
        only: one C loop per column range."""
        for first, stop, at in self.runs:
            np.concatenate(
                [p[:, first:stop] for p in parts], axis=0, out=out[:, at : at + stop - first]
            )


def _runs(layers: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    out: list[tuple[int, int, int]] = []
    for column, layer in enumerate(layers):
        if out and out[-1][1] == layer:
            first, _, at = out[-1]
            out[-1] = (first, layer + 1, at)
        else:
            out.append((layer, layer + 1, column))
    return tuple(out)
