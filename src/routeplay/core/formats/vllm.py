"""vLLM routed experts: base64 ``.npy`` over HTTP, numpy arrays in process.

HTTP: ``choices[i].routed_experts`` is ``base64(np.save(array))`` with ``array`` of
shape ``[T, L, K]``, uint8 when the model has at most 256 experts, a 16-bit type
otherwise. In process: ``RequestOutput.prompt_routed_experts`` holds the prompt rows
and ``CompletionOutput.routed_experts`` the generated rows; the sample's routing is
their concatenation.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from routeplay.core.formats.b64 import decode_base64, encode_base64
from routeplay.core.formats.npy import read_npy, write_npy
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize, check_dtype, check_shape
from routeplay.errors import MalformedPayload, SpecMismatch

__all__ = ["decode", "encode", "from_outputs", "wire_dtype"]


def wire_dtype(spec: RouteSpec) -> np.dtype[np.integer]:
    """The dtype vLLM puts on the wire for this model."""
    return np.dtype(np.uint8) if spec.num_experts <= 256 else np.dtype(np.int16)


def decode(
    payload: str | bytes,
    spec: RouteSpec,
    *,
    start_row: int = 0,
    expected: int | None = None,
    where: str = "",
) -> Routes:
    """Base64 ``.npy`` → canonical routes; ``expected`` is the row count the tokens imply.

    ``start_row`` is the request's ``routed_experts_prompt_start`` (prompt rows omitted).
    """
    raw = decode_base64(payload, what="vLLM routed_experts", where=where)
    array = read_npy(raw, where=where)
    return canonicalize(array, spec, start_row=start_row, expected=expected, where=where)


def encode(array: npt.NDArray[np.integer], spec: RouteSpec, *, dtype: str | None = None) -> str:
    """What a vLLM server sends for ``array`` (``dtype`` overrides the engine's choice)."""
    wire = np.dtype(dtype) if dtype is not None else wire_dtype(spec)
    return encode_base64(write_npy(np.ascontiguousarray(array, dtype=wire)))


def from_outputs(
    prompt_routed_experts: npt.NDArray[np.integer] | None,
    routed_experts: npt.NDArray[np.integer],
    spec: RouteSpec,
    *,
    expected: int | None = None,
    where: str = "",
) -> Routes:
    """Concatenate vLLM's in-process prompt and completion arrays into one payload."""
    parts = [p for p in (prompt_routed_experts, routed_experts) if p is not None]
    for part in parts:
        if not isinstance(part, np.ndarray):
            raise MalformedPayload(
                "vLLM in-process routing must be numpy arrays",
                expected="numpy.ndarray",
                found=type(part).__name__,
                where=where,
            )
        check_dtype(part.dtype, spec, where=where)
        check_shape(part.shape, spec, where=where)
    if len({part.shape[1] for part in parts}) > 1:
        raise SpecMismatch(
            "prompt and completion routing have different layer counts",
            expected="the same layer axis in both parts",
            found=[list(part.shape) for part in parts],
            where=where,
        )
    # Concatenating in the canonical dtype after the range check would cost a second
    # pass; canonicalize validates the joined source array once and casts once.
    joined = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return canonicalize(joined, spec, expected=expected, where=where)
