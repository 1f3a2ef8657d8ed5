"""Cost of checking LMDeploy nested lists before numpy converts them (issue 12).

``decode_lists`` now walks the ``[T][L][K]`` nesting and every leaf's type (C-level
``set(map(type, ...))`` passes) before one ``np.array(..., int64)``, so that a string
among the ids is refused before numpy builds a ``<U{len}>`` array of every element. The
baseline, in the same run, is the previous algorithm: ``np.asarray`` first (dtype
discovery), then a bool scan of the leaves, then the same ``canonicalize``. Also timed: a
body with one 4 MB string among the ids, refused (the baseline's peak memory for it is
printed, not run, above a few MB: it is what the issue reports).

    .venv/bin/python benchmarks/lists_validation.py [--rows 3000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import platform
import time
import tracemalloc
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from routeplay.core import RouteSpec, preset
from routeplay.core.formats import lmdeploy
from routeplay.core.validate import canonicalize
from routeplay.errors import RoutesDataError

RESULTS = Path(__file__).parent / "results"


def previous_decode(value: list[Any], spec: RouteSpec, expected: int) -> object:
    """The decoder before issue 12: convert first, check leaf types after."""
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise ValueError(f"elements of type {array.dtype}")
    leaves = itertools.chain.from_iterable(itertools.chain.from_iterable(value))
    if bool in set(map(type, leaves)):
        raise ValueError("bools")
    return canonicalize(array, spec, expected=expected)


def best_of(repeats: int, *calls: Callable[[], object]) -> list[float]:
    """Best time of each call, the calls interleaved so that load on a shared machine
    falls on both alike."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, spent in zip(calls, times, strict=True):
            started = time.perf_counter()
            call()
            spent.append(time.perf_counter() - started)
    return [min(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    spec = preset("qwen3-235b-a22b")
    rng = np.random.default_rng(0)
    keys = rng.random((args.rows * spec.num_layers, spec.num_experts))
    ids = np.argsort(keys, axis=1)[:, : spec.top_k].astype(np.uint16)
    body = json.loads(json.dumps(ids.reshape(args.rows, spec.num_layers, spec.top_k).tolist()))
    rows = args.rows

    new_s, old_s = best_of(
        args.repeats,
        lambda: lmdeploy.decode_lists(body, spec, expected=rows),
        lambda: previous_decode(body, spec, rows),
    )
    hostile: list[Any] = np.zeros((2, spec.num_layers, spec.top_k), np.uint16).tolist()
    hostile[1][50][3] = "x" * 4_000_000
    tracemalloc.start()
    with contextlib.suppress(RoutesDataError):
        lmdeploy.decode_lists(hostile, spec)
    _, refusal_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    report = {
        "what": "LMDeploy nested-list decode: nesting/leaf checks before conversion vs before",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "python": platform.python_version()},
        "versions": {"numpy": np.__version__},
        "config": {"rows": rows, "layers": spec.num_layers, "top_k": spec.top_k},
        "decode_lists_ms": round(new_s * 1e3, 1),
        "previous_ms": round(old_s * 1e3, 1),
        "ratio_new_over_previous": round(new_s / old_s, 3),
        "refusal_of_4mb_string_peak_bytes": refusal_peak,
        "previous_would_allocate_bytes": 2 * spec.num_layers * spec.top_k * 4 * 4_000_000,
    }
    print(json.dumps(report, indent=2))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    path = RESULTS / f"lists-validation_{platform.node() or 'host'}_{stamp}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
