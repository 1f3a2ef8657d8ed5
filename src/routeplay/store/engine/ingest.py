"""Validation at ingest: an engine store that knows the model's spec validates each
payload as it is put, so adopting a key takes canonical rows that already exist.

Why: validating an adopted payload (range, narrowing, distinct ids: about 25 ms of one
core per 32k-token Qwen3-235B payload) on the trainer's step puts it on the critical
path, next to the transfer, on the engine's node. At ingest it runs while the engine
still generates the step's other samples, and the step itself only moves bytes.

The engine store's actor (``routeplay.store.remote.actors.EngineStoreShell``) starts one
``KeyValidator.ingest`` per put whose metadata fits the spec; the result (a small status
and the canonical block, both owned by the engine store) waits next to the key
(``EngineStore.prepare``). The adopting shard takes each key with what the engine store
knows of its validation (``EngineStoreShell.take_offered_many``: nothing waits in the
engine store once a key is consumed; it ``settle``s the validations that have ended, which
it can look up without a call, and ``decide``s: a key whose validation ended valid comes
as its block alone, any other with its raw payload and the validation to wait for). The
adopter (``routeplay.store.shard.adoption``) waits for a validation still open, and adopts a key
only once its rows are known valid: the block where the validation stands for the key's
own rows, else its raw payload validated on the engine's node; a refused payload fails
there, on the rollout side, with the same error naming the same rows either way. Plain
Python: the Ray calls are passed in.

Costs: one canonical block per payload next to the raw one until the key goes; a key
read with LMDeploy's ``get``, freed, or adopted under another spec is validated all the
same (its block is dropped). A GRPO group's members are laid out from their blocks
(``key_check.canonical_group(..., validated=...)``), not validated again. With
LMDeploy's trailing row, the block keeps that row (one row per sample; readers never
read it).

Lifetime: a ``Validated`` block is owned by the engine store actor and borrowed by the
adopting shard, as the raw payload was until its adoption; it lives while a holder
references it and the engine store lives (detached: it outlives runs). An engine store
killed while a run still holds such blocks makes their reads fail with ``RoutesLost``.

Example:
    >>> store = start_engine_store(spec=spec)  # payloads put from now on: validated at ingest
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from routeplay.core.handle import EngineKey
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import check_dtype, check_shape
from routeplay.errors import RouteplayError
from routeplay.store.engine.engine_store import PayloadMeta

__all__ = ["Prepared", "Validated", "decide", "fits", "settle"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A payload's validation started at ingest (kept next to its key)."""

    spec: RouteSpec
    """The spec it is validated against."""
    rows: int
    """Rows of the payload (all of them: the adopter picks its rows later)."""
    status: Any
    """Reference to None once the payload is valid (the task raises its refusal)."""
    canonical: list[Any]
    """The canonical block's reference, wrapped (Ray passes it through unresolved)."""
    outcome: bool | None = None
    """As the engine store saw it when the key was taken: True valid, False refused or
    lost, None still running (``settle``: the owner checks without a remote call)."""

    def as_validated(self) -> Validated:
        """Its block, to stand for the key's rows."""
        return Validated(canonical=self.canonical, rows=self.rows)


@dataclass(frozen=True, slots=True)
class Validated:
    """What an adopting shard gets for a key validated at ingest: its canonical block."""

    canonical: list[Any]
    """The block's reference, wrapped; rows ``[0, rows)`` of the payload, canonical."""
    rows: int
    """Rows of the block (the key's rows, or one more: LMDeploy's trailing row)."""


def fits(meta: PayloadMeta | None, spec: RouteSpec) -> bool:
    """Whether a payload's metadata fits ``spec`` (else it is not validated at ingest:
    the adopter refuses it by its metadata, before anything is read)."""
    if meta is None or len(meta.shape) != 3:
        return False
    try:
        check_dtype(np.dtype(meta.dtype), spec)
        check_shape(meta.shape, spec)
    except (RouteplayError, TypeError):
        return False
    return True


def settle(
    prepared: Sequence[object], *, outcomes: Callable[[list[Any]], list[bool | None]]
) -> list[object]:
    """Each ``Prepared`` with the outcome of its validation (None while it runs).
    Run by the engine store, which owns the statuses: for it, what one holds is a local
    look-up, where it would cost the adopter a call to the owner (several ms each on a
    busy node, on the step's critical path). ``outcomes``: what the statuses came to,
    without waiting, all looked up at once (a take of a round of GRPO groups settles
    a hundred keys).

    Best effort: the keys are consumed already, so a look-up that fails leaves every
    outcome unknown (the adopter then waits for those it needs) and loses nothing."""
    ready = [one for one in prepared if isinstance(one, Prepared)]
    if not ready:
        return list(prepared)
    try:
        ended = iter(outcomes([one.status for one in ready]))
        return [
            replace(one, outcome=next(ended)) if isinstance(one, Prepared) else one
            for one in prepared
        ]
    except Exception:  # whatever the look-up raised, the keys must still be handed over
        log.warning("validations at ingest not settled", exc_info=True)
        return list(prepared)


def decide(
    taken: Sequence[Any],
    prepared: Sequence[object],
    keys: Sequence[EngineKey],
    starts: Sequence[int],
    spec: RouteSpec,
) -> tuple[list[Any], list[object]]:
    """What the engine store hands the adopter for the keys it consumed (``taken``): per
    key, a ``Validated`` block in place of its raw reference where the validation at
    ingest ended valid under ``spec`` (the raw payload then goes at once), and the
    ``Prepared`` the adopter must wait for where it is still running or ended refused
    under ``spec`` (the raw reference stays: a refusal may lie in rows the key leaves
    out, and a lost validation leaves only the raw payload); None for every other key.
    The adopter's side is ``routeplay.store.shard.adoption``.

    Each reference a reply carries costs its receiver a registration with the owner, on
    the adopter's path (with Ray 2.60 here, a reply with 24 references took 3.8 ms, with
    8 2.8 ms, with none 1.1 ms), so a decided key's reply carries its block alone.

    Example:
        >>> decide([["raw"]], [ready], [key], [0], spec)  # doctest: +SKIP
        ([Validated(canonical=[...], rows=300)], [None])
    """
    out, waits = list(taken), list[object]([None] * len(taken))
    for index, (one, ready) in enumerate(zip(taken, prepared, strict=True)):
        if not isinstance(ready, Prepared) or ready.spec != spec or isinstance(one, BaseException):
            continue
        if ready.outcome is True:
            out[index] = ready.as_validated()
        else:  # running, refused or lost: the adopter waits for the status
            waits[index] = ready
    return out, waits
