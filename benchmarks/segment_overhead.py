"""Acquire + read of many-segment handles on a single-node local Ray store, with Ray's
own floor for as many objects measured in the same run, and the same handles after
compaction with what compacting costs (the ``segments_per_handle`` figures of
``routeplay bench``, without the 3-node cluster and the other workloads):

    PYTHONPATH=src .venv/bin/python benchmarks/segment_overhead.py [--segments 1 100 1000]
        [--runs 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import ray

from routeplay.bench.measure import segment_overhead
from routeplay.store import StoreConfig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, object_store_memory=512 * 1024 * 1024, log_to_driver=False)
    try:
        store = StoreConfig(run="segment-overhead").build()
        points = [segment_overhead(store, n, args.runs) for n in args.segments]
        store.shutdown()
    finally:
        ray.shutdown()
    document = {
        "benchmark": "segment_overhead",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "nodes": 1},
        "runs": args.runs,
        "versions": {"python": sys.version.split()[0], "ray": ray.__version__},
        "segments_per_handle": points,
    }
    text = json.dumps(document, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
