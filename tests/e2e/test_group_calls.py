"""A group's worker call on a wire that carries the rows: one member's bad answer is set
aside with its typed error, the others come back leased from one packed write, and
nothing leaks."""

from __future__ import annotations

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from routeplay.errors import MalformedPayload
from routeplay.pipeline.config import recipe
from routeplay.pipeline.rollout_worker import Sampling
from routeplay.pipeline.services import DemoServices
from routeplay.pipeline.soak_worker import TamperingWorker
from routeplay.rollout import RolloutState, Status

pytestmark = pytest.mark.e2e


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
        assert all(s.holds_lease and s.status is Status.COMPLETED for s in done)
        stats = svc.store.stats()
        assert stats.live_payloads - before.live_payloads == 1  # one write for the group
        assert stats.shared_prefix_bytes_saved > before.shared_prefix_bytes_saved
        for state in done:
            assert state.routing is not None
            assert svc.store.read(state.routing).shape[0] == state.tokens - 1
            state.release()
        assert svc.store.leaks() == []
        ray.kill(worker)
