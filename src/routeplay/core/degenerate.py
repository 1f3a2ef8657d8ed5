"""Degenerate captures: rows an engine bug produced, not routing.

Engines have shipped captures that pass every per-row check yet hold no routing:
all-zero buffers (vLLM #54730, vLLM-Ascend #16314, SGLang #29040, SGLang #37949's NGRAM
tape), rows an engine never routed filled with a constant (verl zero-fills them and
replays expert 0), and a layer whose buffer was never written, repeating one row. For
top-k >= 2 a fill row names an expert K times and is refused as ``DuplicateExperts``;
``DegenerateCheck`` refuses what is left, with ``DegenerateRouting`` naming the layer and
the rows:

- **fill rows** (top-1 models, where a row of one expert per layer is legal): a run of
  at least ``fill_rows`` consecutive token rows in which every id of the row, all layers,
  is the same value, the same for the whole run. Real routing would need that many
  tokens to pick the same expert *number* in every one of the model's independent
  routers: even if one expert took half of every router's tokens, a run of 16 rows over
  4 layers has a chance of 2**-64. Checked only with at least ``min_fill_ids`` layers
  (ids per row); with fewer, a real router can do it, so nothing is refused.
- **a frozen layer**: a payload that starts at the sample's first row (its prompt) and
  has at least ``frozen_rows`` rows, in which one layer names the very same ids in every
  row. A prompt's tokens (chat template, system text) are routed apart by any trained
  router; a continuation payload (``start_row > 0``: a resume's or a later turn's new
  rows only) is not checked, since degenerate generated text (one token repeated) can be
  routed the same way at a layer, and it must be replayed as routed.

Cost: the frozen-layer check compares the first ``frozen_rows`` rows per layer and reads
further only for layers still equal there (none, for real routing); the fill check runs
for top-1 payloads only (an eighth of a top-8 payload's bytes or less).

Example:
    >>> import numpy as np
    >>> from routeplay.core.degenerate import DegenerateCheck
    >>> zeros = np.zeros((32, 4, 1), np.uint8)  # an all-zero top-1 capture
    >>> check = DegenerateCheck()
    >>> check.refuse(zeros, num_experts=8, start_row=0, where="s")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    routeplay.errors.DegenerateRouting: fill rows, not routing: ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.errors import DegenerateRouting, SpecMismatch

__all__ = ["DEFAULT_DEGENERATE", "DegenerateCheck"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DegenerateCheck:
    """Thresholds of the degenerate-capture refusals (see the module docstring); a
    ``RouteSpec`` carries one (``RouteSpec.degenerate``, default ``DEFAULT_DEGENERATE``).

    Example:
        >>> spec = RouteSpec(num_layers=48, top_k=1, num_experts=16,
        ...                  degenerate=DegenerateCheck(fill_rows=32))  # doctest: +SKIP
    """

    fill_rows: int | None = 16
    """Refuse a run of this many fill rows (one value for every id of each row, the same
    value throughout); None: never."""
    min_fill_ids: int = 4
    """Ids per row (MoE layers, top-1) below which fill rows are never refused."""
    frozen_rows: int | None = 64
    """Refuse a layer that repeats one row over a whole payload from row 0 of at least
    this many rows; None: never."""

    def __post_init__(self) -> None:
        for label, value in (("fill_rows", self.fill_rows), ("frozen_rows", self.frozen_rows)):
            if value is not None and value < 2:
                raise SpecMismatch(
                    f"DegenerateCheck.{label} must be at least 2 rows (or None: off)",
                    expected=">= 2 or None",
                    found=value,
                )

    def refuse(
        self, array: npt.NDArray[Any], *, num_experts: int, start_row: int, where: str = ""
    ) -> None:
        """Raise ``DegenerateRouting`` if ``array`` (canonical ``[rows, L, K]``, already
        range- and distinct-checked) holds fill rows or a frozen layer; ``start_row`` is
        the payload's first row in its sample.

        A model whose router has no choice routes that way for real, so nothing is refused
        there: with one expert every row is a fill row; with ``K == num_experts`` every
        row names every expert."""
        rows, layers, top_k = array.shape
        if rows == 0 or top_k >= num_experts:
            return
        if start_row == 0 and self.frozen_rows is not None:
            _refuse_frozen_layer(array, self.frozen_rows, where)
        if self.fill_rows is not None and top_k == 1 and layers >= self.min_fill_ids:
            _refuse_fill_run(array, self.fill_rows, start_row, where)


DEFAULT_DEGENERATE = DegenerateCheck()
"""On by default: it refuses only what real routing cannot produce (module docstring)."""


def _refuse_frozen_layer(array: npt.NDArray[Any], frozen_rows: int, where: str) -> None:
    rows = array.shape[0]
    if rows < frozen_rows:
        return
    first = array[0]
    # Layers equal to row 0 over the first frozen_rows rows: real routing leaves none.
    head = (array[:frozen_rows] == first).all(axis=(0, 2))
    for layer in np.flatnonzero(head):
        if bool((array[:, layer, :] == first[layer]).all()):
            raise DegenerateRouting(
                "a frozen layer, not routing: one layer names the same experts for every "
                "token of the sample",
                expected=f"routing that varies over {rows} tokens, prompt included",
                found=f"ids {first[layer].tolist()} in all {rows} rows",
                where=_at(where, f"layer {int(layer)}, rows [0, {rows})"),
                hint="The engine's capture buffer for this layer was never written (or is "
                "stale): set the sample aside. Thresholds: RouteSpec.degenerate.",
            )


def _refuse_fill_run(array: npt.NDArray[Any], fill_rows: int, start_row: int, where: str) -> None:
    flat = array.reshape(array.shape[0], -1)
    value = flat[:, 0]
    fill = (flat == value[:, None]).all(axis=1)  # every id of the row the same value
    # A run continues while the row is a fill row of the same value as the previous one.
    if not fill.any():
        return
    continues = np.zeros_like(fill)
    continues[1:] = fill[1:] & fill[:-1] & (value[1:] == value[:-1])
    starts = fill & ~continues
    run_ids = np.cumsum(starts) * fill
    lengths = np.bincount(run_ids)[1:]
    longest = int(np.argmax(lengths))
    if lengths[longest] < fill_rows:
        return
    first = int(np.flatnonzero(starts)[longest])
    stop = first + int(lengths[longest])
    raise DegenerateRouting(
        "fill rows, not routing: every layer of consecutive tokens names the same expert",
        expected=f"fewer than {fill_rows} such rows in a row",
        found=f"{stop - first} rows of expert {int(value[first])} in all {flat.shape[1]} layers",
        where=_at(where, f"rows [{start_row + first}, {start_row + stop}), every layer"),
        hint="The engine filled rows it never routed (a zero-filled or padded capture): set "
        "the sample aside. Thresholds: RouteSpec.degenerate.",
    )


def _at(where: str, place: str) -> str:
    return f"{where}, {place}" if where else place
