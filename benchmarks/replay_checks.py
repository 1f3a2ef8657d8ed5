"""Cost of replay's id checks (range + distinct) against the router forward they guard.

Replay refuses ids that would misroute (out of range, or an expert twice in a row) at the
replay boundary. This measures, for one micro-batch of a Qwen3-30B-A3B-shaped model
(L=48, K=8, E=128), the checks in each form replay accepts (a numpy array and a uint8
tensor checked once; a provider checked layer by layer) and, in the same run, the baseline:
the router part of a forward of the same tokens (gate matmul + softmax + top-k, all 48
layers, float32) - the cheapest slice of a forward, so the ratio is an upper bound of the
checks' share of a real forward. Writes a JSON result file named for what, where and when.

    .venv/bin/python benchmarks/replay_checks.py [--tokens 4096] [--hidden 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.core import RouteSpec, preset
from routeplay.train.replay_core import ReplaySource

RESULTS = Path(__file__).parent / "results"
CPU = torch.device("cpu")


def make_routes(spec: RouteSpec, rows: int, seed: int = 0) -> np.ndarray:
    """Valid routing: distinct ids per (row, layer), drawn in blocks to keep setup fast."""
    rng = np.random.default_rng(seed)
    block = np.argsort(rng.random((4096, spec.num_experts)), axis=1)[:, : spec.top_k]
    picks = rng.integers(0, block.shape[0], size=rows * spec.num_layers)
    return block[picks].reshape(rows, spec.num_layers, spec.top_k).astype(spec.dtype)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def router_forward(spec: RouteSpec, tokens: int, hidden: int) -> Callable[[], Any]:
    """The baseline: every MoE layer's gate on the micro-batch (what a forward pays anyway)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator)
    gates = [
        torch.randn(spec.num_experts, hidden, generator=generator) for _ in range(spec.num_layers)
    ]

    def run() -> None:
        with torch.no_grad():
            for weight in gates:
                scores = torch.softmax(x @ weight.t(), dim=-1)
                torch.topk(scores, spec.top_k, dim=-1)

    return run


def cases(
    spec: RouteSpec, routes: np.ndarray
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """form -> (replay with checks, the same replay without them): the difference is the cost."""
    tensor = torch.from_numpy(routes)
    rows = routes.shape[0]

    def provider_run(check: bool) -> Callable[[], Any]:
        def run() -> None:
            source = ReplaySource(lambda layer: tensor[:, layer], spec, check_ids=check)
            for layer in range(spec.num_layers):
                source.ids(layer, device=CPU, rows=rows)

        return run

    return {
        "numpy array (once)": (
            lambda: ReplaySource(routes, spec, check_ids=True),
            lambda: ReplaySource(routes, spec, check_ids=False),
        ),
        "uint8 tensor (once)": (
            lambda: ReplaySource(tensor, spec, check_ids=True),
            lambda: ReplaySource(tensor, spec, check_ids=False),
        ),
        "tensor provider (per layer, widening included)": (provider_run(True), provider_run(False)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    spec = preset(args.model)
    routes = make_routes(spec, args.tokens)
    t_forward = timed(router_forward(spec, args.tokens, args.hidden), args.repeats)
    rows_out = []
    for name, (checked, unchecked) in cases(spec, routes).items():
        t_checked, t_unchecked = timed(checked, args.repeats), timed(unchecked, args.repeats)
        cost = max(t_checked - t_unchecked, 0.0)
        rows_out.append(
            {
                "form": name,
                "with_checks_ms": round(t_checked * 1e3, 3),
                "without_checks_ms": round(t_unchecked * 1e3, 3),
                "checks_ms": round(cost * 1e3, 3),
                "router_forward_ms": round(t_forward * 1e3, 2),
                "checks_over_router_forward": round(cost / t_forward, 4),
            }
        )
    report = {
        "benchmark": "replay_checks",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
        },
        "config": {
            "model": args.model,
            "spec": spec.describe(),
            "tokens": args.tokens,
            "hidden": args.hidden,
            "routes_mb": round(routes.nbytes / 1e6, 2),
            "threads": args.threads,
            "repeats": args.repeats,
            "statistic": "median",
            "baseline": "gate matmul + softmax + top-k of every MoE layer, float32, no grad",
        },
        "versions": {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "torch": torch.__version__,
            "routeplay": routeplay.__version__,
        },
        "results": rows_out,
    }
    _print(report)
    out = args.out or RESULTS / f"replay-checks_{platform.node()}_{datetime.now():%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Console().print(f"wrote {out}")


def _print(report: dict[str, Any]) -> None:
    config = report["config"]
    table = Table(
        title=f"replay id checks, {config['spec']}, {config['tokens']} tokens "
        f"({config['routes_mb']} MB), vs the router forward of those tokens"
    )
    for column in ("form", "checks ms", "router forward ms", "checks / router forward"):
        table.add_column(column)
    for row in report["results"]:
        table.add_row(
            row["form"],
            f"{row['checks_ms']:.2f}",
            f"{row['router_forward_ms']:.1f}",
            f"{row['checks_over_router_forward']:.2%}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
