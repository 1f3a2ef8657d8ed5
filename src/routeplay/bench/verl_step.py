"""verl's R3 data path against routeplay's, on the same workload and the same nodes.

The workload (``VerlStepShape``) is verl's 235B example scaled down: Qwen3-235B geometry
(94 layers, top-8, 128 experts), prompts of random lengths left-padded to ``prompt``
tokens and responses padded to ``response``; the trainer is ``dp`` x ``tp`` x ``pp``
rank actors on the trainer node (``routeplay.bench.verl_roles``). A step is the batch
reaching the driver, then ``passes`` passes over it (old log-probs, reference, update),
as verl's trainer makes them:

- **verl** (verl's own ``DataProto``): the rollout worker returns the padded int16 batch
  to the driver; on every pass the driver chunks it per DP rank (``DataProto.chunk``)
  and puts each chunk, and each of the chunk's TP x PP ranks pulls and deserializes it
  whole, every layer included.
- **routeplay**: the rollout worker writes each sample once and returns handles; the
  driver holds the leases and sends each rank its chunk's handles (the same samples as
  verl's chunk); each rank reads, per pass, only its rows of its stage's layers
  (``Materializer.leasing(layers=layout.moe_layers(spec))``).

Reported per path, medians of ``runs`` steps: the step's time, bytes into each node's
object store (Ray's own counters: what crossed to the driver's node and the trainer's),
bytes into the rank processes, the largest routing a rank held at once, and the routing
the driver held. The first step of each path is checked and not counted: every rank
compares each row the materializer gave it with the same rows of verl's chunk, and every
row of every chunk must be compared once per pipeline stage. After every step nothing
may be left in the store (a leak fails the run, ``RuntimeError``).

Example:
    results = verl_steps(VerlStepShape(samples=8, runs=1), progress=print)
    results["verl_over_routeplay"]["bytes_into_trainer_node"]
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable
from typing import Any

import ray

from routeplay.bench import verl_path
from routeplay.bench.measure import ROLES, cluster, joined, kill_all, on
from routeplay.bench.verl_figures import Rank, RankPass, check_rows, ranks_of, ratios, summary
from routeplay.bench.verl_roles import VerlRank, VerlRollout
from routeplay.bench.workloads import VerlStepShape
from routeplay.core import Handle
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.accounting import node_store_stats

__all__ = ["PATHS", "check_nothing_left", "verl_point", "verl_steps"]

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

PATHS = ("verl", "routeplay")


def verl_steps(
    shape: VerlStepShape, *, address: str | None = None, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Both paths at ``shape``, on a local cluster of its own (``shape.store_bytes`` per
    node) or on the cluster at ``address`` (a node per role)."""
    nodes = cluster(shape.store_bytes) if address is None else joined(address)
    with nodes as roles:
        store = StoreConfig(run="bench-verl", resources=(("head", 0.01),), timeout_s=120).build()
        try:
            progress(f"verl data path x{shape.samples}, DP{shape.dp} TP{shape.tp} PP{shape.pp}")
            point = verl_point(store, shape, roles)
            end = store.stats()
        finally:
            store.shutdown()
    return {**point, "store_end": {"live_payloads": end.live_payloads, "leases": end.leases}}


def verl_point(
    store: RouteStore,
    shape: VerlStepShape,
    roles: dict[str, str],
    *,
    place: Callable[[str], dict[str, Any]] = on,
) -> dict[str, Any]:
    """A checked step per path, then ``shape.runs`` rounds of both (the first path
    alternating). ``roles`` maps node ids to roles (a node it lacks counts as the
    driver's); ``place`` gives each role's actor options (default: on its role's node).

    Example:
        point = verl_point(store, VerlStepShape(samples=8, runs=1), node_roles())
        point["paths"]["verl"]["bytes_into_ranks"]
    """
    bench = _VerlBench(store, shape, roles, place)
    try:
        bench.run("verl", check=True)
        checked = bench.run("routeplay", check=True)
        timed: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
        for round_ in range(shape.runs):
            for path in PATHS if round_ % 2 == 0 else PATHS[::-1]:
                timed[path].append(bench.run(path))
    finally:
        bench.close()
    paths = {path: summary(runs) for path, runs in timed.items()}
    return {
        "shape": dataclasses.asdict(shape),
        "model": shape.spec.describe(),
        "verl_batch": verl_path.kind(),
        "stages": list(shape.stage_layers()),
        "paths": paths,
        "verl_over_routeplay": ratios(paths),
        "rows_checked": checked["rows_checked"],
        "rows_identical_across_paths": True,
    }


class _VerlBench:
    """The step's actors and its two paths."""

    def __init__(
        self,
        store: RouteStore,
        shape: VerlStepShape,
        roles: dict[str, str],
        place: Callable[[str], dict[str, Any]],
    ) -> None:
        self.store, self.shape, self.roles = store, shape, roles
        self.rollout = VerlRollout.options(**place("rollout")).remote(store, shape)
        self.ranks: dict[Rank, Any] = {
            rank: VerlRank.options(**place("trainer")).remote(store, shape, *rank)
            for rank in ranks_of(shape)
        }
        actors = [self.rollout, *self.ranks.values()]
        ray.get([actor.__ray_ready__.remote() for actor in actors], timeout=_DEADLINE_S)

    def run(self, path: str, *, check: bool = False) -> dict[str, Any]:
        """One step through ``path``: its figures (a checked routeplay step: and the rows
        its ranks compared with verl's)."""
        before, start = self._created(), time.perf_counter()
        step = self._verl if path == "verl" else self._routeplay
        driver_bytes, passes = step(check)
        elapsed = time.perf_counter() - start
        after = self._created()
        check_nothing_left(self.store, path)
        flat = [result for results in passes for result in results.values()]
        figures = {
            "ms": elapsed * 1e3,
            "bytes_into": {role: after[role] - before[role] for role in ROLES},
            "bytes_into_ranks": sum(result.bytes_in for result in flat),
            "driver_routing_bytes": driver_bytes,
            "rank_peak_bytes": max(result.peak for result in flat),
        }
        if check and path == "routeplay":
            figures["rows_checked"] = check_rows(passes[0], self.shape)
        return figures

    def _verl(self, check: bool) -> tuple[int, list[dict[Rank, RankPass]]]:
        batch = ray.get(self.rollout.verl_batch.remote(), timeout=_DEADLINE_S)
        driver_bytes = int(verl_path.routed_experts(batch).nbytes)
        passes = []
        for index in range(self.shape.passes):
            refs = [ray.put(chunk) for chunk in verl_path.chunk(batch, self.shape.dp)]
            keep = check and index == 0  # the ranks keep the rows to compare with
            pending = {r: rank.verl_pass.remote(refs[r[0]], keep) for r, rank in self.ranks.items()}
            passes.append(_gathered(pending))
            del refs
        return driver_bytes, passes

    def _routeplay(self, check: bool) -> tuple[int, list[dict[Rank, RankPass]]]:
        handles: list[Handle] = ray.get(self.rollout.write.remote(), timeout=_DEADLINE_S)
        leases = self.store.acquire_many([(h, "train/step") for h in handles])  # the batch
        try:
            driver_bytes = len(pickle.dumps(handles))
            samples = [(str(s), h, sum(self.shape.lengths(s))) for s, h in enumerate(handles)]
            per = len(samples) // self.shape.dp  # verl's chunks: consecutive samples
            chunks = [samples[d * per : (d + 1) * per] for d in range(self.shape.dp)]
            passes = []
            for index in range(self.shape.passes):
                keep = check and index == 0
                pending = {
                    r: rank.routeplay_pass.remote(chunks[r[0]], keep)
                    for r, rank in self.ranks.items()
                }
                passes.append(_gathered(pending))
        finally:
            self.store.release_many(leases)
            self.store.flush()
        return driver_bytes, passes

    def _created(self) -> dict[str, int]:
        """Bytes created in each role's object store so far (Ray's counters)."""
        out = dict.fromkeys(ROLES, 0)
        for node, stats in node_store_stats().items():
            role = self.roles.get(node, "head")
            out[role] += stats.created_bytes
        return out

    def close(self) -> None:
        kill_all([self.rollout, *self.ranks.values()])


def check_nothing_left(store: RouteStore, path: str) -> None:
    """Fail the run (``RuntimeError``) on a lease or payload a step left in the store.

    Example:
        check_nothing_left(store, "routeplay")  # after the step's last release
    """
    stats = store.stats()
    if stats.leases or stats.live_payloads:
        holders = sorted({leak.holder for leak in store.leaks()})[:5]
        raise RuntimeError(
            f"verl data path ({path}) leaked: {stats.leases} leases "
            f"({', '.join(holders)}), {stats.live_payloads} payloads"
        )


def _gathered(pending: dict[Rank, Any]) -> dict[Rank, RankPass]:
    """Each rank's pass, waited for together."""
    results = ray.get(list(pending.values()), timeout=_DEADLINE_S)
    return dict(zip(pending, results, strict=True))
