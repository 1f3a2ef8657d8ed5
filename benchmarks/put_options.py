"""How should a rollout worker hand a payload to the store? Three options, measured.

- caller-owned: the worker ``ray.put``s and the store shard borrows the reference
  (one write, but the payload dies with the worker: OwnerDiedError);
- via-store-actor: the worker passes the array to a store actor that ``ray.put``s it
  (the actor owns it, but the bytes are written twice and pass through the actor);
- staged (routeplay): the shard calls the worker's ``take_staged``, so the shard owns
  the returned blocks: one write, survives the worker, never passes through the shard.

For each: median wall time of the put, object-store bytes written (Ray raylet stats),
and whether the payload is still readable after the worker is killed.

    .venv/bin/python benchmarks/put_options.py [--tokens 32768] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.bench.transfer_paths import make_routing
from routeplay.core import Handle, canonicalize, preset
from routeplay.errors import RoutesLost
from routeplay.store import RoutesProducer, RouteStore, StoreConfig, producer_actor
from routeplay.store.remote.accounting import node_store_stats

RESULTS = Path(__file__).parent / "results"
SPEC = preset("qwen3-235b-a22b")


@ray.remote(num_cpus=0)
class CopyingStore:
    """The baseline: a store actor that receives the bytes and puts them itself."""

    def __init__(self) -> None:
        self.refs: list[Any] = []

    def put(self, array: np.ndarray) -> list[Any]:
        ref = ray.put(array)
        self.refs.append(ref)
        return [ref]


class _Worker(RoutesProducer):
    def __init__(self, store: RouteStore, rows: int) -> None:
        self.store = store
        self.routes = canonicalize(make_routing(SPEC, rows, all_layers=False, dtype="uint8"), SPEC)

    def put(self, option: str, copying: Any) -> Any:
        if option == "caller-owned":
            return self.store.put(self.routes)
        if option == "staged":
            return self.put_routes(self.store, self.routes)
        return ray.get(copying.put.remote(self.routes.array))


Worker = producer_actor(_Worker, num_cpus=0)


def created() -> int:
    return sum(node.created_bytes for node in node_store_stats().values())


def survives(store: RouteStore, result: Any) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # Ray frees a dead owner's objects asynchronously
        try:
            if isinstance(result, Handle):
                store.read(result, 0, 1)
            else:
                ray.get(result[0], timeout=10)
        except (RoutesLost, ray.exceptions.RayError):
            return False
        time.sleep(0.5)
    return True


def measure(option: str, rows: int, runs: int) -> dict[str, Any]:
    store = StoreConfig(run=f"put-{option}", ttl_s=None, timeout_s=60).build()
    copying = CopyingStore.remote()
    times, written = [], []
    for run in range(runs + 1):
        worker = Worker.remote(store, rows)
        ray.get(worker.__ray_ready__.remote())
        before, start = created(), time.perf_counter()
        result = ray.get(worker.put.remote(option, copying))
        elapsed = time.perf_counter() - start
        time.sleep(0.2)
        if run:
            times.append(elapsed)
            written.append(created() - before)
        if run == runs:
            ray.kill(worker)
            alive = survives(store, result)
    store.shutdown()
    ray.kill(copying)
    payload = SPEC.nbytes(rows)
    return {
        "option": option,
        "median_ms": round(statistics.median(times) * 1e3, 1),
        "bytes_written": int(statistics.median(written)),
        "writes_per_payload": round(statistics.median(written) / payload, 2),
        "survives_worker_death": alive,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32 * 1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=600 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        results = [
            measure(o, args.tokens - 1, args.runs)
            for o in ("caller-owned", "via-store-actor", "staged")
        ]
    finally:
        ray.shutdown()
    report = {
        "benchmark": "put_options",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "cpu_count": __import__("os").cpu_count()},
        "config": {
            "model": SPEC.name,
            "rows": args.tokens - 1,
            "payload_bytes": SPEC.nbytes(args.tokens - 1),
            "runs": args.runs,
            "statistic": "median (after one warm-up run)",
        },
        "versions": {
            "python": sys.version.split()[0],
            "ray": ray.__version__,
            "routeplay": routeplay.__version__,
        },
        "results": results,
    }
    table = Table(title=f"put of one {report['config']['payload_bytes']:,}-byte payload")
    for column in ("option", "median ms", "writes/payload", "survives worker death"):
        table.add_column(column)
    for row in results:
        table.add_row(
            row["option"],
            str(row["median_ms"]),
            str(row["writes_per_payload"]),
            str(row["survives_worker_death"]),
        )
    Console().print(table)
    out = args.out or RESULTS / f"put-options_{platform.node()}_{datetime.now():%Y-%m-%d}.json"
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Console().print(f"wrote {out}")


if __name__ == "__main__":
    main()
