"""The multi-turn bytes of ``routeplay bench`` alone (the ``sessions`` figures: a long
branching session and a resumed rollout on every wire, bytes stored per unique row
before and after compaction), on the bench's local 4-node cluster, without the other
workloads:

    PYTHONPATH=src .venv/bin/python benchmarks/multi_turn_bytes.py [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from routeplay.bench.measure import cluster
from routeplay.bench.report import sessions_table
from routeplay.bench.sessions import session_bytes
from routeplay.bench.workloads import BenchConfig
from routeplay.store import StoreConfig, start_engine_store


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the smoke run's small shape")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    config = BenchConfig.smoke() if args.smoke else BenchConfig.full()
    with cluster(config.store_bytes):
        store = StoreConfig(run="bench", resources=(("head", 0.01),), timeout_s=120).build()
        start_engine_store(resources={"engine": 0.01})
        figures = session_bytes(store, config.sessions)
        store.shutdown()
    Console(width=180).print(sessions_table({"sessions": figures}))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
