"""Compaction: the rows of many-segment handles copied once into few payloads.

A long session appends a segment every turn and every resume; every segment is one
more stored object a reader fetches (Ray's floor is about 55 us per object), so a
1,000-segment handle cannot be read within 10 ms however lean the metadata path is.
Compaction writes the rows of such handles again, once, as few payloads.

Planning (pure, no Ray): ``plan_compaction`` lays a set of handles (a session's) out as
a trie over their *rows* (a row is named by its payload, its row there and its weight
version): an edge of the trie is a **section**, rows that exactly the same handles
hold. So a prefix shared by several branches is one section (one payload, referenced by
every branch) and each branch's private suffix is another; a handle that is a prefix of
another one (an earlier turn of the same conversation) becomes a slice of it. A section
whose rows already lie in one payload is kept as it is (nothing is copied twice), and
so are the leading payloads of a section that each hold more rows than the rest after
them (an earlier compaction's: a long session compacted again copies its
rows since then, so a row is copied O(log rows) times over the session's life); every
other section is copied where that lowers the payloads a reader fetches
(``routeplay.store.client.compaction_choice``: a section between two branch points inside kept
payloads may have no payload of its own to remove, and copying it would add one). A
copied section keeps each row's weight version as a
**run table**: one segment over the new payload per run of equal versions
(``version_runs``).

Writing (``compact_handles``): one ``read_many`` copies every copied section's rows
out once, ``write`` stores each section as one payload (one write each), and one
``acquire_many`` leases every rebuilt handle for the holder. The holder's old leases
are not touched here: the caller ends them only after this returns, which is the lease
rule that keeps compaction kill-safe (see docs/compaction.md):

- before the write returns, nothing changed: the old leases hold the old rows;
- between the write and the lease, the new payloads are stored and unleased: if the
  compacting process dies there, the store's payload TTL drops them;
- between the lease and the release of the old leases, the holder holds both: if it
  dies there, revoking the holder (or the lease TTL) ends both;
- a reader's own lease on the old payloads is never touched: it reads the old rows
  until it releases them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy.typing as npt

from routeplay.core.handle import Handle, Segment, Source, StoreRef
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.errors import SpecMismatch
from routeplay.store.client.compaction_choice import paying_copies

if TYPE_CHECKING:
    from routeplay.store.client.lease import Lease

__all__ = [
    "DEFAULT_THRESHOLD",
    "Compacted",
    "CompactionPlan",
    "CompactionReport",
    "Write",
    "compact_handles",
    "plan_compaction",
    "segments_of_runs",
    "version_runs",
]

DEFAULT_THRESHOLD = 64
"""Segments a handle may have before its holder compacts it. Measured
(``benchmarks/segment_overhead.py``, docs/compaction.md): acquire + read costs about
1.5 ms plus 50 us per segment beyond the copy on one node, so 64 segments cost 3.6 ms
(256: 12.9 ms, 1,000: 51 ms; compacted: 1.5 ms); compacting earlier buys under 2 ms a
read and copies the session's rows more often."""

Write = Callable[[Sequence[Routes]], list[Handle]]
"""Stores each array as one payload and returns a one-payload handle per array:
``RouteStore.put_many`` (this process owns the bytes: a driver) or a producer actor's
``put_routes_many`` bound to its store (a store shard owns them)."""

_RowKey = tuple[Source, int, int]  # (source, row within it, weight version): a row's name


def version_runs(segments: Sequence[Segment]) -> tuple[tuple[int, int], ...]:
    """``(rows, weight_version)`` runs of consecutive rows of equal version.

    Example:
        >>> version_runs(handle.segments)  # doctest: +SKIP
        ((4096, 3), (200, 4))
    """
    runs: list[list[int]] = []
    for seg in segments:
        if runs and runs[-1][1] == seg.weight_version:
            runs[-1][0] += seg.rows
        else:
            runs.append([seg.rows, seg.weight_version])
    return tuple((rows, version) for rows, version in runs)


def segments_of_runs(
    source: StoreRef, runs: Sequence[tuple[int, int]], spec: RouteSpec
) -> list[Segment]:
    """Segments over ``source`` rows ``[0, sum(rows))``, one per version run.

    Example:
        >>> segments_of_runs(ref, ((4096, 3), (200, 4)), spec)  # doctest: +SKIP
    """
    out, row = [], 0
    for rows, version in runs:
        out.append(
            Segment(source=source, start=row, stop=row + rows, spec=spec, weight_version=version)
        )
        row += rows
    return out


class _Node:
    """A trie node: ``edge`` is the section of rows that leads to it."""

    __slots__ = ("children", "edge", "leaf")

    def __init__(self, edge: tuple[Segment, ...], leaf: _Node | None = None) -> None:
        self.edge = edge
        self.children: dict[_RowKey, _Node] = {}
        self.leaf: _Node = self if leaf is None else leaf  # a leaf at or below this node


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionPlan:
    """Which rows of a set of handles are copied, and how each handle is rebuilt.

    Example:
        >>> plan = plan_compaction(session_handles)  # doctest: +SKIP
        >>> [plan.sections[i] for i in plan.copied]  # the rows a compaction copies
    """

    spec: RouteSpec
    """Geometry of every handle."""
    sections: tuple[tuple[Segment, ...], ...]
    """Row runs held by exactly the same handles (a trie edge each), as segments."""
    copied: tuple[int, ...]
    """Sections to copy (their rows span several payloads), in order."""
    leaves: tuple[tuple[int, ...], ...]
    """Per leaf (a handle no other extends), the sections that make it, in order."""
    handles: tuple[tuple[int, int], ...]
    """Per input handle: ``(leaf, rows)``, it is rows ``[0, rows)`` of that leaf
    (``(-1, 0)`` for an empty handle)."""

    @property
    def rows_copied(self) -> int:
        """Rows a compaction following this plan copies (each row once)."""
        return sum(sum(seg.rows for seg in self.sections[i]) for i in self.copied)

    def section_handles(self) -> list[Handle]:
        """The copied sections as handles (what is read to copy them)."""
        return [Handle(self.spec, self.sections[i]) for i in self.copied]

    def rebuilt(self, stored: Sequence[StoreRef]) -> list[Handle]:
        """Every input handle over the compacted payloads (``stored[j]`` holds the rows
        of ``copied[j]``); uncopied sections keep their segments.

        Example:
            >>> plan.rebuilt([ref])[0].segments  # doctest: +SKIP
        """
        new = {
            index: segments_of_runs(ref, version_runs(self.sections[index]), self.spec)
            for index, ref in zip(self.copied, stored, strict=True)
        }
        leaves = [
            Handle(self.spec, [s for i in path for s in new.get(i, self.sections[i])])
            for path in self.leaves
        ]
        return [
            Handle(self.spec)
            if leaf < 0
            else leaves[leaf]
            if rows == leaves[leaf].rows
            else leaves[leaf].slice(0, rows)
            for leaf, rows in self.handles
        ]


def plan_compaction(handles: Sequence[Handle]) -> CompactionPlan:
    """The sections of ``handles`` and which of them to copy (see the module docstring).

    Example:
        >>> plan = plan_compaction([turn_1, turn_2, branch_b])  # doctest: +SKIP
        >>> plan.rows_copied  # the shared history once, each branch's suffix once
    """
    spec = _one_spec(handles)
    root = _Node(())
    ends: dict[int, _Node] = {}
    # Longest first: a later handle then never extends a leaf, it ends on a path or
    # branches off it, so every node is a branch point or a leaf (no chains to merge).
    for index in sorted(range(len(handles)), key=lambda i: -handles[i].rows):
        if handles[index].rows:
            ends[index] = _insert(root, handles[index].segments)
    nodes, paths = _sections(root)
    leaf_at = {id(leaf): at for at, leaf in enumerate(paths)}
    sections: list[tuple[Segment, ...]] = []
    copied: list[int] = []
    order: dict[int, list[int]] = {}  # node -> its sections: a kept head, a tail
    for node in nodes:
        head, tail = _kept_head(node.edge)
        order[id(node)] = []
        for part, copy in ((head, False), (tail, _worth_copying(tail))):
            if part:
                order[id(node)].append(len(sections))
                copied.extend([len(sections)] if copy else [])
                sections.append(part)
    leaves = tuple(tuple(i for n in paths[leaf] for i in order[id(n)]) for leaf in paths)
    held = tuple(
        (leaf_at[id(ends[i].leaf)], handles[i].rows) if i in ends else (-1, 0)
        for i in range(len(handles))
    )
    return CompactionPlan(
        spec=spec,
        sections=tuple(sections),
        copied=paying_copies(sections, copied, leaves, held),
        leaves=leaves,
        handles=held,
    )


def _one_spec(handles: Sequence[Handle]) -> RouteSpec:
    if not handles:
        raise SpecMismatch("nothing to compact", expected="at least one handle", found=0)
    spec = handles[0].spec
    for index, handle in enumerate(handles):
        if handle.spec != spec:
            raise SpecMismatch(
                "compacted handles mix model specs",
                expected=spec.describe(),
                found=handle.spec.describe(),
                where=f"handle {index}",
            )
    return spec


def _kept_head(edge: tuple[Segment, ...]) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """``edge`` as (head kept as it is, tail to copy): the head is the leading payloads
    each holding more rows than everything after it (an earlier compaction's,
    a long prompt's). A session compacted again and again then copies the rows since
    its last big payload, not its whole history: payload sizes at least halve along a
    section, so a row is copied O(log rows) times and a section keeps O(log) payloads."""
    left = sum(seg.rows for seg in edge)
    cut = at = 0
    while at < len(edge):
        end = at
        while end < len(edge) and edge[end].source == edge[at].source:
            end += 1  # one payload's consecutive segments (its version runs)
        rows = sum(seg.rows for seg in edge[at:end])
        if rows <= left - rows:
            break
        left, cut, at = left - rows, end, end
    return edge[:cut], edge[cut:]


def _worth_copying(edge: tuple[Segment, ...]) -> bool:
    """Rows spread over several stored payloads (engine keys and inline rows are
    never copied: a key is consumed by its one read, inline rows cost no fetch)."""
    sources = {seg.source for seg in edge}
    return len(sources) > 1 and all(isinstance(s, StoreRef) for s in sources)


def _key(segment: Segment, offset: int = 0) -> _RowKey:
    return (segment.source, segment.start + offset, segment.weight_version)


def _insert(root: _Node, segments: tuple[Segment, ...]) -> _Node:
    """Walk ``segments``' rows down the trie, splitting where they branch off; returns
    the node whose leaf the handle is a prefix of."""
    node, at, off = root, 0, 0  # cursor: segment ``at``, ``off`` rows into it
    while at < len(segments):
        key = _key(segments[at], off)
        child = node.children.get(key)
        if child is None:  # a new branch: the rest of the handle is its private suffix
            rest = (segments[at].sub(off, segments[at].rows), *segments[at + 1 :])
            child = node.children[key] = _Node(rest)
            return child
        matched, at, off = _match(child.edge, segments, at, off)
        if at == len(segments):
            return child  # ends on or inside this edge: a prefix of its leaf
        if matched < _rows(child.edge):  # branches off inside the edge: split it there
            child = _split(node, key, child, matched)
        node = child
    return node


def _match(
    edge: tuple[Segment, ...], segments: tuple[Segment, ...], at: int, off: int
) -> tuple[int, int, int]:
    """Rows of ``edge`` that the handle's rows from the cursor repeat, and the cursor
    after them."""
    matched, e, e_off = 0, 0, 0
    while e < len(edge) and at < len(segments):
        a, b = edge[e], segments[at]
        if (
            a.source != b.source
            or a.start + e_off != b.start + off
            or a.weight_version != b.weight_version
        ):
            break
        step = min(a.rows - e_off, b.rows - off)
        matched, e_off, off = matched + step, e_off + step, off + step
        if e_off == a.rows:
            e, e_off = e + 1, 0
        if off == b.rows:
            at, off = at + 1, 0
    return matched, at, off


def _split(parent: _Node, key: _RowKey, child: _Node, rows: int) -> _Node:
    """Cut ``child``'s edge after ``rows`` rows: the head becomes a branch point."""
    head, tail = _cut(child.edge, rows)
    middle = _Node(head, leaf=child.leaf)
    child.edge = tail
    middle.children[_key(tail[0])] = child
    parent.children[key] = middle
    return middle


def _cut(edge: tuple[Segment, ...], rows: int) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    head: list[Segment] = []
    for i, seg in enumerate(edge):
        if rows >= seg.rows:
            head.append(seg)
            rows -= seg.rows
            if rows == 0:
                return tuple(head), edge[i + 1 :]
            continue
        return (*head, seg.sub(0, rows)), (seg.sub(rows, seg.rows), *edge[i + 1 :])
    return tuple(head), ()


def _rows(edge: tuple[Segment, ...]) -> int:
    return sum(seg.rows for seg in edge)


def _sections(root: _Node) -> tuple[list[_Node], dict[_Node, list[_Node]]]:
    """Every non-root node (depth first, children in insertion order) and, per leaf,
    the nodes from the root down to it."""
    nodes: list[_Node] = []
    paths: dict[_Node, list[_Node]] = {}
    stack: list[tuple[_Node, list[_Node]]] = [
        (child, []) for child in reversed(root.children.values())
    ]
    while stack:
        node, above = stack.pop()
        path = [*above, node]
        nodes.append(node)
        if not node.children:
            paths[node] = path
        stack.extend((child, path) for child in reversed(node.children.values()))
    return nodes, paths


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionReport:
    """What one compaction did (plain numbers, for stats and the bench).

    Example:
        >>> traces.compact("s")  # doctest: +SKIP
        CompactionReport(handles=12, segments_before=65, segments_after=2, ...)
    """

    handles: int
    """Handles compacted together."""
    segments_before: int
    """Segments of the longest handle before."""
    segments_after: int
    """Segments of the longest handle after."""
    rows_copied: int
    """Rows copied (each once)."""
    payloads_written: int
    """Payloads written (one per copied section)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Compacted:
    """The outcome of ``compact_handles``: rebuilt handles and the holder's new leases.

    Example:
        >>> done = store.compact([old.handle], "driver/h")  # doctest: +SKIP
        >>> new = done.leases[0] or old  # None: nothing was copied, keep the old lease
    """

    handles: tuple[Handle, ...]
    """Per input, the rebuilt handle (the input itself where nothing of it was copied)."""
    leases: tuple[Lease | None, ...]
    """Per input, the holder's new lease on its rebuilt handle; None where the handle
    did not change (the holder's old lease still covers it)."""
    report: CompactionReport
    """What was done."""


class CompactingStore(Protocol):
    """What a compaction needs of the store (``RouteStore`` is one): typed by these
    calls, so this module imports neither Ray nor the client that runs it."""

    def put_many(self, batch: Sequence[Routes]) -> list[Handle]:
        """Store each of ``batch`` (the default ``write``: this process owns the bytes)."""
        ...

    def read_many(
        self, requests: Sequence[tuple[Handle, int, int]], *, holder: str = ...
    ) -> list[npt.NDArray[Any]]:
        """Rows of many handles, each block fetched once."""
        ...

    def acquire_many(self, items: Sequence[tuple[Handle, str]]) -> list[Lease]:
        """Leases for many ``(handle, holder)`` pairs, one call per shard."""
        ...


def compact_handles(
    store: CompactingStore, handles: Sequence[Handle], holder: str, *, write: Write | None = None
) -> Compacted:
    """Copy the rows of ``handles`` once into few payloads and lease the rebuilt
    handles for ``holder``. The caller's old leases stay as they are: end them after
    this returns (never before: see the module docstring).

    Example:
        >>> done = compact_handles(store, [lease.handle], "driver/history")  # doctest: +SKIP
        >>> lease.release()  # after the new lease exists
        >>> done.handles[0].segments  # one segment per weight-version run
    """
    if not handles:
        report = CompactionReport(
            handles=0, segments_before=0, segments_after=0, rows_copied=0, payloads_written=0
        )
        return Compacted(handles=(), leases=(), report=report)
    plan = plan_compaction(handles)
    before = max(len(h.segments) for h in handles)
    if not plan.copied:
        report = CompactionReport(
            handles=len(handles),
            segments_before=before,
            segments_after=before,
            rows_copied=0,
            payloads_written=0,
        )
        return Compacted(handles=tuple(handles), leases=(None,) * len(handles), report=report)
    sections = plan.section_handles()
    arrays = store.read_many([(section, 0, section.rows) for section in sections], holder=holder)
    written = (write or store.put_many)([_routes(array, plan.spec) for array in arrays])
    del arrays  # the only copy outside the object store goes now
    rebuilt = plan.rebuilt([_stored(handle) for handle in written])
    changed = [i for i, (old, new) in enumerate(zip(handles, rebuilt, strict=True)) if old != new]
    granted = store.acquire_many([(rebuilt[i], holder) for i in changed])
    leases: list[Lease | None] = [None] * len(handles)
    for index, lease in zip(changed, granted, strict=True):
        leases[index] = lease
    report = CompactionReport(
        handles=len(handles),
        segments_before=before,
        segments_after=max(len(h.segments) for h in rebuilt),
        rows_copied=plan.rows_copied,
        payloads_written=len(written),
    )
    return Compacted(handles=tuple(rebuilt), leases=tuple(leases), report=report)


def _routes(array: Any, spec: RouteSpec) -> Routes:
    """Rows read from the store: canonical already (validated when first stored)."""
    array.flags.writeable = False
    return Routes(array=array, spec=spec)


def _stored(handle: Handle) -> StoreRef:
    [source] = handle.sources()
    assert isinstance(source, StoreRef)  # a write of one array is one stored payload
    return source
