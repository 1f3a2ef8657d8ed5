"""The driver's side of rollouts: which requests a step makes, who runs them, and when a
group is complete.

- ``JobPlanner`` decides a step's jobs: stale samples to regenerate, interrupted samples
  to resume, new single-turn groups (some interrupted on purpose) and new multi-turn
  conversations, each with its own sampling seed.
- ``RolloutPool`` runs jobs on the rollout worker actors and hands back each sample as
  it finishes. The jobs of one group and kind (its fresh members, its resumes, its
  retries, its conversations) run as one worker call whose new rows are one payload
  (fresh members' prompt rows stored once). A job that fails (alone, or with its whole
  call) releases the lease its input held.
- ``GroupAssembler`` holds samples until every member of their group is COMPLETED; an
  interrupted member keeps its group waiting (and leased) until it is resumed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from routeplay.errors import MisuseError
from routeplay.pipeline.rollout_worker import RolloutWorker, Sampling
from routeplay.pipeline.task import random_tokens
from routeplay.rollout import RolloutState, Status
from routeplay.rollout.routing_terms import prefix_holder, sample_holder

_DEADLINE_S = 600.0
"""Longest wait for any rollout to finish: past it, every pending job counts as failed."""

if TYPE_CHECKING:
    from routeplay.core.spec import RouteSpec
    from routeplay.store import RouteStore

__all__ = ["GroupAssembler", "Job", "JobPlanner", "PoolStats", "RolloutConfig", "RolloutPool"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutConfig:
    """How many samples each step generates, and how."""

    workers: int = 2
    """Rollout worker actors."""
    group_size: int = 4
    """Samples per prompt (GRPO group)."""
    groups_per_step: int = 3
    """New single-turn groups per step."""
    partial_groups_per_step: int = 1
    """Of those, groups interrupted after ``stop_after`` tokens and resumed next step."""
    conversations_per_step: int = 1
    """New multi-turn groups per step (each sample is a two-turn trace session)."""
    prompt_tokens: tuple[int, int] = (6, 12)
    """Prompt length range, inclusive."""
    user_turn_tokens: int = 4
    """Tokens the user adds between turn 1 and turn 2."""
    max_new_tokens: int = 24
    """Generated tokens per sample (per turn)."""
    stop_after: int = 8
    """Where interrupted samples stop (< ``max_new_tokens``)."""
    temperature: float = 1.0
    """Sampling temperature."""
    timeout_s: float = 60.0
    """HTTP timeout of one engine request."""

    def __post_init__(self) -> None:
        if not 0 < self.stop_after < self.max_new_tokens:
            raise MisuseError(
                "an interruption must come before the end of a sample",
                expected=f"0 < stop_after < max_new_tokens ({self.max_new_tokens})",
                found=self.stop_after,
            )
        if self.partial_groups_per_step > self.groups_per_step or self.workers < 1:
            raise MisuseError(
                "partial groups are a subset of the new groups; at least one worker",
                found=(self.partial_groups_per_step, self.groups_per_step, self.workers),
            )

    def planner(self, vocab_size: int, seed: int) -> JobPlanner:
        """The per-step job planner of these settings."""
        return JobPlanner(self, vocab_size, np.random.default_rng(seed))

    def build(
        self,
        *,
        store: RouteStore,
        trace: Any,
        url: str,
        wire: str,
        spec: RouteSpec,
        worker_actor: Any = RolloutWorker,
    ) -> RolloutPool:
        """Start the worker actors (``worker_actor``: ``RolloutWorker`` or an actor class
        of a subclass of its shell), talking to the engine at ``url`` in ``wire`` format."""
        # The engine server listens on loopback: the workers live on the driver's node.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        workers = [
            worker_actor.options(scheduling_strategy=here).remote(
                store, trace, url, wire, spec, self.timeout_s
            )
            for _ in range(self.workers)
        ]
        ray.get(
            [worker.__ray_ready__.remote() for worker in workers], timeout=self.timeout_s
        )  # fail fast, start warm
        return RolloutPool(workers, store=store)


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One worker call: a sample to (re)generate or resume, or a conversation to run."""

    state: RolloutState
    """The input sample (a resume holds its lease until the worker's new one exists)."""
    sampling: Sampling
    """How to sample."""
    user_turn: tuple[int, ...] | None = None
    """Set for a new conversation: the user's tokens between turn 1 and turn 2."""

    @property
    def kind(self) -> str:
        """``conversation``, ``resume``, ``retry`` or ``new`` (for counters)."""
        if self.user_turn is not None:
            return "conversation"
        if self.state.status is Status.ABORTED:
            return "resume"
        return "retry" if self.state.routing.retries else "new"


class JobPlanner:
    """Makes each step's jobs from the rollout settings (prompts and seeds from ``rng``)."""

    def __init__(self, settings: RolloutConfig, vocab_size: int, rng: np.random.Generator) -> None:
        self.settings = settings
        self._vocab = vocab_size
        self._rng = rng
        self._groups = itertools.count()

    def jobs(
        self, step: int, retries: Sequence[RolloutState], interrupted: Sequence[RolloutState]
    ) -> list[Job]:
        """Retries and resumes first (they are the oldest), then new groups: single-turn
        ones (the first ``partial_groups_per_step`` interrupted), then conversations."""
        cfg = self.settings
        jobs = [Job(state=s, sampling=self._sampling()) for s in (*retries, *interrupted)]
        for index in range(cfg.groups_per_step + cfg.conversations_per_step):
            group = f"s{step}-g{next(self._groups)}"
            conversation = index >= cfg.groups_per_step
            prompt = random_tokens(self._rng, self._vocab, cfg.prompt_tokens)
            stop = cfg.stop_after if index < cfg.partial_groups_per_step else None
            for member in range(cfg.group_size):
                sample = f"{group}-{member}"
                state = RolloutState(
                    sample_id=sample,
                    group_id=group,
                    prompt_ids=prompt,
                    session_id=sample if conversation else None,
                )
                turn = self._user_turn() if conversation else None
                jobs.append(Job(state=state, sampling=self._sampling(stop), user_turn=turn))
        return jobs

    def _sampling(self, stop_after: int | None = None) -> Sampling:
        return Sampling(
            max_new_tokens=self.settings.max_new_tokens,
            temperature=self.settings.temperature,
            seed=int(self._rng.integers(0, 2**31 - 1)),
            stop_after=stop_after,
        )

    def _user_turn(self) -> tuple[int, ...]:
        n = self.settings.user_turn_tokens
        return random_tokens(self._rng, self._vocab, (n, n))


@dataclass(slots=True)
class PoolStats:
    """Jobs run so far, by kind."""

    new: int = 0
    resume: int = 0
    retry: int = 0
    conversation: int = 0
    failed: int = 0
    revoked_leases: int = 0
    """Leases a dead worker took for its jobs and nobody else could release."""
    errors: list[str] = field(default_factory=list)


class RolloutPool:
    """Rollout worker actors, fed jobs round-robin."""

    def __init__(self, workers: Sequence[Any], *, store: RouteStore | None = None) -> None:
        self._workers = list(workers)
        self._store = store
        self._next = itertools.cycle(range(len(self._workers)))
        self.stats = PoolStats()

    def run(
        self,
        jobs: Sequence[Job],
        version: int,
        on_done: Callable[[RolloutState], object] = lambda _: None,
        *,
        on_failed: Callable[[Job, Exception], object] = lambda *_: None,
        after_submit: Callable[[], object] = lambda: None,
    ) -> tuple[list[RolloutState], list[Job]]:
        """Run every job; returns the samples in the order they finished, and the failed
        jobs (counted, their inputs' leases released, each passed to ``on_failed`` with
        its error). ``after_submit`` runs once every job is in flight (the soak's
        fault-injection point; the demo passes nothing)."""
        pending = {self._submit(batch, version): batch for batch in _batches(jobs)}
        after_submit()
        done: list[RolloutState] = []
        failed: list[Job] = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_DEADLINE_S)
            if not ready:  # every worker hung: fail what is pending, never hang the run
                for batch in pending.values():
                    for job in batch:
                        hung = TimeoutError(f"no answer within {_DEADLINE_S}s")
                        self._fail(job, hung, failed, on_failed)
                break
            batch = pending.pop(ready[0])
            try:
                answer = ray.get(ready[0], timeout=_DEADLINE_S)
            except Exception as exc:  # one bad answer must not stop the run
                for job in batch:
                    self._fail(job, exc, failed, on_failed)
                continue
            for job, state in zip(batch, answer, strict=True):
                if isinstance(state, Exception):  # this member alone was set aside
                    self._fail(job, state, failed, on_failed)
                    continue
                setattr(self.stats, job.kind, getattr(self.stats, job.kind) + 1)
                done.append(state)
                on_done(state)
        return done, failed

    def _fail(
        self,
        job: Job,
        error: Exception,
        failed: list[Job],
        on_failed: Callable[[Job, Exception], object],
    ) -> None:
        _, release_error = job.state.try_release()  # never aborts the run's other jobs
        if release_error is not None:
            self.stats.errors.append(f"{job.state.sample_id}: {release_error}"[:500])
        if isinstance(error, ray.exceptions.RayActorError):
            self._revoke_orphans(job)
        self.stats.failed += 1
        self.stats.errors.append(f"{job.state.sample_id}: {error}"[:500])
        failed.append(job)
        on_failed(job, error)

    def _revoke_orphans(self, job: Job) -> None:
        """A worker that died mid-job may have left leases under the job's holder names
        (its new lease, a borrowed session prefix) that only it could release. The
        input's own lease was just released, so what is left under those names is the
        dead worker's: revoke it (sample ids are never in flight twice)."""
        if self._store is None:
            return
        sample = job.state.sample_id
        for holder in (sample_holder(sample), prefix_holder(sample)):
            self.stats.revoked_leases += self._store.revoke_holder(holder)

    @property
    def workers(self) -> tuple[Any, ...]:
        """The worker actor handles, in round-robin order."""
        return tuple(self._workers)

    def replace_worker(self, index: int, worker: Any) -> Any:
        """Put ``worker`` in slot ``index`` (a restarted worker); returns the old handle
        (the caller ends it)."""
        old, self._workers[index] = self._workers[index], worker
        return old

    def close(self) -> None:
        """Close the workers' clients and end the actors."""
        ray.get([worker.close.remote() for worker in self._workers], timeout=_DEADLINE_S)
        for worker in self._workers:
            ray.kill(worker)

    def _submit(self, batch: list[Job], version: int) -> Any:
        worker = self._workers[next(self._next)]
        states, samplings = [j.state for j in batch], [j.sampling for j in batch]
        turns = [j.user_turn for j in batch]
        if batch[0].user_turn is not None:
            return worker.converse_group.remote(states, turns, samplings, version)
        return worker.rollout_group.remote(states, samplings, version)


def _batches(jobs: Sequence[Job]) -> list[list[Job]]:
    """One batch per group and kind of job (a group's fresh members share their
    prompt; its resumes, retries or conversations are written together too)."""
    by_group: dict[tuple[str, str], list[Job]] = {}
    for job in jobs:
        by_group.setdefault((job.state.group_id, job.kind), []).append(job)
    return list(by_group.values())


class GroupAssembler:
    """Samples waiting for the rest of their group."""

    def __init__(self) -> None:
        self._members: dict[str, dict[str, RolloutState]] = {}
        self._sizes: dict[str, int] = {}

    def expect(self, jobs: Iterable[Job]) -> None:
        """Note each new group's size (resumes and retries change nothing)."""
        for job in jobs:
            if job.kind in ("new", "conversation"):
                group = job.state.group_id
                self._sizes[group] = self._sizes.get(group, 0) + 1

    def lost(self, jobs: Iterable[Job]) -> None:
        """Failed jobs: their groups complete without them."""
        for job in jobs:
            group = job.state.group_id
            self._sizes[group] = self._sizes.get(group, 1) - 1
            self._members.get(group, {}).pop(job.state.sample_id, None)

    def add(self, states: Iterable[RolloutState]) -> list[tuple[str, list[RolloutState]]]:
        """Add finished samples; returns the groups now complete (removed from here)."""
        for state in states:
            self._members.setdefault(state.group_id, {})[state.sample_id] = state
        complete = []
        for group, members in list(self._members.items()):
            size = self._sizes.get(group, len(members))
            if len(members) == size and all(s.status is Status.COMPLETED for s in members.values()):
                complete.append((group, list(members.values())))
                del self._members[group]
        return complete

    def take_interrupted(self) -> list[RolloutState]:
        """Interrupted samples to resume (their completed siblings stay here, leased)."""
        out = []
        for members in self._members.values():
            for sample_id, state in list(members.items()):
                if state.status is Status.ABORTED:
                    out.append(state)
                    del members[sample_id]
        return out

    def drop_incomplete(self) -> int:
        """Release every sample still waiting (groups that lost a member, or teardown)."""
        released = 0
        for members in self._members.values():
            for state in members.values():
                state.release()
                released += 1
        self._members.clear()
        return released
