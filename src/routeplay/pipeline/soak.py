"""``run_soak``: the demo's RL loop for N steps with faults injected, then the accounting.

Each step is the demo's step (``routeplay.pipeline.demo``) with the faults the seeded
``FaultPlan`` draws for it acting at their points (``routeplay.pipeline.faults``):

- before rollout: ``stale_retry`` refreshes the buffer one version ahead (its groups go
  stale and are retried); ``partial_interrupt`` interrupts one more new sample;
  ``malformed_payload`` arms one worker to corrupt its next engine answer;
- with every job in flight: ``worker_kill`` kills the last worker (``ray.kill``) and
  starts a new one in its slot; ``engine_kill`` stops the engine's HTTP server, which is
  restarted on the same port once a request has failed against it;
- after rollout: ``trace_overwrite`` re-inserts a live session's first turn over itself;
  ``dropped_response`` sends a request whose answer nobody reads (its engine key must
  expire by the engine store's TTL);
- in training: ``train_exception`` raises after the first micro-batch; ``trainer_kill``
  raises there too and then replaces the trainer with a new one built from the weights
  last pushed to the engine (the trainer runs in the driver, so the kill is the loss of
  the trainer object mid-fetch, not of a process).

A failed job or training step loses its samples with a typed error, counted by type.
``SoakServices``-level invariants are in ``routeplay.pipeline.soak_report``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from routeplay.core.wires import wire as wire_format
from routeplay.engine.server import EngineServer
from routeplay.pipeline.faults import (
    FaultPlan,
    InjectedFault,
)
from routeplay.pipeline.metrics import ReplayTally
from routeplay.pipeline.progress import DemoProgress, Silent
from routeplay.pipeline.rollouts import Job
from routeplay.pipeline.services import DemoServices, ray_session
from routeplay.pipeline.soak_config import SoakConfig, SoakTally
from routeplay.pipeline.soak_report import SoakReport, build_soak_report
from routeplay.pipeline.soak_worker import TamperingWorker
from routeplay.pipeline.trainer import Trainer
from routeplay.rollout import RolloutState, Status, TrainingBatch
from routeplay.store import start_engine_store
from routeplay.store.engine.service import LMDEPLOY_NAME, LMDEPLOY_NAMESPACE

__all__ = ["SoakConfig", "run_soak"]

_CALL_S = 60.0
"""Deadline of the soak's own remote calls (worker start, arm, engine-store stats)."""


class FaultyTrainer(Trainer):
    """The demo's trainer with one armed exception, raised after a micro-batch (the
    materializer then holds the next one, prefetched)."""

    armed: InjectedFault | None = None

    def _micro_batch(self, *args: Any) -> float:
        loss = super()._micro_batch(*args)
        if self.armed is not None:
            exc, self.armed = self.armed, None
            raise exc
        return loss


def run_soak(config: SoakConfig, progress: DemoProgress | None = None) -> SoakReport:
    """Run the soak and return its report (measured after teardown).

    Example:
        >>> report = run_soak(SoakConfig(steps=9))  # doctest: +SKIP
        >>> report.ok
        True
    """
    progress = progress or Silent()
    started = time.monotonic()
    with ray_session(config.demo.address, config.demo.num_cpus):
        key_store = _start_key_store(config)
        try:
            svc = DemoServices(config.demo, worker_actor=TamperingWorker)
            try:
                soak = _Soak(config, svc)
                try:
                    for step in range(config.steps):
                        soak.step(step, progress)
                    teardown = svc.teardown(config.steps)
                    keys = soak.wait_for_expiry()
                finally:
                    soak.stop()
            finally:
                svc.stop()
        finally:
            if key_store is not None:
                ray.kill(key_store)
    return build_soak_report(
        config,
        svc,
        soak.plan.fired,
        soak.tally,
        teardown,
        keys,
        time.monotonic() - started,
        soak.replay.mismatches,
    )


def _start_key_store(config: SoakConfig) -> Any:
    """Start the engine store with the soak's short TTL before the services look for it;
    returns it when this run started it (None: not a key wire, or it was running)."""
    if not wire_format(config.demo.wire).key_store:
        return None
    try:
        ray.get_actor(LMDEPLOY_NAME, namespace=LMDEPLOY_NAMESPACE)
        return None  # someone else's: it keeps its TTL (keys may expire later)
    except ValueError:
        return start_engine_store(ttl_s=config.key_ttl_s)


class _Soak:
    """The loop's state: the services, the plan, the tally and the replaceable parts."""

    def __init__(self, config: SoakConfig, svc: DemoServices) -> None:
        self.config, self.svc = config, svc
        self.plan: FaultPlan = config.faults.build()
        self.tally = SoakTally()
        self.replay = ReplayTally()
        self.planner = config.demo.rollout.planner(config.demo.engine.vocab_size, config.demo.seed)
        self.wire = wire_format(config.demo.wire)
        self.server: EngineServer = svc.server
        self.port = int(svc.server.url.rsplit(":", 1)[1])
        self._servers: list[EngineServer] = []
        self.trainer = self._new_trainer(svc.trainer.weights())
        self._checkpoint = svc.trainer.weights()

    # -- one step ------------------------------------------------------------------
    def step(self, step: int, progress: DemoProgress) -> None:
        svc, faults = self.svc, self.plan.draw(step)
        version = svc.engine.weight_version
        svc.buffer.refresh(version)
        retries, resumes = svc.buffer.take_retries(), svc.groups.take_interrupted()
        jobs = self.planner.jobs(step, retries, resumes)
        if "partial_interrupt" in faults:
            jobs = self._interrupt_one(jobs)
        svc.groups.expect(jobs)
        svc.sessions.hold(*(job.state for job in jobs))
        if "malformed_payload" in faults:
            ray.get(svc.pool.workers[0].arm.remote(1), timeout=_CALL_S)
        progress.phase(step, "rollout", len(jobs))
        done = self._rollout(jobs, version, faults, progress)
        if "stale_retry" in faults:  # the groups just made go stale one version early
            retried, _ = svc.buffer.refresh(version + 1)
            self.plan.count("stale_retry", min(1, len(retried)))
        if "malformed_payload" in faults:
            tampered = ray.get(svc.pool.workers[0].take_tampered.remote(), timeout=_CALL_S)
            self.plan.count("malformed_payload", tampered)
        if "trace_overwrite" in faults:
            self._overwrite_turn(done)
        if "dropped_response" in faults:
            self._drop_response(step)
        progress.phase(step, "train", 1)
        trained = self._train(step, version, faults)
        progress.advance()
        fired = ", ".join(sorted(faults)) or "-"
        progress.step_done(step, f"v{version}: {len(done)} produced, {trained} trained; {fired}")

    def _interrupt_one(self, jobs: list[Job]) -> list[Job]:
        stop = self.config.demo.rollout.stop_after
        for index, job in enumerate(jobs):
            if job.kind == "new" and job.sampling.stop_after is None:
                sampling = dataclasses.replace(job.sampling, stop_after=stop)
                jobs[index] = dataclasses.replace(job, sampling=sampling)
                self.plan.count("partial_interrupt")
                break
        return jobs

    def _rollout(
        self, jobs: list[Job], version: int, faults: frozenset[str], progress: DemoProgress
    ) -> list[RolloutState]:
        svc = self.svc
        down = "engine_kill" in faults

        kill = "worker_kill" in faults
        last = len(svc.pool.workers) - 1
        in_flight_kill = self.config.faults.worker_kill_in_flight
        if kill and not in_flight_kill:  # dead before it is sent anything
            ray.kill(svc.pool.workers[last], no_restart=True)

        def in_flight() -> None:
            if kill:
                self._restart_worker(last, kill_old=in_flight_kill)
            if down:
                self.server.close()
                self.plan.count("engine_kill")

        def failed(job: Job, exc: Exception) -> None:
            nonlocal down
            self.tally.failure(exc, 1, job.state.sample_id)
            if down:  # the first request that found it dead: restart it
                self._restart_engine()
                down = False

        done, lost = svc.pool.run(
            jobs,
            version,
            on_done=lambda _: progress.advance(),
            on_failed=failed,
            after_submit=in_flight,
        )
        if down:
            self._restart_engine()
        svc.groups.lost(lost)
        svc.sessions.done(*(job.state for job in lost))
        for group_id, states in svc.groups.add(done):
            svc.buffer.add(group_id, states)
        self.tally.produced += len(done)
        return done

    def _train(self, step: int, version: int, faults: frozenset[str]) -> int:
        svc = self.svc
        kill = "trainer_kill" in faults
        if kill or "train_exception" in faults:
            why = "trainer killed mid-fetch" if kill else "exception in a training step"
            self.trainer.armed = InjectedFault(why, where=f"armed in step {step}")
        groups = svc.buffer.sample(self.config.demo.trainer.groups_per_step, version)
        samples = sum(len(group.states) for group in groups)
        try:
            with TrainingBatch(step, groups, sessions=svc.sessions) as batch:
                stats = self.trainer.step(batch, version, self.replay)
        except InjectedFault as exc:
            self.plan.count("trainer_kill" if kill else "train_exception")
            self.tally.failure(exc, samples, f"batch {step}")
            if kill:  # the replacement starts from the weights the engine holds
                self.trainer = self._new_trainer(self._checkpoint)
            return 0
        except Exception as exc:  # a typed loss, counted; the soak goes on
            self.tally.failure(exc, samples, f"batch {step}")
            return 0
        self._checkpoint = self.trainer.weights()
        svc.engine.load_weights(self._checkpoint, version + 1)
        self.tally.trained += stats.samples
        return stats.samples

    # -- faults --------------------------------------------------------------------
    def _restart_worker(self, index: int, *, kill_old: bool) -> None:
        if kill_old:  # while it runs the first of its jobs
            ray.kill(self.svc.pool.workers[index], no_restart=True)
        self.svc.pool.replace_worker(index, self._start_worker())
        self.plan.count("worker_kill")

    def _restart_engine(self) -> None:
        svc = self.svc
        self.server = EngineServer(
            svc.engine, self.wire.name, port=self.port, engine_store=svc.engine_store
        )
        self._servers.append(self.server)

    def _overwrite_turn(self, done: list[RolloutState]) -> None:
        for state in done:
            session = state.session_id
            if session is None or state.status is not Status.COMPLETED:
                continue
            exported = self.svc.trace.export(session, state.prompt_ids, "soak/overwrite")
            if exported is None or exported.rows < exported.matched - 1:
                if exported is not None:
                    exported.lease.release()
                continue
            try:  # the first turn's tokens and rows again: the trie replaces its entry
                turn = state.prompt_ids[: exported.matched]
                self.svc.trace.insert(session, turn, exported.handle[: exported.matched - 1])
            finally:
                exported.lease.release()
            self.plan.count("trace_overwrite")
            return

    def _drop_response(self, step: int) -> None:
        rollout = self.config.demo.rollout
        path, body = self.wire.request(
            list(range(1, 9)),
            max_new_tokens=rollout.stop_after,
            temperature=rollout.temperature,
            seed=step,
        )
        answer = httpx.post(self.server.url + path, json=body, timeout=rollout.timeout_s)
        answer.raise_for_status()  # the engine stored it; nobody reads the key
        self.plan.count("dropped_response")

    # -- parts ---------------------------------------------------------------------
    def _start_worker(self) -> Any:
        svc, rollout = self.svc, self.config.demo.rollout
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        worker = TamperingWorker.options(scheduling_strategy=here).remote(
            svc.store, svc.trace, svc.server.url, self.wire.name, svc.engine.spec, rollout.timeout_s
        )
        ray.get(worker.__ray_ready__.remote(), timeout=_CALL_S)
        return worker

    def _new_trainer(self, weights: dict[str, Any]) -> FaultyTrainer:
        demo = self.config.demo
        trainer = FaultyTrainer(demo.trainer, demo.engine, self.svc.store)
        trainer.model.load_state_dict(weights)
        return trainer

    def wait_for_expiry(self) -> tuple[int, int]:
        """Wait until no engine key is left (or ``expiry_wait_s``); returns (keys
        expired by TTL, keys left)."""
        store = self.svc.engine_store
        if store is None:
            return 0, 0
        deadline = time.monotonic() + self.config.expiry_wait_s
        while True:
            stats = ray.get(store.stats.remote(), timeout=_CALL_S)
            if stats.live_keys == 0 or time.monotonic() > deadline:
                return int(stats.expired), int(stats.live_keys)
            time.sleep(0.2)

    def stop(self) -> None:
        """Close the engine servers this soak restarted (the first is the services')."""
        for server in self._servers:
            server.close()
