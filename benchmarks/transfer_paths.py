"""Engine → rollout → trainer transfer of one routing payload: eager vs lazy.

Eager is what XTuner does today (the rollout worker gets the engine-store key,
``np.asarray``s it, ``ray.put``s it again, the trainer ``ray.get``s that); lazy is
routeplay (the rollout worker adopts the key into the route store without reading it,
the trainer reads its rows straight from the engine's node). Both start from the same
key in the engine store. For each path: wall time from key to trainer-side rows
(median of N runs) and object-store bytes written on every node (Ray's raylet stats),
on one node and on a 3-node local cluster (engine, rollout, trainer + head for the store).

    .venv/bin/python benchmarks/transfer_paths.py [--tokens 32768] [--runs 7] [--nodes both]
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
from ray.cluster_utils import Cluster
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.bench.transfer_paths import Roles, actors_on
from routeplay.core import preset
from routeplay.store import StoreConfig, start_engine_store
from routeplay.store.remote.accounting import node_store_stats

RESULTS = Path(__file__).parent / "results"
ROLES = ("head", "engine", "rollout", "trainer")
STORE_BYTES = 400 * 1024 * 1024


def start_cluster(nodes: int) -> Cluster | None:
    """One local node, or a head plus engine/rollout/trainer nodes on this machine."""
    if nodes == 1:
        ray.init(
            address="local",
            num_cpus=2,
            object_store_memory=STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
        )
        return None
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 1},
            "object_store_memory": STORE_BYTES,
        },
    )
    for role in ROLES[1:]:
        cluster.add_node(num_cpus=1, resources={role: 1}, object_store_memory=STORE_BYTES)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def written_per_node() -> dict[str, int]:
    return {node: stats.created_bytes for node, stats in node_store_stats().items()}


def measure(roles: Roles, path: str, rows: int, runs: int) -> dict[str, Any]:
    """Median wall time (key in hand -> rows on the trainer) and bytes written end to end
    (the engine's own one-write put included) for ``path`` in {"eager", "lazy"}."""
    times, written, engine_put = [], [], []
    for run in range(runs + 1):  # run 0 warms up actors and imports; not counted
        before = written_per_node()
        key = ray.get(roles.engine.generate_one_write.remote(rows, run, "uint8"))
        after_put = written_per_node()
        start = time.perf_counter()
        transfer(roles, path, key, rows)
        elapsed = time.perf_counter() - start
        after = written_per_node()
        if run:
            times.append(elapsed)
            engine_put.append(sum(after_put[n] - before[n] for n in after))
            written.append(sum(after[n] - before[n] for n in after))
        ray.get(roles.rollout.drop.remote())
    return {
        "median_ms": round(statistics.median(times) * 1e3, 1),
        "min_ms": round(min(times) * 1e3, 1),
        "max_ms": round(max(times) * 1e3, 1),
        "engine_put_bytes": int(statistics.median(engine_put)),
        "bytes_written": int(statistics.median(written)),
    }


def transfer(roles: Roles, path: str, key: str, rows: int) -> str:
    if path == "eager":
        wrapped = ray.get(roles.rollout.eager.remote(key))
        return str(ray.get(roles.trainer.read_eager.remote(wrapped)))
    handle = ray.get(roles.rollout.lazy.remote(key, rows))
    return str(ray.get(roles.trainer.read_lazy.remote(handle)))


def run_setting(nodes: int, rows: int, runs: int) -> dict[str, Any]:
    cluster = start_cluster(nodes)
    try:
        spec = preset("qwen3-235b-a22b")
        pinned = nodes > 1
        store = StoreConfig(
            run=f"bench-{nodes}", timeout_s=120, resources=(("head", 0.01),) if pinned else ()
        ).build()
        start_engine_store(resources={"engine": 0.01} if pinned else None)
        roles = actors_on(store, spec, pinned=pinned)
        payload = spec.nbytes(rows)
        out = {"nodes": nodes, "payload_bytes": payload}
        for path in ("eager", "lazy"):
            result = measure(roles, path, rows, runs)
            result["writes_per_payload"] = round(result["bytes_written"] / payload, 2)
            out[path] = result
        out["time_ratio_eager_over_lazy"] = round(
            out["eager"]["median_ms"] / out["lazy"]["median_ms"], 2
        )
        check_same_rows(roles, rows)
        return out
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def check_same_rows(roles: Roles, rows: int) -> None:
    """Both paths must deliver identical rows (the digest of the canonical array)."""
    digests = [
        transfer(
            roles, path, ray.get(roles.engine.generate_one_write.remote(rows, 99, "uint8")), rows
        )
        for path in ("eager", "lazy")
    ]
    if digests[0] != digests[1]:
        raise SystemExit(f"eager and lazy delivered different rows: {digests}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32 * 1024)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--nodes", choices=("1", "3", "both"), default="both")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = args.tokens - 1
    settings = [1, 3] if args.nodes == "both" else [int(args.nodes)]
    results = [run_setting(nodes, rows, args.runs) for nodes in settings]
    report = {
        "benchmark": "transfer_paths",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "cpu_count": __import__("os").cpu_count()},
        "config": {
            "model": "qwen3-235b-a22b",
            "tokens": args.tokens,
            "rows": rows,
            "dtype": "uint8",
            "runs": args.runs,
            "statistic": "median (after one warm-up run)",
            "eager": "rollout: engine_store.get -> np.asarray -> ray.put; trainer: ray.get",
            "lazy": "rollout: adopt key (no bytes); trainer: route-store read from the engine node",
        },
        "bytes_written": "object-store bytes created on all nodes, engine put to trainer read",
        "versions": {
            "python": sys.version.split()[0],
            "ray": ray.__version__,
            "numpy": np.__version__,
            "routeplay": routeplay.__version__,
        },
        "results": results,
    }
    show(report)
    out = args.out or RESULTS / f"transfer-paths_{platform.node()}_{datetime.now():%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Console().print(f"wrote {out}")


def show(report: dict[str, Any]) -> None:
    table = Table(title=f"{report['config']['rows']} rows of Qwen3-235B routing, uint8")
    for column in ("nodes", "path", "median ms", "bytes written", "writes/payload"):
        table.add_column(column)
    for result in report["results"]:
        for path in ("eager", "lazy"):
            row = result[path]
            table.add_row(
                str(result["nodes"]),
                path,
                str(row["median_ms"]),
                f"{row['bytes_written']:,}",
                str(row["writes_per_payload"]),
            )
    Console().print(table)


if __name__ == "__main__":
    main()
