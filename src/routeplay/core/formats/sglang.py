"""SGLang routed experts: base64 of raw little-endian int32, flattened, no header.

The decoded bytes hold rows ``[start_len, T)`` of ``[T, L, K]``, where ``start_len`` is
the *request's* ``routed_experts_start_len`` (0 when not set; SGLang never echoes it), so
the row count is derived from the byte length and the spec. ``L`` is the MoE layers or,
as SGLang sends it, every decoder layer (dense ones as zero rows).

Decoding is the hot path of SGLang ingest (a 32k-token Qwen3-235B sample is 131 MB of
base64), so ``decode`` streams: it decodes the base64 a slice of whole rows at a time into
a preallocated canonical array, and range-checks, narrows and checks distinct ids on each
slice while it is in cache. Invariant: its result, and the error it raises, are exactly
those of the plain path (whole-string base64, ``np.frombuffer``, ``canonicalize``): the
slices only *detect* a problem; any problem hands the payload to the plain path, which
then raises the typed error with the absolute row, layer and slot.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import pybase64

from routeplay.core.formats.b64 import decode_base64, encode_base64
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import DistinctCheck, canonicalize
from routeplay.errors import MalformedPayload

__all__ = ["WIRE_DTYPE", "decode", "encode"]

WIRE_DTYPE = np.dtype("<i4")

SLICE_BYTES: Final = 1 << 20
"""Decoded int32 bytes per slice (about 350 Qwen3-235B rows). The slice, its narrowed rows
and the distinctness scratch stay in L2, and about 100 slices per 32k-token sample keep
numpy's per-call overhead small; measured in ``benchmarks/codec_throughput.py``."""


def decode(
    payload: str | bytes,
    spec: RouteSpec,
    *,
    start_row: int = 0,
    expected: int | None = None,
    where: str = "",
) -> Routes:
    """Base64 int32 → canonical routes for rows ``[start_row, start_row + rows)``.

    Strict: a truncated, padded-short or corrupted string is refused (``MalformedPayload``),
    as are a row count other than ``expected`` (``RowCountMismatch``), ids outside
    ``[0, E)`` (``ExpertOutOfRange``) and an id twice in a top-k row (``DuplicateExperts``).

    Example:
        >>> spec = RouteSpec(num_layers=2, top_k=2, num_experts=8)
        >>> ids = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
        >>> decode(encode(ids), spec, expected=2).array.tolist() == ids.tolist()
        True
    """
    plan = _plan(payload, spec, expected)
    if plan is None:
        return _decode_plain(payload, spec, start_row=start_row, expected=expected, where=where)
    out = np.empty((plan.rows, spec.num_layers, spec.top_k), dtype=spec.dtype)
    if not _fill(payload, plan, spec, out):
        return _decode_plain(payload, spec, start_row=start_row, expected=expected, where=where)
    out.flags.writeable = False
    # A view of a read-only base: nobody can turn writing back on.
    return Routes(array=out.view(), spec=spec, start_row=start_row, source_dtype=WIRE_DTYPE.name)


def encode(array: npt.NDArray[np.integer], *, start_row: int = 0) -> str:
    """What SGLang sends for rows ``[start_row, T)`` of the full ``[T, L, K]`` array."""
    return encode_base64(np.ascontiguousarray(array[start_row:], dtype=WIRE_DTYPE).data)


# --------------------------------------------------------------------------- streaming path


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    """How a well-formed payload splits into slices of whole rows."""

    rows: int
    """Token rows in the payload."""
    layers: int
    """Layers per row on the wire (MoE layers, or every decoder layer)."""
    row_bytes: int
    """Decoded bytes per row (``layers * K * 4``)."""
    step: int
    """Rows per slice; ``step * row_bytes`` is a multiple of 3, so every slice starts at
    a 4-character base64 boundary."""

    def char(self, row: int) -> int:
        """Offset in the base64 text where ``row`` starts (``row`` a multiple of ``step``)."""
        return row * self.row_bytes // 3 * 4


def _plan(payload: object, spec: RouteSpec, expected: int | None) -> _Plan | None:
    """The slicing of a payload whose length fits the spec, or None (let the plain path say why)."""
    if not isinstance(payload, (str, bytes)) or len(payload) % 4:
        return None
    tail = payload[-2:]
    padding = tail.count("=") if isinstance(tail, str) else tail.count(b"=")
    nbytes = len(payload) // 4 * 3 - padding
    for layers in dict.fromkeys((spec.num_layers, spec.decoder_layers)):
        row_bytes = layers * spec.top_k * WIRE_DTYPE.itemsize
        rows, rest = divmod(nbytes, row_bytes)
        if rest == 0 and (expected is None or rows == expected):
            whole = max(1, SLICE_BYTES // row_bytes)
            step = whole if row_bytes % 3 == 0 else max(3, whole // 3 * 3)
            return _Plan(rows=rows, layers=layers, row_bytes=row_bytes, step=step)
    return None


def _fill(payload: str | bytes, plan: _Plan, spec: RouteSpec, out: npt.NDArray[np.generic]) -> bool:
    """Decode, check and narrow every slice into ``out``; False at the first problem."""
    text = memoryview(payload) if isinstance(payload, bytes) else payload  # bytes: no copies
    moe = _moe_selector(plan.layers, spec)
    distinct = DistinctCheck(
        top_k=spec.top_k, max_pairs=plan.step * spec.num_layers, dtype=spec.dtype
    )
    pairs = out.reshape(-1, spec.top_k)
    for first in range(0, plan.rows, plan.step):
        stop = min(plan.rows, first + plan.step)
        end = plan.char(stop) if stop < plan.rows else len(payload)
        try:
            raw = pybase64.b64decode(text[plan.char(first) : end], validate=True)
        except (binascii.Error, ValueError):
            return False
        if len(raw) != (stop - first) * plan.row_bytes:  # padding inside the string
            return False
        # Unsigned view: a negative int32 lands above every valid id, so one max suffices.
        ids = np.frombuffer(raw, dtype="<u4").reshape(stop - first, plan.layers, spec.top_k)
        if moe is not None:
            ids = ids[:, moe, :]
        if int(ids.max()) >= spec.num_experts:
            return False
        np.copyto(out[first:stop], ids, casting="unsafe")  # exact: every id < E fits
        if not distinct.holds(pairs[first * spec.num_layers : stop * spec.num_layers]):
            return False
    return True


def _moe_selector(layers: int, spec: RouteSpec) -> slice | npt.NDArray[np.intp] | None:
    """Which wire layers are the MoE ones: None (all), a slice (a view) or an index array."""
    if layers == spec.num_layers:
        return None
    indices = spec.moe_layer_indices()
    if indices[-1] - indices[0] + 1 == len(indices):  # contiguous, e.g. dense layers first
        return slice(indices[0], indices[-1] + 1)
    return np.asarray(indices, dtype=np.intp)


# --------------------------------------------------------------------------- plain path


def _decode_plain(
    payload: str | bytes,
    spec: RouteSpec,
    *,
    start_row: int,
    expected: int | None,
    where: str,
) -> Routes:
    """Whole-string decode then ``canonicalize``: the reference the streaming path matches,
    and the one that explains a refusal (absolute row, layer and slot)."""
    raw = decode_base64(payload, what="SGLang routed_experts", where=where)
    layers = _layer_count(len(raw), spec, expected, where)
    array = np.frombuffer(raw, dtype=WIRE_DTYPE).reshape(-1, layers, spec.top_k)
    return canonicalize(array, spec, start_row=start_row, expected=expected, where=where)


def _layer_count(nbytes: int, spec: RouteSpec, expected: int | None, where: str) -> int:
    """Layers per row: MoE layers, or every decoder layer if only that fits the byte count."""
    candidates = dict.fromkeys((spec.num_layers, spec.decoder_layers))
    fitting = [n for n in candidates if nbytes % (n * spec.top_k * WIRE_DTYPE.itemsize) == 0]
    for layers in fitting:
        if expected is None or nbytes // (layers * spec.top_k * WIRE_DTYPE.itemsize) == expected:
            return layers
    if fitting:
        return fitting[0]  # whole rows, wrong count: the row check names both counts
    row_bytes = spec.num_layers * spec.top_k * WIRE_DTYPE.itemsize
    found = f"{nbytes} bytes"
    raise MalformedPayload(
        "SGLang routing byte length does not fit the spec",
        expected=(
            f"{expected} rows x {row_bytes} bytes = {expected * row_bytes} bytes"
            if expected is not None
            else f"a multiple of {row_bytes} bytes (L x K x 4)"
        ),
        found=found,
        where=where,
    )
