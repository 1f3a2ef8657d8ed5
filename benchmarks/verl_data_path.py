"""verl's R3 data path against routeplay's, on the same workload and the same nodes.

The workload is scaled down from verl's 235B example (512 samples x 16k tokens, 94 MoE
layers, top-8, TP4 PP8 DP2) to what this 2-core machine holds: Qwen3-235B geometry (94
layers, top-8, 128 experts), ``--samples`` samples, their prompts left-padded to
``--prompt`` tokens and their responses (random lengths) padded to ``--response``. The
trainer is ``--dp`` x ``--tp`` x ``--pp`` rank actors on the trainer node (default DP2 x
TP2 x PP4: sixteen; verl's example is DP2 x TP4 x PP8). A step has three passes
over the batch (old log-probs, reference, update), as verl's trainer makes them.

- **verl** (``routeplay.bench.verl_path``, verl's own ``DataProto``): the rollout worker
  widens each sample to int16 and zero-pads it to the batch width, and returns the batch
  to the driver. On every pass the driver chunks it per DP rank (``DataProto.chunk``) and
  puts each chunk. Each of the chunk's TP x PP ranks pulls and deserializes it whole,
  every layer included.
- **routeplay**: the rollout worker writes each sample once (a producer put, canonical
  uint8) and returns handles; the driver holds the leases and sends each rank its chunk's
  handles. Each rank reads, per pass, only its rows (its SP part, as Megatron scatters
  them) of its stage's layers (``Materializer.leasing(layers=layout.moe_layers(spec))``).

Reported per path, medians of ``--runs`` steps:

- the step's time (the batch reaching the driver, then the three passes);
- bytes into each node's object store (Ray's own counters: what crossed the network to
  the driver's node and to the trainer's), and into the rank processes (verl: each rank's
  deserialized chunk; routeplay: the rows each rank copied out, padding included);
- the largest routing any rank held at once (verl: the deserialized chunk; routeplay:
  the materializer's peak);
- the routing the driver held (verl: the padded batch; routeplay: the handles).

    PYTHONPATH=src .venv/bin/python benchmarks/verl_data_path.py [--samples 32]
        [--prompt 1024] [--response 3072] [--runs 5] [--json PATH]

Example:
    .venv/bin/python benchmarks/verl_data_path.py --samples 8 --runs 3
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import ray

from routeplay.bench import verl_path
from routeplay.bench.measure import cluster, on
from routeplay.core import Handle, Routes, preset
from routeplay.integrations.megatron import MegatronLayout
from routeplay.store import RoutesProducer, RouteStore, StoreConfig, producer_actor
from routeplay.store.accounting import node_store_stats
from routeplay.train import Materializer, pack_samples

RESULTS = Path(__file__).parent / "results"
SPEC = preset("qwen3-235b-a22b")
PASSES = 3


@dataclass(frozen=True)
class Layout:
    """The trainer's parallelism: DP x TP (sequence parallel) x PP rank actors."""

    dp: int
    tp: int
    pp: int

    def stages(self) -> tuple[int | None, int | None]:
        """Megatron's first/last stage layers when the decoder layers do not split evenly
        (the middle stages even, the first and last alike)."""
        layers = SPEC.decoder_layers
        if layers % self.pp == 0:
            return None, None
        for edge in range(layers // self.pp, 0, -1):
            if self.pp > 2 and (layers - 2 * edge) % (self.pp - 2) == 0:
                return edge, edge
        raise SystemExit(f"{layers} layers do not split over PP={self.pp}")


MICRO_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class Shape:
    samples: int
    prompt: int
    response: int

    def lengths(self, sample: int) -> tuple[int, int]:
        """(prompt tokens, response tokens) of a sample: random, within the padding."""
        rng = np.random.default_rng([7, sample])
        prompt = int(rng.integers(self.prompt // 2, self.prompt + 1))
        return prompt, int(rng.integers(self.response // 3, self.response + 1))

    def rows(self, sample: int) -> np.ndarray:
        prompt, response = self.lengths(sample)
        rng = np.random.default_rng(sample)
        block = np.argsort(rng.random((512, SPEC.num_experts)), axis=1)[:, : SPEC.top_k]
        picks = rng.integers(0, 512, size=(prompt + response - 1) * SPEC.num_layers)
        return block[picks].reshape(-1, SPEC.num_layers, SPEC.top_k).astype(SPEC.dtype)


class _Rollout(RoutesProducer):
    """One rollout worker holding the step's decoded routing (untimed: generation)."""

    def __init__(self, store: RouteStore, shape: Shape) -> None:
        self.store, self.shape = store, shape
        self.rows = [shape.rows(s) for s in range(shape.samples)]

    def verl_batch(self) -> Any:
        prompts = [self.shape.lengths(s)[0] for s in range(self.shape.samples)]
        parts = [
            verl_path.sample_batch(
                [rows],
                [str(s)],
                prompt_length=self.shape.prompt,
                response_length=self.shape.response,
                prompt_tokens=prompt,
            )
            for s, (rows, prompt) in enumerate(zip(self.rows, prompts, strict=True))
        ]
        return verl_path.concat(parts)

    def write(self) -> list[Handle]:
        batch = [Routes(array=rows, spec=SPEC) for rows in self.rows]  # validated when decoded
        return self.put_routes_many(self.store, batch)


Rollout: Any = producer_actor(_Rollout, num_cpus=0)


@ray.remote(num_cpus=0)
class Rank:
    """One trainer rank: DP ``dp``, TP ``tp`` (sequence parallel), PP stage ``pp``."""

    def __init__(self, store: RouteStore, layout: Layout, dp: int, tp: int, pp: int) -> None:
        self.store = store
        first, last = layout.stages()
        self.layout = MegatronLayout(
            dp_rank=0,  # the rank gets its own chunk: a plan of one DP rank
            tp_size=layout.tp,
            tp_rank=tp,
            sequence_parallel=True,
            pp_size=layout.pp,
            pp_rank=pp,
            num_layers=SPEC.decoder_layers,
            first_stage_layers=first,
            last_stage_layers=last,
            qkv_format="thd",
        )
        self.name = f"dp{dp}-tp{tp}-pp{pp}"

    def verl_pass(self, chunk: Any) -> tuple[int, int]:
        """The chunk arrived deserialized (every layer, int16, padded): the bytes it
        brought into this process, and the most routing held at once (the same)."""
        nbytes = int(verl_path.routed_experts(chunk).nbytes)
        return nbytes, nbytes

    def routeplay_pass(self, samples: list[tuple[str, Handle, int]]) -> tuple[int, int]:
        """This rank's rows of its stage's layers, micro-batch by micro-batch: the bytes
        copied into this process, and the most routing held at once."""
        align = self.layout.seq_align()
        plan = pack_samples(samples, MICRO_BATCH_TOKENS, feeds_last_token=True, seq_align=align)
        with Materializer.leasing(
            self.store,
            plan,
            self.layout.coords(),
            holder=f"train/{self.name}",
            layers=self.layout.moe_layers(SPEC),
        ) as materializer:
            for _ in materializer:
                pass
        self.store.flush()
        stats = materializer.stats()
        return stats.bytes_out, stats.peak_resident_bytes


def _created() -> dict[str, int]:
    roles = {"head", "rollout", "trainer", "engine"}
    out: dict[str, int] = {}
    for stats in node_store_stats().values():
        resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == stats.node_id), {})
        role = next((r for r in roles if r in resources), "head")
        out[role] = out.get(role, 0) + stats.created_bytes
    return out


def verl_step(rollout: Any, ranks: dict[tuple[int, int, int], Any], dp: int) -> dict[str, Any]:
    before, start = _created(), time.perf_counter()
    batch = ray.get(rollout.verl_batch.remote(), timeout=600)
    driver_bytes = int(verl_path.routed_experts(batch).nbytes)
    passes = []
    for _ in range(PASSES):
        refs = [ray.put(chunk) for chunk in verl_path.chunk(batch, dp)]
        pending = [r.verl_pass.remote(refs[dp]) for (dp, _, _), r in ranks.items()]
        passes += ray.get(pending, timeout=600)
        del refs
    elapsed = time.perf_counter() - start
    return _figures(elapsed, before, driver_bytes, passes)


def routeplay_step(
    store: RouteStore,
    rollout: Any,
    ranks: dict[tuple[int, int, int], Any],
    shape: Shape,
    dp: int,
) -> dict[str, Any]:
    before, start = _created(), time.perf_counter()
    handles: list[Handle] = ray.get(rollout.write.remote(), timeout=600)
    leases = store.acquire_many([(h, "train/step") for h in handles])  # the step's batch
    try:
        driver_bytes = len(pickle.dumps(handles))
        samples = [(str(s), h, sum(shape.lengths(s))) for s, h in enumerate(handles)]
        chunks = [samples[i::dp] for i in range(dp)]
        passes = []
        for _ in range(PASSES):
            pending = [r.routeplay_pass.remote(chunks[dp]) for (dp, _, _), r in ranks.items()]
            passes += ray.get(pending, timeout=600)
        elapsed = time.perf_counter() - start
    finally:
        store.release_many(leases)
        store.flush()
    return _figures(elapsed, before, driver_bytes, passes)


def _figures(
    elapsed: float, before: dict[str, int], driver_bytes: int, passes: list[tuple[int, int]]
) -> dict[str, Any]:
    after = _created()
    return {
        "ms": elapsed * 1e3,
        "bytes_into": {role: after[role] - before.get(role, 0) for role in after},
        "bytes_into_ranks": sum(into for into, _ in passes),
        "driver_routing_bytes": driver_bytes,
        "rank_peak_bytes": max(held for _, held in passes),
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    roles = runs[0]["bytes_into"]
    return {
        "median_ms": round(statistics.median(r["ms"] for r in runs), 1),
        "bytes_into": {k: int(statistics.median(r["bytes_into"][k] for r in runs)) for k in roles},
        "bytes_into_ranks": runs[0]["bytes_into_ranks"],
        "driver_routing_bytes": runs[0]["driver_routing_bytes"],
        "rank_peak_bytes": max(r["rank_peak_bytes"] for r in runs),
        "runs": len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=3072)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    shape = Shape(args.samples, args.prompt, args.response)
    layout = Layout(args.dp, args.tp, args.pp)
    rows = sum(shape.rows(s).shape[0] for s in range(shape.samples))
    with cluster(3 * 1024**3):
        store = StoreConfig(run="verl-data-path", resources=(("head", 0.01),)).build()
        rollout = Rollout.options(**on("rollout")).remote(store, shape)
        ranks = {
            (dp, tp, pp): Rank.options(**on("trainer")).remote(store, layout, dp, tp, pp)
            for dp in range(layout.dp)
            for tp in range(layout.tp)
            for pp in range(layout.pp)
        }
        ray.get([r.__ray_ready__.remote() for r in [rollout, *ranks.values()]], timeout=600)
        runs: dict[str, list[dict[str, Any]]] = {"verl": [], "routeplay": []}
        for _ in range(args.runs + 1):  # the first of each is a warm-up
            runs["verl"].append(verl_step(rollout, ranks, layout.dp))
            runs["routeplay"].append(routeplay_step(store, rollout, ranks, shape, layout.dp))
        store.shutdown()
    paths = {name: _median(found[1:]) for name, found in runs.items()}
    verl, ours = paths["verl"], paths["routeplay"]
    out = {
        "benchmark": "verl-data-path",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": f"{platform.node()} (local Cluster: head, rollout, trainer nodes)",
        "model": SPEC.describe(),
        "workload": {**vars(shape), "rows": rows, "canonical_bytes": SPEC.nbytes(rows)},
        "layout": {**vars(layout), "stages": layout.stages(), "passes": PASSES},
        "paths": paths,
        "verl_over_routeplay": {
            "step_time": round(verl["median_ms"] / ours["median_ms"], 2),
            "bytes_into_ranks": round(verl["bytes_into_ranks"] / ours["bytes_into_ranks"], 2),
            "bytes_into_trainer_node": round(
                verl["bytes_into"]["trainer"] / max(1, ours["bytes_into"]["trainer"]), 2
            ),
            "bytes_into_driver_node": round(
                verl["bytes_into"]["head"] / max(1, ours["bytes_into"]["head"]), 2
            ),
            "rank_peak": round(verl["rank_peak_bytes"] / ours["rank_peak_bytes"], 2),
            "driver_routing": round(verl["driver_routing_bytes"] / ours["driver_routing_bytes"]),
        },
    }
    print(json.dumps(out, indent=1))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    path = args.json or RESULTS / f"verl-data-path_vm_{stamp}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
