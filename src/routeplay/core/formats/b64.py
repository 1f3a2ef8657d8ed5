"""Strict base64 decoding shared by the base64 wire formats (vLLM npy, SGLang int32)."""

from __future__ import annotations

import binascii

import pybase64

from routeplay.errors import MalformedPayload

__all__ = ["decode_base64", "encode_base64"]


def decode_base64(text: str | bytes, *, what: str, where: str = "") -> bytes:
    """Decode standard base64 with padding, refusing any stray or missing character."""
    if not isinstance(text, (str, bytes)):
        raise MalformedPayload(
            f"{what} must be a base64 string",
            expected="str",
            found=type(text).__name__,
            where=where,
        )
    try:
        # validate=True: a truncated or corrupted string fails instead of decoding short.
        return bytes(pybase64.b64decode(text, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise MalformedPayload(
            f"{what} is not valid base64",
            expected="standard base64 with '=' padding, length a multiple of 4",
            found=f"{len(text)} characters ({exc})",
            where=where,
        ) from exc


def encode_base64(raw: bytes | memoryview) -> str:
    """Standard base64 text, as engines put it in JSON."""
    return str(pybase64.b64encode(raw).decode("ascii"))
