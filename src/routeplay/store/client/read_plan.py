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
from routeplay.store.shard.shard import shard_of

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

    Mutable while ``plan_reads`` builds it; callers only read it. Every step is done once
    per payload (its shard, its block list) and once per segment (its copy), never per
    pair: a 1,000-segment handle plans in one linear pass.
    """

    rows: list[int] = field(default_factory=list)
    wanted: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    """Per shard, per payload, the blocks to fetch (each once, in first-use order)."""
    blocks: dict[str, list[int]] = field(default_factory=dict)
    """The same block lists by payload id alone (found without its shard)."""
    seen: set[tuple[str, int]] = field(default_factory=set)
    """``(payload, block)`` already listed, for payloads of several blocks (a payload
    of one block is listed once its list is not empty)."""
    copies: list[BlockCopy] = field(default_factory=list)
    direct: list[DirectCopy] = field(default_factory=list)

    def locate_requests(self, shard: int) -> list[tuple[str, list[int]]]:
        """``(payload_id, sorted blocks)`` for one shard, in a stable order."""
        return [
            (pid, blocks if len(blocks) == 1 else sorted(blocks))
            for pid, blocks in self.wanted[shard].items()
        ]


def plan_reads(requests: Sequence[tuple[Handle, int, int]], *, copies: bool = True) -> ReadPlan:
    """Plan reading rows ``[start, stop)`` of each handle. ``copies=False`` plans only
    the blocks to fetch (``copies`` and ``direct`` stay empty): what holding blocks for
    later reads needs, each of which plans its own copies."""
    plan = ReadPlan()
    for index, (handle, start, stop) in enumerate(requests):
        plan.rows.append(stop - start)
        for segment, offset in handle.spans(start, stop):
            source = segment.source
            if isinstance(source, StoreRef):
                _plan_stored(plan, index, offset, segment, source, copies)
            elif copies:
                assert isinstance(source, (InlineSource, EngineKey))
                plan.direct.append(DirectCopy(request=index, offset=offset, segment=segment))
    return plan


def _plan_stored(
    plan: ReadPlan, request: int, offset: int, seg: Segment, ref: StoreRef, copies: bool
) -> None:
    pid = ref.payload_id
    blocks = plan.blocks.get(pid)
    if blocks is None:  # first use of this payload: its shard is looked up once
        blocks = plan.blocks[pid] = []
        plan.wanted.setdefault(shard_of(pid), {})[pid] = blocks
    if ref.block_rows <= 0:  # one block (the default): no block arithmetic
        if not blocks:
            blocks.append(0)
        if copies:
            plan.copies.append(
                BlockCopy(request, offset, pid, 0, seg.start, seg.stop, seg.start, seg)
            )
        return
    for block in ref.blocks(seg.start, seg.stop):
        if (pid, block) not in plan.seen:
            plan.seen.add((pid, block))
            blocks.append(block)
        if not copies:
            continue
        base = block * ref.block_rows
        lo = max(seg.start, base)
        hi = min(seg.stop, base + ref.block_rows)
        plan.copies.append(
            BlockCopy(
                request=request,
                offset=offset + lo - seg.start,
                payload_id=pid,
                block=block,
                lo=lo - base,
                hi=hi - base,
                first_row=lo,
                segment=seg,
            )
        )
