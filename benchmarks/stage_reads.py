"""Per-stage reads at PP=8: each pipeline stage reads only its own MoE layers.

A step of Qwen3-235B routing (94 MoE layers, top-8, uint8) is written to the route store on
a local Ray instance (the real object store). Megatron's PP=8 layout of its 94 decoder
layers (uneven: 10 in the first stage, 12 in each other one) gives each stage its MoE
layers (``MegatronLayout.moe_layers``). Every stage's rank materializes the whole step
twice, in the same run: reading every layer (what a stage did before) and reading its
own layers only (``Materializer(layers=...)``). Reported per stage: the routing bytes
copied out of the store, the bytes held at the peak (the materializer's accounting:
read ahead plus the micro-batch in use) and the read time (median of ``--runs``).

The object store still ships whole blocks to the node (a block holds every layer of its
rows); what scales with 1/PP is what each rank copies, holds and hands to its routers.

    PYTHONPATH=src .venv/bin/python benchmarks/stage_reads.py [--samples 8]
        [--tokens 8192] [--runs 5] [--json PATH]

Example:
    .venv/bin/python benchmarks/stage_reads.py --samples 4 --runs 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import ray

from routeplay.core import Routes, preset
from routeplay.integrations.megatron import MegatronLayout
from routeplay.store import RouteStore, StoreConfig
from routeplay.train import Materializer, PackingPlan, RankCoords, pack_samples

RESULTS = Path(__file__).parent / "results"
PP, FIRST, LAST = 8, 10, 12  # 94 layers: 10 + 6 x 12 + 12


def build_step(store: RouteStore, samples: int, tokens: int) -> PackingPlan:
    """``samples`` samples of ``tokens`` tokens (valid random rows), one pack each."""
    spec = preset("qwen3-235b-a22b")
    rng = np.random.default_rng(0)
    block = np.argsort(rng.random((4096, spec.num_experts)), axis=1)[:, : spec.top_k]
    handles = []
    for index in range(samples):
        picks = rng.integers(0, len(block), size=(tokens - 1) * spec.num_layers)
        rows = block[picks].reshape(tokens - 1, spec.num_layers, spec.top_k).astype(spec.dtype)
        # The step's batch holds a lease on every sample while the stages read.
        handle, _ = store.put_leased(Routes(array=rows, spec=spec), "bench/batch")
        handles.append((f"s{index}", handle, tokens))
    return pack_samples(handles, tokens, packs_per_micro_batch=1)


def read_step(
    store: RouteStore, plan: PackingPlan, layers: tuple[int, ...] | None, runs: int
) -> dict[str, Any]:
    """The whole step read by one rank ``runs`` times: bytes, peak held, median seconds."""
    seconds, stats = [], None
    for _ in range(runs):
        start = time.perf_counter()
        with Materializer.leasing(
            store, plan, RankCoords(), holder="bench/stage", layers=layers
        ) as materializer:
            for _ in materializer:
                pass
        seconds.append(time.perf_counter() - start)
        stats = materializer.stats()
    assert stats is not None
    return {
        "bytes_read": stats.bytes_read,
        "peak_resident_bytes": stats.peak_resident_bytes,
        "median_ms": round(1e3 * statistics.median(seconds), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    ray.init(num_cpus=2, object_store_memory=2 * 1024**3, include_dashboard=False)
    spec = preset("qwen3-235b-a22b")
    store = StoreConfig(run="stage-reads").build()
    try:
        plan = build_step(store, args.samples, args.tokens)
        whole = read_step(store, plan, None, args.runs)
        stages = []
        for rank in range(PP):
            layout = MegatronLayout(
                pp_size=PP,
                pp_rank=rank,
                num_layers=spec.decoder_layers,
                first_stage_layers=FIRST,
                last_stage_layers=LAST,
            )
            layers = layout.moe_layers(spec)
            own = read_step(store, plan, layers, args.runs)
            stages.append(
                {
                    "pp_rank": rank,
                    "layers": len(layers),
                    **own,
                    "bytes_over_whole": round(own["bytes_read"] / whole["bytes_read"], 4),
                    "held_over_whole": round(
                        own["peak_resident_bytes"] / whole["peak_resident_bytes"], 4
                    ),
                    "time_over_whole": round(own["median_ms"] / whole["median_ms"], 3),
                }
            )
    finally:
        store.shutdown()
        ray.shutdown()
    total = sum(stage["bytes_read"] for stage in stages)
    out = {
        "benchmark": "stage-reads",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": f"{platform.node()} ({platform.machine()})",
        "model": spec.describe(),
        "samples": args.samples,
        "tokens": args.tokens,
        "pp": PP,
        "whole": whole,
        "stages": stages,
        "all_stages_bytes_over_one_whole_read": round(total / whole["bytes_read"], 4),
    }
    for stage in stages:
        print(
            f"stage {stage['pp_rank']}: {stage['layers']} layers, "
            f"{stage['bytes_read'] / 1e6:.1f} MB read ({stage['bytes_over_whole']:.3f} of a whole "
            f"read), {stage['peak_resident_bytes'] / 1e6:.1f} MB held at the peak, "
            f"{stage['median_ms']} ms ({stage['time_over_whole']}x)"
        )
    print(
        f"whole read: {whole['bytes_read'] / 1e6:.1f} MB, "
        f"{whole['peak_resident_bytes'] / 1e6:.1f} MB held, {whole['median_ms']} ms"
    )
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    path = args.json or RESULTS / f"stage-reads_vm_{stamp}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
