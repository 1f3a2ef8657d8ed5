"""Checking an adopted engine key: its metadata before it is consumed, its rows once.

Plain numpy over ``routeplay.core.validate`` (no Ray). ``check_key_meta`` runs where the
key lives (the engine store), before the key is consumed, so a refused key is freed
there and never leaks. ``canonical_rows`` runs once per payload, on the engine's node
(``routeplay.store.actors.KeyValidator``): it keeps the key's rows (an LMDeploy payload
may hold one trailing row more, see ``EngineKey.trailing_rows``), validates
them and narrows them to the canonical dtype, so trainer ranks only ever copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import EngineKey
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize, check_dtype, check_row_count, check_shape
from routeplay.errors import MalformedPayload, RouteplayError, RunMismatch
from routeplay.store.engine_store import EngineStore, PayloadMeta

__all__ = [
    "canonical_routes",
    "canonical_rows",
    "check_key_meta",
    "check_key_rows",
    "take_checked_many",
]


def check_key_rows(payload_rows: int, key: EngineKey, *, where: str) -> None:
    """Refuse a payload whose row count the key cannot explain."""
    if payload_rows not in key.payload_rows:
        check_row_count(payload_rows, key.rows, where=where)


def check_key_meta(meta: PayloadMeta, key: EngineKey, spec: RouteSpec) -> None:
    """Shape, dtype and row count of a key's payload, from metadata (nothing is read)."""
    where = f"engine key {key.key}"
    check_dtype(np.dtype(meta.dtype), spec, where=where)
    check_shape(meta.shape, spec, where=where)
    check_key_rows(meta.shape[0], key, where=where)


def take_checked_many(
    store: EngineStore[Any], keys: list[EngineKey], spec: RouteSpec, run: str | None = None
) -> list[Any]:
    """Per key: its wrapped reference (consumed), or the error that refused it (the key
    is then freed, never leaked). One engine-store call for a whole batch of keys.
    ``run``: the adopting store's run; a key issued to, or claimed by, another run is
    refused with ``RunMismatch`` and left untouched (it is not ours to free)."""
    out: list[Any] = []
    for key in keys:
        if run is not None and key.run not in ("", run):
            out.append(_other_run(key, run))
            continue

        def check(meta: PayloadMeta, key: EngineKey = key) -> None:
            check_key_meta(meta, key, spec)

        try:
            out.append(store.take_checked(key.key, check, run))
        except RouteplayError as exc:
            out.append(exc)
    return out


def _other_run(key: EngineKey, run: str) -> RunMismatch:
    return RunMismatch(
        "engine key issued to another run",
        expected=f"a key of run {run}",
        found=f"a key of run {key.run}",
        where=f"engine key {key.key}",
    )


def canonical_rows(
    payload: object, key: EngineKey, spec: RouteSpec
) -> npt.NDArray[np.unsignedinteger]:
    """Rows ``[0, key.rows)`` of a key's payload, validated and canonical (one copy:
    the trailing row is dropped by slicing, before the narrowing cast copies)."""
    return canonical_routes(payload, key, spec).array


def canonical_routes(payload: object, key: EngineKey, spec: RouteSpec) -> Routes:
    """``canonical_rows`` as ``Routes`` (what a batch layout takes)."""
    where = f"engine key {key.key}"
    array = check_key_payload(payload, key, spec, where=where)
    return canonicalize(array[: key.rows], spec, expected=key.rows, where=where)


def check_key_payload(
    payload: object, key: EngineKey, spec: RouteSpec, *, where: str
) -> npt.NDArray[Any]:
    """The payload behind a key as an array whose type, shape and rows the key explains,
    checked before anything is copied or allocated for the rows the response claimed."""
    if not isinstance(payload, np.ndarray):
        raise MalformedPayload(
            "an engine key's payload is not an array",
            expected="a numpy integer array [T, L, K]",
            found=type(payload).__name__,
            where=where,
        )
    check_dtype(payload.dtype, spec, where=where)
    check_shape(payload.shape, spec, where=where)
    check_key_rows(int(payload.shape[0]), key, where=where)
    return payload
