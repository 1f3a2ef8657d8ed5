"""The lease table as a state machine: hypothesis drives random acquire/release/clone/
transfer/expire sequences against a simple model and checks every invariant."""

from __future__ import annotations

import re
import weakref

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from routeplay.errors import AlreadyReleased, RoutesExpired, RoutesLost, RunMismatch
from routeplay.store import LeaseTable, PayloadState
from routeplay.store.shard.lease_table import LEASE_IDS_PER_DRAW

RUN = "run-a"
HOLDERS = st.sampled_from(["buffer/g1", "session/s1", "train/step-1", "train/step-2"])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Bytes:
    """Stands in for an ObjectRef: weak-referenceable, so we can see when nobody holds it."""


class LeaseMachine(RuleBasedStateMachine):
    payloads = Bundle("payloads")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.table: LeaseTable[Bytes] = LeaseTable(RUN, ttl_s=10.0, clock=self.clock)
        self.model_leases: dict[str, tuple[str, frozenset[str]]] = {}  # id -> holder, payloads
        self.ever_leased: set[str] = set()
        self.fresh: dict[str, set[str]] = {}  # lease -> payloads it was the first to lease
        self.alive: dict[str, tuple[int, float]] = {}  # payload -> nbytes, created
        self.refs: dict[str, weakref.ref[Bytes]] = {}
        self.count = 0

    @rule(target=payloads, nbytes=st.integers(1, 1000))
    def add(self, nbytes: int) -> str:
        pid = f"p{self.count}"
        self.count += 1
        ref = Bytes()
        self.refs[pid] = weakref.ref(ref)
        self.table.add(pid, ref, rows=1, nbytes=nbytes)
        self.alive[pid] = (nbytes, self.clock.now)
        return pid

    @rule(target=leases, chosen=st.lists(payloads, min_size=1, max_size=3), holder=HOLDERS)
    def acquire(self, chosen: list[str], holder: str) -> str:
        if all(pid in self.alive for pid in chosen):
            fresh = {pid for pid in chosen if not self._held(pid)}
            lid = self.table.acquire(chosen, holder, run=RUN)
            self.model_leases[lid] = (holder, frozenset(chosen))
            self.fresh[lid] = fresh
            self.ever_leased.update(chosen)
            return lid
        with pytest.raises((RoutesLost, RoutesExpired)):
            self.table.acquire(chosen, holder, run=RUN)
        return "never-granted"

    @rule(lease=leases)
    def release(self, lease: str) -> None:
        dropped = self.table.release(lease)
        entry = self.model_leases.pop(lease, None)
        expected = set()
        if entry is not None:
            for pid in entry[1]:
                if not any(pid in p for _, p in self.model_leases.values()):
                    expected.add(pid)
                    del self.alive[pid]
        assert set(dropped) == expected
        assert self.table.release(lease) == []  # idempotent

    @rule(lease=leases)
    def revoke(self, lease: str) -> None:
        """A rolled-back grant: payloads it first leased return to STORED (TTL again)."""
        dropped = self.table.revoke(lease)
        entry = self.model_leases.pop(lease, None)
        expected = set()
        if entry is not None:
            for pid in entry[1]:
                if self._held(pid):
                    continue
                if pid in self.fresh.get(lease, set()):
                    self.ever_leased.discard(pid)
                else:
                    expected.add(pid)
                    del self.alive[pid]
        assert set(dropped) == expected

    def _held(self, pid: str) -> bool:
        return any(pid in pids for _, pids in self.model_leases.values())

    @rule(target=leases, lease=leases, holder=HOLDERS)
    def clone(self, lease: str, holder: str) -> str:
        if lease not in self.model_leases:
            with pytest.raises(AlreadyReleased):
                self.table.clone(lease, holder)
            return "never-granted"
        lid = self.table.clone(lease, holder)
        self.model_leases[lid] = (holder, self.model_leases[lease][1])
        return lid

    @rule(target=leases, lease=leases, holder=HOLDERS)
    def transfer(self, lease: str, holder: str) -> str:
        if lease not in self.model_leases:
            with pytest.raises(AlreadyReleased):
                self.table.transfer(lease, holder)
            return "never-granted"
        lid = self.table.transfer(lease, holder)
        _, pids = self.model_leases.pop(lease)
        self.model_leases[lid] = (holder, pids)
        return lid

    @rule(seconds=st.floats(0, 8))
    def tick_and_expire(self, seconds: float) -> None:
        self.clock.now += seconds
        expired = set(self.table.expire())
        due = {
            pid
            for pid, (_, created) in self.alive.items()
            if pid not in self.ever_leased and created <= self.clock.now - 10.0
        }
        assert expired == due
        for pid in due:
            del self.alive[pid]
            assert self.table.state(pid) is PayloadState.EXPIRED

    @precondition(lambda self: self.count > 0)
    @rule(payload=payloads)
    def other_runs_are_refused(self, payload: str) -> None:
        with pytest.raises(RunMismatch):
            self.table.refs([payload], run="run-b")
        with pytest.raises(RunMismatch):
            self.table.acquire([payload], "intruder", run="run-b")

    @invariant()
    def states_follow_leases(self) -> None:
        held = {pid for _, pids in self.model_leases.values() for pid in pids}
        for pid in self.alive:
            state = self.table.state(pid)
            assert state is (PayloadState.LEASED if pid in held else PayloadState.STORED)

    @invariant()
    def stats_match_the_model(self) -> None:
        stats = self.table.stats()
        assert stats.live_payloads == len(self.alive)
        assert stats.live_bytes == sum(n for n, _ in self.alive.values())
        assert stats.leases == len(self.model_leases)
        assert len(self.table.leaks()) == len(self.model_leases)

    @invariant()
    def dropped_payloads_hold_no_reference(self) -> None:
        # CPython frees on the last reference (no cycles here), so no gc pass is needed.
        for pid, ref in self.refs.items():
            assert (ref() is not None) == (pid in self.alive), pid


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_refs_of_a_released_payload_name_it() -> None:
    table: LeaseTable[object] = LeaseTable(RUN)
    table.add("p1", object(), rows=3, nbytes=30)
    lease = table.acquire(["p1"], "buffer/g1", run=RUN)
    assert table.release(lease) == ["p1"]
    with pytest.raises(RoutesLost, match="p1"):
        table.refs(["p1"], run=RUN)


def test_lease_ids_stay_unguessable_across_draws() -> None:
    """Ids are drawn many at a time: each is still 128 random bits of its own, none
    repeats, and a new draw is made when one is used up."""
    table: LeaseTable[object] = LeaseTable(RUN, lease_prefix="run-a.0")
    table.add("p1", object(), rows=3, nbytes=30)
    first = table.acquire(["p1"], "buffer/g1", run=RUN)
    ids = [first] + [table.clone(first, "train/step-1") for _ in range(2 * LEASE_IDS_PER_DRAW)]
    assert len(set(ids)) == len(ids)
    tails = [lease_id.removeprefix("run-a.0/lease-") for lease_id in ids]
    assert all(re.fullmatch(r"[0-9a-f]{32}", tail) for tail in tails)
    assert len({tail[:8] for tail in tails}) > len(tails) // 2  # random, not counted up


def test_revoking_a_clone_leaves_its_payloads_to_the_original() -> None:
    """A clone's payloads are all leased already: revoking it restores none to STORED,
    and only the original's revoke does."""
    table: LeaseTable[object] = LeaseTable(RUN, ttl_s=5.0)
    table.add("p1", object(), rows=3, nbytes=30)
    original = table.acquire(["p1"], "buffer/g1", run=RUN)
    clone = table.clone(original, "train/step-1")
    assert table.revoke(clone) == []
    assert table.state("p1") is PayloadState.LEASED
    assert table.revoke(original) == []
    assert table.state("p1") is PayloadState.STORED  # fresh again: its TTL applies


def test_transfer_keeps_the_payload_alive() -> None:
    table: LeaseTable[object] = LeaseTable(RUN)
    table.add("p1", object(), rows=3, nbytes=30)
    lease = table.acquire(["p1"], "buffer/g1", run=RUN)
    moved = table.transfer(lease, "train/step-1")
    assert table.state("p1") is PayloadState.LEASED
    assert [leak.holder for leak in table.leaks()] == ["train/step-1"]
    assert table.stats().bytes_by_holder == (("train/step-1", 30),)
    table.release(moved)
    assert table.stats().released_bytes == 30


def test_expiry_is_counted_and_named() -> None:
    clock = Clock()
    table: LeaseTable[object] = LeaseTable(RUN, ttl_s=5, clock=clock)
    table.add("p1", object(), rows=1, nbytes=7)
    clock.now = 6
    assert table.expire() == ["p1"]
    assert table.stats().expired_bytes == 7
    with pytest.raises(RoutesExpired, match="TTL"):
        table.acquire(["p1"], "late", run=RUN)


def test_leaks_say_who_holds_what_since_when() -> None:
    clock = Clock()
    table: LeaseTable[object] = LeaseTable(RUN, clock=clock, wall_clock=lambda: 1_700_000_000.0)
    table.add("p1", object(), rows=2, nbytes=20)
    table.add("p2", object(), rows=3, nbytes=30)
    table.acquire(["p1", "p2"], "session/abc", run=RUN)
    clock.now = 12.5
    [leak] = table.leaks()
    assert leak.holder == "session/abc"
    assert leak.since == 1_700_000_000.0
    assert leak.age_s == 12.5
    assert leak.payloads == ("p1", "p2")
    assert leak.nbytes == 50
