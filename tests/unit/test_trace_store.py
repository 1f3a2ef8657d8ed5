"""TraceStore over the in-process route store: shared prefixes stored once, prefix
matches (mid-edge, past the stored rows), exports that outlive their session, overwrites
that release only the session's old lease, and idempotent session release."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import pytest
from faults import FaultyBackend, faulty_store

from routeplay.core import Handle, Routes, RouteSpec, canonicalize
from routeplay.errors import HandleError, RoutesLost
from routeplay.rollout.trace_actor import TraceStoreShell
from routeplay.rollout.trace_store import TraceStore, TraceStoreStats, session_holder
from routeplay.store import RouteStore, StoreConfig

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
TURN1 = list(range(100, 110))  # 10 tokens -> rows [0, 9)
TURN2 = [*TURN1, 7, 8, 9, 10, 11, 12]  # 16 tokens -> rows [0, 15)


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


@pytest.fixture
def store() -> RouteStore:
    # One shard: a Lease is then one lease id, so the store's per-holder counts are leases.
    return RouteStore.local(StoreConfig(run="traces", shards=1))


@pytest.fixture
def traces(store: RouteStore) -> TraceStore:
    return TraceStore(store)


@pytest.fixture
def two_turns(store: RouteStore, traces: TraceStore) -> tuple[Handle, npt.NDArray[np.uint8]]:
    """Session "s" holds turn 1 and turn 2; turn 2 reuses turn 1's payload and appends
    only its new rows. Returns turn 2's handle and rows."""
    first, new = routing(len(TURN1) - 1, seed=1), routing(len(TURN2) - len(TURN1), seed=2)
    h1 = store.put(first)
    h2 = h1 + store.put(new)
    traces.insert("s", TURN1, h1)
    traces.insert("s", TURN2, h2)
    return h2, np.concatenate([first.array, new.array])


def holders(store: RouteStore) -> dict[str, int]:
    return dict(store.stats().leases_by_holder)


def test_turns_sharing_a_prefix_store_their_payloads_once(
    store: RouteStore, traces: TraceStore, two_turns: tuple[Handle, npt.NDArray[np.uint8]]
) -> None:
    _, rows = two_turns
    stats = store.stats()
    assert stats.live_payloads == 2  # turn 1's rows + turn 2's new rows, nothing copied
    assert dict(stats.bytes_by_holder)[session_holder("s")] == SPEC.nbytes(len(TURN2) - 1)
    assert holders(store) == {"session/s": 2}
    assert traces.stats() == TraceStoreStats(sessions=1, nodes=2, leases=2, rows=9 + 15)
    match = traces.longest_prefix("s", TURN2)
    assert match.handle is not None
    np.testing.assert_array_equal(store.read(match.handle), rows)


@pytest.mark.parametrize(
    ("query", "matched", "rows"),
    [
        pytest.param([*TURN1[:5], 0, 0], 5, 5, id="mid-edge"),
        pytest.param([*TURN1, 99], 10, 10, id="turn1-then-new: uses turn 2's row 9"),
        pytest.param(TURN1, 10, 10, id="exactly-turn1"),
        pytest.param([*TURN2, 1, 2, 3], 16, 15, id="past-the-stored-rows"),
        pytest.param(TURN2, 16, 15, id="exactly-turn2"),
        pytest.param(TURN1[:1], 1, 1, id="one-token"),
    ],
)
def test_longest_prefix_reuses_only_causally_valid_rows(
    store: RouteStore,
    traces: TraceStore,
    two_turns: tuple[Handle, npt.NDArray[np.uint8]],
    query: list[int],
    matched: int,
    rows: int,
) -> None:
    _, stored = two_turns
    match = traces.longest_prefix("s", query)
    assert (match.matched, match.rows) == (matched, rows)
    assert match.handle is not None
    assert match.handle.rows == rows
    np.testing.assert_array_equal(store.read(match.handle), stored[:rows])


def test_a_lone_sequence_gives_one_row_less_than_its_tokens(
    store: RouteStore, traces: TraceStore
) -> None:
    traces.insert("t", TURN1, store.put(routing(9, seed=3)))
    match = traces.longest_prefix("t", [*TURN1, 5])
    assert (match.matched, match.rows) == (10, 9)


def test_no_match_for_unrelated_tokens_or_unknown_sessions(
    traces: TraceStore, two_turns: tuple[Handle, npt.NDArray[np.uint8]]
) -> None:
    for session, query in [("s", [1, 2, 3]), ("s", []), ("nobody", TURN2)]:
        match = traces.longest_prefix(session, query)
        assert (match.matched, match.rows, match.handle) == (0, 0, None)
        assert traces.export(session, query, "sample/x") is None


def test_export_outlives_the_session_until_the_exporter_releases(
    store: RouteStore, traces: TraceStore, two_turns: tuple[Handle, npt.NDArray[np.uint8]]
) -> None:
    _, stored = two_turns
    exported = traces.export("s", [*TURN2, 42], "sample/1")
    assert exported is not None
    assert (exported.rows, exported.handle.rows) == (15, 15)
    assert traces.release_session("s") == 2
    assert holders(store) == {"sample/1": 1}
    np.testing.assert_array_equal(store.read(exported.handle), stored)
    exported.lease.release()
    assert store.stats().live_payloads == 0
    with pytest.raises(RoutesLost):
        store.read(exported.handle)


def test_export_leases_only_the_payloads_of_the_matched_rows(
    store: RouteStore, traces: TraceStore, two_turns: tuple[Handle, npt.NDArray[np.uint8]]
) -> None:
    exported = traces.export("s", TURN1[:4], "sample/short")
    assert exported is not None
    traces.release_session("s")
    assert store.stats().live_payloads == 1  # turn 2's new rows went with the session
    exported.lease.release()
    assert store.leaks() == []


def test_overwrite_releases_only_the_sessions_old_lease(
    store: RouteStore, traces: TraceStore
) -> None:
    old_rows, new_rows = routing(9, seed=4), routing(9, seed=5)
    traces.insert("s", TURN1, store.put(old_rows))
    exported = traces.export("s", TURN1, "sample/old")
    assert exported is not None
    traces.insert("s", TURN1, store.put(new_rows))
    assert holders(store) == {"sample/old": 1, "session/s": 1}
    assert traces.stats().leases == 1
    np.testing.assert_array_equal(store.read(exported.handle), old_rows.array)
    match = traces.longest_prefix("s", TURN1)
    assert match.handle is not None
    np.testing.assert_array_equal(store.read(match.handle), new_rows.array[:9])
    exported.lease.release()
    assert store.stats().live_payloads == 1  # the old payload went with its last lease


def test_reinserting_the_same_handle_never_drops_its_payload(
    store: RouteStore, traces: TraceStore
) -> None:
    routes = routing(9, seed=6)
    handle = store.put(routes)
    traces.insert("s", TURN1, handle)
    traces.insert("s", TURN1, handle)
    assert holders(store) == {"session/s": 1}
    np.testing.assert_array_equal(store.read(handle), routes.array)


def test_release_session_is_idempotent_and_leaves_no_session_lease(
    store: RouteStore, traces: TraceStore, two_turns: tuple[Handle, npt.NDArray[np.uint8]]
) -> None:
    traces.insert("other", TURN1, store.put(routing(9, seed=7)))
    assert traces.release_session("s") == 2
    assert traces.release_session("s") == 0
    assert [r.holder for r in store.leaks()] == ["session/other"]
    assert traces.sessions() == ["other"]
    assert traces.longest_prefix("s", TURN2).handle is None
    assert traces.release_all() == 1
    assert (store.leaks(), store.stats().live_payloads) == ([], 0)


def test_session_context_and_close_release_on_exceptions(
    store: RouteStore, traces: TraceStore
) -> None:
    def failed_turn() -> None:
        with traces.session("ctx") as sid:
            traces.insert(sid, TURN1, store.put(routing(9, seed=8)))
            raise RuntimeError("trainer step failed")

    def failed_driver() -> None:
        with TraceStore(store) as scoped:
            scoped.insert("a", TURN1, store.put(routing(9, seed=9)))
            raise RuntimeError("driver failed")

    with pytest.raises(RuntimeError, match="trainer step failed"):
        failed_turn()
    assert store.leaks() == []
    with pytest.raises(RuntimeError, match="driver failed"):
        failed_driver()
    assert (store.leaks(), traces.sessions()) == ([], [])


def test_a_handle_with_the_wrong_row_count_is_refused(
    store: RouteStore, traces: TraceStore
) -> None:
    handle = store.put(routing(10, seed=10))  # one row per token: one too many
    with pytest.raises(HandleError, match=r"9 rows for 10 tokens.*found 10 rows"):
        traces.insert("s", TURN1, handle)
    with pytest.raises(HandleError):
        traces.insert("s", [], handle[:0])
    assert (traces.sessions(), holders(store)) == ([], {})


def test_stats_is_a_frozen_snapshot(
    traces: TraceStore, two_turns: tuple[Handle, npt.NDArray[np.uint8]]
) -> None:
    before = traces.stats()
    traces.release_session("s")
    assert (before.sessions, before.leases, traces.stats().sessions) == (1, 2, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.sessions = 0  # type: ignore[misc]


def test_the_actor_shell_forwards_to_the_plain_class(store: RouteStore) -> None:
    shell = TraceStoreShell(store)
    shell.insert("s", TURN1, store.put(routing(9, seed=11)))
    assert shell.longest_prefix("s", TURN1).rows == 9
    exported = shell.export("s", TURN1[:3], "sample/3")
    assert exported is not None
    assert (shell.sessions(), shell.stats().leases) == (["s"], 1)
    assert shell.release_session("s") == 1
    assert shell.release_all() == 0
    exported.lease.release()
    assert store.leaks() == []


def test_leases_span_shards_when_turns_live_on_different_shards() -> None:
    store = RouteStore.local(StoreConfig(run="traces-sharded", shards=3))
    traces = TraceStore(store)
    parts = [routing(3, seed=20 + i) for i in range(5)]
    handle = Handle.concat(SPEC, [store.put(p) for p in parts])  # 15 rows, several shards
    tokens = list(range(16))
    traces.insert("s", tokens, handle)
    exported = traces.export("s", tokens, "sample/all")
    assert exported is not None
    assert traces.release_session("s") == 1
    assert {r.holder for r in store.leaks()} == {"sample/all"}
    np.testing.assert_array_equal(
        store.read(exported.handle), np.concatenate([p.array for p in parts])
    )
    exported.lease.release()
    assert (store.leaks(), store.stats().live_payloads) == ([], 0)


# -- error paths: a shard that died answers RoutesLost to releases ---------------------
def faulty_traces() -> tuple[RouteStore, FaultyBackend, TraceStore]:
    store, backend = faulty_store("traces-faults")
    return store, backend, TraceStore(store)


def test_release_session_attempts_every_lease_and_keeps_the_failed_one() -> None:
    store, backend, traces = faulty_traces()
    h1 = store.put(routing(len(TURN1) - 1, seed=1))
    h2 = store.put(routing(len(TURN2) - 1, seed=2))
    traces.insert("s", TURN1, h1)
    traces.insert("s", TURN2, h2)
    backend.dead_holders.add(session_holder("s"))
    traces.insert("s", [*TURN1, 5], h1 + store.put(routing(1, seed=3)))  # leased while dead
    with pytest.raises(RoutesLost):
        traces.release_session("s")
    assert holders(store) == {"session/s": 1}  # the other two were released
    assert traces.sessions() == []
    with pytest.raises(RoutesLost):
        traces.release_session("s")  # a retry, not a silent no-op
    assert traces.stats().unreleased == 1
    backend.heal()
    assert traces.release_session("s") == 1
    assert traces.release_session("s") == 0
    assert traces.stats().unreleased == 0
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def test_release_all_releases_every_session_although_one_fails() -> None:
    store, backend, traces = faulty_traces()
    backend.dead_holders.add(session_holder("a"))
    traces.insert("a", TURN1, store.put(routing(len(TURN1) - 1, seed=1)))
    traces.insert("b", TURN1, store.put(routing(len(TURN1) - 1, seed=2)))
    with pytest.raises(RoutesLost):
        traces.release_all()
    assert holders(store) == {"session/a": 1}  # b went although a failed first
    [stuck] = traces.take_unreleased()
    assert traces.stats().unreleased == 0
    backend.heal()
    stuck.release()
    assert store.leaks() == []


def test_an_overwrite_whose_release_fails_keeps_the_old_lease_as_unreleased() -> None:
    store, backend, traces = faulty_traces()
    backend.dead_holders.add(session_holder("s"))
    traces.insert("s", TURN1, store.put(routing(len(TURN1) - 1, seed=1)))
    backend.dead_holders.clear()
    new = store.put(routing(len(TURN1) - 1, seed=2))
    traces.insert("s", TURN1, new)  # the insert itself succeeded
    assert traces.longest_prefix("s", TURN1).handle == new
    assert (traces.stats().leases, traces.stats().unreleased) == (1, 1)
    assert holders(store) == {"session/s": 2}
    backend.heal()
    assert traces.release_session("s") == 2
    assert store.leaks() == []


def test_exports_carry_the_weight_version_of_every_stored_row(store: RouteStore) -> None:
    traces = TraceStore(store)
    turn1 = store.put(routing(len(TURN1) - 1, seed=1), weight_version=0)
    turn2 = turn1 + store.put(routing(len(TURN2) - len(TURN1), seed=2), weight_version=3)
    traces.insert("s", TURN2, turn2)
    exported = traces.export("s", [*TURN2[:12], 0], "rollout/retry")
    assert exported is not None
    assert exported.rows == 12
    assert exported.handle.weight_versions().tolist() == [0] * 9 + [3] * 3
    exported.lease.release()
    traces.close()
    assert store.leaks() == []
