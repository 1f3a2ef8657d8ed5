"""Copying planned block ranges into a read's outputs (the read path's last step,
``routeplay.store.client.read_path``), from blocks just fetched or from blocks held
for several reads (``HeldBlocks``: a trainer rank's next micro-batches fetched at once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.layers import LayerSubset
from routeplay.store.client.read_plan import BlockCopy
from routeplay.store.joined_rows import JoinedRows

__all__ = ["HeldBlocks", "copy_blocks"]


class HeldBlocks:
    """Blocks of several reads, fetched at once and held as zero-copy views until
    ``release`` (``ReadPath.hold_blocks``): the views pin the blocks in the node's object
    store, not in this process. ``with`` releases them."""

    def __init__(self, views: dict[tuple[str, int], Any]) -> None:
        self._views = views

    def __len__(self) -> int:
        return len(self._views)

    def copy_into(
        self,
        copies: Sequence[BlockCopy],
        outs: Sequence[npt.NDArray[Any]],
        columns: LayerSubset | None,
    ) -> bool:
        """Copy ``copies`` from the held views; False (nothing copied) when a block they
        need is not held."""
        views = self._views
        if any((copy.payload_id, copy.block) not in views for copy in copies):
            return False
        copy_blocks(copies, views, outs, columns)
        return True

    def release(self) -> None:
        """Drop the views (idempotent): the blocks may leave the node's store again."""
        self._views.clear()

    def __enter__(self) -> HeldBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def copy_blocks(
    copies: Sequence[BlockCopy],
    blocks: Mapping[tuple[str, int], Any],
    outs: Sequence[npt.NDArray[Any]],
    columns: LayerSubset | None,
) -> None:
    """Copy each block range into its output. Ranges that follow each other in one
    output (the segments of a handle, in order) go in one ``np.concatenate``: one C
    loop for a run of 1,000 segments instead of 1,000 slice assignments. A block stored
    as pieces (``JoinedRows``: a packed group) gives the views of the pieces that hold
    the range."""
    run: list[Any] = []  # the views of the current run: dropped before returning
    start = end = request = -1
    try:
        for copy in copies:
            block = blocks[(copy.payload_id, copy.block)]
            if copy.request != request or copy.offset != end:
                _flush_run(outs, request, start, end, run, columns)
                request, start, end = copy.request, copy.offset, copy.offset
            if type(block) is JoinedRows:
                run.extend(block.views(copy.lo, copy.hi))
            else:
                run.append(block[copy.lo : copy.hi])
            end += copy.hi - copy.lo
        _flush_run(outs, request, start, end, run, columns)
    finally:
        run.clear()


def _flush_run(
    outs: Sequence[npt.NDArray[Any]],
    request: int,
    start: int,
    end: int,
    run: list[Any],
    columns: LayerSubset | None,
) -> None:
    if columns is not None and run:
        columns.concatenate(run, outs[request][start:end])
    elif len(run) == 1:
        outs[request][start:end] = run[0]
    elif run:
        np.concatenate(run, axis=0, out=outs[request][start:end])
    run.clear()
