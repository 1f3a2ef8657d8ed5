"""Compaction's pure parts (run tables, the plan of which rows to copy) and its write
path on the in-process store: exact rows, weight versions kept, each row copied once,
shared prefixes one payload, and the holder's old leases left for it to end."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from routeplay.core import Handle, Routes, RouteSpec, Segment, StoreRef, canonicalize
from routeplay.rollout import CompactionPolicy, TraceStore, session_holder
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.client.compaction import (
    compact_handles,
    plan_compaction,
    segments_of_runs,
    version_runs,
)

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


def ref(name: str, rows: int) -> StoreRef:
    return StoreRef(payload_id=f"0.{name}", run="r", rows=rows)


def seg(source: StoreRef, start: int, stop: int, version: int = 0) -> Segment:
    return Segment(source=source, start=start, stop=stop, spec=SPEC, weight_version=version)


def test_a_run_table_merges_equal_versions_and_rebuilds_them_over_one_payload() -> None:
    a, b, c = ref("a", 5), ref("b", 5), ref("c", 5)
    segments = [seg(a, 0, 5, 1), seg(b, 0, 3, 1), seg(c, 1, 5, 2)]
    runs = version_runs(segments)
    assert runs == ((8, 1), (4, 2))
    new = ref("new", 12)
    rebuilt = Handle(SPEC, segments_of_runs(new, runs, SPEC))
    assert [s.rows for s in rebuilt.segments] == [8, 4]
    np.testing.assert_array_equal(
        rebuilt.weight_versions(), Handle(SPEC, segments).weight_versions()
    )


def test_the_turns_of_one_conversation_become_slices_of_one_payload() -> None:
    turns = [ref(str(i), 4) for i in range(5)]
    history = [Handle(SPEC, [seg(t, 0, 4) for t in turns[: i + 1]]) for i in range(5)]
    plan = plan_compaction(history)
    assert len(plan.copied) == 1
    assert plan.rows_copied == 20  # every row once, not once per turn holding it
    new = ref("new", 20)
    rebuilt = plan.rebuilt([new])
    assert [h.rows for h in rebuilt] == [4, 8, 12, 16, 20]
    assert all(h.segments == (seg(new, 0, h.rows),) for h in rebuilt)


def test_a_prefix_shared_by_branches_is_one_section_and_a_one_payload_suffix_is_kept() -> None:
    shared = [ref(f"p{i}", 4) for i in range(3)]
    a1, a2, b1 = ref("a1", 3), ref("a2", 3), ref("b1", 6)
    prefix = [seg(p, 0, 4) for p in shared]
    branch_a = Handle(SPEC, [*prefix, seg(a1, 0, 3), seg(a2, 0, 3, version=1)])
    # b branches off inside the last shared payload (a re-generated answer)
    branch_b = Handle(SPEC, [*prefix[:2], seg(shared[2], 0, 2), seg(b1, 0, 6)])
    plan = plan_compaction([branch_a, branch_b])
    copied = [plan.sections[i] for i in plan.copied]
    assert [sum(s.rows for s in edge) for edge in copied] == [10, 2 + 6]
    # the shared 10 rows, then a's private 2 + 6; b's private suffix is b1 alone: kept
    kept = [e for i, e in enumerate(plan.sections) if i not in plan.copied]
    assert kept == [(seg(b1, 0, 6),)]
    new_prefix, new_a = ref("np", 10), ref("na", 8)
    rebuilt_a, rebuilt_b = plan.rebuilt([new_prefix, new_a])
    assert rebuilt_a.sources() == (new_prefix, new_a)
    assert rebuilt_b.sources() == (new_prefix, b1)  # the same shared payload
    np.testing.assert_array_equal(rebuilt_a.weight_versions(), branch_a.weight_versions())


def test_a_compacted_session_is_not_copied_again() -> None:
    one = Handle(SPEC, [seg(ref("x", 9), 0, 5, 1), seg(ref("x", 9), 5, 9, 2)])
    assert plan_compaction([one, one[:3]]).copied == ()


Piece = tuple[int, int, int, int]  # (payload, start, stop, weight version)


@st.composite
def sessions(draw: st.DrawFn) -> tuple[list[int], list[list[Piece]], int]:
    """A session tree: payload sizes, and per handle its pieces ``(payload, start, stop,
    version)`` as (``prefix`` rows of an earlier handle) + new payloads, which may
    interleave (``A[:1] B[:1] A[1:] B[1:]``: one payload's rows on both sides of a cut)."""
    sizes: list[int] = []
    handles: list[list[Piece]] = []
    for _ in range(draw(st.integers(1, 6))):
        base = draw(st.integers(-1, len(handles) - 1)) if handles else -1
        prefix: list[Piece] = []
        if base >= 0:
            total = sum(stop - start for _, start, stop, _ in handles[base])
            prefix = _take(handles[base], draw(st.integers(0, total)))
        new: list[Piece] = []
        for _ in range(draw(st.integers(0 if base >= 0 else 1, 4))):
            sizes.append(draw(st.integers(1, 5)))
            new.append((len(sizes) - 1, 0, sizes[-1], draw(st.integers(0, 2))))
        if len(new) >= 2 and draw(st.booleans()):
            new = _interleaved(new)
        handles.append([*prefix, *new])
    return sizes, handles, draw(st.integers(0, 2**16))


def _interleaved(pieces: list[Piece]) -> list[Piece]:
    """Each piece's first row, then the rest of each (rows of a payload on both sides)."""
    heads = [(p, start, start + 1, v) for p, start, _, v in pieces]
    rests = [(p, start + 1, stop, v) for p, start, stop, v in pieces if stop > start + 1]
    return [*heads, *rests]


def _take(pieces: list[Piece], rows: int) -> list[Piece]:
    out = []
    for payload, start, stop, version in pieces:
        if rows <= 0:
            break
        out.append((payload, start, min(stop, start + rows), version))
        rows -= stop - start
    return out


@settings(max_examples=60, deadline=None)
@given(sessions())
# Found by the property: the branch points cut inside payloads 0 and 1, so the section
# between them (rows of both) had no payload of its own to remove; copying it added one.
@example(
    (
        [4, 3, 1, 2, 1, 1],
        [
            [(0, 0, 4, 0), (1, 0, 3, 0), (2, 0, 1, 0)],
            [],
            [],
            [],
            [(0, 0, 3, 0), (3, 0, 2, 0), (4, 0, 1, 0)],
            [(0, 0, 4, 0), (1, 0, 1, 0), (5, 0, 1, 0)],
        ],
        0,
    )
)
# Found in review: two payloads interleaved (A0 B0 | A1 B1 | A2 B2) and branches at the
# cuts: each section between cuts holds both, so counted per section each copy removed
# two payloads, but the three copies together removed the same two and added three.
@example(
    (
        [3, 3, 1, 1],
        [
            [(0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 2, 0), (1, 1, 2, 0), (0, 2, 3, 0), (1, 2, 3, 0)],
            [(0, 0, 1, 0), (1, 0, 1, 0), (2, 0, 1, 0)],
            [(0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 2, 0), (1, 1, 2, 0), (3, 0, 1, 0)],
        ],
        0,
    )
)
def test_compaction_keeps_every_row_and_version_and_copies_each_row_once(
    session: tuple[list[int], list[list[Piece]], int],
) -> None:
    sizes, shapes, seed = session
    store = RouteStore.local(StoreConfig(run="compact"))
    stored = [store.put(routing(n, seed + i)) for i, n in enumerate(sizes)]
    handles = [
        Handle(SPEC, [seg(stored[p].segments[0].source, a, b, v) for p, a, b, v in pieces])  # type: ignore[arg-type]
        for pieces in shapes
    ]
    old = store.acquire_many([(h, "session/s") for h in handles])
    expected = [store.read(h) for h in handles]
    unique_rows = {
        (s.source, r) for h in handles for s in h.segments for r in range(s.start, s.stop)
    }
    done = compact_handles(store, handles, "session/s")
    assert done.report.rows_copied <= len(unique_rows)
    for handle, before, new, rows in zip(handles, old, done.handles, expected, strict=True):
        np.testing.assert_array_equal(store.read(new), rows)
        np.testing.assert_array_equal(new.weight_versions(), handle.weight_versions())
        assert before.read().tobytes() == rows.tobytes()  # old leases still read

    def payloads(hs: tuple[Handle, ...] | list[Handle]) -> set[object]:
        return {source for h in hs for source in h.sources()}

    assert len(payloads(done.handles)) <= len(payloads(handles))
    assert max(len(h.sources()) for h in done.handles) <= max(len(h.sources()) for h in handles)
    for handle, new in zip(handles, done.handles, strict=True):
        assert len(new.sources()) <= len(handle.sources())  # no reader fetches more
    # the holder ends the old leases it has a new one for (the others still hold)
    held = [
        new if new is not None else before for before, new in zip(old, done.leases, strict=True)
    ]
    store.release_many([b for b, new in zip(old, done.leases, strict=True) if new is not None])
    for new, rows in zip(done.handles, expected, strict=True):
        np.testing.assert_array_equal(store.read(new), rows)
    store.release_many(held)
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def test_the_holder_reads_exact_rows_after_and_its_old_leases_free_the_old_payloads() -> None:
    store = RouteStore.local(StoreConfig(run="compact-leases"))
    parts = [routing(3, seed=i) for i in range(80)]
    handle = Handle.concat(
        SPEC, [store.put(p, weight_version=i // 40) for i, p in enumerate(parts)]
    )
    old = store.acquire(handle, "driver/history")
    reader = store.acquire(handle, "train/step-1")  # another holder: left alone
    done = compact_handles(store, [handle], "driver/history")
    [new] = done.handles
    assert (len(new.segments), len(new.sources())) == (2, 1)  # two version runs, one payload
    assert done.report.segments_before == 80
    assert done.report.payloads_written == 1
    old.release()
    rows = np.concatenate([p.array for p in parts])
    np.testing.assert_array_equal(reader.read(), rows)  # its payloads are still held
    np.testing.assert_array_equal(store.read(new), rows)
    reader.release()
    assert store.stats().live_payloads == 1  # only the compacted payload is left
    [lease] = done.leases
    assert lease is not None
    lease.release()
    assert store.leaks() == []


def _conversation(
    store: RouteStore, traces: TraceStore, session: str, turns: int, *, first: int = 0
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Turns ``first`` to ``first + turns - 1`` of one conversation, each appending
    its own payload of 3 rows to the one before (version: turn // 2)."""
    tokens: list[int] = [1, *range(2, 2 + 3 * first)]
    match = traces.longest_prefix(session, tokens) if first else None
    handle = match.handle if match is not None and match.handle is not None else Handle(SPEC)
    keys, expected = [], []
    for turn in range(first, first + turns):
        handle = handle + store.put(routing(3, seed=100 + turn), weight_version=turn // 2)
        tokens = [*tokens, *range(2 + 3 * turn, 5 + 3 * turn)]
        expected.append(store.read(handle))  # before the insert: it may compact
        traces.insert(session, tokens, handle)
        keys.append(tokens)
    return keys, expected


def test_a_session_past_the_threshold_is_compacted_and_keeps_its_rows() -> None:
    store = RouteStore.local(StoreConfig(run="traces-auto"))
    traces = TraceStore(store, policy=CompactionPolicy(threshold=4))
    keys, expected = _conversation(store, traces, "s", turns=4)
    exported = traces.export("s", keys[-1], "sample/a")  # a reader of the old rows
    assert exported is not None
    assert traces.stats().compactions == 0
    more, last = _conversation(store, traces, "s", turns=1, first=4)  # 5 segments: due
    keys, expected = keys + more, expected + last
    stats = traces.stats()
    assert (stats.compactions, stats.due) == (1, 0)
    for tokens, rows in zip(keys, expected, strict=True):
        match = traces.longest_prefix("s", tokens)
        assert match.handle is not None
        assert len(match.handle.sources()) == 1
        np.testing.assert_array_equal(store.read(match.handle, 0, len(tokens) - 1), rows)
    np.testing.assert_array_equal(exported.lease.read(), expected[3])
    assert dict(store.stats().leases_by_holder)[session_holder("s")] == 5
    traces.release_session("s")
    exported.lease.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def test_branches_of_a_session_share_one_compacted_prefix() -> None:
    store = RouteStore.local(StoreConfig(run="traces-branches"))
    traces = TraceStore(store, policy=CompactionPolicy(auto=False))
    keys, expected = _conversation(store, traces, "s", turns=6)
    base = keys[-1]
    history = traces.longest_prefix("s", base).handle
    assert history is not None
    for branch in range(2):  # two answers to the same history, each of two turns
        handle, tokens = history, base
        for turn in range(2):
            handle = handle + store.put(routing(4, seed=7 + 2 * branch + turn))
            tokens = [
                *tokens,
                *range(1000 * (branch + 1) + 4 * turn, 1000 * (branch + 1) + 4 * turn + 4),
            ]
            traces.insert("s", tokens, handle)
            keys.append(tokens)
            expected.append(store.read(handle))
    assert len(history.segments) == 6
    report = traces.compact("s")
    assert report is not None
    assert report.rows_copied == 6 * 3 + 2 * 2 * 4  # every row once
    a = traces.longest_prefix("s", keys[7]).handle
    b = traces.longest_prefix("s", keys[9]).handle
    assert a is not None
    assert b is not None
    assert len(a.sources()) == len(b.sources()) == 2
    assert a.sources()[0] == b.sources()[0]  # one shared payload, not a copy per branch
    for tokens, rows in zip(keys, expected, strict=True):
        match = traces.longest_prefix("s", tokens)
        assert match.handle is not None
        np.testing.assert_array_equal(store.read(match.handle, 0, len(tokens) - 1), rows)
    assert store.stats().live_payloads == 3
    traces.close()
    assert store.leaks() == []


def test_a_payload_holding_most_of_a_section_is_kept_and_only_the_rest_copied() -> None:
    big, a, b, c = ref("big", 100), ref("a", 3), ref("b", 3), ref("c", 3)
    tail = [seg(a, 0, 3), seg(b, 0, 3), seg(c, 0, 3)]
    handle = Handle(SPEC, [seg(big, 0, 60, 1), seg(big, 60, 100, 2), *tail])
    plan = plan_compaction([handle])
    assert plan.rows_copied == 9
    [rebuilt] = plan.rebuilt([ref("new", 9)])
    assert rebuilt.sources() == (big, ref("new", 9))
    np.testing.assert_array_equal(rebuilt.weight_versions(), handle.weight_versions())
    # payloads each bigger than the rest after them are the shape a compacted
    # session has already: nothing to copy
    assert plan_compaction([Handle(SPEC, [seg(big, 0, 100), seg(a, 0, 3)])]).copied == ()


def test_a_session_compacted_again_and_again_copies_each_row_a_logarithmic_number_of_times() -> (
    None
):
    store = RouteStore.local(StoreConfig(run="compact-often"))
    handle, lease, copied, rounds = Handle(SPEC), None, 0, 64
    parts = []
    for round_ in range(rounds):
        turns = []
        for turn in range(4):  # four turns a round, then the holder compacts
            part = routing(3, seed=4 * round_ + turn)
            parts.append(part.array)
            new, held = store.put_leased(part, "test/turn", weight_version=round_)
            handle, turns = handle + new, [*turns, held]
        done = compact_handles(store, [handle], "session/s")
        store.release_many(turns)
        copied += done.report.rows_copied
        [handle], [new] = done.handles, done.leases
        assert new is not None
        if lease is not None:
            lease.release()
        lease = new
        assert len(handle.sources()) <= np.log2(round_ + 1) + 2
    rows = handle.rows
    np.testing.assert_array_equal(store.read(handle), np.concatenate(parts))
    assert copied <= rows * (np.log2(rounds) + 2)  # not rows * rounds / 2, as recopying all
    np.testing.assert_array_equal(handle.weight_versions(), np.arange(rows) // 12)
    assert lease is not None
    lease.release()
    assert store.stats().live_payloads == 0


def test_a_compacted_handle_of_many_version_runs_is_not_due_again() -> None:
    one = ref("one", 10)
    runs = Handle(SPEC, [seg(one, i, i + 1, version=i) for i in range(10)])
    many = Handle(SPEC, [seg(ref(str(i), 1), 0, 1) for i in range(10)])
    policy = CompactionPolicy(threshold=4)
    assert (policy.due(runs), policy.due(many), policy.due(many[:4])) == (False, True, False)
    assert not CompactionPolicy(threshold=4, auto=False).due(many)
