"""Pickling a packed group (``JoinedRows``) as Ray does, against pickling its pieces as
arrays (what a group cost before it went as buffers), alternating in one process:

    PYTHONPATH=src .venv/bin/python benchmarks/joined_rows_pickle.py [--rounds 7]

Why: a rollout worker hands every group it writes to the shard through Ray's pickler
(cloudpickle, protocol 5, out-of-band buffers), on the step's critical path, and each
trainer rank unpickles every group it reads. The shape is the RL step's: a 512-row prompt
and 8 members' own 511 rows, Qwen3-30B-A3B's 48 layers x top-8, uint8.

Example:
    .venv/bin/python benchmarks/joined_rows_pickle.py --rounds 3 --calls 200
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from ray import cloudpickle

from routeplay.store.joined_rows import JoinedRows


def _per_call_us(work: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        work()
    return (time.perf_counter() - start) / calls * 1e6


def _dumped(value: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    return cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append), buffers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, (512, 48, 8), dtype=np.uint8)
    pieces = (prompt, *(rng.integers(0, 128, (511, 48, 8), dtype=np.uint8) for _ in range(8)))
    group = JoinedRows(pieces)
    ways: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    for name, value, rebuilt in (
        ("as buffers (JoinedRows)", group, lambda restored: restored),
        # What the stream held before: the class and the pieces as arrays.
        ("as arrays (its pieces)", (JoinedRows, pieces), lambda pair: pair[0](pair[1])),
    ):
        data, buffers = _dumped(value)
        ways[name] = (
            lambda value=value: _dumped(value),
            lambda data=data, buffers=buffers, rebuilt=rebuilt: rebuilt(
                pickle.loads(data, buffers=buffers)
            ),
        )
    figures: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in ways}
    for _ in range(args.rounds):
        for name, (dump, load) in ways.items():
            figures[name][0].append(_per_call_us(dump, args.calls))
            figures[name][1].append(_per_call_us(load, args.calls))
    for name, (dumps, loads) in figures.items():
        print(
            f"{name}: pickle {statistics.median(dumps):.1f} us [{min(dumps):.1f}-{max(dumps):.1f}],"
            f" unpickle {statistics.median(loads):.1f} us [{min(loads):.1f}-{max(loads):.1f}]"
            f" (medians of {args.rounds} rounds of {args.calls})"
        )


if __name__ == "__main__":
    main()
