"""Safe ``.npy`` reading: the header is parsed as a literal, pickles are never loaded.

``np.load(allow_pickle=False)`` would also refuse pickles, but we read the header
ourselves so that we can name the exact refusal (pickle, object dtype, short data)
and wrap the data bytes without a copy.
"""

from __future__ import annotations

import io
import math
import tokenize
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.errors import MalformedPayload, UnsafePayload, describe

__all__ = ["read_npy", "write_npy"]

_MAGIC = b"\x93NUMPY"
_PICKLE_PROTO = 0x80
_MAX_HEADER = 10_000
"""Header bytes we parse at most (numpy's own default limit)."""
_MAX_DIM = 2**63 - 1
"""numpy's largest dimension (intp); beyond it numpy raises a bare ValueError."""


def read_npy(raw: bytes, *, where: str = "") -> npt.NDArray[Any]:
    """A read-only array backed by ``raw``; refuses pickles and object dtypes unexecuted.

    Every refusal is typed: a header that does not parse (truncated dict, nesting that
    would recurse, an unterminated token) is ``MalformedPayload``; record, subarray and
    object dtypes are ``UnsafePayload``; dimensions are checked against the data length
    (and the 64-bit range) before numpy sees them.

    Example:
        >>> read_npy(write_npy(np.zeros((2, 3), np.uint8))).shape
        (2, 3)
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise MalformedPayload(
            ".npy payload must be bytes", expected="bytes", found=type(raw).__name__, where=where
        )
    raw = bytes(raw)
    if not raw.startswith(_MAGIC):
        if raw[:1] == bytes([_PICKLE_PROTO]):
            raise UnsafePayload(
                "payload is a pickle; it was not unpickled",
                expected="an .npy file (np.save)",
                found="pickle protocol header",
                where=where,
                hint="Never unpickle engine bytes: ask the engine for .npy or raw ints.",
            )
        raise MalformedPayload(
            "payload is not an .npy file",
            expected=f"magic {_MAGIC!r}",
            found=describe(raw[:8]),
            where=where,
        )
    shape, fortran, dtype, offset = _read_header(raw, where)
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsafePayload(
            ".npy holds objects, records or subarrays; refused without loading",
            expected="a plain integer dtype",
            found=str(dtype),
            where=where,
        )
    if any(n < 0 for n in shape):
        raise MalformedPayload(
            ".npy header has a negative dimension",
            expected="non-negative dimensions",
            found=describe(list(shape)),
            where=where,
        )
    span = math.prod(n for n in shape if n) * max(dtype.itemsize, 1)
    if any(n > _MAX_DIM for n in shape) or span > _MAX_DIM:
        # numpy refuses such shapes with a bare ValueError ("array is too big"), even when
        # one dimension is 0: it bounds the non-zero dimensions' product times itemsize.
        raise MalformedPayload(
            ".npy header has dimensions beyond the 64-bit range",
            expected="non-zero dimensions whose product times the item size is below 2**63",
            found=describe(list(shape)),
            where=where,
        )
    count = math.prod(shape)  # Python ints: a crafted header cannot overflow this
    need = count * dtype.itemsize
    have = len(raw) - offset
    if have != need:
        raise MalformedPayload(
            ".npy data length does not match its header",
            expected=f"{need} bytes for shape {describe(list(shape))} {dtype}",
            found=f"{have} bytes",
            where=where,
        )
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
    try:
        if fortran:
            transposed: npt.NDArray[Any] = flat.reshape(shape[::-1]).T
            return transposed
        return flat.reshape(shape)
    except ValueError as exc:  # any shape numpy still refuses: ours to name, not numpy's
        raise MalformedPayload(
            ".npy shape cannot be built",
            expected="a shape numpy can represent",
            found=f"{describe(list(shape))}: {str(exc)[:120]}",
            where=where,
        ) from exc


def _read_header(raw: bytes, where: str) -> tuple[tuple[int, ...], bool, np.dtype[np.generic], int]:
    stream = io.BytesIO(raw)
    try:
        major, _minor = np.lib.format.read_magic(stream)
        # Header parsing is ast.literal_eval of a dict: data, never code.
        read = (
            np.lib.format.read_array_header_1_0
            if major == 1
            else np.lib.format.read_array_header_2_0
        )
        header = read(stream, max_header_size=_MAX_HEADER)
        shape, fortran, dtype = header
        return tuple(int(n) for n in shape), bool(fortran), np.dtype(dtype), stream.tell()
    # literal_eval of a hostile header: a truncated dict (TokenError), 5,000 nested unary
    # minus signs (RecursionError, or MemoryError in the parser), a bad descr (TypeError).
    except (
        ValueError,
        SyntaxError,
        TypeError,
        tokenize.TokenError,
        RecursionError,
        MemoryError,
        OverflowError,
    ) as exc:
        raise MalformedPayload(
            ".npy header is malformed",
            expected="a valid .npy v1-v3 header",
            found=f"{type(exc).__name__}: {str(exc)[:160]}",
            where=where,
        ) from exc


def write_npy(array: npt.NDArray[np.generic]) -> bytes:
    """``np.save`` bytes of ``array`` (what vLLM base64-encodes)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()
