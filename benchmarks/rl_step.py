"""The realistic RL step of ``routeplay bench`` alone: GRPO groups written by an asyncio
rollout worker, a replay buffer, a training batch and four trainer ranks, on routeplay's
producer and LMDeploy-key paths, next to Ray's own floor for the same objects and verl's
padded driver path, in one run (``routeplay.bench.rl_step``).

Why a script of its own: the full bench takes about 12 minutes on this host, and the RL
step is what issue 39 tunes. Its ratios move by about 0.3 from run to run here, so read
one file against the others in ``benchmarks/results/rl-step_*``.

    PYTHONPATH=src .venv/bin/python benchmarks/rl_step.py [--samples 64,256,1024,4096]
        [--runs 3] [--out-dir benchmarks/results]

Example:
    .venv/bin/python benchmarks/rl_step.py --samples 256,1024 --runs 3
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import ray

from routeplay.bench.host_cpu import cores
from routeplay.bench.rl_step import rl_steps
from routeplay.bench.workloads import RLStepShape


def _commit() -> str:
    """The checkout measured (a result names the code it measured)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def _summary(point: dict[str, Any]) -> str:
    """One line per path: the step, its whole and trainer-side ratios to Ray's floor,
    its phases and its shard calls."""
    floor = point["paths"]["ray_floor"]
    lines = [f"{point['samples']} samples (verl / producer: {point.get('verl_over_producer')})"]
    for name, path in point["paths"].items():
        phases = {k: round(v, 1) for k, v in path["phases_ms"].items()}
        trainer = path["trainer_ms"] / floor["trainer_ms"]
        lines.append(
            f"  {name:10s} {path['median_ms']:8.1f} ms (x{path['over_ray_floor']})"
            f" trainer-side x{trainer:.2f} {phases} calls {path['shard_calls']}"
        )
    lines.extend(f"  skipped: {why}" for why in (point.get("skipped") or {}).values())
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default="64,256,1024,4096", help="samples per step")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per path and size")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    samples = tuple(int(n) for n in args.samples.split(","))
    started = time.perf_counter()
    result = rl_steps(RLStepShape(samples=samples, runs=args.runs), progress=print)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    out = {
        "what": f"routeplay.bench.rl_step.rl_steps(RLStepShape(samples={samples}, "
        f"runs={args.runs}))",
        "command": "python benchmarks/rl_step.py",
        "host": f"{platform.node()}, {cores()} cores (local Cluster: head, engine, rollout, "
        "trainer nodes)",
        "versions": {
            "python": platform.python_version(),
            "ray": ray.__version__,
            "numpy": np.__version__,
        },
        "commit": _commit(),
        **result,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"rl-step_vm_{stamp}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    for point in result["points"]:
        print(_summary(point))
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
