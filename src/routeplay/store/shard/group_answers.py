"""What the engine node's validator answers an adopter for GRPO groups of engine keys
(``AdoptionSteps.send_groups``): per group asked, its members' outcomes and layout, or the
typed error that failed that group alone; every accepted group's arrays staged under one
token. ``lay_out_groups`` is the validator's side, shared by the Ray validator and the
in-process backend; ``routeplay.store.shard.adoption`` decides on the answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from routeplay.core.handle import EngineKey
from routeplay.core.spec import RouteSpec
from routeplay.errors import MisuseError, RouteplayError
from routeplay.store.engine.key_check import GroupLayout, canonical_group
from routeplay.store.shard.shard import StoredPayload

__all__ = ["GroupAnswer", "GroupRequest", "LaidOut", "lay_out_groups"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupRequest:
    """One group's layout, as the adopter asks it of the engine node's validator
    (``AdoptionSteps.send_groups``); its payloads travel beside it, in member order."""

    keys: tuple[EngineKey, ...]
    """The members' keys (those its take accepted)."""
    starts: tuple[int, ...]
    """Per member, the first row stored."""
    shared_prefix: int
    """Rows the members share (the group's prompt)."""
    pack: bool
    """The members laid out as one payload."""
    validated: tuple[bool, ...]
    """Per member: its payload is its block validated at ingest (taken as it is)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupAnswer:
    """A group's validation and layout, as its validator answers it."""

    outcomes: tuple[Any, ...]
    """Per accepted-by-metadata key: its sample index into ``samples``, or its refusal."""
    samples: tuple[tuple[Any, ...], ...]
    """Each accepted sample's parts ``(array, start, stop)`` (``routeplay.store.write_plan``)."""
    payloads: list[StoredPayload]
    """One per laid-out array."""
    saved_bytes: int
    """Bytes the shared prefix saved."""

    @classmethod
    def of(cls, group: GroupLayout) -> GroupAnswer:
        """The answer for a validated group's layout.

        Example:
            >>> GroupAnswer.of(canonical_group(raw, keys, spec, starts))  # doctest: +SKIP
        """
        layout = group.layout
        stored = [
            StoredPayload(blocks=1, rows=int(a.shape[0]), nbytes=int(a.nbytes), block_rows=0)
            for a in layout.arrays
        ]
        return cls(
            outcomes=group.outcomes,
            samples=layout.samples,
            payloads=stored,
            saved_bytes=layout.saved_bytes,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LaidOut:
    """Many groups' layouts, as one validator call answers them: every accepted
    group's arrays wait under one staging token, in group order."""

    token: Any
    """Where the arrays wait for the shard (``take_group``)."""
    groups: tuple[GroupAnswer | RouteplayError, ...]
    """Per group asked, its answer, or the typed error that failed that group alone."""


def lay_out_groups(
    requests: Sequence[GroupRequest], spec: RouteSpec, payloads: Sequence[object]
) -> tuple[list[Any], list[GroupAnswer | RouteplayError]]:
    """The validator's side of ``send_groups``: each group validated and laid out on its
    own (``key_check.canonical_group``), its members' payloads taken from ``payloads`` in
    order; every accepted group's arrays, in order, and each group's answer.

    Example:
        >>> arrays, answers = lay_out_groups(requests, spec, payloads)  # doctest: +SKIP
    """
    arrays: list[Any] = []
    answers: list[GroupAnswer | RouteplayError] = []
    at = 0
    for request in requests:
        mine = payloads[at : at + len(request.keys)]
        at += len(request.keys)
        try:
            group = canonical_group(
                mine, request.keys, spec, request.starts, shared_prefix=request.shared_prefix,
                pack=request.pack, validated=request.validated,
            )  # fmt: skip
        except RouteplayError as exc:
            answers.append(exc.with_traceback(None))  # its frames would hold the payloads
            continue
        arrays.extend(group.layout.arrays)
        answers.append(GroupAnswer.of(group))
    if at != len(payloads):
        raise MisuseError(
            "a groups' layout got a different number of payloads than its members",
            expected=at,
            found=len(payloads),
        )
    return arrays, answers
