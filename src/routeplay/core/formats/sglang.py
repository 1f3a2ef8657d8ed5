"""SGLang routed experts: base64 of raw little-endian int32, flattened, no header.

The decoded bytes hold rows ``[start_len, T)`` of ``[T, L, K]`` where ``start_len`` is
the request's ``routed_experts_start_len`` (never echoed in the body), so the row count
is derived from the byte length and the spec.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from routeplay.core.formats.b64 import decode_base64, encode_base64
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize
from routeplay.errors import MalformedPayload

__all__ = ["WIRE_DTYPE", "decode", "encode"]

WIRE_DTYPE = np.dtype("<i4")


def decode(
    payload: str | bytes,
    spec: RouteSpec,
    *,
    start_row: int = 0,
    expected: int | None = None,
    where: str = "",
) -> Routes:
    """Base64 int32 → canonical routes for rows ``[start_row, start_row + rows)``."""
    raw = decode_base64(payload, what="SGLang routed_experts", where=where)
    layers = _layer_count(len(raw), spec, expected, where)
    array = np.frombuffer(raw, dtype=WIRE_DTYPE).reshape(-1, layers, spec.top_k)
    return canonicalize(array, spec, start_row=start_row, expected=expected, where=where)


def encode(array: npt.NDArray[np.integer], *, start_row: int = 0) -> str:
    """What SGLang sends for rows ``[start_row, T)`` of the full ``[T, L, K]`` array."""
    return encode_base64(np.ascontiguousarray(array[start_row:], dtype=WIRE_DTYPE).data)


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
