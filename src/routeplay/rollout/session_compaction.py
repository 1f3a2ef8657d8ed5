"""When a trace session is compacted: the session side of ``routeplay.store.client.compaction``.

A session whose stored handles grow past ``CompactionPolicy.threshold`` segments is
*due*; the trace store compacts a due session off the caller's path (the trace-store
actor sends itself the work after answering the insert that made it due) or at once
when it runs in process. ``TraceStore.compact`` compacts a session on request.

The policy only decides *when*; *how* (one copy of each row, shared prefixes kept one
payload, run tables of weight versions, the lease rule) is the store's write path.
"""

from __future__ import annotations

from dataclasses import dataclass

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError
from routeplay.store.client.compaction import DEFAULT_THRESHOLD

__all__ = ["CompactionPolicy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionPolicy:
    """When a trace session's handles are compacted.

    Example:
        >>> CompactionPolicy(threshold=32).due(handle)  # doctest: +SKIP
        True
    """

    threshold: int = DEFAULT_THRESHOLD
    """A session is due when one of its handles spans more stored payloads than this
    (its segments, with a compacted payload's version runs counted once: the cost is
    per object). 64 by default: about 3.6 ms on one node, see ``DEFAULT_THRESHOLD``."""
    auto: bool = True
    """Compact due sessions without being asked (off: only ``compact()`` does)."""

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise MisuseError(
                "invalid CompactionPolicy.threshold", expected=">= 1", found=self.threshold
            )

    def due(self, handle: Handle) -> bool:
        """True when ``handle`` has grown past the threshold (and compaction is on).
        Payloads, not segments: a compacted handle whose rows changed weight version
        every turn keeps a segment per turn over one payload, and is not due again."""
        if not self.auto or len(handle.segments) <= self.threshold:
            return False  # the cheap count first: payloads are never more than segments
        return len(handle.sources()) > self.threshold
