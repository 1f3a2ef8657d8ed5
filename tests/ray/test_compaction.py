"""Session compaction on real Ray: the trace-store actor compacts a long session off the
insert's path while a reader reads, the compacted payload survives the actor, and
killing the actor half-way (after the write, after the new leases) leaves exact rows
for every reader, zero leaks once the store's dead-holder paths ran, and the object
store back at its baseline."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from store_probe import kill_and_wait, used_bytes, wait_until

from routeplay.core import Handle, Routes, RouteSpec, canonicalize
from routeplay.rollout import CompactionPolicy, TraceStoreClient, TraceStoreConfig
from routeplay.rollout.trace_actor import TraceStoreShell
from routeplay.store import Lease, RouteStore, StoreConfig
from routeplay.store.flow import Flow
from routeplay.store.remote.producer import producer_actor

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=48, top_k=8, num_experts=128)  # 384 B a row
TURNS, ROWS = 10, 300  # 115 KB a turn: every payload lives in the object store


def routing(rows: int, seed: int) -> Routes:
    rng = np.random.default_rng(seed)
    table = np.argsort(rng.random((256, SPEC.num_experts)), axis=1)[:, : SPEC.top_k]
    return canonicalize(
        table[rng.integers(0, 256, size=(rows, SPEC.num_layers))].astype(np.uint8), SPEC
    )


def conversation(
    store: RouteStore, traces: TraceStoreClient, turns: int, *, first: int = 0
) -> tuple[list[int], np.ndarray]:
    """Turns ``first`` to ``turns - 1`` of session "s", each appending one payload to
    the stored history (weight version: turn // 3); returns the last turn's tokens and
    the rows of every turn so far."""
    tokens = [0, *range(1, 1 + first * ROWS)]
    match = traces.longest_prefix("s", tokens) if first else None
    handle = match.handle if match is not None and match.handle is not None else Handle(SPEC)
    for turn in range(first, turns):
        new, lease = store.put_leased(routing(ROWS, turn), "test/turns", weight_version=turn // 3)
        handle = handle + new
        tokens = [*tokens, *range(1 + turn * ROWS, 1 + (turn + 1) * ROWS)]
        traces.insert("s", tokens, handle)
        lease.release()  # the session holds it now
    return tokens, np.concatenate([routing(ROWS, turn).array for turn in range(turns)])


@ray.remote(num_cpus=0)
def read_until(lease: Lease, expected: np.ndarray, files: str) -> int:
    """Read the lease's rows again and again (in another process: no pinned blocks),
    saying so with the file ``files/reading``, until the file ``files/stop`` exists;
    returns how many reads, all exact (a wrong row raises)."""
    reads = 0
    while not (Path(files) / "stop").exists() and reads < 100_000:
        np.testing.assert_array_equal(lease.read(), expected)
        reads += 1
        (Path(files) / "reading").touch()
    return reads


def start_reading(lease: Lease, expected: np.ndarray, files: Path) -> Any:
    """``read_until`` started, and reading, when this returns."""
    reading = read_until.remote(lease, expected, str(files))
    assert wait_until(lambda: (files / "reading").exists(), timeout_s=30)
    return reading


@pytest.fixture(scope="module")
def store(ray_local: None) -> Iterator[RouteStore]:
    built = StoreConfig(run="compaction", timeout_s=30).build()
    yield built
    built.shutdown()


def test_the_trace_actor_compacts_a_long_session_while_a_reader_reads(
    store: RouteStore, tmp_path: Path
) -> None:
    baseline = used_bytes()
    traces = TraceStoreConfig(compaction=CompactionPolicy(threshold=TURNS - 1)).build(store)
    tokens, rows = conversation(store, traces, turns=TURNS - 1)
    exported = traces.export("s", tokens, "sample/old")  # held before: the old payloads
    assert exported is not None
    reading = start_reading(exported.lease, rows[: exported.rows], tmp_path)
    more, rows = conversation(store, traces, TURNS, first=TURNS - 1)  # 10 segments: due
    assert wait_until(lambda: traces.stats().compactions == 1)  # done by the actor, later
    (tmp_path / "stop").touch()
    assert ray.get(reading) > 0  # reads before, during and after the compaction
    again = traces.compact("s")  # on request: compact already, nothing to copy
    assert again is not None
    assert (again.rows_copied, again.segments_after) == (0, 4)
    after = traces.export("s", more, "sample/new")
    assert after is not None
    assert len(after.handle.sources()) == 1  # one payload ...
    assert len(after.handle.segments) == 4  # ... and a segment per weight-version run
    np.testing.assert_array_equal(store.read(after.handle), rows[: after.rows])
    np.testing.assert_array_equal(
        after.handle.weight_versions(), np.arange(after.rows) // ROWS // 3
    )
    traces.release_session("s")
    traces.shutdown()  # the shard owns the compacted rows: they outlive the actor
    np.testing.assert_array_equal(after.lease.read(), rows[: after.rows])
    np.testing.assert_array_equal(exported.lease.read(), rows[: exported.rows])
    after.lease.release()  # waited for (each lease came with its own client copy)
    exported.lease.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0
    assert wait_until(lambda: used_bytes() <= baseline), (used_bytes(), baseline)


class _StallingStore(RouteStore):
    """The real store client, stalling after one step of a compaction so that the test
    kills the compacting actor exactly there."""

    def __init__(self, config: StoreConfig, backend: Any, stall: str) -> None:
        super().__init__(config, backend)
        self._stall = stall

    def put_staged_many_flow(self, *args: Any, **kwargs: Any) -> Flow[list[Handle]]:
        # The flow both faces run (a producer's put_routes_many drives it).
        written = yield from super().put_staged_many_flow(*args, **kwargs)
        if self._stall == "written":  # compacted rows stored, not yet leased
            time.sleep(120)
        return written

    def release_lease(self, parts: Mapping[int, str]) -> None:
        if self._stall == "leased":  # new leases granted, the old ones not yet released
            time.sleep(120)
        super().release_lease(parts)


class _StallingShell(TraceStoreShell):
    def __init__(self, store: RouteStore, stall: str) -> None:
        super().__init__(
            _StallingStore(store.config, store.backend, stall), CompactionPolicy(auto=False)
        )


StallingTraceActor = producer_actor(_StallingShell, num_cpus=0)


def _session_leases(store: RouteStore) -> int:
    return dict(store.stats().leases_by_holder).get("session/s", 0)


@pytest.mark.parametrize("stall", ["written", "leased"])
def test_killing_the_compacting_actor_half_way_frees_nothing_held_and_leaks_nothing(
    ray_local: None, stall: str, tmp_path: Path
) -> None:
    store = StoreConfig(run=f"compaction-killed-{stall}", ttl_s=2.0, timeout_s=30).build()
    baseline = used_bytes()
    actor = StallingTraceActor.remote(store, stall)
    traces = TraceStoreClient(actor=actor, config=TraceStoreConfig())
    try:
        tokens, rows = conversation(store, traces, TURNS)
        exported = traces.export("s", tokens, "sample/reader")
        assert exported is not None
        reading = start_reading(exported.lease, rows[: exported.rows], tmp_path)
        actor.compact.remote("s")  # not waited for: the actor is killed half-way
        reached: dict[str, Any] = {
            "written": lambda: store.stats().unleased_payloads == 1,
            "leased": lambda: _session_leases(store) == 2 * TURNS,
        }
        assert wait_until(reached[stall], timeout_s=20), store.stats()
        kill_and_wait(actor)
        time.sleep(0.2)  # a few more reads after the kill
        (tmp_path / "stop").touch()
        assert ray.get(reading) > 0  # every read exact, through the kill
        np.testing.assert_array_equal(exported.lease.read(), rows[: exported.rows])
        # the dead holder's leases end by revocation, the unleased payload by its TTL
        assert store.revoke_holder("session/s") == TURNS * (2 if stall == "leased" else 1)
        np.testing.assert_array_equal(exported.lease.read(), rows[: exported.rows])
        exported.lease.release()
        assert wait_until(lambda: store.stats().live_payloads == 0, timeout_s=10), store.stats()
        assert store.leaks() == []
        assert wait_until(lambda: used_bytes() <= baseline), (used_bytes(), baseline)
    finally:
        store.shutdown()
