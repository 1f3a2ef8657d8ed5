"""Decode + validate throughput of every wire format, on one Qwen3-235B-shaped sample.

Reports MB/s of canonical output (uint8 ``[T, 94, 8]``) for routeplay's decoders and,
in the same run, for a naive baseline per format (stdlib base64, ``np.load``, a per-row
sort for distinctness), then writes a JSON result file named for what, where and when.

    .venv/bin/python benchmarks/codec_throughput.py [--tokens 32768] [--repeats 7]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
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


def cases(
    spec: RouteSpec, full: np.ndarray
) -> dict[str, tuple[Any, Callable[[], Any], Callable[[], Any]]]:
    """format -> (wire payload, routeplay decode, naive baseline decode)."""
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

    return {
        "vllm npy uint8 (base64)": (npy_u8, lambda: vllm.decode(npy_u8, spec), naive_npy(npy_u8)),
        "vllm npy int16 (base64)": (
            npy_i16,
            lambda: vllm.decode(npy_i16, spec),
            naive_npy(npy_i16),
        ),
        "sglang int32 (base64)": (sgl, lambda: sglang.decode(sgl, spec), naive_sglang),
        "vllm in-process int16 arrays": (
            None,
            lambda: vllm.from_outputs(prompt, completion, spec),
            lambda: naive_validate(np.concatenate([prompt, completion]), spec),
        ),
        "lmdeploy nested lists (parsed)": (
            None,
            lambda: lmdeploy.decode_lists(lists, spec),
            lambda: naive_validate(np.array(lists), spec),
        ),
        "lmdeploy nested lists (JSON text)": (
            lists_json,
            lambda: lmdeploy.decode_lists(json.loads(lists_json), spec),
            lambda: naive_validate(np.array(json.loads(lists_json)), spec),
        ),
    }


def timed(fn: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


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
    for name, (wire, ours, baseline) in cases(spec, full).items():
        result = ours()
        np.testing.assert_array_equal(result.array, full)  # both sides decode the same thing
        slow_repeats = 2 if "lists" in name else args.repeats
        t_ours, t_base = timed(ours, slow_repeats), timed(baseline, slow_repeats)
        rows_out.append(
            {
                "format": name,
                "wire_mb": round(len(wire) / 1e6, 2) if wire is not None else None,
                "routeplay_ms": round(t_ours * 1e3, 2),
                "routeplay_mb_s": round(canonical_mb / t_ours, 1),
                "baseline_ms": round(t_base * 1e3, 2),
                "baseline_mb_s": round(canonical_mb / t_base, 1),
                "speedup_vs_baseline": round(t_base / t_ours, 2),
            }
        )
    report = {
        "benchmark": "codec_throughput",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {
            "host": platform.node(),
            "cpu_count": __import__("os").cpu_count(),
            "machine": platform.machine(),
        },
        "config": {
            "model": args.model,
            "tokens": args.tokens,
            "rows": full.shape[0],
            "spec": spec.describe(),
            "canonical_mb": round(canonical_mb, 2),
            "repeats": args.repeats,
            "statistic": "median",
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
    for column in ("format", "wire MB", "routeplay MB/s", "baseline MB/s", "speedup"):
        table.add_column(column)
    for row in report["results"]:
        table.add_row(
            row["format"],
            str(row["wire_mb"] or "-"),
            str(row["routeplay_mb_s"]),
            str(row["baseline_mb_s"]),
            f"{row['speedup_vs_baseline']}x",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
