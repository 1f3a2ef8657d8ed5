"""The long fuzz setting, counted: every fuzz test of ``tests/fuzz`` under the ``long``
hypothesis profile, each in its own subprocess capped by an address-space limit, with the
counts the issue asks for (inputs, typed refusals, untyped errors, hangs, peak RSS).

Each test runs ``--rounds`` calls of ``fuzzing.LONG_ROUND`` inputs (a tenth of that, times
the CI share, for the engine server) in a subprocess with ``RLIMIT_AS`` set, so an input
that tries to allocate gigabytes fails that subprocess (a ``MemoryError`` counted as
untyped, or the process dying: reported with its stderr) instead of the machine. The
engine server's tests import torch, whose address space at start is far above its
resident memory, so their limit is their start-up address space plus the same budget;
the RSS figure is measured either way.

    .venv/bin/python benchmarks/fuzz_long.py [--rounds 10] [--jobs 2] [--budget-gib 2]

Writes ``benchmarks/results/fuzz-long_<host>_<date>.json``. Untyped errors, hangs and
failed subprocesses must be 0; the script exits 1 otherwise.
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
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FUZZ_DIR = ROOT / "tests" / "fuzz"
MODULES = ("test_fuzz_decoders", "test_fuzz_inspect", "test_fuzz_server")
"""Test modules whose hypothesis tests are run."""
GIB = 1 << 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="calls of each test")
    parser.add_argument("--jobs", type=int, default=2, help="subprocesses at once")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="memory per subprocess")
    parser.add_argument("--only", nargs="*", default=[], help="test names to run (all: empty)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker, args.rounds, args.budget_gib)
    tests = [t for t in _tests() if not args.only or t.split(":")[1] in args.only]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(tests, pool.map(lambda t: _run(t, args), tests), strict=True))
    report = _report(results, args, time.monotonic() - started)
    path = RESULTS / f"fuzz-long_{platform.node() or 'host'}_{_today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["totals"], indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    totals = report["totals"]
    return 1 if totals["untyped_errors"] or totals["hangs"] or report["failed"] else 0


def _env() -> dict[str, str]:
    paths = [str(ROOT / "src"), str(FUZZ_DIR), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "ROUTEPLAY_FUZZ": "long",
        "ROUTEPLAY_FUZZ_COUNT": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(paths),
    }


def _tests() -> list[str]:
    listing = subprocess.run(
        [sys.executable, "-c", _LIST], env=_env(), capture_output=True, text=True, check=True
    )
    return listing.stdout.split()


_LIST = f"""
import importlib
for name in {MODULES!r}:
    module = importlib.import_module(name)
    for attr in sorted(dir(module)):
        if attr.startswith("test_") and hasattr(getattr(module, attr), "hypothesis"):
            print(f"{{name}}:{{attr}}")
"""


def _run(test: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", test, "--rounds", str(args.rounds)]
    command += ["--budget-gib", str(args.budget_gib)]
    print(f"[fuzz-long] {test} ...", flush=True)
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"[fuzz-long] {test}: FAILED (exit {done.returncode})", flush=True)
        return {"failed": True, "returncode": done.returncode, "stderr": done.stderr[-4000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    print(f"[fuzz-long] {test}: {result['inputs_total']} inputs", flush=True)
    return result


def _worker(test: str, rounds: int, budget_gib: float) -> int:
    import faulthandler
    import importlib
    import traceback

    faulthandler.enable()  # a crash in C prints where it happened
    module_name, test_name = test.split(":")
    module = importlib.import_module(module_name)  # heavy imports happen here
    base = _address_space()
    limit = int(budget_gib * GIB) + (base if module_name == "test_fuzz_server" else 0)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import fuzzing

    failures: list[str] = []
    started = time.monotonic()
    for _ in range(rounds):
        try:
            getattr(module, test_name)()
        except (Exception, MemoryError) as exc:  # hypothesis failing, or memory at the cap
            failures.append(f"{type(exc).__name__}: {str(exc)[:300]}")
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


def _report(
    results: dict[str, dict[str, Any]], args: argparse.Namespace, spent: float
) -> dict[str, Any]:
    ok = [r for r in results.values() if not r.get("failed")]
    totals = {
        "inputs": sum(r["inputs_total"] for r in ok),
        "typed_refusals": sum(r["typed_refusals"] for r in ok),
        "untyped_errors": sum(r["untyped_errors"] for r in ok),
        "hangs": sum(r["hangs"] for r in ok),
        "slowest_input_s": max((r["slowest_input_s"] for r in ok), default=0.0),
        "peak_rss_mib": max((r["peak_rss_mib"] for r in ok), default=0.0),
        "test_failures": sum(len(r["test_failures"]) // 2 for r in ok),
        "seconds": round(spent, 1),
    }
    import hypothesis
    import numpy

    return {
        "what": "long fuzz setting of tests/fuzz (hypothesis profile fuzz-long)",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
        "versions": {"hypothesis": hypothesis.__version__, "numpy": numpy.__version__},
        "config": {
            "rounds": args.rounds,
            "jobs": args.jobs,
            "budget_gib": args.budget_gib,
            "hang_s": 5.0,
        },
        "failed": [name for name, r in results.items() if r.get("failed")],
        "totals": totals,
        "tests": results,
    }


def _today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


if __name__ == "__main__":
    sys.exit(main())
