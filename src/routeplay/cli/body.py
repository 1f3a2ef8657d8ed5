"""The response body ``routeplay inspect`` reads: from a file or standard input, capped.

Invariant: memory grows with the bytes that actually arrive, never with a size the
input claims (a file's ``st_size``, a pipe that never ends), and never past the cap plus
one chunk: the body is read in chunks and refused as soon as it outgrows the cap.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, BinaryIO, Final

from routeplay.errors import MalformedPayload, MisuseError

__all__ = ["DEFAULT_MAX_BYTES", "STDIN", "parse_body", "read_body"]

DEFAULT_MAX_BYTES: Final = 256 << 20
"""Largest body read by default: a 100k-token answer of a 61-layer, top-8 model is about
150 MB as JSON lists; a larger one needs ``--max-bytes``."""
STDIN: Final = "<stdin>"
"""What a message names the body by when it came from standard input."""
_CHUNK: Final = 1 << 20


def read_body(path: Path | None, *, max_bytes: int) -> tuple[bytearray, str]:
    """The body's bytes and what to call it in messages; ``None`` or ``-``: standard input.

    Raises ``MisuseError`` once the body outgrows ``max_bytes`` and ``OSError`` when the
    file cannot be read.

    Example:
        >>> body, where = read_body(Path("resp.json"), max_bytes=1 << 20)  # doctest: +SKIP
    """
    if path is None or str(path) == "-":
        return _read_capped(sys.stdin.buffer, max_bytes, STDIN), STDIN
    with path.open("rb") as stream:
        return _read_capped(stream, max_bytes, path.name), path.name


def _read_capped(stream: BinaryIO, max_bytes: int, where: str) -> bytearray:
    # Chunks, not read(max_bytes + 1): a buffered read of n bytes allocates n up front.
    body = bytearray()
    while chunk := stream.read(_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise MisuseError(
                "the response body is larger than inspect reads",
                expected=f"at most {max_bytes} bytes",
                found=f"more than {max_bytes} bytes (stopped reading there)",
                where=where,
                hint="Pass --max-bytes with a larger limit if the body is really that big.",
            )
    return body  # not bytes(body): that copy would double the peak for a large body


def parse_body(text: bytes | bytearray, where: str) -> Any:
    """The body as JSON, or ``MalformedPayload`` saying what kept it from parsing.

    Example:
        >>> parse_body(b'{"choices": []}', "resp.json")
        {'choices': []}
    """
    if not text or text.isspace():  # json's "Expecting value" hides that nothing came
        raise MalformedPayload(
            "response body is empty", expected="one JSON object", found="no bytes", where=where
        )
    try:
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise MalformedPayload(
            "response body is not UTF-8 text",
            expected="a UTF-8 JSON document",
            found=f"byte {exc.start} = {bytes(text[exc.start : exc.start + 1])!r}",
            where=where,
        ) from exc
    except json.JSONDecodeError as exc:
        raise MalformedPayload(
            "response body is not JSON",
            expected="one JSON object",
            found=f"{exc.msg} at line {exc.lineno} column {exc.colno}",
            where=where,
        ) from exc
    except RecursionError as exc:  # nesting deeper than the interpreter's stack
        raise MalformedPayload(
            "response body nests too deeply to parse",
            expected=f"JSON nested less than about {sys.getrecursionlimit()} levels",
            found="deeper nesting",
            where=where,
        ) from exc
    except ValueError as exc:  # an integer over sys.get_int_max_str_digits() digits
        raise MalformedPayload(
            "response body holds a number too long to parse",
            expected=f"integers of at most {sys.get_int_max_str_digits()} digits",
            found=str(exc)[:160],
            where=where,
        ) from exc
