"""Decode + validate throughput of every wire format, on one Qwen3-235B-shaped sample.

Reports MB/s of canonical output (uint8 ``[T, 94, 8]``) for routeplay's decoders and,
in the same run, for a naive baseline per format (stdlib base64, ``np.load``, a per-row
sort for distinctness) and, for the base64 formats, the bound of base64 decoding alone
(``pybase64.b64decode(text, validate=True)`` of the whole string, what a decoder that
first decodes and then validates can at best reach; for SGLang also the same decode done
in the streaming decoder's row slices, its floor without any check). MB/s are always of
canonical output, so every line compares with every other. Writes a JSON result file
named for what, where and when.

    .venv/bin/python benchmarks/codec_throughput.py [--tokens 32768] [--repeats 7]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pybase64
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.core import RouteSpec, preset
from routeplay.core.formats import lmdeploy, sglang, vllm

RESULTS = Path(__file__).parent / "results"


def make_sample(spec: RouteSpec, rows: int, seed: int = 0) -> np.ndarray:
    """Valid routing: distinct ids per (row, layer), drawn in blocks to keep setup fast."""
    rng = np.random.default_rng(seed)
    block = np.argsort(rng.random((4096, spec.num_experts)), axis=1)[:, : spec.top_k]
    picks = rng.integers(0, block.shape[0], size=rows * spec.num_layers)
    return block[picks].reshape(rows, spec.num_layers, spec.top_k).astype(spec.dtype)


def naive_validate(array: np.ndarray, spec: RouteSpec) -> np.ndarray:
    """What a straightforward implementation does: widen, range-check, sort every row."""
    wide = array.astype(np.int64)
    if wide.min() < 0 or wide.max() >= spec.num_experts:
        raise ValueError("out of range")
    ordered = np.sort(wide.reshape(-1, spec.top_k), axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise ValueError("duplicate")
    return wide.astype(spec.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One wire format's payload and the decoders timed on it."""

    wire: Any
    """The payload as it arrives (text, or None for in-process arrays)."""
    ours: Callable[[], Any]
    """routeplay's decode + validate, returning Routes."""
    baseline: Callable[[], Any]
    """A straightforward decode + validate."""
    bounds: dict[str, Callable[[], Any]]
    """Work that any decoder of this format must do (base64 alone), by name."""


def sliced_base64(text: str, spec: RouteSpec) -> None:
    """Base64 decoding alone, in the SGLang decoder's row slices: its floor."""
    plan = sglang._plan(text, spec, None)
    assert plan is not None, "a valid payload always has a plan"
    for first in range(0, plan.rows, plan.step):
        stop = min(plan.rows, first + plan.step)
        end = plan.char(stop) if stop < plan.rows else len(text)
        pybase64.b64decode(text[plan.char(first) : end], validate=True)


def cases(spec: RouteSpec, full: np.ndarray) -> dict[str, Case]:
    """format -> its payload and decoders."""
    rows = full.shape[0]
    npy_u8 = vllm.encode(full, spec)
    npy_i16 = vllm.encode(full, spec, dtype="int16")
    sgl = sglang.encode(full)
    lists = lmdeploy.encode_lists(full)
    lists_json = json.dumps(lists)
    prompt, completion = full[: rows // 2].astype(np.int16), full[rows // 2 :].astype(np.int16)

    def naive_npy(text: str) -> Callable[[], Any]:
        return lambda: naive_validate(
            np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False), spec
        )

    def naive_sglang() -> Any:
        raw = np.frombuffer(base64.b64decode(sgl), "<i4").reshape(rows, spec.num_layers, spec.top_k)
        return naive_validate(raw, spec)

    def base64_alone(text: str) -> dict[str, Callable[[], Any]]:
        return {"base64_only": lambda: pybase64.b64decode(text, validate=True)}

    return {
        "vllm npy uint8 (base64)": Case(
            wire=npy_u8,
            ours=lambda: vllm.decode(npy_u8, spec),
            baseline=naive_npy(npy_u8),
            bounds=base64_alone(npy_u8),
        ),
        "vllm npy int16 (base64)": Case(
            wire=npy_i16,
            ours=lambda: vllm.decode(npy_i16, spec),
            baseline=naive_npy(npy_i16),
            bounds=base64_alone(npy_i16),
        ),
        "sglang int32 (base64)": Case(
            wire=sgl,
            ours=lambda: sglang.decode(sgl, spec),
            baseline=naive_sglang,
            bounds={**base64_alone(sgl), "base64_only_sliced": lambda: sliced_base64(sgl, spec)},
        ),
        "vllm in-process int16 arrays": Case(
            wire=None,
            ours=lambda: vllm.from_outputs(prompt, completion, spec),
            baseline=lambda: naive_validate(np.concatenate([prompt, completion]), spec),
            bounds={},
        ),
        "lmdeploy nested lists (parsed)": Case(
            wire=None,
            ours=lambda: lmdeploy.decode_lists(lists, spec),
            baseline=lambda: naive_validate(np.array(lists), spec),
            bounds={},
        ),
        "lmdeploy nested lists (JSON text)": Case(
            wire=lists_json,
            ours=lambda: lmdeploy.decode_lists(json.loads(lists_json), spec),
            baseline=lambda: naive_validate(np.array(json.loads(lists_json)), spec),
            bounds={},
        ),
    }


def timed(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in rounds (one call of each per round).

    Interleaving makes load from other processes on the machine hit every function
    alike, so the ratios between them hold even when the absolute figures move.
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32 * 1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default="qwen3-235b-a22b")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    spec = preset(args.model)
    full = make_sample(spec, args.tokens - 1)
    canonical_mb = full.nbytes / 1e6
    rows_out = []
    for name, case in cases(spec, full).items():
        result = case.ours()
        np.testing.assert_array_equal(result.array, full)  # both sides decode the same thing
        slow_repeats = 2 if "lists" in name else args.repeats
        times = timed({"ours": case.ours, "baseline": case.baseline, **case.bounds}, slow_repeats)
        t_ours, t_base = times["ours"], times["baseline"]
        row: dict[str, Any] = {
            "format": name,
            "wire_mb": round(len(case.wire) / 1e6, 2) if case.wire is not None else None,
            "routeplay_ms": round(t_ours * 1e3, 2),
            "routeplay_mb_s": round(canonical_mb / t_ours, 1),
            "baseline_ms": round(t_base * 1e3, 2),
            "baseline_mb_s": round(canonical_mb / t_base, 1),
            "speedup_vs_baseline": round(t_base / t_ours, 2),
        }
        for bound in case.bounds:
            t_bound = times[bound]
            row[f"{bound}_ms"] = round(t_bound * 1e3, 2)
            row[f"{bound}_mb_s"] = round(canonical_mb / t_bound, 1)
            row[f"routeplay_vs_{bound}"] = round(t_bound / t_ours, 2)
        rows_out.append(row)
    report = {
        "benchmark": "codec_throughput",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_1m": round(os.getloadavg()[0], 2),  # other processes sharing it
        },
        "config": {
            "model": args.model,
            "tokens": args.tokens,
            "rows": full.shape[0],
            "spec": spec.describe(),
            "canonical_mb": round(canonical_mb, 2),
            "repeats": args.repeats,
            "repeats_nested_lists": 2,
            "statistic": "median, decoders of one format timed in interleaved rounds",
            "slice_bytes": sglang.SLICE_BYTES,
        },
        "versions": {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "pybase64": pybase64.__version__,
            "routeplay": routeplay.__version__,
        },
        "results": rows_out,
    }
    _print(report)
    out = args.out or RESULTS / f"codec-throughput_{platform.node()}_{datetime.now():%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Console().print(f"wrote {out}")


def _print(report: dict[str, Any]) -> None:
    table = Table(
        title=f"decode + validate, {report['config']['spec']}, {report['config']['rows']} rows "
        f"({report['config']['canonical_mb']} MB canonical)"
    )
    columns = (
        "format",
        "wire MB",
        "routeplay MB/s",
        "base64-only MB/s",
        "ratio",
        "base64 sliced MB/s",
        "ratio",
        "naive MB/s",
        "speedup",
    )
    for column in columns:
        table.add_column(column)
    for row in report["results"]:
        table.add_row(
            row["format"],
            str(row["wire_mb"] or "-"),
            str(row["routeplay_mb_s"]),
            str(row.get("base64_only_mb_s", "-")),
            _ratio(row.get("routeplay_vs_base64_only")),
            str(row.get("base64_only_sliced_mb_s", "-")),
            _ratio(row.get("routeplay_vs_base64_only_sliced")),
            str(row["baseline_mb_s"]),
            f"{row['speedup_vs_baseline']}x",
        )
    console = Console(width=160)  # the table is wide; never wrap it into an unreadable column
    console.print(table)
    console.print(
        "ratio: routeplay MB/s over the bound's (1.0 = as fast as base64 decoding alone)."
    )


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
