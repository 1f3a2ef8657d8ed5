"""Everything a demo run starts, in order, and the teardown that proves nothing leaked.

Start order: Ray (a local instance unless one is running or an address is given), the
run's route store, the engine-side store (LMDeploy key mode: before the engine, as
LMDeploy expects), the reference engine and its HTTP server, the trace store actor, the
rollout workers, the replay buffer and the trainer.

Teardown releases every holder the run created (buffer, samples waiting for their group
or for a resume, trace sessions), waits for Ray to free the bytes, *then* reads the
store's leaks and live bytes (both must be zero); ``stop`` then ends the actors, the
server and the store (``ray_session`` the Ray instance it started).

What teardown counts is the run's own where the parts are run-scoped: the route store's
leases and bytes are the run's, and so are the engine-store keys it claimed
(``keys(run)``). Keys no run claimed yet are the run's only when nobody else shared the
cluster; Ray's object-store counters are cluster-wide, so ``Teardown.sharing`` says
whether anyone else was seen (the report then leaves those figures out).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from routeplay.core.wires import wire as wire_format
from routeplay.engine.generator import ReferenceEngine
from routeplay.engine.server import EngineServer
from routeplay.pipeline.config import DemoConfig
from routeplay.pipeline.meter import Meter, Sharing, StoreTotals, cluster_users
from routeplay.pipeline.rollout_worker import RolloutWorker
from routeplay.pipeline.rollouts import GroupAssembler, RolloutPool
from routeplay.pipeline.trainer import Trainer
from routeplay.rollout import ReplayBuffer, RolloutState, SessionLedger
from routeplay.rollout.trace_actor import TraceStoreClient, TraceStoreConfig
from routeplay.store import RouteStore, StoreConfig, leave_engine_store, start_engine_store
from routeplay.store.engine.service import LMDEPLOY_NAME, LMDEPLOY_NAMESPACE

__all__ = ["DemoServices", "Teardown", "ray_session"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Teardown:
    """What was left after every holder of the run released its leases."""

    leaked_leases: int
    """Leases still held (``RouteStore.leaks()``)."""
    leaked_bytes: int
    """Payload bytes the store still keeps alive."""
    leak_holders: tuple[str, ...]
    """Who holds the leaked leases (empty when nothing leaked)."""
    payloads: int
    """Payloads the store took over the run."""
    payload_bytes: int
    """Their bytes (as stored: LMDeploy keys keep the engine's uint16)."""
    prompt_bytes_saved: int
    """Bytes never written because GRPO groups' verified-equal prompts were stored once."""
    engine_keys_left: int
    """Engine-store keys of this run never consumed (LMDeploy key mode; 0 otherwise):
    those it claimed, plus the unclaimed ones when nobody shared the cluster."""
    engine_keys_unclaimed: int
    """Live engine-store keys no run has claimed (any run's engine may have put them)."""
    written: StoreTotals
    """Object-store bytes and objects created over the run (cluster-wide counters)."""
    engine_objects: int
    """Of those, the objects the engine side wrote (LMDeploy key mode: its answers'
    arrays and the engine store's copies; 0 for wires that carry the rows)."""
    engine_bytes: int
    """Their payload bytes."""
    object_store_bytes_after: int
    """Object-store bytes in use above the run's starting baseline once Ray settled
    after the releases (0: every payload was freed; cluster-wide, and not waited for
    when the cluster was already seen shared)."""
    sharing: Sharing
    """Other runs and Ray jobs seen on the cluster during the run (the two counters
    above are this run's alone only when there were none)."""


@contextlib.contextmanager
def ray_session(address: str | None, num_cpus: int | None) -> Iterator[None]:
    """Use the running Ray, or join ``address``, or start a local instance; only what
    was started here is shut down on exit."""
    if ray.is_initialized():
        yield
        return
    ray.init(
        address=address or "local",
        num_cpus=num_cpus if address is None else None,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


class DemoServices:
    """The run's processes and holders: ``teardown()`` releases every holder and accounts
    what is left, ``stop()`` ends the processes (also when start-up fails midway)."""

    def __init__(self, config: DemoConfig, *, worker_actor: Any = RolloutWorker) -> None:
        """``worker_actor``: the rollout workers' actor class (a subclass's, e.g. the
        soak's tampering workers)."""
        self.config = config
        self.run = f"demo-{uuid.uuid4().hex[:8]}"
        self._stack = contextlib.ExitStack()
        try:
            self.store: RouteStore = StoreConfig(run=self.run, shards=config.store_shards).build()
            # Gone from the cluster's actor names before stop returns (Ray kills actors
            # asynchronously): a run started next must not count this one as a neighbour.
            self._stack.callback(_wait_until_gone, self.run, self.store.config.namespace)
            self._stack.callback(self.store.shutdown)
            self.engine_store = self._engine_store(config.wire)
            self.engine = ReferenceEngine(config.engine)
            # Loopback only (the reference engine answers anyone): workers run on this node.
            self.server = self._stack.enter_context(
                EngineServer(self.engine, config.wire, engine_store=self.engine_store)
            )
            # The trace store answers within the route store's deadline (it calls it).
            trace_config = TraceStoreConfig(timeout_s=self.store.config.timeout_s)
            self.trace: TraceStoreClient = trace_config.build(self.store)
            self._stack.callback(self.trace.shutdown)
            self.pool: RolloutPool = config.rollout.build(
                store=self.store,
                trace=self.trace,
                url=self.server.url,
                wire=config.wire,
                spec=self.engine.spec,
                worker_actor=worker_actor,
            )
            self._stack.callback(self.pool.close)
            # A session goes when its last waiting sample is trained, discarded or lost.
            self.sessions = SessionLedger(self.release_session)
            self.buffer: ReplayBuffer[RolloutState] = config.buffer.build(
                self.store, sessions=self.sessions
            )
            self.groups = GroupAssembler()
            self.trainer: Trainer = config.trainer.build(config.engine, self.store)
            self.meter = Meter(self.store)  # last: the baseline is the started system
            self._stack.callback(self.meter.close)
        except BaseException:
            self._stack.close()  # whatever started is stopped again
            raise

    def release_session(self, session: str) -> int:
        """Release one trace session (the ``SessionLedger`` calls this when the session's
        last waiting sample is done)."""
        return self.trace.release_session(session)

    def teardown(self, step: int) -> Teardown:
        """Release every holder the run created (buffer, samples waiting for their group
        or a resume, trace sessions), then account what is left: it must be nothing."""
        self.buffer.close()
        self.groups.drop_incomplete()
        self.trace.release_all()
        self.meter.point(step, "teardown")
        # Waiting for Ray to free the run's bytes only tells something when the usage is
        # the run's alone; on a shared cluster another run's bytes keep it up anyway.
        shared = self.meter.sharing().shared
        after = self.meter.settle(timeout_s=0.0 if shared else 10.0)
        leaks = self.store.leaks()
        stats = self.store.stats()
        sharing = self.meter.sharing()
        own, unclaimed = self._engine_keys()
        engine = self.server.stats()
        return Teardown(
            leaked_leases=len(leaks),
            leaked_bytes=stats.live_bytes,
            leak_holders=tuple(sorted({leak.holder for leak in leaks})),
            payloads=stats.live_payloads + stats.released_payloads + stats.expired_payloads,
            payload_bytes=stats.live_bytes + stats.released_bytes + stats.expired_bytes,
            prompt_bytes_saved=stats.shared_prefix_bytes_saved,
            engine_keys_left=own + (0 if sharing.shared else unclaimed),
            engine_keys_unclaimed=unclaimed,
            written=self.meter.written(),
            engine_objects=engine.engine_objects,
            engine_bytes=engine.engine_bytes,
            object_store_bytes_after=after,
            sharing=sharing,
        )

    def _engine_keys(self) -> tuple[int, int]:
        """Live engine-store keys this run claimed, and those no run claimed."""
        if self.engine_store is None:
            return 0, 0
        mine, nobodys = ray.get(
            [self.engine_store.keys.remote(self.run), self.engine_store.keys.remote("")],
            timeout=self.store.config.timeout_s,
        )
        return len(mine), len(nobodys)

    def _engine_store(self, wire: str) -> Any:
        if not wire_format(wire).key_store:
            return None
        try:
            ray.get_actor(LMDEPLOY_NAME, namespace=LMDEPLOY_NAMESPACE)
            existed = True
        except ValueError:
            existed = False
        actor = start_engine_store(user=self.run)
        # Shared by every run on the cluster: ended with the last run using it, if ours.
        self._stack.callback(leave_engine_store, actor, self.run, end_if_last=not existed)
        return actor

    def stop(self) -> None:
        """Stop the workers, actors, server and store (idempotent; after accounting)."""
        self._stack.close()

    def __enter__(self) -> DemoServices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_until_gone(run: str, namespace: str, *, timeout_s: float = 10.0) -> None:
    """Wait (up to ``timeout_s``) until no route store actor of ``run`` is listed."""
    deadline = time.monotonic() + timeout_s
    while run in cluster_users(namespace)[0] and time.monotonic() < deadline:
        time.sleep(0.05)
