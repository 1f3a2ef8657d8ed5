"""Which planned copies of a compaction pay: no handle ends with more payloads to fetch,
and the session with fewer.

A copy replaces its section's payloads by one new payload, but a payload that a kept
section still references stays, and a payload that several copies share is removed once,
not once per copy. So a copy is judged with the copies it shares payloads with (a
*group*, a connected component over shared payloads): for a handle, the group adds one
payload per copy the handle holds and removes the group's payloads that no kept part of
the handle references; for the session, it adds one per copy and removes its payloads
no kept section references. A group stays only if it adds no payload to any handle and
removes at least one from the session; otherwise all of it stays uncopied. Dropping a
group turns its sections into kept ones, but no other group shares a payload with it,
so the judgement of the others stands: one pass decides, in time linear in the handles'
sections.
"""

from __future__ import annotations

from collections.abc import Sequence

from routeplay.core.handle import Segment, Source

__all__ = ["paying_copies"]


def paying_copies(
    sections: Sequence[tuple[Segment, ...]],
    copied: Sequence[int],
    leaves: Sequence[Sequence[int]],
    handles: Sequence[tuple[int, int]],
) -> tuple[int, ...]:
    """The copies of ``copied`` whose group lowers what is fetched (module docstring).
    ``leaves``: per leaf, its sections in order; ``handles``: per handle, ``(leaf, rows)``
    (``(-1, 0)`` for an empty one), as ``CompactionPlan`` has them.

    Example:
        >>> paying_copies(plan.sections, candidates, plan.leaves, plan.handles)  # doctest: +SKIP
        (0, 2)
    """
    group = _groups(sections, copied)
    kept_anywhere = {
        source for i, section in enumerate(sections) if i not in group for source in _of(section)
    }
    bad = {
        g
        for g, members in _members(group).items()
        if not _session_loses_one(members, sections, kept_anywhere)
    }
    for leaf, rows in handles:
        if leaf >= 0:
            bad |= _groups_adding_to(_held(sections, leaves[leaf], rows), group)
    return tuple(i for i in copied if group[i] not in bad)


def _of(section: Sequence[Segment]) -> set[Source]:
    return {seg.source for seg in section}


def _groups(sections: Sequence[tuple[Segment, ...]], copied: Sequence[int]) -> dict[int, int]:
    """Copy -> its group (the smallest copy of it): copies sharing a payload, transitively."""
    parent = {i: i for i in copied}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[Source, int] = {}
    for i in copied:
        for source in _of(sections[i]):
            a, b = root(i), root(first.setdefault(source, i))
            parent[max(a, b)] = min(a, b)
    return {i: root(i) for i in copied}


def _members(group: dict[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in group.items():
        out.setdefault(g, []).append(i)
    return out


def _session_loses_one(
    members: list[int], sections: Sequence[tuple[Segment, ...]], kept: set[Source]
) -> bool:
    removed = {s for i in members for s in _of(sections[i])} - kept
    return len(removed) > len(members)


def _held(
    sections: Sequence[tuple[Segment, ...]], path: Sequence[int], rows: int
) -> list[tuple[int, set[Source]]]:
    """The sections a handle of ``rows`` rows along ``path`` holds, each with the payloads
    of its part (the last one may be cut)."""
    out = []
    for i in path:
        if rows <= 0:
            break
        sources: set[Source] = set()
        for seg in sections[i]:
            if rows <= 0:
                break
            sources.add(seg.source)
            rows -= seg.rows
        out.append((i, sources))
    return out


def _groups_adding_to(held: list[tuple[int, set[Source]]], group: dict[int, int]) -> set[int]:
    """The groups that would leave this handle with more payloads than it has."""
    kept = {s for i, sources in held if i not in group for s in sources}
    copies: dict[int, int] = {}
    removed: dict[int, set[Source]] = {}
    for i, sources in held:
        if i in group:
            copies[group[i]] = copies.get(group[i], 0) + 1
            removed.setdefault(group[i], set()).update(sources - kept)
    return {g for g, n in copies.items() if n > len(removed[g])}
