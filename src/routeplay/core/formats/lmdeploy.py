"""LMDeploy routed experts: nested JSON lists ``[T][L][K]``, or a key into ``shared_store``.

With the Ray executor LMDeploy puts the ``uint16 [T, L, K]`` array into its detached
``shared_store`` actor and returns ``ObjectRef.hex()`` as the key; the data stays there
until someone ``get``s it. Without Ray it returns the nested lists inline.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import EngineKey
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize
from routeplay.errors import DtypeError, MalformedPayload

__all__ = ["KEY_PATTERN", "WIRE_DTYPE", "decode_lists", "encode_lists", "is_key", "parse_key"]

WIRE_DTYPE: Final = np.dtype(np.uint16)
# Ray object ids are 28 bytes, so ObjectRef.hex() is 56 lowercase hex characters.
KEY_PATTERN: Final = re.compile(r"[0-9a-f]{56}")


def is_key(value: object) -> bool:
    """True when ``value`` is an LMDeploy shared-store key rather than inline data."""
    return isinstance(value, str) and KEY_PATTERN.fullmatch(value) is not None


def parse_key(
    value: object,
    *,
    rows: int,
    actor: str = "shared_store",
    namespace: str = "lmdeploy",
    run: str = "",
    trailing_rows: int = 0,
    where: str = "",
) -> EngineKey:
    """A structured reference to the payload behind ``value``; no data is touched."""
    if not is_key(value):
        raise MalformedPayload(
            "routing string is not an LMDeploy shared_store key",
            expected="56 lowercase hex characters (ObjectRef.hex())",
            found=repr(value)[:80],
            where=where,
        )
    assert isinstance(value, str)  # narrowed by is_key
    return EngineKey(
        key=value,
        rows=rows,
        actor=actor,
        namespace=namespace,
        run=run,
        trailing_rows=trailing_rows,
    )


def decode_lists(
    value: object, spec: RouteSpec, *, expected: int | None = None, where: str = ""
) -> Routes:
    """Nested lists ``[T][L][K]`` of ints → canonical routes (one C-level conversion)."""
    if not isinstance(value, list):
        raise MalformedPayload(
            "LMDeploy inline routing must be nested lists",
            expected="list[list[list[int]]]",
            found=type(value).__name__,
            where=where,
        )
    try:
        array = (
            np.asarray(value) if value else np.empty((0, spec.num_layers, spec.top_k), WIRE_DTYPE)
        )
    except (ValueError, OverflowError) as exc:
        raise MalformedPayload(
            "nested routing lists are ragged or not numbers",
            expected=f"[T][{spec.num_layers}][{spec.top_k}] integers",
            found=str(exc).split("\n")[0][:160],
            where=where,
        ) from exc
    if array.dtype.kind not in "iu":
        raise (MalformedPayload if array.dtype.kind in "OUS" else DtypeError)(
            "nested routing lists hold something other than integers",
            expected="integers",
            found=f"elements of type {array.dtype}",
            where=where,
        )
    if array.ndim == 3 and _holds_bools(value):
        raise DtypeError(
            "nested routing lists hold JSON booleans among the ids",
            expected="integers only",
            found="true/false values (numpy would read them as 1/0)",
            where=where,
        )
    return canonicalize(array, spec, expected=expected, where=where)


def _holds_bools(lists: list[Any]) -> bool:
    # numpy silently turns bools mixed with ints into 1/0; a C-level type scan
    # (map/chain, no Python-level loop body) costs about a third of the conversion.
    leaves = itertools.chain.from_iterable(itertools.chain.from_iterable(lists))
    return bool in set(map(type, leaves))


def encode_lists(array: npt.NDArray[np.integer]) -> list[list[list[int]]]:
    """What LMDeploy sends inline for ``array``."""
    lists: list[list[list[int]]] = array.tolist()
    return lists
