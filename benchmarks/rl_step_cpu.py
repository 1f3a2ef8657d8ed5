"""Where the realistic RL step's CPU goes: each phase's CPU by process kind (the rollout
worker, the shard, the ranks, the driver, the raylets), routeplay's producer path next
to Ray's floor for the same objects, on the bench's own cluster and actors.

Why: on a 2-core host the step is CPU-bound (the raylets moving the bytes take about a
second of CPU at 4,096 samples on either path), so what routeplay adds shows as CPU
first, and a phase's wall time moves with it at about half its size. The figures are
CPU milliseconds summed over every process of each kind (``psutil``), read before and
after each phase; the first run of each path warms up and is not counted. The summary is
each kind's CPU per step, the mean over the runs (``psutil`` counts in 10 ms ticks: a
small step needs several runs), next to the step's time (its phases' sum); ``--each``
also prints every run's phases.

    PYTHONPATH=src .venv/bin/python benchmarks/rl_step_cpu.py [--samples 4096] [--runs 2] [--each]

Example:
    .venv/bin/python benchmarks/rl_step_cpu.py --samples 1024 --runs 1
"""

from __future__ import annotations

import argparse
import collections
import os
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from routeplay.bench.measure import cluster, on
from routeplay.bench.rl_step import _PhaseMeter, _StepBench
from routeplay.bench.workloads import RLStepShape
from routeplay.store import RouteStore, StoreConfig, start_engine_store

_KINDS = (("raylet", "raylet"), ("gcs_server", "gcs"))


def _kind(process: psutil.Process) -> str:
    """A process's kind: the driver, a Ray actor's class, a Ray daemon, or other."""
    if process.pid == os.getpid():
        return "driver"
    command = " ".join(process.cmdline() or [])
    if command.startswith("ray::"):
        return command.split()[0].removeprefix("ray::").split(".")[0]
    return next((kind for needle, kind in _KINDS if needle in command), "other")


def cpu_by_kind() -> collections.Counter[str]:
    """CPU milliseconds used so far by every process of each kind."""
    used: collections.Counter[str] = collections.Counter()
    for process in psutil.process_iter():
        try:
            times = process.cpu_times()
            used[_kind(process)] += (times.user + times.system) * 1e3
        except (psutil.Error, OSError):  # gone meanwhile, or not ours to read
            continue
    return used


class _CpuMeter(_PhaseMeter):
    """The bench's phase meter, plus each phase's CPU by process kind."""

    def __init__(self, store: RouteStore) -> None:
        super().__init__(store)
        self.cpu: dict[str, dict[str, int]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = cpu_by_kind()
        with super().phase(name):
            yield
        after = cpu_by_kind()
        used = {kind: round(after[kind] - before[kind]) for kind in after}
        self.cpu[name] = {kind: ms for kind, ms in sorted(used.items(), key=lambda x: -x[1]) if ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--runs", type=_at_least_one, default=2)
    parser.add_argument("--each", action="store_true", help="print every run's phases too")
    args = parser.parse_args()
    shape = RLStepShape(samples=(args.samples,), runs=args.runs)
    with cluster(shape.store_bytes):
        store = StoreConfig(run="bench-rl-cpu", resources=(("head", 0.01),), timeout_s=120).build()
        start_engine_store(resources={"engine": 0.01})
        bench = _StepBench(store, shape, args.samples, on)
        paths = {"producer": bench._routeplay, "ray_floor": bench._ray_floor}
        meters: dict[str, list[_CpuMeter]] = {path: [] for path in paths}
        try:
            for path in paths:
                bench.run(path)  # warm-up
            for _ in range(args.runs):
                for path, step in paths.items():
                    meter = _CpuMeter(store)
                    bench.step += 1
                    step(meter, False, None)
                    meters[path].append(meter)
                    if args.each:
                        _print_run(path, meter)
        finally:
            bench.close()
            store.shutdown()
    for path, runs in meters.items():
        _print_summary(path, runs)


def _at_least_one(text: str) -> int:
    """``--runs``: the summary is a mean over the runs, so there must be one."""
    runs = int(text)
    if runs < 1:
        raise argparse.ArgumentTypeError(f"at least 1 run, found {runs}")
    return runs


def _print_run(path: str, meter: _CpuMeter) -> None:
    print(path, {phase: round(ms) for phase, ms in meter.ms.items()})
    for phase, used in meter.cpu.items():
        print(f"    {phase:9s} CPU ms {used}")


def _print_summary(path: str, runs: list[_CpuMeter]) -> None:
    """Each kind's CPU per step and the step's time, means over ``runs``."""
    by_kind: collections.Counter[str] = collections.Counter()
    for meter in runs:
        for used in meter.cpu.values():
            by_kind.update(used)
    step_ms = sum(sum(meter.ms.values()) for meter in runs) / len(runs)
    total = sum(by_kind.values()) / len(runs)
    kinds = ", ".join(f"{kind} {ms / len(runs):.0f}" for kind, ms in by_kind.most_common())
    print(f"{path}: step {step_ms:.0f} ms, CPU {total:.0f} ms a step ({kinds})")


if __name__ == "__main__":
    main()
