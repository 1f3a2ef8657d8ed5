"""A sample's routing by value, for checkpoints: ``RoutingRecord`` (rows and segments,
no object-store reference), ``record_routings`` (many with one read) and
``RoutingRecord.restore`` (stored anew and leased).

Example:
    >>> [record] = record_routings([sample.routing], store)  # doctest: +SKIP
    >>> routing = record.restore(store, spec)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import Handle, Segment
from routeplay.core.validate import canonicalize
from routeplay.errors import HandleError, MalformedPayload
from routeplay.rollout.routing_terms import Origin, RoutesPutter, RowReader, sample_holder
from routeplay.rollout.sample_routing import SampleRouting

if TYPE_CHECKING:
    from routeplay.core.spec import RouteSpec

__all__ = ["RoutingRecord", "cut_segments", "record_routings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingRecord:
    """A ``SampleRouting`` by value: what a checkpoint keeps (never an object-store
    reference: it would not survive the process, and a pickled ref has no owner).

    Example:
        >>> meta, array = record.to_json(), record.array  # doctest: +SKIP
        >>> again = RoutingRecord.from_json(meta, array)
    """

    sample_id: str
    """The sample's id."""
    session_id: str | None
    """Its trace session, if any."""
    origin: Origin
    """Who produced the rows (restored routing is marked ``RESTORED``)."""
    retries: int
    """Regenerations so far."""
    response_versions: tuple[int, ...]
    """Per-response-token versions kept on the routing (often empty)."""
    prompt_tokens: int | None
    """Prompt length recorded by ``complete()``."""
    segments: tuple[tuple[int, int], ...]
    """``(rows, weight_version)`` of each handle segment, in order (empty: no routing)."""
    array: npt.NDArray[Any] | None = field(default=None, compare=False)
    """The rows, canonical (None: no routing)."""

    @classmethod
    def of(cls, routing: SampleRouting, store: RowReader) -> RoutingRecord:
        """``routing`` by value (rows read now; no object-store reference), for a
        checkpoint. ``record_routings`` records many with one read.

        Example:
            >>> record = RoutingRecord.of(sample.routing, store)  # doctest: +SKIP
            >>> restored = record.restore(store, spec)
        """
        return record_routings([routing], store)[0]

    def to_json(self) -> dict[str, Any]:
        """The record without its array (JSON-safe)."""
        return {
            "sample_id": self.sample_id,
            "session_id": self.session_id,
            "origin": self.origin.value,
            "retries": self.retries,
            "response_versions": list(self.response_versions),
            "prompt_length": self.prompt_tokens,
            "segments": [list(seg) for seg in self.segments],
        }

    @classmethod
    def from_json(cls, meta: dict[str, Any], array: npt.NDArray[Any] | None) -> RoutingRecord:
        """A record from ``to_json()`` and its array (a checkpoint is outside data: a
        record that does not parse raises ``MalformedPayload``)."""
        try:
            prompt = meta.get("prompt_length")
            return cls(
                sample_id=str(meta["sample_id"]),
                session_id=meta.get("session_id"),
                origin=Origin(meta.get("origin", Origin.NONE.value)),
                retries=int(meta.get("retries", 0)),
                response_versions=tuple(int(v) for v in meta.get("response_versions", ())),
                prompt_tokens=None if prompt is None else int(prompt),
                segments=tuple((int(r), int(v)) for r, v in meta.get("segments", ())),
                array=array,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedPayload(
                "a routing record does not parse",
                expected="the fields RoutingRecord.to_json() writes",
                found=f"{type(exc).__name__}: {exc}"[:200],
                where=f"record {str(meta.get('sample_id', '?'))[:80]}",
            ) from exc

    def restore(
        self, store: RoutesPutter, spec: RouteSpec, *, holder: str | None = None
    ) -> SampleRouting:
        """The routing stored anew and leased (``holder``, default the sample's own),
        its segments' weight versions as recorded, marked ``RESTORED``; without an array
        (a queued retry) nothing is stored and the routing comes back empty.

        The array is validated again (``canonicalize``); a lease that cannot be taken
        leaves the stored payload unleased, for the store's TTL."""
        base = SampleRouting(
            sample_id=self.sample_id,
            session_id=self.session_id,
            origin=Origin.NONE,
            retries=self.retries,
            response_versions=self.response_versions,
        )
        if self.array is None:
            return base
        where = f"checkpoint sample {self.sample_id}"
        routes = canonicalize(self.array, spec, where=where)
        if sum(rows for rows, _ in self.segments if rows >= 0) > routes.rows:
            raise HandleError(
                "recorded segments cover more rows than the array",
                expected=f"at most {routes.rows} rows",
                found=f"segments {list(self.segments)[:8]}",
                where=where,
            )
        stored = cut_segments(store.put(routes), spec, self.segments)
        lease = store.acquire(stored, holder or sample_holder(self.sample_id))
        restored = base.attach(stored, lease, Origin.RESTORED)
        return dataclasses.replace(restored, prompt_tokens=self.prompt_tokens)


def record_routings(routings: Sequence[SampleRouting], store: RowReader) -> list[RoutingRecord]:
    """Each routing by value, with one batched read for all of them (one metadata call
    per shard, each block once).

    Example:
        >>> records = record_routings([s.routing for s in samples], store)  # doctest: +SKIP
    """
    routed = [r.handle for r in routings if r.handle is not None]
    arrays = iter(store.read_many([(handle, 0, handle.rows) for handle in routed]))
    records = []
    for routing in routings:
        handle = routing.handle
        records.append(
            RoutingRecord(
                sample_id=routing.sample_id,
                session_id=routing.session_id,
                origin=routing.origin,
                retries=routing.retries,
                response_versions=routing.response_versions,
                prompt_tokens=routing.prompt_tokens,
                segments=tuple((seg.rows, seg.weight_version) for seg in handle.segments)
                if handle is not None
                else (),
                array=np.asarray(next(arrays)) if handle is not None else None,
            )
        )
    return records


def cut_segments(stored: Handle, spec: RouteSpec, segments: Sequence[tuple[int, int]]) -> Handle:
    """A freshly stored payload cut back into recorded ``(rows, weight_version)``
    segments (``rows < 0``: up to the end)."""
    if not stored.segments:  # a sample with no routing rows yet
        return stored
    source = stored.segments[0].source
    parts, start = [], 0
    for rows, version in segments:
        stop = stored.rows if rows < 0 else start + rows
        parts.append(
            Segment(source=source, start=start, stop=stop, spec=spec, weight_version=version)
        )
        start = stop
    return Handle(spec, parts)
