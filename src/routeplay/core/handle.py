"""Segments and handles: what a sample carries instead of its routing bytes.

A ``Segment`` names a token-row range ``[start, stop)`` of one stored array (its
``source``), with the spec and the weight version that produced those rows. A
``Handle`` is an immutable, ordered tuple of segments covering rows ``[0, rows)`` of
one sample. Partial rollouts and later turns *append* segments; micro-batches and
SP/CP shards *slice* handles; nothing is concatenated until a trainer rank copies the
rows it needs.

Invariants kept by construction:
- every segment of a handle has the handle's spec;
- no empty segments; adjacent segments that continue the same source with the same
  weight version are merged, so ``h[:a] + h[a:] == h`` for every ``a``;
- handles never hold a payload except through ``InlineSource`` (tests, checkpoints).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt

from routeplay.core.records import slot_builder
from routeplay.core.spec import RouteSpec
from routeplay.errors import HandleError, SpecMismatch

__all__ = ["EngineKey", "Handle", "InlineSource", "Piece", "Segment", "Source", "StoreRef"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class InlineSource:
    """Routing carried by value; equal only to itself (identity), never compared by content."""

    array: npt.NDArray[np.unsignedinteger]
    """Canonical ``[rows, L, K]`` array."""

    @property
    def rows(self) -> int:
        """Token rows in the array."""
        return int(self.array.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreRef:
    """A payload held by the route store, named by the id the store minted."""

    payload_id: str
    """Store-minted id, unique within the run."""
    run: str
    """Run that owns the payload; other runs can neither read nor release it."""
    rows: int
    """Token rows in the stored payload."""
    block_rows: int = 0
    """Rows per stored block (a reader fetches only the blocks it needs); 0 = one block.
    Stored payloads are always canonical: adopted engine keys are validated at adoption."""

    def __hash__(self) -> int:
        # The id alone: equal refs share it, and a str caches its hash, where the
        # generated hash builds and hashes a field tuple on every call (a handle of
        # 1,000 segments hashes its sources on every acquire and read).
        return hash(self.payload_id)

    def __reduce__(self) -> tuple[object, ...]:
        # Positional: a plan of thousands of samples unpickles in every trainer rank.
        return (_store_ref, (self.payload_id, self.run, self.rows, self.block_rows))

    def blocks(self, start: int, stop: int) -> range:
        """Indices of the blocks holding rows ``[start, stop)``."""
        if self.block_rows <= 0 or stop <= start:
            return range(0, 1 if stop > start else 0)
        return range(start // self.block_rows, -(-stop // self.block_rows))


def _store_ref(payload_id: str, run: str, rows: int, block_rows: int) -> StoreRef:
    return StoreRef(payload_id=payload_id, run=run, rows=rows, block_rows=block_rows)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineKey:
    """A payload still inside an engine-side store, consumed once by whoever reads it.

    The sample's rows are ``[0, rows)`` of the stored array. The stored array holds
    between ``rows`` and ``rows + trailing_rows`` rows: LMDeploy with
    ``include_stop_str_in_output=False`` (its default) trims the stop token from the
    answer and its counts but not from the stored array, which then ends with one row the
    sample does not have. A store adopting the key accepts any row count in
    ``payload_rows`` and exposes only rows ``[0, rows)``, as a slice of the stored array
    (no copy); the trailing rows are never read.

    Example:
        >>> EngineKey(key="ab" * 28, rows=6, trailing_rows=1).payload_rows
        range(6, 8)
    """

    key: str
    """Key the engine returned (LMDeploy: hex of the stored ObjectRef)."""
    rows: int
    """Token rows of the sample (from its token counts): rows ``[0, rows)`` of the payload."""
    actor: str = "shared_store"
    """Name of the engine-side store actor."""
    namespace: str = "lmdeploy"
    """Ray namespace of that actor (``lmdeploy``; ``sglang`` for XTuner's patched SGLang)."""
    run: str = ""
    """Run the key was issued to."""
    trailing_rows: int = 0
    """Rows the stored array may hold beyond ``rows`` (LMDeploy: 1, the trimmed stop token)."""

    def __hash__(self) -> int:
        return hash(self.key)  # as ``StoreRef.__hash__``: equal keys share it

    @property
    def payload_rows(self) -> range:
        """Row counts the stored array may have: ``rows`` to ``rows + trailing_rows``."""
        return range(self.rows, self.rows + self.trailing_rows + 1)


Source: TypeAlias = InlineSource | StoreRef | EngineKey


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """Rows ``[start, stop)`` of one source, produced under one weight version."""

    source: Source
    """Where the rows live."""
    start: int
    """First row within the source."""
    stop: int
    """One past the last row within the source."""
    spec: RouteSpec
    """Geometry of the rows."""
    weight_version: int = 0
    """Policy weight version that produced these rows."""

    def __post_init__(self) -> None:
        _check_rows(self.source, self.start, self.stop)

    @property
    def rows(self) -> int:
        """Token rows in the segment."""
        return self.stop - self.start

    def sub(self, start: int, stop: int) -> Segment:
        """Rows ``[start, stop)`` of this segment, counted from the segment's first row."""
        return Segment(
            source=self.source,
            start=self.start + start,
            stop=self.start + stop,
            spec=self.spec,
            weight_version=self.weight_version,
        )

    def continued_by(self, other: Segment) -> bool:
        """True when ``other`` picks up exactly where this segment stops."""
        return (
            other.source == self.source
            and other.start == self.stop
            and other.weight_version == self.weight_version
            and other.spec == self.spec
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Positional tuple: a handle of 100 segments pickles to a few KB, not 100 dicts.
        return (_segment, (self.source, self.start, self.stop, self.spec, self.weight_version))


def _check_rows(source: Source, start: int, stop: int) -> None:
    if not 0 <= start <= stop <= source.rows:
        raise HandleError(
            "segment rows lie outside their source",
            expected=f"0 <= start <= stop <= {source.rows}",
            found=f"[{start}, {stop})",
        )


def _segment(source: Source, start: int, stop: int, spec: RouteSpec, version: int) -> Segment:
    """A pickled segment, checked again (its rows within its source) and made without
    ``__init__``: a trainer rank unpickles a step's plan, a segment or more per sample,
    and the keyword ``__init__`` of a frozen dataclass costs twice as much."""
    _check_rows(source, start, stop)
    return _new_segment(source, start, stop, spec, version)  # type: ignore[no-any-return]


_new_segment = slot_builder(Segment, ("source", "start", "stop", "spec", "weight_version"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """Where one segment's rows land when a handle range is read."""

    segment: Segment
    """Segment trimmed to the requested rows (its start/stop index the source)."""
    offset: int
    """Row of the requested range at which the piece begins."""


@dataclass(frozen=True, slots=True, init=False, repr=False)
class Handle:
    """Immutable ordered segments covering token rows ``[0, rows)`` of one sample."""

    spec: RouteSpec
    """Geometry shared by every segment."""
    segments: tuple[Segment, ...]
    """Normalized segments: non-empty, merged where contiguous."""
    _rows: int = field(compare=False, repr=False)
    """Sum of the segments' rows (cached: ``pieces`` and slicing ask for it on every call)."""

    def __init__(self, spec: RouteSpec, segments: Sequence[Segment] = ()) -> None:
        normalized = _normalize(spec, segments)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "segments", normalized)
        object.__setattr__(self, "_rows", sum(seg.stop - seg.start for seg in normalized))

    @classmethod
    def of(cls, segment: Segment) -> Handle:
        """A handle of one segment."""
        return cls(segment.spec, (segment,))

    @property
    def rows(self) -> int:
        """Token rows covered (counted once, at construction)."""
        return self._rows

    @property
    def nbytes(self) -> int:
        """Canonical bytes of the covered rows (what a full read copies)."""
        return self.spec.nbytes(self.rows)

    def __bool__(self) -> bool:
        # No __len__ on purpose: with __len__ and __getitem__ numpy takes a handle for a
        # sequence of rows, so np.array(handles, dtype=object) (verl's batch columns)
        # would iterate it. ``rows`` is the row count.
        return self.rows > 0

    def append(self, segment: Segment, *, at_row: int | None = None) -> Handle:
        """Add rows after the last one; ``at_row`` asserts where they must start."""
        if at_row is not None and at_row != self.rows:
            raise HandleError(
                "appended rows do not start where the handle ends",
                expected=f"rows starting at {self.rows}",
                found=f"rows starting at {at_row}",
                hint="A resumed or follow-up response must continue the history exactly.",
            )
        return self._extended(_normalize(self.spec, (segment,)))

    def __add__(self, other: Handle) -> Handle:
        if not isinstance(other, Handle):
            return NotImplemented
        if other.spec is not self.spec and other.spec != self.spec:
            return Handle(self.spec, (*self.segments, *other.segments))  # names the segment
        return self._extended(other.segments)

    def _extended(self, tail: tuple[Segment, ...]) -> Handle:
        """These segments, then ``tail`` (normalized, of this spec). Both sides are
        normalized already, so only the seam can merge: appending checks the new
        segments only, where a full re-normalization made a session that appends every
        turn quadratic in its turns."""
        if not tail:
            return self
        head = self.segments
        if head and head[-1].continued_by(tail[0]):
            segments = (*head[:-1], _merged(head[-1], tail[0]), *tail[1:])
        else:
            segments = (*head, *tail)
        extended = object.__new__(Handle)
        object.__setattr__(extended, "spec", self.spec)
        object.__setattr__(extended, "segments", segments)
        object.__setattr__(extended, "_rows", self._rows + sum(s.stop - s.start for s in tail))
        return extended

    @classmethod
    def concat(cls, spec: RouteSpec, handles: Sequence[Handle]) -> Handle:
        """Rows of every handle, in order."""
        return cls(spec, [seg for handle in handles for seg in handle.segments])

    def slice(self, start: int, stop: int) -> Handle:
        """Rows ``[start, stop)`` as a new handle (no data is touched)."""
        return Handle(self.spec, [piece.segment for piece in self.pieces(start, stop)])

    def __getitem__(self, key: builtins.slice) -> Handle:
        if not isinstance(key, builtins.slice) or key.step not in (None, 1):
            raise HandleError(
                "handles slice by contiguous row ranges", expected="h[a:b]", found=key
            )
        start, stop, _ = key.indices(self.rows)
        return self.slice(start, max(start, stop))

    def pieces(self, start: int = 0, stop: int | None = None) -> Iterator[Piece]:
        """The segments that hold rows ``[start, stop)``, trimmed, with output offsets."""
        for segment, offset in self.spans(start, stop):
            yield Piece(segment=segment, offset=offset)

    def spans(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[Segment, int]]:
        """``pieces`` as plain ``(segment, offset)`` pairs: what a read of many segments
        iterates (a tuple per segment instead of a frozen dataclass).

        Example:
            [(segment, offset)] = Handle.of(seg).spans(0, 4)
        """
        stop = self.rows if stop is None else stop
        if not 0 <= start <= stop <= self.rows:
            raise HandleError(
                "row range outside the handle",
                expected=f"0 <= start <= stop <= {self.rows}",
                found=f"[{start}, {stop})",
            )
        row = 0
        for seg in self.segments:
            rows = seg.stop - seg.start
            lo, hi = max(start, row), min(stop, row + rows)
            if lo < hi:
                whole = lo == row and hi == row + rows  # common case: no trimmed copy
                yield (seg if whole else seg.sub(lo - row, hi - row)), lo - start
            row += rows
            if row >= stop:
                return

    def weight_versions(self) -> npt.NDArray[np.int64]:
        """Weight version of every row (for staleness), built without a Python loop per row."""
        counts = [seg.rows for seg in self.segments]
        versions = [seg.weight_version for seg in self.segments]
        return np.repeat(np.asarray(versions, dtype=np.int64), counts)

    UNSTAMPED: ClassVar[int] = -1
    """The ``weight_version`` of rows written before their version is known (XTuner's
    rollout worker, agent loop and SessionServer never see it: its ``ReplayBuffer.put``
    stamps the version, ``update_sample_version``). ``stamped`` sets it; until then the
    rows count as older than any version (a staleness check expires them)."""

    @property
    def unstamped(self) -> bool:
        """True while a segment still has ``UNSTAMPED`` for its weight version."""
        return any(seg.weight_version == Handle.UNSTAMPED for seg in self.segments)

    def stamped(self, version: int) -> Handle:
        """This handle with every ``UNSTAMPED`` segment produced under ``version``; the
        segments stamped before keep theirs (a resume's history keeps its version, only
        the rows added since the last stamp take the new one). No row moves.

        Example:
            >>> h = store.adopt_key(key, spec, weight_version=Handle.UNSTAMPED)  # doctest: +SKIP
            >>> h.stamped(7).weight_versions().min()  # doctest: +SKIP
            7
        """
        if version < 0:
            raise HandleError(
                "a weight version is a model step, counted from 0",
                expected="version >= 0",
                found=version,
                hint="Stamp with the model step XTuner's ReplayBuffer.put stamps (model_step).",
            )
        if not self.unstamped:
            return self
        return Handle(
            self.spec,
            [
                seg
                if seg.weight_version != Handle.UNSTAMPED
                else Segment(
                    source=seg.source,
                    start=seg.start,
                    stop=seg.stop,
                    spec=seg.spec,
                    weight_version=version,
                )
                for seg in self.segments
            ],
        )

    def sources(self) -> tuple[Source, ...]:
        """Distinct sources in order of first use (inline sources compare by identity).

        A dict keeps first-use order in one pass: a list-membership test here made every
        acquire and read of a many-segment handle (long sessions, many resumes) quadratic.
        """
        return tuple(dict.fromkeys(seg.source for seg in self.segments))

    def __repr__(self) -> str:
        """Rows, geometry and where the rows live; never the rows themselves.

        Example:
            >>> spec = RouteSpec(num_layers=3, top_k=2, num_experts=8)
            >>> rows = np.zeros((37, 3, 2), dtype=np.uint8)
            >>> Handle.of(Segment(source=InlineSource(array=rows), start=0, stop=37, spec=spec))
            Handle(inline, rows=37, layers=3, top_k=2, segments=1, sources=[inline 37 rows])
        """
        # The generated repr printed every InlineSource's array (a 1,000-row handle made
        # a screen of numbers) and every segment; a log line needs the shape of it.
        sources = self.sources()
        kinds = sorted({_SOURCE_KINDS[type(source)] for source in sources})
        kind = kinds[0] if len(kinds) == 1 else "mixed" if kinds else "empty"
        shown = [_source_label(source) for source in sources[:_SHOWN_SOURCES]]
        if len(sources) > _SHOWN_SOURCES:
            shown.append(f"... {len(sources) - _SHOWN_SOURCES} more")
        return (
            f"Handle({kind}, rows={self.rows}, layers={self.spec.num_layers}, "
            f"top_k={self.spec.top_k}, segments={len(self.segments)}, "
            f"sources=[{', '.join(shown)}])"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Its segments were normalized when it was built: a copy takes them as they are
        # (a trainer rank unpickles a step's plan, thousands of handles, per step).
        # Segments as plain tuples: a pickler's per-object hook (Ray's cloudpickle calls
        # one for every object that is not a builtin) runs once per handle, not per segment.
        rows = tuple([(s.source, s.start, s.stop, s.weight_version) for s in self.segments])
        return (_restored_handle_rows, (self.spec, rows, self._rows))


_SOURCE_KINDS: dict[type, str] = {InlineSource: "inline", StoreRef: "store", EngineKey: "key"}
_SHOWN_SOURCES = 3
"""Sources a handle's repr names; the rest are counted (a session can have hundreds)."""
_ID_CHARS = 12
"""Characters of a payload id or engine key a repr shows: enough to grep a log for."""


def _source_label(source: Source) -> str:
    if isinstance(source, InlineSource):
        return f"inline {source.rows} rows"
    ident = source.payload_id if isinstance(source, StoreRef) else source.key
    short = ident if len(ident) <= _ID_CHARS else ident[:_ID_CHARS] + "..."
    return f"{_SOURCE_KINDS[type(source)]} {short} ({source.rows} rows)"


def _restored_handle_rows(
    spec: RouteSpec, parts: tuple[tuple[Source, int, int, int], ...], rows: int
) -> Handle:
    """A pickled handle's segments, checked again (a segment's rows within its source),
    not normalized again (they were when the handle was built)."""
    segments = tuple([_segment(src, start, stop, spec, v) for src, start, stop, v in parts])
    return _restored_handle(spec, segments, rows)


def _restored_handle(spec: RouteSpec, segments: tuple[Segment, ...], rows: int) -> Handle:
    return _new_handle(spec, segments, rows)  # type: ignore[no-any-return]


_new_handle = slot_builder(Handle, ("spec", "segments", "_rows"))


def _normalize(spec: RouteSpec, segments: Sequence[Segment]) -> tuple[Segment, ...]:
    out: list[Segment] = []
    for seg in segments:
        if seg.spec is not spec and seg.spec != spec:  # identity first: specs are shared
            raise SpecMismatch(
                "segment spec differs from the handle spec",
                expected=spec.describe(),
                found=seg.spec.describe(),
                where=f"segment {len(out)}",
            )
        if seg.rows == 0:
            continue
        if out and out[-1].continued_by(seg):
            seg = _merged(out.pop(), seg)
        out.append(seg)
    return tuple(out)


def _merged(first: Segment, then: Segment) -> Segment:
    """``first`` and ``then`` (which continues it) as one segment."""
    return Segment(
        source=first.source,
        start=first.start,
        stop=then.stop,
        spec=first.spec,
        weight_version=then.weight_version,
    )
