"""One trainer rank's read of its share, alone: wall time and process CPU of routeplay's
``Materializer.leasing`` next to Ray's floor for the same bytes (one ``ray.get`` of the
rank's group objects and a copy of each sample's rows), rank after rank, on the RL
step's own cluster and shape (``routeplay.bench.rl_step``).

Why: in the full step four ranks share two cores with the raylets moving the bytes, so
a rank's own cost hides in the others'; read one rank at a time, its CPU is its own.
Each rank reads twice per path: the first read pulls the blocks to the trainer node,
the second finds them there (the materializer's CPU without the transfer).

    PYTHONPATH=src .venv/bin/python benchmarks/rank_read_cpu.py [--samples 4096] [--steps 2]

Example:
    .venv/bin/python benchmarks/rank_read_cpu.py --samples 1024 --steps 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from routeplay.bench.measure import cluster, on
from routeplay.bench.rl_roles import VERSION
from routeplay.bench.rl_step import _handle, _StepBench
from routeplay.bench.workloads import RLStepShape
from routeplay.rollout import TrainingBatch
from routeplay.store import RouteStore, StoreConfig, start_engine_store
from routeplay.train import Materializer, PackingPlan, RankCoords, pack_samples


def _timed(read: Callable[[], None]) -> tuple[float, float]:
    """Wall and process-CPU milliseconds of ``read``."""
    wall, cpu = time.perf_counter(), time.process_time()
    read()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


class _ProbeRank:
    """One trainer rank, reading its share either way."""

    def __init__(self, store: RouteStore, shape: RLStepShape, dp_rank: int) -> None:
        self.store, self.shape, self.dp_rank = store, shape, dp_rank

    def routeplay(self, plan: PackingPlan, holder: str) -> tuple[float, float]:
        def read() -> None:
            coords = RankCoords(dp_rank=self.dp_rank)
            with Materializer.leasing(self.store, plan, coords, holder=holder) as m:
                for _ in m:
                    pass
            self.store.flush()

        return _timed(read)

    def floor(self, wrapped: list[list[Any]]) -> tuple[float, float]:
        shape = self.shape
        prompt, rows, own = shape.shared_prompt, shape.rows, shape.rows - shape.shared_prompt
        pack = np.empty((shape.group * rows, *shape.spec.row_shape), shape.spec.dtype)

        def read() -> None:
            arrays = ray.get(wrapped[0])
            for array in arrays:
                for member in range(shape.group):
                    at = member * rows
                    pack[at : at + prompt] = array[:prompt]
                    pack[at + prompt : at + rows] = array[
                        prompt + member * own : prompt + (member + 1) * own
                    ]
            del arrays

        return _timed(read)


_Probe: Any = ray.remote(num_cpus=0)(_ProbeRank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    shape = RLStepShape(samples=(args.samples,), runs=1)
    with cluster(shape.store_bytes):
        store = StoreConfig(run="bench-rank", resources=(("head", 0.01),), timeout_s=120).build()
        start_engine_store(resources={"engine": 0.01})
        bench = _StepBench(store, shape, args.samples, on)
        probes = [_Probe.options(**on("trainer")).remote(store, shape, r) for r in range(shape.dp)]
        try:
            for step in range(args.steps):
                _one_step(bench, probes, shape, step)
        finally:
            bench.close()
            store.shutdown()


def _one_step(bench: _StepBench, probes: list[Any], shape: RLStepShape, step: int) -> None:
    """Write a step, then each rank reads its share, twice per path, one rank at a time."""
    bench.step += 1
    groups = ray.get(bench.rollout.write_groups.remote(), timeout=600)
    bench.buffer.add_all({f"{bench.step}/{g}": states for g, states in enumerate(groups)})
    del groups
    [refs] = ray.get(bench.rollout.put_groups.remote(), timeout=600)
    shares = np.array_split(np.arange(len(refs)), shape.dp)
    with TrainingBatch(bench.step, bench.buffer.sample(bench.groups, VERSION)) as batch:
        samples = [(s.sample_id, _handle(s), shape.tokens) for s in batch.states]
        plan = pack_samples(samples, shape.pack_length, 1, dp_size=shape.dp)
        for rank, probe in enumerate(probes):
            share = plan.share(rank)
            holder = f"{batch.holder}/dp{rank}"
            ours = [ray.get(probe.routeplay.remote(share, holder)) for _ in range(2)]
            mine = [[refs[g] for g in shares[rank]]]
            floor = [ray.get(probe.floor.remote(mine)) for _ in range(2)]
            print(
                f"step {step} dp{rank} (wall ms, CPU ms): routeplay first {_shown(ours[0])}, "
                f"again {_shown(ours[1])}; Ray's floor first {_shown(floor[0])}, "
                f"again {_shown(floor[1])}"
            )
    del refs


def _shown(figures: tuple[float, float]) -> str:
    return f"({figures[0]:.0f}, {figures[1]:.0f})"


if __name__ == "__main__":
    main()
