"""Checking an adopted engine key: its metadata before it is consumed, its rows once.

Plain numpy over ``routeplay.core.validate`` (no Ray). ``check_key_meta`` runs where the
key lives (the engine store), before the key is consumed, so a refused key is freed
there and never leaks. ``canonical_rows`` runs once per payload, on the engine's node
(``routeplay.store.remote.actors.KeyValidator``): it keeps the key's rows (an LMDeploy payload
may hold one trailing row more, see ``EngineKey.trailing_rows``), validates
them and narrows them to the canonical dtype, so trainer ranks only ever copy.

Only new rows: an engine store holds the whole sequence (LMDeploy, XTuner's SGLang),
also for a resume or a later turn whose history the store already holds. The adopter
gives a start row (the history's rows) and only rows ``[start, rows)`` are validated,
narrowed and kept; the rows before it are dropped with the raw payload, on the engine's
node, so they never cross nodes nor stay stored twice. Their shape and dtype are checked
(the payload's metadata); their values are *not* compared with the history's rows, by
choice: a resume under new weights re-routes the history (R3 replays the rows that
sampled those tokens, the history's own), the inline path (``new_rows``) keeps the
history the same way, and a comparison would need the history's rows on the engine's
node, the very copy this avoids. A caller that wants the check adopts from row 0 and
compares the rows itself.

``canonical_group`` lays a GRPO group's keys out together (``routeplay.store.write_plan``):
each member's rows are validated on their own, a member whose rows are refused is set
aside with its error, and the others become one layout (their verified-equal prompt
rows once; ``pack``: one payload).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import EngineKey
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize, check_dtype, check_row_count, check_shape
from routeplay.errors import HandleError, MalformedPayload, RouteplayError, RunMismatch
from routeplay.store.engine.engine_store import EngineStore, PayloadMeta
from routeplay.store.write_plan import BatchLayout, plan_batch

__all__ = [
    "GroupLayout",
    "canonical_group",
    "canonical_routes",
    "canonical_rows",
    "check_key_meta",
    "check_key_rows",
    "check_start_rows",
    "key_where",
    "take_checked_many",
]


def check_key_rows(payload_rows: int, key: EngineKey, *, where: str) -> None:
    """Refuse a payload whose row count the key cannot explain."""
    if payload_rows not in key.payload_rows:
        check_row_count(payload_rows, key.rows, where=where)


def key_where(key: EngineKey) -> str:
    """How a refusal names a key: the key and the engine store (its wire) it came from.

    Example:
        >>> key_where(EngineKey(key="ab" * 28, rows=3))  # doctest: +ELLIPSIS
        'engine key abab... (lmdeploy/shared_store)'
    """
    return f"engine key {key.key} ({key.namespace}/{key.actor})"


def check_key_meta(meta: PayloadMeta, key: EngineKey, spec: RouteSpec) -> None:
    """Shape, dtype and row count of a key's payload, from metadata (nothing is read)."""
    where = key_where(key)
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
            # Without its traceback: its frames hold every key's offered validation and
            # raw reference of the take in a cycle (the error is in ``out``) that only the
            # garbage collector breaks, which an idle engine store may not run for minutes.
            out.append(exc.with_traceback(None))
    return out


def _other_run(key: EngineKey, run: str) -> RunMismatch:
    return RunMismatch(
        "engine key issued to another run",
        expected=f"a key of run {run}",
        found=f"a key of run {key.run}",
        where=f"engine key {key.key}",
    )


def check_start_rows(keys: Sequence[EngineKey], start_rows: Sequence[int] | None) -> list[int]:
    """One start row per key (0 when none are given), each leaving a row to adopt."""
    starts = [0] * len(keys) if start_rows is None else [int(s) for s in start_rows]
    if len(starts) != len(keys):
        raise HandleError(
            "one start row per adopted key",
            expected=f"{len(keys)} start rows",
            found=f"{len(starts)} start rows",
        )
    for key, start in zip(keys, starts, strict=True):
        if not 0 <= start < key.rows:
            raise HandleError(
                "an adopted key's start row leaves no row to adopt",
                expected=f"a start row in [0, {key.rows})",
                found=start,
                where=f"engine key {key.key}",
                hint="A key with no rows past the history is freed, not adopted "
                "(RouteStore.free_key; stitch does so).",
            )
    return starts


def canonical_rows(
    payload: object, key: EngineKey, spec: RouteSpec, start: int = 0, *, threads: int = 1
) -> npt.NDArray[np.unsignedinteger]:
    """Rows ``[start, key.rows)`` of a key's payload, validated and canonical (one copy:
    the history rows and the trailing row are dropped by slicing, before the narrowing
    cast copies); ``threads`` as in ``canonicalize``."""
    return canonical_routes(payload, key, spec, start, threads=threads).array


def canonical_routes(
    payload: object, key: EngineKey, spec: RouteSpec, start: int = 0, *, threads: int = 1
) -> Routes:
    """``canonical_rows`` as ``Routes`` (what a batch layout takes); errors name the
    sequence's rows (a refused row ``r`` is row ``r`` of the whole sequence)."""
    where = key_where(key)
    array = check_key_payload(payload, key, spec, where=where)
    return canonicalize(
        array[start : key.rows],
        spec,
        start_row=start,
        expected=key.rows - start,
        where=where,
        threads=threads,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLayout:
    """A group of adopted keys laid out for storing, its refused members set aside."""

    layout: BatchLayout
    """The accepted members' rows as arrays to store (``samples``: accepted only)."""
    outcomes: tuple[int | RouteplayError, ...]
    """Per key, in order: its index into ``layout.samples``, or the error refusing it."""


def validated_routes(block: object, key: EngineKey, spec: RouteSpec, start: int = 0) -> Routes:
    """Rows ``[start, key.rows)`` of a block validated at ingest
    (``routeplay.store.engine.ingest``: every row of the key's payload, canonical), as
    ``Routes``, validated again by nothing but their type and shape (a view: no copy).

    Example:
        >>> routes = validated_routes(block, key, spec, start=0)  # doctest: +SKIP
    """
    where = key_where(key)
    if not isinstance(block, np.ndarray) or block.dtype != spec.dtype:
        raise MalformedPayload(
            "a block validated at ingest is not a canonical array",
            expected=f"a numpy {spec.dtype} array [T, L, K]",
            found=getattr(block, "dtype", type(block).__name__),
            where=where,
        )
    if tuple(block.shape[1:]) != spec.row_shape:
        raise MalformedPayload(
            "a block validated at ingest has another row shape",
            expected=spec.row_shape,
            found=tuple(block.shape[1:]),
            where=where,
        )
    check_key_rows(int(block.shape[0]), key, where=where)
    rows = block[start : key.rows].view()
    rows.flags.writeable = False
    return Routes(array=rows, spec=spec, start_row=start, source_dtype=spec.dtype.name)


def canonical_group(
    payloads: Sequence[object],
    keys: Sequence[EngineKey],
    spec: RouteSpec,
    starts: Sequence[int],
    *,
    shared_prefix: int = 0,
    pack: bool = False,
    validated: Sequence[bool] = (),
) -> GroupLayout:
    """Each key's rows ``[start, rows)`` validated on its own; the accepted ones laid out
    together (``plan_batch``: verified-equal first ``shared_prefix`` rows once, ``pack``
    one array), a refused one set aside with its error, so it costs only its member.
    ``validated[i]``: payload ``i`` is the key's block validated at ingest, taken as it is
    (``validated_routes``); the others are raw payloads (default: all of them).

    Example:
        >>> group = canonical_group(raw, keys, spec, [0] * len(keys), shared_prefix=600)
        >>> group.outcomes  # doctest: +SKIP
        (0, 1, DuplicateExperts(...), 2)
    """
    accepted: list[Routes] = []
    outcomes: list[int | RouteplayError] = []
    ready = list(validated) or [False] * len(keys)
    for payload, key, start, done in zip(payloads, keys, starts, ready, strict=True):
        try:
            read = validated_routes if done else canonical_routes
            accepted.append(read(payload, key, spec, start))
        except RouteplayError as exc:
            # Without its traceback: the frames would hold every raw payload of the group
            # (zero-copy views of the object store) in a cycle only the GC breaks.
            outcomes.append(exc.with_traceback(None))
            continue
        outcomes.append(len(accepted) - 1)
    layout = plan_batch(accepted, prefix_rows=shared_prefix, pack=pack)
    return GroupLayout(layout=layout, outcomes=tuple(outcomes))


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
