"""What Ray charges for objects owned by an actor other than their writer: the RL step's
group objects written and read three ways on the bench's own cluster (head, engine,
rollout and trainer nodes), steps alternating:

- ``put``: the writer ``ray.put``s each group and owns it (Ray's floor: lost with it);
- ``owner``: an idle owner actor on the head node (the bench's ``StepOwner``, its owned
  floor) calls the writer, which returns the groups (one return value each), so the
  owner owns them and they outlive the writer;
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
from typing import Any, NamedTuple

import numpy as np
import ray

from routeplay.bench.measure import cluster, on
from routeplay.bench.rl_roles import StepOwner
from routeplay.bench.rl_step import unique_rows
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

    def owned_groups(self) -> Any:
        """The groups as return values, for ``StepOwner`` (the bench's owned floor)."""
        return tuple(self.groups) if len(self.groups) > 1 else self.groups[0]


def _set_busy(owner: Any, on: bool) -> None:
    """Run in the owner's process (``__ray_call__``): start or stop a Python thread that
    spins there, as routeplay's shard runs its handlers while it owns the blocks."""
    busy = owner.__dict__.setdefault("_busy", threading.Event())
    if on and not busy.is_set():
        busy.set()
        threading.Thread(target=_spin_while, args=(busy,), daemon=True).start()
    elif not on:
        busy.clear()


def _spin_while(busy: threading.Event) -> None:
    while busy.is_set():
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


def _step(kind: str, groups: int, roles: _Roles) -> tuple[float, float, float]:
    start = time.perf_counter()
    if kind == "put":
        [refs] = ray.get(roles.writer.put_groups.remote())
    else:
        ray.get(roles.owner.__ray_call__.remote(_set_busy, kind == "owner_busy"))
        [refs] = ray.get(roles.owner.make.remote(groups))
    written = time.perf_counter()
    shares = np.array_split(np.arange(len(refs)), READERS)
    gets = ray.get(
        [
            reader.read.remote([[refs[g] for g in share]])
            for reader, share in zip(roles.readers, shares, strict=True)
        ]
    )
    read = time.perf_counter()
    ray.get(roles.owner.__ray_call__.remote(_set_busy, False))
    del refs
    ray.get(roles.owner.drop.remote())
    return (written - start) * 1e3, (read - written) * 1e3, max(ms for ms, _ in gets)


class _Roles(NamedTuple):
    writer: Any
    owner: Any
    readers: list[Any]


def measure(groups: int, steps: int) -> dict[str, tuple[float, float, float]]:
    """Medians of (write, reads phase, slowest reader's get) per kind, in ms."""
    shape = RLStepShape()
    layout = (unique_rows(shape), *shape.spec.row_shape)
    with cluster(shape.store_bytes):
        writer = Writer.options(**on("rollout")).remote(groups, layout, str(shape.spec.dtype))
        # The bench's own owner (its owned floor), where routeplay's shard runs.
        owner = StepOwner.options(**on("head")).remote(writer)
        readers = [Reader.options(**on("trainer")).remote() for _ in range(READERS)]
        roles = _Roles(writer, owner, readers)
        runs: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
        for step in range(steps + 1):  # the first round warms every actor up
            for kind in KINDS:
                figures = _step(kind, groups, roles)
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
