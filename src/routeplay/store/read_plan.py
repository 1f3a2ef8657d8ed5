"""Planning a batched read: which blocks of which payloads, and where their rows land.

Pure Python over handles (no Ray), so the row arithmetic is unit-tested on its own.
A reader asks for row ranges of many handles; the plan lists, per store shard, the
``(payload, blocks)`` to locate in one call, and the copies that place each block's
rows into each output. Only blocks overlapping a requested range are fetched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from routeplay.core.handle import EngineKey, Handle, InlineSource, Segment, StoreRef
from routeplay.store.shard import shard_of

__all__ = ["BlockCopy", "DirectCopy", "ReadPlan", "plan_reads"]


class BlockCopy(NamedTuple):
    """Copy rows ``[lo, hi)`` of a stored block into output ``request`` at ``offset``.

    A named tuple, not a frozen dataclass: a read of a 1,000-segment handle builds one per
    segment, and a tuple builds several times faster (no per-field ``__setattr__``).
    """

    request: int
    """Index of the output (the request) the rows go to."""
    offset: int
    """Row of that output where they land."""
    payload_id: str
    """Stored payload holding the block."""
    block: int
    """Block index within the payload."""
    lo: int
    """First row within the block."""
    hi: int
    """One past the last row within the block."""
    first_row: int
    """Row of the payload where this copy starts (for error messages and validation)."""
    segment: Segment
    """The segment being read (spec and source)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectCopy:
    """Rows of a segment that is not in the route store (inline array or engine key)."""

    request: int
    """Index of the output the rows go to."""
    offset: int
    """Row of that output where they land."""
    segment: Segment
    """The segment (its start/stop index the source)."""


@dataclass(slots=True)
class ReadPlan:
    """Everything a batched read needs: one locate list per shard, then copies.

    Mutable while ``plan_reads`` builds it; callers only read it.
    """

    rows: list[int] = field(default_factory=list)
    wanted: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    seen: set[tuple[str, int]] = field(default_factory=set)
    """``(payload, block)`` already listed: O(1) membership for many-segment handles."""
    copies: list[BlockCopy] = field(default_factory=list)
    direct: list[DirectCopy] = field(default_factory=list)

    def locate_requests(self, shard: int) -> list[tuple[str, list[int]]]:
        """``(payload_id, sorted blocks)`` for one shard, in a stable order."""
        return [(pid, sorted(blocks)) for pid, blocks in self.wanted[shard].items()]


def plan_reads(requests: Sequence[tuple[Handle, int, int]]) -> ReadPlan:
    """Plan reading rows ``[start, stop)`` of each handle."""
    plan = ReadPlan()
    for index, (handle, start, stop) in enumerate(requests):
        plan.rows.append(stop - start)
        for piece in handle.pieces(start, stop):
            source = piece.segment.source
            if isinstance(source, StoreRef):
                _plan_stored(plan, index, piece.offset, piece.segment, source)
            else:
                assert isinstance(source, (InlineSource, EngineKey))
                plan.direct.append(
                    DirectCopy(request=index, offset=piece.offset, segment=piece.segment)
                )
    return plan


def _plan_stored(plan: ReadPlan, request: int, offset: int, seg: Segment, ref: StoreRef) -> None:
    wanted = plan.wanted.setdefault(shard_of(ref.payload_id), {})
    blocks = wanted.setdefault(ref.payload_id, [])
    if ref.block_rows <= 0:  # one block (the default): no block arithmetic
        if (ref.payload_id, 0) not in plan.seen:
            plan.seen.add((ref.payload_id, 0))
            blocks.append(0)
        plan.copies.append(
            BlockCopy(request, offset, ref.payload_id, 0, seg.start, seg.stop, seg.start, seg)
        )
        return
    for block in ref.blocks(seg.start, seg.stop):
        if (ref.payload_id, block) not in plan.seen:
            plan.seen.add((ref.payload_id, block))
            blocks.append(block)
        base = block * ref.block_rows
        lo = max(seg.start, base)
        hi = min(seg.stop, base + ref.block_rows) if ref.block_rows else seg.stop
        plan.copies.append(
            BlockCopy(
                request=request,
                offset=offset + lo - seg.start,
                payload_id=ref.payload_id,
                block=block,
                lo=lo - base,
                hi=hi - base,
                first_row=lo,
                segment=seg,
            )
        )
