"""verl's R3 data path against routeplay's, on the same workload and the same nodes.

A thin script over ``routeplay.bench.verl_step`` (``routeplay bench`` runs the same
section after the RL step): verl's 235B example scaled down to this machine, Qwen3-235B
geometry, ``--samples`` samples with prompts left-padded to ``--prompt`` tokens and
responses padded to ``--response``, on ``--dp`` x ``--tp`` x ``--pp`` Megatron rank actors
(default DP2 x TP2 x PP4; verl's example is DP2 x TP4 x PP8), three passes a step. The
module docstring of ``routeplay.bench.verl_step`` says what each path does and what is
measured; the results go to ``benchmarks/results/verl-data-path_vm_<UTC stamp>.json``
(or ``--json``).

    PYTHONPATH=src .venv/bin/python benchmarks/verl_data_path.py [--samples 24]
        [--prompt 1024] [--response 3072] [--runs 5] [--json PATH]

Example:
    .venv/bin/python benchmarks/verl_data_path.py --samples 8 --runs 3
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from routeplay.bench.verl_step import verl_steps
from routeplay.bench.workloads import VerlStepShape

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=3072)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    shape = VerlStepShape(
        samples=args.samples,
        prompt=args.prompt,
        response=args.response,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        runs=args.runs,
    )
    out = _document(shape, verl_steps(shape))
    print(json.dumps(out, indent=1))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    path = args.json or RESULTS / f"verl-data-path_vm_{stamp}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"results: {path}")


def _document(shape: VerlStepShape, results: dict[str, Any]) -> dict[str, Any]:
    """The results under the keys of the earlier runs' files, with what ran where."""
    rows = sum(sum(shape.lengths(s)) - 1 for s in range(shape.samples))
    return {
        "benchmark": "verl-data-path",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": f"{platform.node()} (local Cluster: head, engine, rollout, trainer nodes)",
        "model": results["model"],
        "verl_batch": results["verl_batch"],
        "workload": {
            "samples": shape.samples,
            "prompt": shape.prompt,
            "response": shape.response,
            "rows": rows,
            "canonical_bytes": shape.spec.nbytes(rows),
        },
        "layout": {
            "dp": shape.dp,
            "tp": shape.tp,
            "pp": shape.pp,
            "stages": results["stages"],
            "passes": shape.passes,
        },
        "paths": results["paths"],
        "verl_over_routeplay": results["verl_over_routeplay"],
        "rows_checked": results["rows_checked"],
        "store_end": results["store_end"],
    }


if __name__ == "__main__":
    main()
