"""Reading ahead in windows: the stored blocks of a trainer rank's next micro-batches,
fetched in one call and held while each micro-batch is copied out of them.

Why: a rank's share is read one micro-batch at a time (bounded memory), and a fetch per
micro-batch cost a rank about a quarter of its read's CPU on Ray (a ``ray.get``, its
deserialization and its release per micro-batch: 128 of them for 1,024 samples), CPU
taken from the cores that move the bytes. A window's blocks are fetched together
(``RouteStore.hold_blocks``) and held as zero-copy views: they pin the blocks in the
node's object store, where the rank's pull put them anyway, not in the process, so the
materializer's bound on the rows it holds is unchanged. A window ends at ``WINDOW_BYTES``
of blocks or ``WINDOW_ITEMS`` micro-batches; a micro-batch larger than that is a window
of its own, read as before. The first micro-batch is a window of its own too: a window's
micro-batches wait for all its blocks, and the trainer's first micro-batch should not
(it starts the step's compute), while later windows are fetched as the trainer works.

A window also ends at every micro-batch whose consumption ends leases (the
materializer's per-sample leases, ``release_each``): its views are dropped before that
micro-batch is handed out, so a view never outlives the last lease on its payload.

A window whose fetch finds a payload lost is read micro-batch by micro-batch instead, so
the error surfaces at the micro-batch whose rows it concerns, after the ones before it
were handed out, as without windows. A timeout is raised as it is: the window's reads
would each wait it out again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import Handle
from routeplay.errors import RoutesLost

__all__ = ["WINDOW_BYTES", "WINDOW_ITEMS", "PlannedRead", "hold_window", "windows"]

WINDOW_BYTES = 64 << 20
"""Stored bytes of the blocks one window holds (node memory, not the process's)."""
WINDOW_ITEMS = 32
"""Micro-batches in one window at most."""


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """One micro-batch read, planned: the rank's rows as one handle, and their mask."""

    position: int
    """Position of the read in the rank's stream (every pass's micro-batches in order)."""
    pass_index: int
    """Pass over the step the read belongs to."""
    mb: int
    """Micro-batch index in the plan."""
    handle: Handle
    """The rank's rows of the micro-batch (sample slices and padding runs)."""
    mask: npt.NDArray[np.bool_]
    """True where a row is a sample's routing."""
    real_rows: int
    """Rows that are samples' routing (not padding)."""
    block_bytes: int
    """Bytes of the distinct stored blocks the read touches."""


def windows(
    reads: Iterable[PlannedRead],
    *,
    max_bytes: int = WINDOW_BYTES,
    max_items: int = WINDOW_ITEMS,
    first_items: int = 1,
    ends_after: Collection[int] = (),
) -> Iterator[list[PlannedRead]]:
    """Consecutive reads, grouped into windows of at most ``max_items`` reads and
    ``max_bytes`` of blocks (a read over that is a window of its own); the first window
    holds at most ``first_items`` reads, and a window ends after any read whose position
    is in ``ends_after``.

    Example:
        >>> [len(w) for w in windows(reads, max_items=2)]  # doctest: +SKIP
        [1, 2, 2]
    """
    window: list[PlannedRead] = []
    size = 0
    limit = min(first_items, max_items)
    for read in reads:
        if window and (size + read.block_bytes > max_bytes or len(window) >= limit):
            yield window
            window, size, limit = [], 0, max_items
        window.append(read)
        size += read.block_bytes
        if read.position in ends_after:
            yield window
            window, size, limit = [], 0, max_items
    if window:
        yield window


def hold_window(
    store: object, window: Sequence[PlannedRead], holder: str
) -> AbstractContextManager[Any]:
    """The window's blocks, fetched at once and held (``RouteStore.hold_blocks``); a
    context whose value is None (read each micro-batch on its own) for a store that
    cannot hold blocks, a window of one read, or a fetch that found a payload lost.

    Example:
        >>> with hold_window(store, window, "materializer dp0") as held:  # doctest: +SKIP
        ...     store.read_many([(window[0].handle, 0, n)], held=held)
    """
    hold = getattr(store, "hold_blocks", None)
    if hold is None or len(window) < 2:
        return nullcontext(None)
    try:
        held: AbstractContextManager[Any] = hold(
            [(read.handle, 0, read.handle.rows) for read in window], holder=holder
        )
    except RoutesLost:  # each read raises it at its own micro-batch
        return nullcontext(None)
    return held
