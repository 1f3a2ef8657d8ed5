"""Running the data-path benchmark on a local 3-node ``ray.cluster_utils.Cluster``.

Nodes: a head (the store shards and the driver), the engine's node (the engine and
LMDeploy's ``shared_store``), the rollout node and the trainer node (the SP ranks). Every
figure of a workload comes from the same cluster in the same run: the three paths, the
physical limit (``routeplay.bench.limit``: the best pull of the workload's own bytes from
the node each path's payloads live on, plus the SP ranks' copies, or the best run of the
path's Ray floor where that was faster), and Ray's own byte counters.

Example:
    results = run_bench(BenchConfig.quick())
    results["workloads"][0]["eager_ms"] / results["workloads"][0]["routeplay_ms"]
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from routeplay.bench.host_cpu import busy_core_ms, cores
from routeplay.bench.limit import FloorRun, Probes, beaten, tightened
from routeplay.bench.roles import (
    Adoption,
    BenchEngine,
    BenchRank,
    BenchRollout,
    RankRead,
    sample_routing,
)
from routeplay.bench.sessions import session_bytes
from routeplay.bench.workloads import BenchConfig, Workload
from routeplay.core import Handle, canonicalize, preset
from routeplay.errors import MisuseError
from routeplay.store import RouteStore, StoreConfig, start_engine_store
from routeplay.store.engine.service import LMDEPLOY_NAME, LMDEPLOY_NAMESPACE
from routeplay.store.remote.accounting import node_store_stats

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

__all__ = ["PATHS", "adoption_summary", "phases_ms", "run_bench"]

ROLES = ("head", "engine", "rollout", "trainer")
PATHS = ("eager", "producer", "adopt")


def prepared_at_ingest(engine_store: Any) -> int:
    """Payloads the engine store has started validating at ingest so far (its
    ``stats().prepared``).

    Example:
        before = prepared_at_ingest(engine_store)
    """
    return int(ray.get(engine_store.stats.remote(), timeout=_DEADLINE_S).prepared)


def node_roles() -> dict[str, str]:
    """Node id -> role of the connected cluster (each node carries its role's resource).

    Raises ``MisuseError`` when a role has no node."""
    list_nodes: Any = ray.nodes  # untyped in Ray
    roles = {
        n["NodeID"]: next((r for r in ROLES if r in n["Resources"]), "")
        for n in list_nodes()
        if n["Alive"]
    }
    missing = [role for role in ROLES if role not in roles.values()]
    if missing:
        raise MisuseError(
            "the bench needs one node per role, each with its role as a resource",
            expected=f"nodes with the resources {ROLES}",
            found=f"no node for {missing}",
            hint="start the nodes with e.g. `ray start --resources '{\"engine\": 1}'`",
        )
    return {node: role for node, role in roles.items() if role}


@contextmanager
def joined(address: str) -> Iterator[dict[str, str]]:
    """An existing cluster whose nodes carry the roles (the driver's connection is kept
    when it is already connected); yields node id -> role."""
    if ray.is_initialized():
        yield node_roles()
        return
    ray.init(address=address, log_to_driver=False)
    try:
        yield node_roles()
    finally:
        ray.shutdown()


@contextmanager
def cluster(store_bytes: int) -> Iterator[dict[str, str]]:
    """Head + engine + rollout + trainer nodes on this machine; yields node id -> role."""
    nodes: Any = Cluster(  # untyped in Ray
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 1},
            "object_store_memory": store_bytes,
            # No dashboard: the bench reads the raylets' own counters, and the dashboard's
            # periodic work would only add noise to the timed runs (and CPU to the start).
            "include_dashboard": False,
            # Raylets free out-of-scope objects in batches, every second by default: the
            # multi-turn figures read Ray's settled bytes in use several times a workload.
            "_system_config": {"free_objects_period_milliseconds": 100},
        },
    )
    try:
        for role in ROLES[1:]:
            nodes.add_node(num_cpus=1, resources={role: 1}, object_store_memory=store_bytes)
        ray.init(address=nodes.address, log_to_driver=False)
        yield node_roles()
    finally:
        ray.shutdown()
        nodes.shutdown()


def on(role: str) -> dict[str, Any]:
    return {"resources": {role: 0.01}}


class Bench:
    """One workload's actors and timed runs."""

    def __init__(self, store: RouteStore, workload: Workload, roles: dict[str, str]) -> None:
        self.w = workload
        self.roles = roles
        spec = workload.spec
        self.engine = BenchEngine.options(**on("engine")).remote(spec)
        self.rollout = BenchRollout.options(**on("rollout")).remote(store, spec)
        self.ranks = [
            BenchRank.options(**on("trainer")).remote(store, spec, r, workload.sp)
            for r in range(workload.sp)
        ]
        self.engine_store = ray.get_actor(LMDEPLOY_NAME, namespace=LMDEPLOY_NAMESPACE)

    def run(
        self, path: str, seed: int, *, check: bool = False, ingest: bool = True
    ) -> dict[str, Any]:
        """One step through ``path``: engine done -> every rank holds its rows.

        The adopted-key path adopts first, apart from the step, as an RL loop adopts
        each sample when it completes, long before the trainer's step: right after the
        engine has put the step's keys, the rollout worker adopts the samples one after
        another (``adopt_each``; a GRPO group in one call), each call timed on its clock
        (``adoption_ms``, one figure per sample adopted). Its step is then the hop that
        hands the adopted handles on and every rank's acquire and read. The engine store
        validates each payload as the engine puts it (``routeplay.store.engine.ingest``; an
        adoption waits for a validation still running), unless ``ingest`` is False: then
        each payload is validated near the engine when adopted, and waited for."""
        # A GRPO group's layout is made at adoption from its members' raw rows.
        at_ingest = path == "adopt" and ingest and not self.w.prompt_tokens
        with self._validating_at_ingest(at_ingest):
            prepared, before_engine = prepared_at_ingest(self.engine_store), self._created()
            plan = self.w.sample_plan(seed)
            if path == "producer":
                ray.get(self.rollout.decode.remote(plan), timeout=_DEADLINE_S)
                keys: list[str] = []
            else:
                keys = ray.get(self.engine.keys.remote(plan), timeout=_DEADLINE_S)
            # The path's bytes count from before its first write: validated at ingest, the
            # engine's puts (less the engine's own payloads), else the adoption.
            before = before_engine if at_ingest else self._created()
            adoptions: list[Adoption] = []
            if path == "adopt":
                rows, prompt = [p[0] for p in plan], self.w.prompt_tokens
                adopting = self.rollout.adopt_each.remote(keys, rows, prompt)
                adoptions = ray.get(adopting, timeout=_DEADLINE_S)
            cpu_start = busy_core_ms()
            start = time.perf_counter()
            out = self._step(path, seed, keys, check)
            elapsed = time.perf_counter() - start
            core_ms = busy_core_ms() - cpu_start
            created = {role: n - before[role] for role, n in self._created().items()}
            if at_ingest:
                created["engine"] -= self.w.samples * self.w.raw_bytes
            prepared = prepared_at_ingest(self.engine_store) - prepared
        ray.get(self.rollout.drop.remote(), timeout=_DEADLINE_S)
        ray.get([rank.flush.remote() for rank in self.ranks], timeout=_DEADLINE_S)
        figures: dict[str, Any] = {
            "ms": elapsed * 1e3,
            "core_ms": core_ms,
            "bytes_written": sum(n for role, n in created.items() if role != "trainer"),
            "validated_at_ingest": prepared,
            "bytes_pulled": created["trainer"],
            "created_by_node": created,
            "peak_rank_bytes": max(rank.peak_bytes for rank in out),
            "digests": [rank.digest for rank in out],
            "phases_ms": phases_ms(elapsed, out),
        }
        if path == "adopt":  # each member of a group is adopted when its group's call returns
            figures["adoption_ms"] = [a.ms for a in adoptions for _ in range(a.samples)]
            figures["adoption_calls"] = len(adoptions)
        return figures

    def _step(self, path: str, seed: int, keys: list[str], check: bool) -> list[RankRead]:
        """The timed part: the rollout worker's hop (the eager relay, the producer's
        write, or handing on the handles it adopted before the step), then every rank's
        read. The hop's result goes to the ranks as a reference (Ray sends it on as it is
        made), as a trainer's controller would pass it, rather than through a
        ``ray.get`` here."""
        if path == "eager":
            relayed = self.rollout.eager.remote(keys)
            reads = [rank.read_eager.remote(relayed, check) for rank in self.ranks]
            return list(ray.get(reads, timeout=_DEADLINE_S))
        if path == "producer":
            hop = self.rollout.produce.remote(self.w.prompt_tokens)
        else:
            hop = self.rollout.adopted.remote()
        holder = f"train/{path}/{seed}"
        reads = [rank.read_routeplay.remote(hop, holder, check) for rank in self.ranks]
        return list(ray.get(reads, timeout=_DEADLINE_S))

    @contextmanager
    def _validating_at_ingest(self, on: bool) -> Iterator[None]:
        """The engine store validates payloads at ingest (``on``) for this block only:
        the other paths, and a run that failed, leave it off."""
        spec = self.w.spec if on else None
        ray.get(self.engine_store.validate_as.remote(spec), timeout=_DEADLINE_S)
        try:
            yield
        finally:
            ray.get(self.engine_store.validate_as.remote(None), timeout=_DEADLINE_S)

    def _created(self) -> dict[str, int]:
        return {self.roles[n]: s.created_bytes for n, s in node_store_stats().items()}


def phases_ms(elapsed_s: float, reads: list[RankRead]) -> dict[str, float]:
    """Where one step's time went (ms), as its slowest rank (the longest acquire + read)
    saw it: its ``acquire`` and its ``read``, and ``outside_ranks``, the rest of the
    step: the rollout worker's hop (the producer's write, or handing on the handles
    adopted before the step), sending the calls to the ranks and their answers back.
    The three add up to the step. (Another rank can wait longer for its grant: its pull
    joins the one already under way.)

    Example:
        phases_ms(0.25, [RankRead(0, "", 0.012, 0.19), RankRead(0, "", 0.005, 0.2)])
        # {'outside_ranks': 45.0, 'acquire': 5.0, 'read': 200.0}
    """
    slowest = max(reads, key=lambda rank: rank.acquire_s + rank.read_s)
    return {
        "outside_ranks": round(1e3 * (elapsed_s - slowest.acquire_s - slowest.read_s), 1),
        "acquire": round(1e3 * slowest.acquire_s, 1),
        "read": round(1e3 * slowest.read_s, 1),
    }


def adoption_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The adoption as the rollout saw it, over every sample adopted in ``runs`` (ms, on
    its clock): ``p50``, ``p99`` (linear between the nearest samples), ``samples``
    (samples adopted) and ``calls`` (adoption calls: one per sample, one per GRPO group).

    Example:
        adoption_summary([{"adoption_ms": [2.0, 4.0], "adoption_calls": 2}])
        # {'p50': 3.0, 'p99': 3.98, 'samples': 2, 'calls': 2}
    """
    latencies = [ms for run in runs for ms in run["adoption_ms"]]
    p50, p99 = np.percentile(latencies, [50, 99])
    return {
        "p50": round(float(p50), 2),
        "p99": round(float(p99), 2),
        "samples": len(latencies),
        "calls": sum(run["adoption_calls"] for run in runs),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    times = [r["ms"] for r in runs]
    last = runs[-1]
    adoption = {"adoption_ms": adoption_summary(runs)} if "adoption_ms" in last else {}
    return {
        "median_ms": round(statistics.median(times), 1),
        "min_ms": round(min(times), 1),
        "max_ms": round(max(times), 1),
        "runs": len(times),
        "core_ms": round(statistics.median(r["core_ms"] for r in runs)),
        "bytes_written": int(statistics.median(r["bytes_written"] for r in runs)),
        "bytes_pulled": int(statistics.median(r["bytes_pulled"] for r in runs)),
        "validated_at_ingest": max(r["validated_at_ingest"] for r in runs),
        "created_by_node": last["created_by_node"],
        "peak_rank_bytes": max(r["peak_rank_bytes"] for r in runs),
        "phases_ms": {
            phase: round(statistics.median(r["phases_ms"][phase] for r in runs), 1)
            for phase in runs[0]["phases_ms"]
        },
        **adoption,
    }


LIMIT_RUNS = 5
"""Measurements of each part of a limit, the best kept (at least this many)."""


def measure_workload(
    store: RouteStore,
    w: Workload,
    roles: dict[str, str],
    runs: int,
    probes: Probes,
    pairs: int = 0,
) -> dict[str, Any]:
    """Every path of one workload, its limit, and a check that all paths agree; the
    producer and adopt paths run ``max(runs, pairs)`` times, each run next to a run of
    Ray's own floor for its objects. The adopted-key paths' adoptions, made before their
    steps, are summed up per path over the timed runs (``adoption_ms``, the checked run
    left out); ``adoption_p50_ms`` / ``adoption_p99_ms`` are the adopt path's.
    ``adopt_at_step`` (a name kept from when that validation ran on the step) is the
    adopted-key path with each payload validated at adoption.

    Order: the routeplay paths, the limit, then the eager path. The eager path leaves
    gigabytes for Ray and its ranks to free (its int64 copies, its relayed objects),
    work that would otherwise run during the next path's runs (tried in rounds with the
    others on the headline workload: Ray's own floor went from about 350 to 470 ms)."""
    bench = Bench(store, w, roles)
    digests = {
        "producer": bench.run("producer", seed=1, check=True)["digests"],
        "adopt": bench.run("adopt", seed=1, check=True)["digests"],
        "adopt_at_step": bench.run("adopt", seed=1, check=True, ingest=False)["digests"],
    }
    timed = {"adopt_at_step": [bench.run("adopt", seed=2 + i, ingest=False) for i in range(runs)]}
    with probes.bare_ray_fetch(w) as fetch_run:
        timed["adopt"], fetch_floors = _paired(bench, "adopt", fetch_run, max(runs, pairs))
    with probes.bare_ray(w) as bare_run:
        timed["producer"], floors = _paired(bench, "producer", bare_run, max(runs, pairs))
    bare, bare_fetch = [f.ms for f in floors], [f.ms for f in fetch_floors]
    probed = probes.workload_limit(w, runs=max(LIMIT_RUNS, runs))
    limit = tightened(probed, {"producer": bare, "adopt": bare_fetch})
    digests["eager"] = bench.run("eager", seed=1, check=True)["digests"]
    timed["eager"] = [bench.run("eager", seed=2 + i) for i in range(runs)]
    if len({tuple(d) for d in digests.values()}) != 1:
        raise RuntimeError(f"{w.name}: the paths delivered different rows: {digests}")
    per_path = {path: summarize(path_runs) for path, path_runs in timed.items()}
    producer = timed["producer"]
    entry: dict[str, Any] = {
        "name": w.name,
        "model": w.model,
        "tokens": w.tokens,
        "samples": w.samples,
        "sp": w.sp,
        "shared_prompt": w.prompt_tokens,
        "payload_bytes": w.payload_bytes,
        "unique_bytes": w.unique_bytes,
        "eager_ms": per_path["eager"]["median_ms"],
        "routeplay_ms": per_path["producer"]["median_ms"],
        "adopt_ms": per_path["adopt"]["median_ms"],
        "adopt_at_step_ms": per_path["adopt_at_step"]["median_ms"],
        "adoption_p50_ms": per_path["adopt"]["adoption_ms"]["p50"],
        "adoption_p99_ms": per_path["adopt"]["adoption_ms"]["p99"],
        "limit_ms": limit["limit_ms"],
        "limit": limit,
        "bare_ray_ms": round(statistics.median(bare), 1),
        "bare_ray_runs": len(bare),
        "producer_beyond_bare_ray_ms": _median_difference(producer, bare),
        "bare_ray_fetch_ms": round(statistics.median(bare_fetch), 1),
        "adopt_beyond_bare_ray_fetch_ms": _median_difference(timed["adopt"], bare_fetch),
        "bare_ray_fetch_rank_ms": round(statistics.median(f.rank_ms for f in fetch_floors), 1),
        "adopt_read_beyond_bare_ray_fetch_ms": _median_difference(
            timed["adopt"], [f.rank_ms for f in fetch_floors], phase="read"
        ),
        "producer_minus_bare_ray_medians_ms": round(
            per_path["producer"]["median_ms"] - statistics.median(bare), 1
        ),
        "below_limit": beaten({p: per_path[p]["median_ms"] for p in ("producer", "adopt")}, limit),
        "bytes_written": {p: per_path[p]["bytes_written"] for p in PATHS},
        "bytes_pulled": {p: per_path[p]["bytes_pulled"] for p in PATHS},
        "peak_rank_bytes": {p: per_path[p]["peak_rank_bytes"] for p in PATHS},
        "rows_identical_across_paths": True,
    }
    entry.update(per_path)
    kill_all([bench.engine, bench.rollout, *bench.ranks])
    return entry


def _paired(
    bench: Bench, path: str, floor_run: Callable[[], FloorRun], runs: int
) -> tuple[list[dict[str, Any]], list[FloorRun]]:
    """``path``'s timed runs, each next to a run of Ray's own floor for the same objects
    (``Probes.bare_ray`` / ``bare_ray_fetch``): pairs taken at the same moment of the
    machine, which goes first alternating (what one run leaves behind, e.g. objects Ray
    is still freeing, falls on either side alike)."""
    timed, floors = [], []
    for i in range(runs):
        if i % 2:
            floors.append(floor_run())
        timed.append(bench.run(path, seed=2 + i))
        if not i % 2:
            floors.append(floor_run())
    return timed, floors


def _median_difference(
    runs: list[dict[str, Any]], floors: list[float], *, phase: str = ""
) -> float:
    """Median of the pairs' differences: each run's time (or its ``phase``) less the
    floor run timed next to it."""

    def timed(run: dict[str, Any]) -> float:
        return float(run["phases_ms"][phase] if phase else run["ms"])

    pairs = zip(runs, floors, strict=True)
    return round(statistics.median(timed(run) - floor for run, floor in pairs), 1)


def kill_all(actors: list[Any]) -> None:
    for actor in actors:
        ray.kill(actor)


# -- scaling --------------------------------------------------------------------------------
def scaling(
    store: RouteStore, config: BenchConfig, roles: dict[str, str], probes: Probes
) -> dict[str, Any]:
    """Tokens per sample and samples per step (all paths), segments per handle."""
    tokens = [
        _point(
            store,
            Workload(model="qwen3-235b-a22b", tokens=t, samples=2, sp=1),
            roles,
            config,
            probes,
        )
        for t in config.scale_tokens
    ]
    samples = [
        _point(
            store,
            Workload(model="qwen3-30b-a3b", tokens=8192, samples=n, sp=1),
            roles,
            config,
            probes,
        )
        for n in config.scale_samples
    ]
    segments = [segment_overhead(store, n, config.scale_runs) for n in config.scale_segments]
    return {
        "tokens_per_sample": tokens,
        "samples_per_step": samples,
        "segments_per_handle": segments,
    }


def _point(
    store: RouteStore,
    w: Workload,
    roles: dict[str, str],
    config: BenchConfig,
    probes: Probes,
) -> dict[str, Any]:
    bench = Bench(store, w, roles)
    out: dict[str, Any] = {"name": w.name, "tokens": w.tokens, "samples": w.samples}
    for path in PATHS:
        bench.run(path, seed=1)  # warm-up
        out[f"{path}_ms"] = summarize(
            [bench.run(path, seed=2 + i) for i in range(config.scale_runs)]
        )["median_ms"]
    limit = probes.workload_limit(w, runs=max(LIMIT_RUNS, config.scale_runs))
    out["limit_ms"] = limit["limit_ms"]
    out["limit"] = limit
    out["below_limit"] = beaten({p: out[f"{p}_ms"] for p in ("producer", "adopt")}, limit)
    kill_all([bench.engine, bench.rollout, *bench.ranks])
    return out


def segment_overhead(store: RouteStore, segments: int, runs: int) -> dict[str, Any]:
    """Acquire + read of a handle of ``segments`` segments (32k rows of Qwen3-30B in all,
    one payload per segment), minus a warm copy of the same bytes. Measured on the Ray
    store (Ray's per-object cost included), on the in-process store (the same plain
    classes: routeplay's own per-segment metadata cost), and against Ray's floor for the
    same number of objects in the same run (``ray_floor_ms``: an actor hands the
    references out, one ``ray.get`` fetches them all, the views are dropped). Then the
    same handle compacted (``routeplay.store.client.compaction``): what compacting costs
    (``compact_ms``: read every row once, write one payload, lease it) and what the
    compacted handle costs to acquire and read (``compacted_*``)."""
    spec = preset("qwen3-30b-a3b")
    rows = 32768
    full = canonicalize(sample_routing(spec, rows, seed=7), spec).array
    bounds = np.linspace(0, rows, segments + 1).astype(int)
    parts = [canonicalize(full[a:b], spec) for a, b in itertools.pairwise(bounds)]
    out = np.empty_like(full)
    np.copyto(out, full)
    copies = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        np.copyto(out, full)
        copies.append(time.perf_counter() - start)
    copy = statistics.median(copies[1:])
    figures: dict[str, Any] = {"segments": segments, "copy_ms": round(copy * 1e3, 2)}
    local = RouteStore.local(StoreConfig(run="bench-segments"))
    for prefix, where in (("", store), ("local_", local)):
        # Separate puts, as the turns of a long session are: one payload per segment.
        handle = Handle.concat(spec, [where.put(part) for part in parts])
        assert len(handle.segments) == len(parts)  # one payload each: nothing merges
        with _kept(where, handle):
            acquire, read = _acquire_read_s(where, handle, out, runs)
            if not prefix:
                figures.update(_compacted(where, handle, out, runs, copy))
        figures[f"{prefix}acquire_ms"] = round(acquire * 1e3, 2)
        figures[f"{prefix}read_ms"] = round(read * 1e3, 2)
        figures[f"{prefix}acquire_read_ms"] = round((acquire + read) * 1e3, 2)
        figures[f"{prefix}overhead_ms"] = round((acquire + read - copy) * 1e3, 2)
    floor = _ray_floor_s([part.array for part in parts], runs, dict(store.config.resources))
    figures["ray_floor_ms"] = round(floor * 1e3, 2)
    figures["overhead_beyond_ray_floor_ms"] = round(figures["overhead_ms"] - floor * 1e3, 2)
    return figures


@contextmanager
def _kept(where: RouteStore, handle: Handle) -> Iterator[None]:
    """The payloads outlive each timed lease through another client's lease; its pins
    do not serve the timed reader, whose grant carries every block reference (as a
    trainer rank's does)."""
    keep = RouteStore(where.config, where.backend).acquire(handle, "bench/keep")
    try:
        yield
    finally:
        keep.release()
        where.flush()


def _acquire_read_s(
    where: RouteStore, handle: Handle, out: np.ndarray, runs: int
) -> tuple[float, float]:
    """Median seconds of a cold acquire and of the read of every row through it."""
    acquires, reads = [], []
    for _ in range(runs + 1):
        start = time.perf_counter()
        lease = where.acquire(handle, "bench/segments")
        acquired = time.perf_counter()
        where.read_many([(handle, 0, handle.rows)], out=[out])
        reads.append(time.perf_counter() - acquired)
        acquires.append(acquired - start)
        lease.release()
    where.flush()
    return statistics.median(acquires[1:]), statistics.median(reads[1:])


def _compacted(
    where: RouteStore, handle: Handle, out: np.ndarray, runs: int, copy: float
) -> dict[str, Any]:
    """Compact ``handle`` (as its holder would: the old payloads stay held), timed per
    run; then the acquire + read of the compacted handle, as ``_acquire_read_s``."""
    times, compacted = [], handle
    for run in range(runs + 1):
        start = time.perf_counter()
        done = where.compact([handle], "bench/compacted")
        times.append(time.perf_counter() - start)
        [compacted], [lease] = done.handles, done.leases
        if lease is not None and run < runs:
            lease.release()  # a fresh payload each run; the last one is measured below
    with _kept(where, compacted):
        if lease is not None:
            lease.release()
        acquire, read = _acquire_read_s(where, compacted, out, runs)
    return {
        "compact_ms": round(statistics.median(times[1:]) * 1e3, 2),
        "compacted_segments": len(compacted.segments),
        "compacted_acquire_read_ms": round((acquire + read) * 1e3, 2),
        "compacted_overhead_ms": round((acquire + read - copy) * 1e3, 2),
    }


@ray.remote(num_cpus=0)
class _RefHolder:
    """Holds object references and hands them out (what a shard's grant carries)."""

    def hold(self, refs: list[Any]) -> int:
        self._refs = refs
        return len(refs)

    def give(self) -> list[Any]:
        return self._refs


def _ray_floor_s(arrays: list[np.ndarray], runs: int, resources: dict[str, float]) -> float:
    """Median seconds Ray itself takes for ``len(arrays)`` objects: an actor placed like
    the store shards returns their references, one ``ray.get`` fetches every value, and
    the zero-copy views are dropped (as a read drops them)."""
    refs = [ray.put(array) for array in arrays]
    holder_class: Any = _RefHolder
    holder = holder_class.options(resources=resources).remote()
    ray.get(holder.hold.remote(refs), timeout=_DEADLINE_S)
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        given = ray.get(holder.give.remote(), timeout=_DEADLINE_S)
        values = ray.get(given, timeout=_DEADLINE_S)
        del values, given
        times.append(time.perf_counter() - start)
    kill_all([holder])
    return statistics.median(times[1:])


# -- many small samples ---------------------------------------------------------------------
def small_puts(store: RouteStore, count: int) -> dict[str, Any]:
    """Puts per second of ``count`` 1k-token Qwen3-30B samples: ``ray.put`` vs ``put_many``."""
    spec = preset("qwen3-30b-a3b")
    batch = [canonicalize(sample_routing(spec, 1023, seed=i), spec) for i in range(count)]
    start = time.perf_counter()
    refs = [ray.put(routes.array) for routes in batch]
    plain = time.perf_counter() - start
    del refs
    start = time.perf_counter()
    handles = store.put_many(batch)
    batched = time.perf_counter() - start
    leases = store.acquire_many([(h, "bench/small") for h in handles])
    store.release_many(leases)
    store.flush()
    return {
        "samples": count,
        "sample_bytes": batch[0].nbytes,
        "ray_put_per_s": round(count / plain, 1),
        "put_many_per_s": round(count / batched, 1),
        "ratio": round(plain / batched, 2),
    }


def run_bench(
    config: BenchConfig, *, address: str | None = None, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """The whole benchmark; returns the results object (see ``routeplay.bench.report``).

    On a local cluster of its own, or on the cluster at ``address`` (its nodes carry the
    resources ``head``, ``engine``, ``rollout``, ``trainer``: one node each)."""
    nodes = cluster(config.store_bytes) if address is None else joined(address)
    with nodes as roles:
        store = StoreConfig(run="bench", resources=(("head", 0.01),), timeout_s=120).build()
        start_engine_store(resources={"engine": 0.01})
        probes = Probes()
        workloads = []
        for w in config.workloads:
            progress(f"workload {w.name}")
            workloads.append(
                measure_workload(store, w, roles, config.runs, probes, config.pair_runs)
            )
        progress("scaling")
        scale = scaling(store, config, roles, probes)
        probes.close()
        sessions = session_bytes(store, config.sessions, progress=progress)
        small = small_puts(store, config.small_samples)
        stats = store.stats()
        store.shutdown()
    return {
        "workloads": workloads,
        "scaling": scale,
        "sessions": sessions,
        "small_puts": small,
        "host_cores": cores(),
        "store_end": {"live_payloads": stats.live_payloads, "leases": stats.leases},
    }
