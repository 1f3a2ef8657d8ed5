"""The cancellation storm of ``tests/ray/test_cancel_storm.py``, seeded runs in a row
under load, with pass or fail per seed (issue 38, point 5: "a cancellation or a timeout
ends only its own call"; done when 20 seeded runs in a row pass under load).

Runs pytest on that module once, with one test case per seed (``ROUTEPLAY_STORM_SEEDS``),
each an async actor's storm of ``--coroutines`` coroutines over one store client, most
cancelled or timed out at random moments, with one busy loop per core spinning
``--duty`` of the time. Each seed's outcome comes from pytest's JUnit XML, its figures
(coroutines ok, cancelled, timed out; seconds) from the line the test prints.

    .venv/bin/python benchmarks/cancel_storm.py [--seeds 100-119] [--coroutines 160] [--duty 1.0]

Writes ``benchmarks/results/cancel-storm_<host>_<UTC time>.json``; exits 1 if a seed
failed. ``PYTHONPATH=<another src>`` runs it against another copy of routeplay (the
report names the one imported).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TEST = "tests/ray/test_cancel_storm.py"
FIGURES = 'cancel storm: {"seed": '
"""How the test's figures for one seed start (a JSON object, to the end of the line; a
progress mark of pytest's may come first on that line)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="100-119", help="'7', '3,9' or '100-119'")
    parser.add_argument("--coroutines", type=int, default=160, help="per storm")
    parser.add_argument("--duty", type=float, default=1.0, help="busy share of each core")
    args = parser.parse_args()
    env = {
        **os.environ,
        "ROUTEPLAY_STORM_SEEDS": args.seeds,
        "ROUTEPLAY_STORM_COROUTINES": str(args.coroutines),
        "ROUTEPLAY_STORM_DUTY": str(args.duty),
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", TEST, "-s", "-q", "-p", "no:cacheprovider"]
        run = subprocess.run(
            [*command, f"--junitxml={junit}"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        verdicts = _verdicts(junit) if junit.exists() else {}
    figures = _figures(run.stdout)
    seeds = [{**figures.get(seed, {"seed": seed}), **v} for seed, v in verdicts.items()]
    for seed in seeds:
        print(f"seed {seed['seed']}: {seed['verdict']} {seed.get('outcomes', '')}", flush=True)
    report = _report(args, env, seeds, time.monotonic() - started)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    path = RESULTS / f"cancel-storm_{platform.node() or 'host'}_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["totals"], indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    if not seeds:
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
    return 0 if seeds and report["totals"]["failed"] == 0 else 1


def _verdicts(junit: Path) -> dict[int, dict[str, Any]]:
    """Per seed (the test id's parameter): ``passed`` or ``failed`` and why, and seconds."""
    out: dict[int, dict[str, Any]] = {}
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("name", "")
        if "[" not in name:
            continue
        seed = int(name.rsplit("[", 1)[1].rstrip("]"))
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        verdict: dict[str, Any] = {"verdict": "passed" if problem is None else "failed"}
        if problem is not None:
            verdict["why"] = (problem.get("message") or "")[:2000]
        verdict["test_s"] = round(float(case.get("time", "0")), 1)
        out[seed] = verdict
    return out


def _figures(stdout: str) -> dict[int, dict[str, Any]]:
    """Each seed's figures, from the lines the test prints."""
    out: dict[int, dict[str, Any]] = {}
    for line in stdout.splitlines():
        at = line.find(FIGURES)
        if at >= 0:
            figures = json.loads(line[at + len("cancel storm: ") :])
            out[int(figures["seed"])] = figures
    return out


def _report(
    args: argparse.Namespace, env: dict[str, str], seeds: list[dict[str, Any]], spent: float
) -> dict[str, Any]:
    import numpy
    import ray

    failed = [s["seed"] for s in seeds if s["verdict"] != "passed"]
    return {
        "what": "cancellation storm (tests/ray/test_cancel_storm.py), seeded runs in a row",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
        "versions": {"ray": ray.__version__, "numpy": numpy.__version__},
        "routeplay": _imported_routeplay(env),
        "config": {"seeds": args.seeds, "coroutines": args.coroutines, "duty": args.duty},
        "totals": {
            "seeds": len(seeds),
            "passed": len(seeds) - len(failed),
            "failed": len(failed),
            "failed_seeds": failed,
            "seconds": round(spent, 1),
        },
        "seeds": seeds,
    }


def _imported_routeplay(env: dict[str, str]) -> dict[str, str]:
    """Which routeplay the storm ran (a ``PYTHONPATH`` may name another copy), and the
    checkout's commit."""
    where = subprocess.run(
        [sys.executable, "-c", "import routeplay; print(routeplay.__file__)"],
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {"path": where, "commit": commit}


if __name__ == "__main__":
    sys.exit(main())
