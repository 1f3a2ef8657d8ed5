"""A group's worker call on a wire that carries the rows: one member's bad answer (a
corrupted body, or rows that disagree with the member's tokens at completion) is set
aside with its typed error, the others come back leased from one packed write, and
nothing leaks. In ``make test-long`` (each test is a demo's services on Ray); the units
of group ingest and its refusals are in ``make test``."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from routeplay.errors import MalformedPayload, RoutesLost, RowCountMismatch
from routeplay.pipeline.config import recipe
from routeplay.pipeline.rollout_worker import Sampling, WorkerShell
from routeplay.pipeline.services import DemoServices
from routeplay.pipeline.soak_worker import TamperingWorker
from routeplay.rollout import RolloutState, Status
from routeplay.store import producer_actor

pytestmark = [pytest.mark.e2e, pytest.mark.long]


@pytest.mark.usefixtures("ray_local")
def test_one_bad_answer_costs_only_its_member() -> None:
    config = recipe("smoke").replace(wire="sglang")
    with DemoServices(config) as svc:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        worker = TamperingWorker.options(scheduling_strategy=here).remote(
            svc.store, svc.trace, svc.server.url, "sglang", svc.engine.spec, 60.0
        )
        prompt = (5, 6, 7, 8, 9, 10)
        states = [
            RolloutState(sample_id=f"m{i}", group_id="g", prompt_ids=prompt) for i in range(4)
        ]
        samplings = [Sampling(max_new_tokens=3, seed=i) for i in range(4)]
        before = svc.store.stats()
        ray.get(worker.arm.remote(1), timeout=30)  # the first answer arrives corrupted
        out = ray.get(worker.rollout_group.remote(states, samplings, 0), timeout=120)
        assert ray.get(worker.take_tampered.remote(), timeout=30) == 1
        assert isinstance(out[0], MalformedPayload)
        done = [s for s in out[1:] if isinstance(s, RolloutState)]
        assert len(done) == 3
        assert all(s.routing.holds_lease and s.status is Status.COMPLETED for s in done)
        stats = svc.store.stats()
        assert stats.live_payloads - before.live_payloads == 1  # one write for the group
        assert stats.shared_prefix_bytes_saved > before.shared_prefix_bytes_saved
        for state in done:
            assert state.routing.handle is not None
            assert svc.store.read(state.routing.handle).shape[0] == state.tokens - 1
            state.release()
        assert svc.store.leaks() == []
        ray.kill(worker)


class PromptSkewShell(WorkerShell):
    """A worker whose engine sees one prompt token fewer than member ``m1`` holds (a chat
    template or BOS mismatch between the sample and the request): its answer's rows are
    one short of the sample's tokens."""

    def _request(
        self, state: RolloutState, sampling: Sampling, start: int
    ) -> tuple[str, dict[str, Any]]:
        if state.sample_id == "m1":
            state = dataclasses.replace(state, prompt_ids=state.prompt_ids[1:])
        return super()._request(state, sampling, start)


@pytest.mark.usefixtures("ray_local")
def test_a_completion_whose_rows_disagree_with_its_tokens_costs_only_its_member() -> None:
    with DemoServices(recipe("smoke").replace(wire="sglang")) as svc:
        worker = _shell_here(PromptSkewShell, svc)
        states, samplings = _group(3)
        out = ray.get(worker.rollout_group.remote(states, samplings, 0), timeout=120)
        assert isinstance(out[1], RowCountMismatch)
        assert "sample m1" in str(out[1])
        done = [out[0], out[2]]
        assert all(isinstance(s, RolloutState) and s.status is Status.COMPLETED for s in done)
        held = dict(svc.store.stats().leases_by_holder)
        assert "rollout/m1" not in held  # the refused member's new lease ended
        assert held == {"rollout/m0": 1, "rollout/m2": 1}
        for state in done:
            state.release()
        # The single-sample call refuses the same way, leaving nothing leased.
        with pytest.raises(RowCountMismatch, match="sample m1"):
            ray.get(worker.rollout.remote(states[1], samplings[1], 0), timeout=120)
        assert svc.store.stats().leases == 0
        assert svc.store.leaks() == []
        ray.kill(worker)


class _DeadWrites:
    """A producer's writer whose group write fails (its shard is gone: the call raises
    before anything is staged); every other call goes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def put_leased_many(self, *args: Any, **kwargs: Any) -> Any:
        raise RoutesLost("the shard adopting the group died", where="test")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DeadWritesShell(WorkerShell):
    """A worker whose group writes are lost."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._writer = _DeadWrites(self._writer)  # type: ignore[assignment]


@pytest.mark.usefixtures("ray_local")
def test_a_failed_group_write_sets_every_member_aside_and_leaves_nothing() -> None:
    """The worker's group call answers (it does not raise): every member set aside with
    the write's error, its continuation abandoned, nothing leased, written or staged."""
    with DemoServices(recipe("smoke").replace(wire="sglang")) as svc:
        worker = _shell_here(DeadWritesShell, svc)
        states, samplings = _group(3)
        out = ray.get(worker.rollout_group.remote(states, samplings, 0), timeout=120)
        assert all(isinstance(s, RoutesLost) for s in out), out
        assert svc.store.stats().leases == 0
        assert svc.store.stats().live_payloads == 0
        assert svc.store.leaks() == []
        assert ray.get(worker.staged_count.remote(), timeout=30) == 0
        ray.kill(worker)


def _shell_here(shell: type[WorkerShell], svc: DemoServices) -> Any:
    """A worker of class ``shell`` (shipped by value) on this node, on SGLang's wire."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return (
        producer_actor(shell, num_cpus=0)
        .options(scheduling_strategy=here)
        .remote(svc.store, svc.trace, svc.server.url, "sglang", svc.engine.spec, 60.0)
    )


def _group(size: int) -> tuple[list[RolloutState], list[Sampling]]:
    """A group of ``size`` fresh members sharing one prompt, and their samplings."""
    states = [
        RolloutState(sample_id=f"m{i}", group_id="g", prompt_ids=(5, 6, 7, 8, 9, 10))
        for i in range(size)
    ]
    return states, [Sampling(max_new_tokens=3, seed=i) for i in range(size)]
