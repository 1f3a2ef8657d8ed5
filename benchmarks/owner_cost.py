"""What Ray charges for objects owned by an actor other than their writer: the RL step's
group objects written and read three ways on the bench's own cluster (head, engine,
rollout and trainer nodes), steps alternating:

- ``put``: the writer ``ray.put``s each group and owns it (Ray's floor: lost with it);
- ``owner``: an idle owner actor on the head node calls the writer, which returns the
  groups (one return value each), so the owner owns them and they outlive the writer;
- ``owner_busy``: the same while a Python thread spins in the owner's process, as
  routeplay's shard answers calls while it owns the blocks.

Four reader actors on the trainer node then ``ray.get`` a quarter of the groups each (a
reader asks each object's owner where it lives). Printed: medians of the write, of the
reads phase and of the slowest reader's get, in ms.

    PYTHONPATH=src .venv/bin/python benchmarks/owner_cost.py [--groups 8,128] [--steps 8]

Example:
    .venv/bin/python benchmarks/owner_cost.py --groups 8 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np
import ray

from routeplay.bench.measure import cluster, on
from routeplay.bench.workloads import RLStepShape

KINDS = ("put", "owner", "owner_busy")
READERS = 4


@ray.remote(num_cpus=0)
class Writer:
    """The rollout worker: the step's groups, each laid out as one array."""

    def __init__(self, groups: int, shape: tuple[int, ...], dtype: str) -> None:
        rng = np.random.default_rng(0)
        self.groups = [rng.integers(0, 128, shape).astype(dtype) for _ in range(groups)]

    def put_groups(self) -> list[list[Any]]:
        return [[ray.put(group) for group in self.groups]]

    def return_groups(self) -> Any:
        return tuple(self.groups) if len(self.groups) > 1 else self.groups[0]


@ray.remote(num_cpus=0)
class Owner:
    """Owns what it asks the writer for; optionally keeps its own process busy."""

    def __init__(self, writer: Any, groups: int) -> None:
        self.writer, self.groups = writer, groups
        self.held: list[Any] = []
        self.busy = threading.Event()

    def make(self) -> list[list[Any]]:
        refs = self.writer.return_groups.options(num_returns=self.groups).remote()
        refs = list(refs) if self.groups > 1 else [refs]
        ray.wait(refs, num_returns=len(refs), fetch_local=False)
        self.held = refs
        return [refs]

    def drop(self) -> None:
        self.held = []

    def spin(self, on: bool) -> None:
        if on and not self.busy.is_set():
            self.busy.set()
            threading.Thread(target=self._spin, daemon=True).start()
        elif not on:
            self.busy.clear()

    def _spin(self) -> None:
        while self.busy.is_set():
            sum(range(2000))


@ray.remote(num_cpus=0)
class Reader:
    def read(self, wrapped: list[list[Any]]) -> tuple[float, int]:
        """ms to get the objects, and a checksum of their last bytes (every one mapped)."""
        start = time.perf_counter()
        arrays = ray.get(wrapped[0])
        checksum = sum(int(a.reshape(-1)[-1]) for a in arrays)
        del arrays
        return (time.perf_counter() - start) * 1e3, checksum


def _step(kind: str, writer: Any, owner: Any, readers: list[Any]) -> tuple[float, float, float]:
    start = time.perf_counter()
    if kind == "put":
        [refs] = ray.get(writer.put_groups.remote())
    else:
        ray.get(owner.spin.remote(kind == "owner_busy"))
        [refs] = ray.get(owner.make.remote())
    written = time.perf_counter()
    shares = np.array_split(np.arange(len(refs)), READERS)
    gets = ray.get(
        [r.read.remote([[refs[g] for g in s]]) for r, s in zip(readers, shares, strict=True)]
    )
    read = time.perf_counter()
    ray.get(owner.spin.remote(False))
    del refs
    ray.get(owner.drop.remote())
    return (written - start) * 1e3, (read - written) * 1e3, max(ms for ms, _ in gets)


def measure(groups: int, steps: int) -> dict[str, tuple[float, float, float]]:
    """Medians of (write, reads phase, slowest reader's get) per kind, in ms."""
    shape = RLStepShape()
    rows = shape.shared_prompt + shape.group * (shape.rows - shape.shared_prompt)
    layout = (rows, *shape.spec.row_shape)
    with cluster(shape.store_bytes):
        writer = Writer.options(**on("rollout")).remote(groups, layout, str(shape.spec.dtype))
        owner = Owner.options(**on("head")).remote(writer, groups)
        readers = [Reader.options(**on("trainer")).remote() for _ in range(READERS)]
        runs: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
        for step in range(steps + 1):  # the first round warms every actor up
            for kind in KINDS:
                figures = _step(kind, writer, owner, readers)
                if step:
                    runs[kind].append(figures)
    return {kind: _medians(figures) for kind, figures in runs.items()}


def _medians(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    write, reads, slowest = zip(*runs, strict=True)
    return statistics.median(write), statistics.median(reads), statistics.median(slowest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="8,128", help="groups per step, comma-separated")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    for groups in (int(g) for g in args.groups.split(",")):
        for kind, (write, reads, slowest) in measure(groups, args.steps).items():
            print(
                f"{groups:5d} groups {kind:10s} write {write:7.1f}  reads {reads:7.1f}  "
                f"slowest get {slowest:7.1f}"
            )


if __name__ == "__main__":
    main()
