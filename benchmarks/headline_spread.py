"""The headline workload (Qwen3-235B, 8 x 32k rows, SP=4) measured as ``routeplay bench``
measures it, on several fresh local clusters one after the other: how far each path's
median and Ray's own floors for the same objects stand from the limit, per cluster.

Why: the full bench measures this workload on one cluster, and its ratios are a median
over a best run. On a small host both the paths and Ray's own transfers vary from
cluster to cluster, and so does the limit itself (the best of a few pulls). This script
shows that spread, so a ratio from one run can be read against it: where Ray's own
fetch of the adopted objects already stands at 1.2x-1.4x the limit, a path that adds
its calls to that fetch is judged by the host as much as by itself.

    PYTHONPATH=src .venv/bin/python benchmarks/headline_spread.py [--clusters 4]
        [--runs 5] [--pairs 9] [--json PATH]

Example:
    .venv/bin/python benchmarks/headline_spread.py --clusters 2 --json /tmp/spread.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ray

from routeplay.bench.host_cpu import cores
from routeplay.bench.limit import Probes
from routeplay.bench.measure import cluster, measure_workload
from routeplay.bench.workloads import BenchConfig, Workload
from routeplay.store import StoreConfig, start_engine_store

HEADLINE = Workload(model="qwen3-235b-a22b", tokens=32768, samples=8, sp=4)

RATIOS = {
    # name: (the figure, the limit it is read against)
    "adopt/limit": ("adopt_ms", "adopt"),
    "bare_ray_fetch/limit": ("bare_ray_fetch_ms", "adopt"),
    "producer/limit": ("routeplay_ms", "producer"),
    "bare_ray/limit": ("bare_ray_ms", "producer"),
}
"""The ratios read per cluster: each path's median, and Ray's own floor for its objects."""


def one_cluster(runs: int, pairs: int) -> dict[str, Any]:
    """The headline workload on a fresh local cluster, as ``routeplay bench`` runs it."""
    with cluster(BenchConfig.full().store_bytes) as roles:
        store = StoreConfig(run="spread", resources=(("head", 0.01),), timeout_s=120).build()
        start_engine_store(resources={"engine": 0.01})
        probes = Probes()
        try:
            entry = measure_workload(store, HEADLINE, roles, runs, probes, pairs)
        finally:
            probes.close()
            store.shutdown()
    return summary(entry)


def summary(entry: dict[str, Any]) -> dict[str, Any]:
    """What one cluster's measurement says about the distance to the limit."""
    by_path = entry["limit"]["by_path"]
    return {
        "limit_ms": by_path,
        "probe_limit_ms": entry["limit"]["probe_by_path"],
        "floor_best_ms": entry["limit"]["floor_best_ms"],
        "medians_ms": {
            key: entry[key]
            for key in ("adopt_ms", "routeplay_ms", "bare_ray_fetch_ms", "bare_ray_ms")
        },
        "adopt_beyond_bare_ray_fetch_ms": entry["adopt_beyond_bare_ray_fetch_ms"],
        "producer_beyond_bare_ray_ms": entry["producer_beyond_bare_ray_ms"],
        "ratios": {
            name: round(entry[figure] / by_path[path], 3) for name, (figure, path) in RATIOS.items()
        },
        "below_limit": entry["below_limit"],
    }


def spread(clusters: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per ratio and per limit: min, median and max over the clusters."""
    series = {name: [c["ratios"][name] for c in clusters] for name in RATIOS}
    series |= {f"limit_{p}_ms": [c["limit_ms"][p] for c in clusters] for p in ("adopt", "producer")}
    return {
        name: {"min": min(xs), "median": round(statistics.median(xs), 3), "max": max(xs)}
        for name, xs in series.items()
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    clusters = []
    for index in range(args.clusters):
        clusters.append(one_cluster(args.runs, args.pairs))
        print(f"cluster {index + 1}: {json.dumps(clusters[-1]['ratios'])}", flush=True)
    document = {
        "benchmark": "headline_spread",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "nodes": 4, "cores": cores()},
        "workload": HEADLINE.name,
        "runs": args.runs,
        "pairs": args.pairs,
        "versions": {"python": sys.version.split()[0], "ray": ray.__version__},
        "spread": spread(clusters),
        "clusters": clusters,
    }
    text = json.dumps(document, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
