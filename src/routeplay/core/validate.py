"""Validation of routing arrays against a RouteSpec, and the cast to canonical dtype.

Every check is a vectorized pass over the array (no Python loop per element); only
when a check fails do we spend time locating the first offending (row, layer) for the
message. Rows are reported as absolute token rows (``start_row`` added).
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
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
    "DistinctCheck",
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
    if _in_range(array, spec):
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


class DistinctCheck:
    """Reusable buffers for "no expert twice in a top-k row", over blocks of (row, layer) pairs.

    A block is copied column-major (slot ``i`` of every pair contiguous), so comparing
    slot ``i`` with slot ``i + s`` for every ``i`` at once is one contiguous SIMD pass per
    shift ``s``: ``K - 1`` compares per block instead of ``K (K - 1) / 2`` (a per-row sort
    is ~10x slower, strided columns ~3x). Blocks of ``max_pairs`` keep the buffers in cache.

    Example:
        >>> check = DistinctCheck(top_k=2, max_pairs=4, dtype=np.dtype(np.uint8))
        >>> check.holds(np.array([[0, 1], [2, 3]], np.uint8)), check.holds(np.array([[5, 5]]))
        (True, False)
    """

    def __init__(self, *, top_k: int, max_pairs: int, dtype: np.dtype[Any]) -> None:
        self._top_k = top_k
        self._columns = np.empty((top_k, max_pairs), dtype=dtype)
        shifts = max(1, top_k - 1)
        self._clash = np.empty((shifts, max_pairs), dtype=bool)
        self._equal = np.empty((shifts, max_pairs), dtype=bool)

    def holds(self, pairs: IntArray) -> bool:
        """Whether every row of ``pairs`` (``[n <= max_pairs, K]``) has K distinct ids."""
        top_k, count = self._top_k, pairs.shape[0]
        if top_k < 2 or count == 0:
            return True
        columns = self._columns[:, :count]
        np.copyto(columns, pairs.T)
        clash = self._clash[:, :count]
        np.equal(columns[1:], columns[:-1], out=clash)  # slots (i, i + 1)
        for shift in range(2, top_k):
            rows = top_k - shift
            equal = self._equal[:rows, :count]
            np.equal(columns[shift:], columns[:-shift], out=equal)  # slots (i, i + shift)
            np.bitwise_or(clash[:rows], equal, out=clash[:rows])
        return not bool(clash.any())


_DISTINCT_BLOCK = 1 << 15
"""(row, layer) pairs per block of ``check_distinct``: 256 KB of uint8 columns at K=8."""


def check_distinct(array: IntArray, *, start_row: int = 0, where: str = "") -> None:
    """Refuse any (token, layer) row that names an expert twice (zero padding shows up here)."""
    _, layers, top_k = array.shape
    if top_k < 2 or array.size == 0:
        return
    pairs = array.reshape(-1, top_k)
    check = DistinctCheck(
        top_k=top_k, max_pairs=min(_DISTINCT_BLOCK, pairs.shape[0]), dtype=array.dtype
    )
    if all(
        check.holds(pairs[first : first + _DISTINCT_BLOCK])
        for first in range(0, pairs.shape[0], _DISTINCT_BLOCK)
    ):
        return
    # Only now find every clash, for the message (first offender and counts).
    ordered = np.sort(pairs, axis=1)
    clash = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
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
    threads: int = 1,
) -> Routes:
    """Validate ``array`` and return it as canonical, read-only, C-contiguous ``Routes``.

    Order matters: shape and dtype first (cheap), then rows, range (before the cast, so
    nothing truncates silently), then the cast, then distinctness on the compact array,
    then the degenerate-capture refusals of ``spec.degenerate`` (fill rows, a frozen
    layer: ``routeplay.core.degenerate``).
    The three run as one sweep over blocks of rows that stay in cache (``_sweep``):
    each byte of the input is read from memory once and each output byte written once.
    ``threads > 1`` sweeps that many contiguous row ranges at once (numpy releases the
    GIL in these loops, so a large payload uses the node's cores; small ones stay on one).
    """
    source = np.dtype(source_dtype if source_dtype is not None else array.dtype)
    check_dtype(array.dtype, spec, where=where)
    check_shape(array.shape, spec, where=where)
    if expected is not None:
        check_row_count(array.shape[0], expected, where=where)
    layers = None if array.shape[1] == spec.num_layers else list(spec.moe_layer_indices())
    # Already canonical and nobody can write to it (a Ray object, a decoder's own
    # buffer made read-only): checked in place, never copied.
    in_place = (
        layers is None
        and array.dtype == spec.dtype
        and array.flags.c_contiguous
        and not array.flags.writeable
    )
    canonical = array if in_place else np.empty((array.shape[0], *spec.row_shape), spec.dtype)
    if not _sweep_all(array, layers, None if in_place else canonical, spec, threads):
        _raise_first_refusal(array, layers, spec, start_row=start_row, where=where)
    spec.degenerate.refuse(
        canonical, num_experts=spec.num_experts, start_row=start_row, where=where
    )
    # A read-only view: Routes are immutable, and the caller's own flags stay untouched.
    canonical = canonical.view()
    canonical.flags.writeable = False
    return Routes(array=canonical, spec=spec, start_row=start_row, source_dtype=source.name)


_MIN_BLOCKS_PER_THREAD = 8
"""A thread's share of a sweep is at least this many blocks (else threads cost more)."""


def _sweep_all(
    array: IntArray, layers: list[int] | None, out: IntArray | None, spec: RouteSpec, threads: int
) -> bool:
    """``_sweep`` over the whole array, split into up to ``threads`` row ranges."""
    block_rows = _block_rows(spec)
    blocks = -(-array.shape[0] // block_rows)
    parts = max(1, min(threads, blocks // _MIN_BLOCKS_PER_THREAD))
    if parts == 1:
        return _sweep(array, layers, out, spec)
    bounds = [block_rows * (blocks * i // parts) for i in range(parts)] + [array.shape[0]]
    ranges = list(itertools.pairwise(bounds))
    with ThreadPoolExecutor(max_workers=parts) as pool:
        done = pool.map(
            lambda r: _sweep(
                array[r[0] : r[1]], layers, None if out is None else out[r[0] : r[1]], spec
            ),
            ranges,
        )
        return all(list(done))


def _block_rows(spec: RouteSpec) -> int:
    return max(1, _DISTINCT_BLOCK // spec.num_layers)


def _sweep(
    array: IntArray, layers: list[int] | None, out: IntArray | None, spec: RouteSpec
) -> bool:
    """Range check, cast into ``out`` (``None``: ``array`` is already canonical, checked
    in place) and distinct check, block by block of rows; False at the first block that
    fails either check (the caller then finds and names the offender)."""
    rows, top_k = array.shape[0], spec.top_k
    if rows == 0:
        return True
    block_rows = _block_rows(spec)
    distinct = DistinctCheck(
        top_k=top_k,
        max_pairs=min(rows, block_rows) * spec.num_layers,
        dtype=spec.dtype if out is not None else array.dtype,
    )
    for lo in range(0, rows, block_rows):
        block = array[lo : lo + block_rows]
        if layers is not None:
            block = block[:, layers, :]  # the MoE layers of an all-layers payload
        if not _in_range(block, spec):
            return False
        target = block
        if out is not None:
            target = out[lo : lo + block_rows]
            np.copyto(target, block, casting="unsafe")  # ids checked: the narrowing is exact
        if not distinct.holds(target.reshape(-1, top_k)):
            return False
    return True


def _in_range(array: IntArray, spec: RouteSpec) -> bool:
    # Viewing signed ints as unsigned maps negatives above every valid id: one max pass.
    unsigned = array.view(array.dtype.str.replace("i", "u")) if array.dtype.kind == "i" else array
    return array.size == 0 or int(unsigned.max()) < spec.num_experts


def _raise_first_refusal(
    array: IntArray, layers: list[int] | None, spec: RouteSpec, *, start_row: int, where: str
) -> None:
    """The slow path, only for a refused array: the whole-array checks, in the documented
    order (every range error before any distinctness error), name the first offender."""
    selected = array if layers is None else array[:, layers, :]
    check_range(selected, spec, start_row=start_row, where=where)
    check_distinct(
        np.ascontiguousarray(selected, dtype=spec.dtype), start_row=start_row, where=where
    )
    raise AssertionError("a block failed a check the whole array passes")  # unreachable


def _at(where: str, row: int, layer: int, slot: int | None = None) -> str:
    place = f"row {row}, layer {layer}" + (f", slot {slot}" if slot is not None else "")
    return f"{where}, {place}" if where else place


def _max_value(dtype: np.dtype[np.generic]) -> int:
    bits = 8 * dtype.itemsize - (1 if dtype.kind == "i" else 0)
    return (1 << bits) - 1
