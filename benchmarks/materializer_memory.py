"""Per-rank routing bytes read and peak resident bytes of the materializer, by SP size.

A step of full 262,144-token packs of Qwen3-235B routing (L=94, K=8, uint8) sits in the
local route store (no Ray). For SP = 1, 2, 4, 8 every SP rank materializes its
micro-batches (one pack each) with ``Materializer``; in the same run the baseline does
what the eager path did: each SP rank reads the whole pack, builds it, widens it to
int64 and only then keeps its SP slice. Both sides are measured the same way:

- bytes read: nbytes of the arrays ``read_many`` returns (a counting wrapper);
- peak resident: tracemalloc's peak over the rank's run (numpy reports its buffers to
  tracemalloc), i.e. real allocations, plus the materializer's own accounting;
- the consumer "trains" ``--compute-ms`` per micro-batch so read-ahead fills up.

    .venv/bin/python benchmarks/materializer_memory.py [--packs 4] [--sp 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

import routeplay
from routeplay.core import Handle, Routes, RouteSpec, preset
from routeplay.store import RouteStore, StoreConfig
from routeplay.train.materializer import Materializer
from routeplay.train.packing import PackingPlan, RankCoords, local_ranges, pack_samples

RESULTS = Path(__file__).parent / "results"


class CountingReader:
    """Forwards ``read_many`` and counts the bytes of the arrays it returns."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self.bytes = 0
        self.calls = 0

    def read_many(
        self, requests: Sequence[tuple[Handle, int, int]], *, holder: str = ""
    ) -> list[npt.NDArray[Any]]:
        out = self.store.read_many(requests, holder=holder)
        self.calls += 1
        self.bytes += sum(int(a.nbytes) for a in out)
        return out


def make_rows(spec: RouteSpec, rows: int, rng: np.random.Generator) -> npt.NDArray[Any]:
    """Valid routing (distinct ids per row and layer), drawn from a block of patterns."""
    block = np.argsort(rng.random((4096, spec.num_experts)), axis=1)[:, : spec.top_k]
    picks = rng.integers(0, block.shape[0], size=rows * spec.num_layers)
    return block[picks].reshape(rows, spec.num_layers, spec.top_k).astype(spec.dtype)


def build_step(
    store: RouteStore, spec: RouteSpec, args: argparse.Namespace
) -> tuple[PackingPlan, list[tuple[str, Handle, int]]]:
    """Samples of random lengths filling ``--packs`` packs exactly, put in the store."""
    rng = np.random.default_rng(args.seed)
    samples: list[tuple[str, Handle, int]] = []
    for _ in range(args.packs):
        left = args.pack_tokens
        while left:
            rows = int(rng.integers(args.min_tokens, args.max_tokens + 1)) - 1
            rows = left if left - rows < args.min_tokens else rows  # last one fills the pack
            # Trusted synthetic rows: skip validation, it is not what is measured here.
            handle = store.put(Routes(array=make_rows(spec, rows, rng), spec=spec))
            samples.append((f"sample-{len(samples)}", handle, rows + 1))
            left -= rows
    plan = pack_samples(samples, args.pack_tokens, packs_per_micro_batch=1)
    assert len(plan.packs) == args.packs
    return plan, samples


def measure(run: Any) -> tuple[Any, int, float]:
    """Run ``run()`` under tracemalloc: its result, peak bytes allocated above the start."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return result, peak, seconds


def compute(routes: npt.NDArray[Any], ms: float) -> None:
    """Stand-in for a forward/backward pass: touch the rows, take some time."""
    routes[:: max(1, routes.shape[0] // 64)].sum()
    time.sleep(ms / 1e3)


def ours(
    store: RouteStore, plan: PackingPlan, coords: RankCoords, args: argparse.Namespace
) -> dict[str, Any]:
    reader = CountingReader(store)
    leases = {
        s.sample_id: store.acquire(s.handle, coords.describe())
        for p in plan.packs
        for s in p.samples
    }

    def run() -> Any:
        with Materializer(reader, plan, coords, leases=leases, prefetch=args.prefetch) as m:
            for item in m:
                compute(item.routes, args.compute_ms)
        return m.stats()

    stats, peak, seconds = measure(run)
    return {
        "bytes_read": reader.bytes,
        "sample_bytes_read": stats.bytes_read,
        "block_bytes": stats.block_bytes,
        "read_calls": reader.calls,
        "peak_resident_bytes": peak,
        "materializer_peak_bytes": stats.peak_resident_bytes,
        "seconds": round(seconds, 3),
    }


def baseline(
    store: RouteStore, plan: PackingPlan, coords: RankCoords, args: argparse.Namespace
) -> dict[str, Any]:
    """The eager path: the whole pack on every SP rank, widened to int64, then split."""
    reader = CountingReader(store)
    spec = plan.spec
    pad = np.arange(spec.top_k) % spec.num_experts

    def run() -> None:
        for packs in plan.micro_batches:
            for index in packs:
                pack = plan.packs[index]
                parts = reader.read_many([(s.handle, 0, s.handle.rows) for s in pack.samples])
                full = np.empty((pack.length, *spec.row_shape), spec.dtype)
                full[:] = pad
                for sample, rows in zip(pack.samples, parts, strict=True):
                    full[sample.offset : sample.stop] = rows
                del parts
                wide = full.astype(np.int64)
                del full
                ranges = local_ranges(pack.length, coords)
                local = np.concatenate([wide[a:b] for a, b in ranges])
                del wide
                compute(local, args.compute_ms)
                del local

    _, peak, seconds = measure(run)
    return {
        "bytes_read": reader.bytes,
        "read_calls": reader.calls,
        "peak_resident_bytes": peak,
        "seconds": round(seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-235b-a22b")
    parser.add_argument("--pack-tokens", type=int, default=262_144)
    parser.add_argument("--packs", type=int, default=4, help="packs in the step (1 per mb)")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--min-tokens", type=int, default=2_048)
    parser.add_argument("--max-tokens", type=int, default=32_768)
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--block-rows", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    spec = preset(args.model)
    store = RouteStore.local(StoreConfig(run="bench-materializer", block_rows=args.block_rows))
    plan, samples = build_step(store, spec, args)
    step_leases = [store.acquire(h, "train/step") for _, h, _ in samples]
    pack_bytes = spec.nbytes(args.pack_tokens)
    rows_out = []
    for sp in args.sp:
        per_rank = [ours(store, plan, RankCoords(sp_rank=r, sp_size=sp), args) for r in range(sp)]
        base = baseline(store, plan, RankCoords(sp_rank=0, sp_size=sp), args)
        worst = {k: max(r[k] for r in per_rank) for k in ("bytes_read", "peak_resident_bytes")}
        rows_out.append(
            {
                "sp": sp,
                "ranks_measured": sp,
                "bytes_read_per_rank_max": worst["bytes_read"],
                "block_bytes_per_rank_max": max(r["block_bytes"] for r in per_rank),
                "peak_resident_bytes_per_rank_max": worst["peak_resident_bytes"],
                "materializer_peak_bytes_per_rank_max": max(
                    r["materializer_peak_bytes"] for r in per_rank
                ),
                "bound_bytes": (args.prefetch + 1) * (pack_bytes // sp + args.pack_tokens // sp),
                "seconds_per_rank_median": statistics.median(r["seconds"] for r in per_rank),
                "baseline_bytes_read_per_rank": base["bytes_read"],
                "baseline_peak_resident_bytes_per_rank": base["peak_resident_bytes"],
                "baseline_seconds_per_rank": base["seconds"],
                "bytes_read_ratio": round(worst["bytes_read"] / base["bytes_read"], 4),
                "peak_resident_ratio": round(
                    worst["peak_resident_bytes"] / base["peak_resident_bytes"], 4
                ),
                "per_rank": per_rank,
            }
        )
    for lease in step_leases:
        lease.release()
    assert store.leaks() == [], "a lease outlived the benchmark"
    report = {
        "benchmark": "materializer_memory",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": {
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
        },
        "config": {
            "model": args.model,
            "spec": spec.describe(),
            "pack_tokens": args.pack_tokens,
            "pack_mb": round(pack_bytes / 1e6, 1),
            "packs_in_step": args.packs,
            "packs_per_micro_batch": 1,
            "samples_in_step": len(samples),
            "sample_tokens": [args.min_tokens, args.max_tokens],
            "prefetch": args.prefetch,
            "compute_ms_per_micro_batch": args.compute_ms,
            "store": f"local, block_rows={store.block_rows_for(spec)}",
            "baseline": "every SP rank reads the whole pack, widens it to int64, then slices",
            "peak_measure": "tracemalloc peak above the start of each rank's run",
            "seed": args.seed,
        },
        "versions": {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "routeplay": routeplay.__version__,
        },
        "results": rows_out,
    }
    _print(report)
    out = (
        args.out
        or RESULTS / f"materializer-memory_{platform.node()}_{datetime.now():%Y-%m-%d}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Console().print(f"wrote {out}")


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    table = Table(
        title=f"per-rank routing bytes per step (max over ranks), {cfg['spec']}, "
        f"{cfg['pack_tokens']}-token packs "
        f"({cfg['pack_mb']} MB uint8), {cfg['packs_in_step']} micro-batches, "
        f"prefetch {cfg['prefetch']}"
    )
    for column in (
        "SP",
        "read MB",
        "store blocks MB",
        "baseline read MB",
        "read ratio",
        "peak MB",
        "baseline peak MB",
        "peak ratio",
    ):
        table.add_column(column)
    for row in report["results"]:
        table.add_row(
            str(row["sp"]),
            f"{row['bytes_read_per_rank_max'] / 1e6:.1f}",
            f"{row['block_bytes_per_rank_max'] / 1e6:.1f}",
            f"{row['baseline_bytes_read_per_rank'] / 1e6:.1f}",
            f"{row['bytes_read_ratio']:.3f}",
            f"{row['peak_resident_bytes_per_rank_max'] / 1e6:.1f}",
            f"{row['baseline_peak_resident_bytes_per_rank'] / 1e6:.1f}",
            f"{row['peak_resident_ratio']:.3f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
