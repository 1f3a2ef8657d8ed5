"""What a step's lease work costs the shard's table, per sample: the RL step's four lease
operations per sample on one shard (each member's lease at finish, the buffer's take-over,
the batch's take-over, the batch's close), in process, next to the same table minting
each lease id with its own draw from the OS's random source (as it did before
``LEASE_IDS_PER_DRAW``), alternating, in one run.

Why: the shard's handlers are on the step's waited path (a buffer's and a batch's
take-over wait for their new leases), and at 4,096 samples they grant about 12,000 leases
a step.

    PYTHONPATH=src .venv/bin/python benchmarks/lease_table_cost.py [--samples 4096] [--runs 15]

Example:
    .venv/bin/python benchmarks/lease_table_cost.py --samples 1024 --runs 5
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time

from routeplay.store import LeaseTable

GROUP = 8
"""Samples per payload (a GRPO group packed in one payload, as the RL step stores it)."""


class _OneDrawPerId(LeaseTable[object]):
    """The table as it minted lease ids before: one draw of 16 random bytes per id."""

    def _new_lease_id(self) -> str:
        return f"{self._lease_prefix}/lease-{secrets.token_hex(16)}"


def step_ms(table: LeaseTable[object], samples: int) -> float:
    """Milliseconds of one step's lease work on ``table`` (a fresh one each step)."""
    for group in range(samples // GROUP):
        table.add(f"p{group}", object(), rows=1023, nbytes=1)
    start = time.perf_counter()
    own = [table.acquire((f"p{i // GROUP}",), f"rollout/{i}", run="r") for i in range(samples)]
    buffered = [table.clone(lease, f"buffer/{i // GROUP}") for i, lease in enumerate(own)]
    for lease in own:
        table.release(lease)
    batch = [table.clone(lease, "train/step-1") for lease in buffered]
    for lease in buffered:
        table.release(lease)
    for lease in batch:
        table.release(lease)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    tables = {"pooled ids": LeaseTable, "one draw per id": _OneDrawPerId}
    figures: dict[str, list[float]] = {name: [] for name in tables}
    for _ in range(args.runs):
        for name, cls in tables.items():
            figures[name].append(step_ms(cls("r", lease_prefix="r.0"), args.samples))
    for name, ms in figures.items():
        median = statistics.median(ms)
        print(
            f"{name}: {median:.1f} ms a step of {args.samples} samples "
            f"({median / args.samples * 1e3:.2f} us a sample; min {min(ms):.1f} ms)"
        )


if __name__ == "__main__":
    main()
