"""Two demo runs at once on one Ray instance, sharing LMDeploy's engine store.

Run B starts first, so it creates the shared ``lmdeploy/shared_store`` actor; run A joins
it. Each pauses after its step 0 (live leased samples in its buffer, and one engine key
it claimed and has not consumed) while the other tries everything on that data: every
attempt is a ``RunMismatch`` and leaves the data as it was. B is then stopped early
(after 2 of its 4 steps) while A waits with live data; A trains on to its third and last
step after B's teardown, which must leave the engine store, A's keys and payloads alone. Each
report is its run's own: no leak, no mismatch, its own engine keys, and the shared
cluster said (the cluster-wide object-store figures are not evaluated). A second
driver process on the cluster is seen, and named, by a run's meter as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import ray

from routeplay.core import EngineKey, Handle, Segment, read_response
from routeplay.core.wires import wire
from routeplay.errors import RunMismatch
from routeplay.pipeline.config import recipe
from routeplay.pipeline.demo import run_demo
from routeplay.pipeline.meter import Meter
from routeplay.pipeline.report import DemoReport
from routeplay.pipeline.services import DemoServices
from routeplay.rollout import RolloutState
from routeplay.store import StoreConfig
from routeplay.store.engine.service import LMDEPLOY_NAME, LMDEPLOY_NAMESPACE

pytestmark = [pytest.mark.e2e, pytest.mark.long]

WIRE = "lmdeploy-key"  # engine keys live in the one engine store every run shares
WAIT_S = 120.0  # the other run's next step or teardown, on 2 busy CPUs
Hook = Callable[[int, DemoServices], bool]


class TwoRuns:
    """Where the two runs meet: each hook publishes its services and waits for the other."""

    def __init__(self) -> None:
        self.live: dict[str, DemoServices] = {}
        self.keys: dict[str, EngineKey] = {}
        self.payloads: dict[str, Any] = {}  # what each claimed key held, peeked
        self.both_up = threading.Barrier(2, timeout=WAIT_S)
        self.probed = threading.Event()
        self.b_done = threading.Event()
        self.checked_after_b: list[str] = []

    def guarded(self, hook: Hook) -> Hook:
        """A failing hook must not leave the other run waiting for it until the timeout."""

        def run(step: int, svc: DemoServices) -> bool:
            try:
                return hook(step, svc)
            except BaseException:
                self.both_up.abort()
                self.probed.set()
                raise

        return run

    def b_hook(self, step: int, svc: DemoServices) -> bool:
        if step == 0:
            self._meet("b", svc)
            a, b = self.live["a"], svc
            _probe(intruder=a, owner=b, key=self.keys["b"])
            _probe(intruder=b, owner=a, key=self.keys["a"])
            self.probed.set()
        return step == 1  # stopped early: 2 of 4 steps

    def a_hook(self, step: int, svc: DemoServices) -> bool:
        if step == 0:
            self._meet("a", svc)
            assert self.probed.wait(WAIT_S), "run B never finished probing"
        elif step == 1:
            assert self.b_done.wait(WAIT_S), "run B did not stop"
            self._check_a_survived_b(svc)
        return False

    def _meet(self, name: str, svc: DemoServices) -> None:
        self.live[name] = svc
        self.keys[name], self.payloads[name] = _claimed_key(svc)
        self.both_up.wait()  # both runs mid-run, with live data

    def _check_a_survived_b(self, svc: DemoServices) -> None:
        """B's teardown left the shared engine store, both claimed keys and A's payloads
        alone: A adopts its key now (consuming it) and reads what it peeked before."""
        b, key = self.live["b"], self.keys["a"]
        engine = ray.get_actor(LMDEPLOY_NAME, namespace=LMDEPLOY_NAMESPACE)
        assert ray.get(engine.keys.remote(b.run), timeout=20) == [self.keys["b"].key]
        assert ray.get(engine.keys.remote(svc.run), timeout=20) == [key.key]
        late = svc.store.adopt_key(key, svc.engine.spec)
        with svc.store.acquire(late, "test/after-b") as lease:
            np.testing.assert_array_equal(lease.read(), self.payloads["a"][: key.rows])
        state = _waiting_sample(svc)
        assert state.routing.handle is not None
        assert svc.store.read(state.routing.handle).shape[0] == state.routing.rows
        self.checked_after_b.append(svc.run)


def _claimed_key(svc: DemoServices) -> tuple[EngineKey, Any]:
    """One engine response of ``svc``'s engine, whose key its run claims by peeking at the
    payload under its run id (the key stays live: nothing consumed it); the payload."""
    fmt = wire(WIRE)
    path, body = fmt.request((5, 9, 2, 7), max_new_tokens=3, temperature=1.0, seed=3)
    answer = httpx.post(f"{svc.server.url}{path}", json=body, timeout=30).json()
    key = read_response(fmt.engine, answer, svc.engine.spec).key
    assert key is not None
    assert key.run == ""  # as read from a response: no run yet
    payload = ray.get(svc.engine_store.peek.remote(key.key, svc.run), timeout=20)
    assert payload.shape[0] in key.payload_rows
    return key, payload


def _lazy(key: EngineKey, svc: DemoServices) -> Handle:
    return Handle.of(Segment(source=key, start=0, stop=key.rows, spec=svc.engine.spec))


def _waiting_sample(svc: DemoServices) -> RolloutState:
    """A leased sample waiting in ``svc``'s replay buffer."""
    waiting = [s for g in svc.buffer.groups() for s in g.states if s.routing.lease is not None]
    assert waiting, f"run {svc.run} has no sample waiting in its buffer"
    return waiting[0]


def _probe(*, intruder: DemoServices, owner: DemoServices, key: EngineKey) -> None:
    """``intruder`` tries to read, lease, release, adopt, consume and free ``owner``'s
    live data; each is refused with ``RunMismatch`` and ``owner``'s data stays intact."""
    state = _waiting_sample(owner)
    handle, lease = state.routing.handle, state.routing.lease
    assert handle is not None
    assert lease is not None
    before = owner.store.read(handle)
    [leak] = [r for r in owner.store.leaks() if r.lease_id in lease.lease_ids]
    spec = owner.engine.spec
    attempts: dict[str, Callable[[], Any]] = {
        "read a payload": lambda: intruder.store.read(handle),
        "resolve a payload": lambda: intruder.store.resolve(handle, slice(0, 1)),
        "lease a payload": lambda: intruder.store.acquire(handle, "train/intruder"),
        "release a lease by id": lambda: intruder.store.revoke([leak.lease_id]),
        "release a leak record": lambda: intruder.store.revoke([leak]),
        "adopt (consume) a key": lambda: intruder.store.adopt_keys([key], spec),
        "free a key": lambda: intruder.store.free_key(key),
        "resolve a key": lambda: intruder.store.read(_lazy(key, intruder)),
        "adopt a key scoped to its run": lambda: intruder.store.adopt_key(
            owner.store.scoped(key), spec
        ),
    }
    for what, attempt in attempts.items():
        with pytest.raises(RunMismatch):  # noqa: PT012 (the fail names what got through)
            attempt()
            pytest.fail(f"run {intruder.run} could {what} of run {owner.run}")
    engine = owner.engine_store
    assert ray.get(engine.keys.remote(owner.run), timeout=20) == [key.key]
    assert key.key not in ray.get(engine.keys.remote(intruder.run), timeout=20)
    np.testing.assert_array_equal(owner.store.read(handle), before)
    assert not lease.released
    assert leak.lease_id in {r.lease_id for r in owner.store.leaks()}


def _own_invariants(report: DemoReport, steps: int, other: str) -> None:
    assert report.steps == steps
    assert report.routing_mismatches == 0
    assert report.routing_rows_replayed > 0
    assert (report.leaked_leases, report.leaked_bytes) == (0, 0), report.leak_holders
    assert report.failed_rollouts == 0
    # Ray's counters were not this run's alone: said, and not evaluated.
    assert report.object_store_shared
    assert other in report.other_runs
    assert report.other_jobs == ()  # both runs are threads of this one driver
    assert report.writes_per_payload is None
    assert report.object_store_bytes_after is None
    assert report.unchecked == ("writes_per_payload",)
    assert report.ok


def _engine_store_exists() -> bool:
    try:
        ray.get_actor(LMDEPLOY_NAME, namespace=LMDEPLOY_NAMESPACE)
    except ValueError:
        return False
    return True


@pytest.mark.usefixtures("ray_local")
def test_two_runs_share_the_engine_store_and_one_stops_early() -> None:
    assert not _engine_store_exists()  # B must be the one that creates it
    meet = TwoRuns()
    smoke = recipe("smoke")
    # Two of a step's three complete groups trained: one waits in the buffer (what the
    # other run tries to touch), goes stale and is retried.
    trainer = dataclasses.replace(smoke.trainer, groups_per_step=2)
    config = smoke.replace(wire=WIRE, steps=4, trainer=trainer)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="demo") as pool:
        run_b = pool.submit(run_demo, config.replace(seed=1), should_stop=meet.guarded(meet.b_hook))
        run_b.add_done_callback(lambda _: meet.b_done.set())
        _wait_for(_engine_store_exists, run_b)
        run_a = pool.submit(
            run_demo, config.replace(seed=2, steps=3), should_stop=meet.guarded(meet.a_hook)
        )
        b, a = run_b.result(timeout=4 * WAIT_S), run_a.result(timeout=4 * WAIT_S)

    assert meet.checked_after_b == [a.run]
    _own_invariants(b, 2, other=a.run)
    _own_invariants(a, 3, other=b.run)
    assert min(a.samples_retried, a.partial_resumes, a.sessions) > 0
    # Engine keys are counted per run: B's claimed key was still live when A counted.
    assert (b.engine_keys_left, a.engine_keys_left) == (1, 0)
    # B created the engine store and left first: A still used it, so it survived both
    # teardowns (the last user did not create it). This test started it: it ends it.
    engine = ray.get_actor(LMDEPLOY_NAME, namespace=LMDEPLOY_NAMESPACE)
    assert ray.get(engine.free.remote(meet.keys["b"].key, b.run), timeout=20)
    assert ray.get(engine.keys.remote(b.run), timeout=20) == []
    ray.kill(engine)


def _wait_for(ready: Callable[[], bool], run: Future[DemoReport]) -> None:
    """Poll ``ready`` until it holds; a run that fails first raises its error here."""
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if run.done():
            run.result()
            pytest.fail("run B ended before its engine store was up")
        assert time.monotonic() < deadline, "run B's engine store did not come up"
        time.sleep(0.1)


@contextlib.contextmanager
def _other_driver() -> Iterator[str]:
    """Another Ray driver (a job of its own) connected to this Ray instance; its job id."""
    address = ray.get_runtime_context().gcs_address
    code = (
        f"import ray, sys; ray.init(address={address!r}, log_to_driver=False); "
        "print(ray.get_runtime_context().get_job_id(), flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        yield child.stdout.readline().strip()
    finally:
        child.communicate(timeout=60)  # closes its stdin: it disconnects and exits


@pytest.mark.usefixtures("ray_local")
def test_a_runs_meter_names_another_driver_seen_during_the_run() -> None:
    store = StoreConfig(run="demo-meter", timeout_s=20).build()
    try:
        with Meter(store) as meter:
            assert meter.sharing().other_jobs == ()
            with _other_driver() as job:
                assert job
                assert meter.sharing().other_jobs == (job,)
            # Gone before teardown, still named: its objects were counted meanwhile.
            assert meter.sharing().other_jobs == (job,)
            assert meter.sharing().shared
    finally:
        store.shutdown()
