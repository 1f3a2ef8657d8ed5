"""The long fuzz setting, counted: every fuzz test of ``tests/fuzz`` under the ``long``
hypothesis profile, in subprocesses capped by an address-space limit, with the counts the
issue asks for (inputs, typed refusals, untyped errors, hangs, peak RSS).

Each group of tests runs in its own subprocess with ``RLIMIT_AS`` set, so an input that
tries to allocate gigabytes fails that subprocess (a ``MemoryError`` counted as untyped,
or the process dying: reported) instead of the machine. The engine server group imports
torch, whose address space at start is far above its resident memory, so its limit is
its start-up address space plus the same budget; the RSS figure is measured either way.

    .venv/bin/python benchmarks/fuzz_long.py [--scale 1.0] [--budget-gib 2]

Writes ``benchmarks/results/fuzz-long_<host>_<date>.json``. Untyped errors and hangs
must be 0; the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FUZZ_DIR = ROOT / "tests" / "fuzz"
GROUPS = {
    "decoders": "test_fuzz_decoders",
    "inspect": "test_fuzz_inspect",
    "server": "test_fuzz_server",
}
"""Subprocess groups: one test module each."""
GIB = 1 << 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every test's inputs")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="memory per subprocess")
    parser.add_argument("--groups", nargs="*", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker, args.budget_gib)
    started = time.monotonic()
    results = {name: _run_group(name, args) for name in args.groups}
    report = _report(results, args, time.monotonic() - started)
    path = RESULTS / f"fuzz-long_{platform.node() or 'host'}_{_today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["totals"], indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    bad = report["totals"]["untyped_errors"] or report["totals"]["hangs"] or report["failed"]
    return 1 if bad else 0


def _run_group(name: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {
        **os.environ,
        "ROUTEPLAY_FUZZ": "long",
        "ROUTEPLAY_FUZZ_COUNT": "1",
        "ROUTEPLAY_FUZZ_SCALE": str(args.scale),
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(FUZZ_DIR), os.environ.get("PYTHONPATH", "")]
        ),
    }
    command = [sys.executable, __file__, "--worker", name, "--budget-gib", str(args.budget_gib)]
    print(f"[fuzz-long] {name} ...", flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"failed": True, "returncode": done.returncode, "stderr": done.stderr[-4000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    print(f"[fuzz-long] {name}: {result['inputs_total']} inputs", flush=True)
    return result


def _worker(name: str, budget_gib: float) -> int:
    import importlib
    import traceback

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    module = importlib.import_module(GROUPS[name])  # heavy imports happen here
    base = _address_space()
    limit = int(budget_gib * GIB) + (base if name == "server" else 0)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import fuzzing

    failures: list[str] = []
    started = time.monotonic()
    for test_name in sorted(dir(module)):
        test = getattr(module, test_name)
        if not (test_name.startswith("test_") and hasattr(test, "hypothesis")):
            continue
        try:
            test()
        except Exception as exc:  # hypothesis itself failing, or a MemoryError under the cap
            failures.append(f"{test_name}: {type(exc).__name__}: {str(exc)[:300]}")
            failures.append(traceback.format_exc()[-1500:])
    tally = fuzzing.TALLY
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "inputs": dict(tally.inputs),
                "inputs_total": sum(tally.inputs.values()),
                "typed_refusals": sum(tally.refused.values()),
                "untyped_errors": sum(tally.untyped.values()),
                "untyped_by_target": dict(tally.untyped),
                "untyped_examples": tally.untyped_examples,
                "hangs": sum(tally.hangs.values()),
                "slowest_input_s": round(tally.slowest_s, 3),
                "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
                "address_space_limit_mib": round(limit / (1 << 20)),
                "address_space_at_start_mib": round(base / (1 << 20)),
                "seconds": round(time.monotonic() - started, 1),
                "test_failures": failures,
            }
        )
    )
    return 0


def _address_space() -> int:
    # VmSize of this process now (Linux): what RLIMIT_AS counts.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace, spent: float) -> dict:
    ok = [r for r in results.values() if not r.get("failed")]
    totals = {
        "inputs": sum(r["inputs_total"] for r in ok),
        "typed_refusals": sum(r["typed_refusals"] for r in ok),
        "untyped_errors": sum(r["untyped_errors"] for r in ok),
        "hangs": sum(r["hangs"] for r in ok),
        "slowest_input_s": max((r["slowest_input_s"] for r in ok), default=0.0),
        "peak_rss_mib": max((r["peak_rss_mib"] for r in ok), default=0.0),
        "test_failures": sum(len(r["test_failures"]) for r in ok),
        "seconds": round(spent, 1),
    }
    import hypothesis
    import numpy

    return {
        "what": "long fuzz setting of tests/fuzz (hypothesis profile fuzz-long)",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
        "versions": {"hypothesis": hypothesis.__version__, "numpy": numpy.__version__},
        "config": {"scale": args.scale, "budget_gib": args.budget_gib, "hang_s": 5.0},
        "failed": [name for name, r in results.items() if r.get("failed")],
        "totals": totals,
        "groups": results,
    }


def _today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


if __name__ == "__main__":
    sys.exit(main())
