"""Validation of routing arrays against a RouteSpec, and the cast to canonical dtype.

Every check is a vectorized pass over the array (no Python loop per element); only
when a check fails do we spend time locating the first offending (row, layer) for the
message. Rows are reported as absolute token rows (``start_row`` added).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import (
    DtypeError,
    DuplicateExperts,
    ExpertOutOfRange,
    RowCountMismatch,
    SpecMismatch,
)

__all__ = [
    "canonicalize",
    "check_distinct",
    "check_dtype",
    "check_range",
    "check_row_count",
    "check_shape",
    "expected_rows",
]

IntArray = npt.NDArray[Any]


def expected_rows(prompt_tokens: int, completion_tokens: int, start_row: int = 0) -> int:
    """Rows an engine must send: every input token but the last generated one, from start_row."""
    return prompt_tokens + completion_tokens - 1 - start_row


def check_row_count(rows: int, expected: int, *, where: str = "") -> None:
    """Raise ``RowCountMismatch`` unless ``rows == expected``."""
    if rows != expected:
        off = rows - expected
        hint = (
            "One row too many: the engine included the last generated token."
            if off == 1
            else "Check the token counts and the start row the request asked for."
        )
        raise RowCountMismatch(
            "routing rows do not match the token counts",
            expected=f"{expected} rows (prompt + completion - 1 - start)",
            found=f"{rows} rows",
            where=where,
            hint=hint,
        )


def check_dtype(dtype: np.dtype[np.generic], spec: RouteSpec, *, where: str = "") -> None:
    """Refuse non-integer dtypes and integer dtypes too narrow for every expert id."""
    if dtype.kind not in "iu":
        raise DtypeError(
            "routing must be an integer array",
            expected="an integer dtype",
            found=str(dtype),
            where=where,
        )
    if _max_value(dtype) < spec.num_experts - 1:
        raise DtypeError(
            "dtype cannot hold every expert id, so ids may have wrapped",
            expected=f"a dtype holding ids up to {spec.num_experts - 1}",
            found=str(dtype),
            where=where,
        )


def check_shape(shape: tuple[int, ...], spec: RouteSpec, *, where: str = "") -> None:
    """Refuse arrays that are not ``[rows, L, K]`` for the spec (L may count dense layers)."""
    layer_counts = {spec.num_layers, spec.decoder_layers}
    if len(shape) != 3 or shape[1] not in layer_counts or shape[2] != spec.top_k:
        layers = " or ".join(str(n) for n in sorted(layer_counts))
        raise SpecMismatch(
            "routing shape does not match the model spec",
            expected=f"[rows, {layers}, {spec.top_k}]",
            found=list(shape),
            where=where,
        )


def check_range(array: IntArray, spec: RouteSpec, *, start_row: int = 0, where: str = "") -> None:
    """Refuse ids outside ``[0, num_experts)``; negative ids included."""
    if array.size == 0:
        return
    # Viewing signed ints as unsigned maps negatives above every valid id: one max pass.
    unsigned = array.view(array.dtype.str.replace("i", "u")) if array.dtype.kind == "i" else array
    if int(unsigned.max()) < spec.num_experts:
        return
    bad = (array < 0) | (array >= spec.num_experts)
    row, layer, slot = np.unravel_index(int(np.argmax(bad)), array.shape)
    raise ExpertOutOfRange(
        "expert id out of range",
        expected=f"ids in [0, {spec.num_experts})",
        found=int(array[row, layer, slot]),
        where=_at(where, start_row + int(row), int(layer), int(slot)),
        hint=f"{int(bad.sum())} ids are out of range; is num_experts right for this model?",
    )


def check_distinct(array: IntArray, *, start_row: int = 0, where: str = "") -> None:
    """Refuse any (token, layer) row that names an expert twice (zero padding shows up here)."""
    _, layers, top_k = array.shape
    if top_k < 2 or array.size == 0:
        return
    # Column-major copy makes every pairwise compare a contiguous SIMD pass (~3x faster
    # than strided columns, ~10x faster than sorting each row).
    columns = np.ascontiguousarray(array.reshape(-1, top_k).T)
    clash = np.zeros(columns.shape[1], dtype=bool)
    equal = np.empty_like(clash)
    for i in range(top_k):
        for j in range(i + 1, top_k):
            np.equal(columns[i], columns[j], out=equal)
            clash |= equal
    if not clash.any():
        return
    flat = int(np.argmax(clash))
    row, layer = divmod(flat, layers)
    zero_rows = int((array.reshape(-1, top_k) == 0).all(axis=1).sum())
    hint = f"{int(clash.sum())} rows repeat an expert"
    hint += f", {zero_rows} are all zeros (padding?)." if zero_rows else "."
    raise DuplicateExperts(
        "an expert appears twice in one top-k row",
        expected=f"{top_k} distinct ids",
        found=array[row, layer].tolist(),
        where=_at(where, start_row + row, layer),
        hint=hint,
    )


def canonicalize(
    array: IntArray,
    spec: RouteSpec,
    *,
    start_row: int = 0,
    expected: int | None = None,
    source_dtype: np.dtype[np.generic] | None = None,
    where: str = "",
) -> Routes:
    """Validate ``array`` and return it as canonical, read-only, C-contiguous ``Routes``.

    Order matters: shape and dtype first (cheap), then rows, range (before the cast, so
    nothing truncates silently), then the cast, then distinctness on the compact array.
    """
    source = np.dtype(source_dtype if source_dtype is not None else array.dtype)
    check_dtype(array.dtype, spec, where=where)
    check_shape(array.shape, spec, where=where)
    if expected is not None:
        check_row_count(array.shape[0], expected, where=where)
    if array.shape[1] != spec.num_layers:
        # The engine sent every decoder layer: keep the MoE ones only.
        array = array[:, list(spec.moe_layer_indices()), :]
    check_range(array, spec, start_row=start_row, where=where)
    canonical = np.ascontiguousarray(array, dtype=spec.dtype)
    if canonical.flags.writeable and np.may_share_memory(canonical, array):
        # The caller could mutate its buffer after validation; Routes must not change.
        canonical = canonical.copy()
    check_distinct(canonical, start_row=start_row, where=where)
    # A read-only view: Routes are immutable, and the caller's own flags stay untouched.
    canonical = canonical.view()
    canonical.flags.writeable = False
    return Routes(array=canonical, spec=spec, start_row=start_row, source_dtype=source.name)


def _at(where: str, row: int, layer: int, slot: int | None = None) -> str:
    place = f"row {row}, layer {layer}" + (f", slot {slot}" if slot is not None else "")
    return f"{where}, {place}" if where else place


def _max_value(dtype: np.dtype[np.generic]) -> int:
    bits = 8 * dtype.itemsize - (1 if dtype.kind == "i" else 0)
    return (1 << bits) - 1
