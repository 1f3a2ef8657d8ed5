"""LMDeploy routed experts: nested JSON lists ``[T][L][K]``, or a key into ``shared_store``.

With the Ray executor LMDeploy puts the ``uint16 [T, L, K]`` array into its detached
``shared_store`` actor and returns ``ObjectRef.hex()`` as the key; the data stays there
until someone ``get``s it. Without Ray it returns the nested lists inline.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import EngineKey
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize, check_shape
from routeplay.errors import DtypeError, MalformedPayload, describe

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
            found=describe(value),
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
    """Nested lists ``[T][L][K]`` of ints → canonical routes.

    The nesting and every leaf's type are checked first, with C-level passes in constant
    extra memory; only then does numpy convert (one C-level pass into int64). So a string
    or a float among the ids is refused before numpy could build an array sized by the
    longest leaf, and a bool is never read as 0/1.
    """
    if not isinstance(value, list):
        raise MalformedPayload(
            "LMDeploy inline routing must be nested lists",
            expected="list[list[list[int]]]",
            found=type(value).__name__,
            where=where,
        )
    if not value:
        return canonicalize(
            np.empty((0, spec.num_layers, spec.top_k), WIRE_DTYPE),
            spec,
            expected=expected,
            where=where,
        )
    _check_nesting(value, spec, where)
    try:
        array = np.array(value, dtype=np.int64)
    except OverflowError as exc:
        raise MalformedPayload(
            "nested routing lists hold an integer beyond 64 bits",
            expected="integers that fit in int64",
            found=str(exc)[:160],
            where=where,
        ) from exc
    return canonicalize(array, spec, expected=expected, where=where)


def _check_nesting(rows: list[Any], spec: RouteSpec, where: str) -> None:
    """Refuse anything but ``[T][L][K]`` lists of ints, L and K of the spec (C-level
    passes: ``set(map(...))`` over rows, then (row, layer) lists, then leaves)."""
    ragged = f"[T][{spec.num_layers}][{spec.top_k}] integers"
    _all_lists(rows, "token rows", ragged, where)
    layers = _uniform_length(rows, "token rows", ragged, where)
    middle = itertools.chain.from_iterable(rows)
    _all_lists(middle, "(token, layer) entries", ragged, where)
    top_k = _uniform_length(itertools.chain.from_iterable(rows), "layer entries", ragged, where)
    check_shape((len(rows), layers, top_k), spec, where=where)
    leaves = itertools.chain.from_iterable(itertools.chain.from_iterable(rows))
    kinds = set(map(type, leaves))
    if kinds == {int}:
        return
    names = sorted(kind.__name__ for kind in kinds - {int})
    numeric = set(names) <= {"bool", "float"}
    raise (DtypeError if numeric else MalformedPayload)(
        "nested routing lists hold something other than integers",
        expected="integers",
        found=f"elements of type {', '.join(names)}"
        + (" (numpy would read true/false as 1/0)" if "bool" in names else ""),
        where=where,
    )


def _all_lists(values: Iterable[Any], what: str, expected: str, where: str) -> None:
    kinds = set(map(type, values))
    if kinds <= {list}:
        return
    names = sorted(kind.__name__ for kind in kinds - {list})
    raise MalformedPayload(
        "nested routing lists are ragged or not numbers",
        expected=expected,
        found=f"{what} of type {', '.join(names)}",
        where=where,
    )


def _uniform_length(values: Iterable[list[Any]], what: str, expected: str, where: str) -> int:
    lengths = set(map(len, values))
    if len(lengths) == 1:
        return lengths.pop()
    shown = sorted(lengths)[:6]
    raise MalformedPayload(
        "nested routing lists are ragged or not numbers",
        expected=expected,
        found=f"{what} of lengths {shown}" + ("..." if len(lengths) > 6 else ""),
        where=where,
    )


def encode_lists(array: npt.NDArray[np.integer]) -> list[list[list[int]]]:
    """What LMDeploy sends inline for ``array``."""
    lists: list[list[list[int]]] = array.tolist()
    return lists
