"""The demo's RL loop, top to bottom: engine -> rollout workers -> replay buffer ->
trainer with R3 replay -> weights back to the engine. Set-up and teardown live in
``services``, the step's jobs in ``rollouts``, the learner in ``trainer``.

Each step, at the engine's weight version ``v``:
1. stale groups go back to the rollout queue (the buffer releases only its own leases;
   a trace session goes when its last waiting sample is trained, discarded or lost);
2. workers regenerate them, resume the samples interrupted last step (history rows kept,
   new rows appended at ``v``), and start new groups and two-turn trace sessions;
3. the oldest fresh groups become a ``TrainingBatch`` (it takes their leases over and
   releases them when the step ends, also on an exception, and marks its samples done);
4. the trainer replays the engine's routing per micro-batch, steps, and pushes its
   float32 weights to the engine as version ``v + 1``.

``should_stop(step, services)``, asked after each step, ends a run early: teardown and
the report are the same as at the last step (the report's ``steps`` says how many ran).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from routeplay.pipeline.config import DemoConfig
from routeplay.pipeline.metrics import ReplayTally
from routeplay.pipeline.progress import DemoProgress, Silent
from routeplay.pipeline.report import DemoReport, build_report
from routeplay.pipeline.services import DemoServices, ray_session
from routeplay.pipeline.trainer import StepStats
from routeplay.rollout import TrainingBatch

__all__ = ["run_demo"]


def run_demo(
    config: DemoConfig,
    progress: DemoProgress | None = None,
    *,
    should_stop: Callable[[int, DemoServices], bool] | None = None,
) -> DemoReport:
    """Run ``config`` end to end and return its report (measured after teardown).

    ``should_stop`` sees the live services after each step (to inspect them, or to
    stop the run there by answering True).

    Example:
        >>> report = run_demo(recipe("smoke"), should_stop=lambda step, _: step == 0)
        >>> report.steps, report.ok
        (1, True)
    """
    progress = progress or Silent()
    started = time.monotonic()
    with ray_session(config.address, config.num_cpus):
        svc = DemoServices(config)
        try:
            meter, tally, steps = svc.meter, ReplayTally(), []
            planner = config.rollout.planner(config.engine.vocab_size, config.seed)
            meter.point(0, "start")
            for step in range(config.steps):
                version = svc.engine.weight_version
                svc.buffer.refresh(version)
                retries, resumes = svc.buffer.take_retries(), svc.groups.take_interrupted()
                jobs = planner.jobs(step, retries, resumes)
                svc.groups.expect(jobs)
                svc.sessions.hold(*(job.state for job in jobs))

                progress.phase(step, "rollout", len(jobs))
                done, failed = svc.pool.run(jobs, version, on_done=lambda _: progress.advance())
                svc.groups.lost(failed)
                svc.sessions.done(*(job.state for job in failed))
                svc.buffer.add_all(dict(svc.groups.add(done)))  # one call per shard
                meter.point(step, "rollout")

                groups = svc.buffer.sample(config.trainer.groups_per_step, version)
                progress.phase(step, "train", 1)
                with TrainingBatch(step, groups, sessions=svc.sessions) as batch:
                    stats = svc.trainer.step(batch, version, tally)
                svc.engine.load_weights(svc.trainer.weights(), version + 1)
                point = meter.point(step, "train")
                progress.advance()

                steps.append(stats)
                progress.step_done(step, _summary(version, stats, point.leases))
                if should_stop is not None and should_stop(step, svc):
                    break
            teardown = svc.teardown(len(steps))
        finally:
            svc.stop()
    return build_report(config, svc, tally, steps, teardown, time.monotonic() - started)


def _summary(version: int, stats: StepStats, leases: int) -> str:
    without, _, with_r3 = stats.kl_k3
    native = None if stats.drift is None else stats.drift.no_replay.route_share
    live = None if stats.drift is None else stats.drift.live.route_share
    drift = "" if native is None or live is None else (
        f"routes differing {native:.1%} (live under R3 {live:.1%}), "
    )  # fmt: skip
    return (
        f"v{version}: trained {stats.samples} samples, reward {stats.reward:.3f}, "
        f"loss {stats.loss:+.4f}, k3 KL {without:.2e} -> {with_r3:.2e} with replay, "
        f"{drift}{leases} leases live"
    )
