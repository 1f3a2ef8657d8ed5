"""What leasing a group's members in the write's own call saves: the RL step's rollout
worker writes every group of a step two ways on the bench's own cluster, steps
alternating:

- ``two_calls``: ``aingest_routing_group`` (one coalesced adopt call for the groups
  answered together), then ``afinish_all`` (one coalesced ``lease_many`` for their
  members);
- ``one_call``: ``aingest_and_finish_group`` (the same adopt call grants every member's
  ``rollout/<id>`` lease: ``adopt_from_leased``), what the bench's producer path runs.

Timed on the driver: the worker's ``write_groups`` call, from the answers decoded to
every member's ``SampleRouting`` back on the driver (the RL step's ``writes`` phase).
Each step's samples are then discarded (untimed). Printed per step size: the median and
minimum of each, and one_call / two_calls.

    PYTHONPATH=src .venv/bin/python benchmarks/leased_group_writes.py [--samples 64,256,1024]
                                                                      [--steps 10]

Example:
    .venv/bin/python benchmarks/leased_group_writes.py --samples 64 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import ray

from routeplay.bench import rl_roles
from routeplay.bench.measure import cluster, on
from routeplay.bench.workloads import RLStepShape
from routeplay.core import Handle
from routeplay.core.wires import EngineRouting
from routeplay.rollout import SampleRouting, afinish_all, aingest_routing_group
from routeplay.rollout.routing_groups import discard_all
from routeplay.store import StoreConfig, producer_actor


class _TwoCalls(rl_roles._StepRollout):
    """The bench's rollout worker, each group written, then its members leased."""

    async def _ingest(self, group: int, routings: Sequence[EngineRouting]) -> list[SampleRouting]:
        shape = self.shape
        prompt = tuple(range(group * shape.shared_prompt, (group + 1) * shape.shared_prompt))
        conts = [
            SampleRouting(sample_id=rl_roles.sample_id(group, m)).continuation(prompt_ids=prompt)
            for m in range(len(routings))
        ]
        written = await aingest_routing_group(
            conts, routings, writer=self._writer, weight_version=rl_roles.VERSION, spec=self.spec
        )
        handles = [h for h in written if isinstance(h, Handle)]
        response = shape.tokens - shape.shared_prompt
        return [
            r.complete(prompt_tokens=shape.shared_prompt, response_tokens=response)
            for r in await afinish_all(conts, self.store, handles)
        ]


def _timed_write(store: Any, worker: Any) -> float:
    """One step's writes (ms); its samples then discarded, untimed."""
    start = time.perf_counter()
    groups = ray.get(worker.write_groups.remote(), timeout=600)
    elapsed = (time.perf_counter() - start) * 1e3
    discard_all([routing for group in groups for routing in group])
    store.flush()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship _TwoCalls
    two_calls_actor = producer_actor(_TwoCalls, num_cpus=0)
    shape = RLStepShape()
    with cluster(shape.store_bytes):
        store = StoreConfig(run="leased-writes", resources=(("head", 0.01),), timeout_s=120).build()
        for samples in (int(n) for n in args.samples.split(",")):
            workers = {
                "two_calls": two_calls_actor.options(**on("rollout")).remote(store, shape),
                "one_call": rl_roles.StepRollout.options(**on("rollout")).remote(store, shape),
            }
            groups = shape.groups(samples)
            ray.get([w.prepare.remote(groups, samples) for w in workers.values()], timeout=600)
            times: dict[str, list[float]] = {name: [] for name in workers}
            for step in range(args.steps + 1):  # the first round warms both up
                order = list(workers) if step % 2 else list(reversed(workers))
                for name in order:
                    elapsed = _timed_write(store, workers[name])
                    if step:
                        times[name].append(elapsed)
            medians = {name: statistics.median(values) for name, values in times.items()}
            print(
                f"{samples} samples ({groups} groups):",
                ", ".join(
                    f"{name} {medians[name]:.1f} ms (min {min(times[name]):.1f})" for name in times
                ),
                f"one_call / two_calls {medians['one_call'] / medians['two_calls']:.3f}",
                flush=True,
            )
            for worker in workers.values():
                ray.kill(worker)
        assert store.stats().leases == 0
        store.shutdown()


if __name__ == "__main__":
    main()
