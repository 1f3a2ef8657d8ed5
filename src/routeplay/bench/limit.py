"""The physical limit of a workload: a lower bound no path can beat, measured per run.

A path's step (engine done -> every SP rank holds its rows) must at least move the
step's cross-node bytes from the node where the path's payloads live to the trainer
node, and each SP rank must copy its rows out. The limit is the best (fastest) of
``runs`` measurements of exactly that, on the workload's own bytes and node pairs:

- **pull**: the trainer node fetches, in one ``ray.get``, fresh objects of the sizes the
  path stores (one per sample; a GRPO group's shared prompt once), from the node the
  path's payloads live on: the rollout node for the producer path (its worker's blocks),
  the engine node for the adopted-key path (validated next to LMDeploy's store);
- **copy**: the workload's SP ranks on the trainer node copy their share of the step's
  canonical bytes from warm memory into warm buffers, at once; each rank times its own
  copy and the slowest rank counts (ranks that did not overlap only lower the figure).

``limit = best pull + best copy``. The best of each part errs low, so the limit is a
lower bound, and a path whose median beats it means the measurement is wrong: ``beaten``
names such paths, and the bench says so and fails instead of printing a ratio below 1.
Where a workload also times Ray's own floor for a path (below; the scaling points time
none, so theirs stay the probe's), the limit is
``tightened`` to the floor's best run if that was faster: a floor run moves the same
bytes between the same nodes and makes the same copies, so the physical limit is at most
its time, and the probe, timed at one moment of a drifting machine, can stand above it
(a full run saw the adopt path's floor at a median of 0.95x a probe-only limit).
(Adding the parts assumes no rank copies while another rank's bytes still cross; a path
that overlapped them perfectly could gain at most the copy, a few per cent of the pull
at 1 GB/s pulls and 10 GB/s copies: far below what any path's own calls cost.)

Next to the limit, for the reader: the machine's busy core-ms during the best pull
(``pull_core_ms``: what Ray's transfer costs in CPU, ``routeplay.bench.host_cpu``), the
best time of one core validating the step's engine payloads on the engine node
(``validate_ms``: the CPU the adopted-key path spends that the producer path does not),
and Ray's own floor for each path's objects: ``bare_ray`` for the producer path (the
same objects put by an actor on the rollout node and fetched and copied by the SP ranks
with plain ``ray.put`` / ``ray.get``: no store, no leases, no shard calls), and
``bare_ray_fetch`` for the adopted-key path (the same objects already on the engine node,
as validation at ingest leaves them: only the ranks' fetch and copy), each timed like a
path. Their runs alternate with the path's, so each run of the path has a floor run
next to it (the machine's drift between phases of a workload cancels); the median of
the pairs' differences is what routeplay itself costs on that path, and the rest of
the distance to the limit is Ray's.

Example:
    limit = Probes().workload_limit(w, runs=5)
    limit["by_path"]["adopt"]          # ms: engine node -> trainer node, then the copies
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import ray

from routeplay.bench.host_cpu import busy_core_ms
from routeplay.bench.roles import rank_rows, sample_routing
from routeplay.bench.workloads import Workload
from routeplay.core import canonicalize

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

SOURCE_NODE = {"producer": "rollout", "adopt": "engine"}
"""Where each routeplay path's payloads live when the trainer ranks read them."""

__all__ = [
    "SOURCE_NODE",
    "FloorRun",
    "Probes",
    "beaten",
    "object_sizes",
    "rank_byte_ranges",
    "rank_shares",
    "tightened",
    "validate_s",
]


def object_sizes(w: Workload) -> list[int]:
    """Bytes of the objects a path stores for ``w``: one per sample, the shared prompt
    of a GRPO group once (what crosses to the trainer node: ``w.unique_bytes``)."""
    if not w.prompt_tokens:
        return [w.spec.nbytes(w.rows)] * w.samples
    suffix = w.spec.nbytes(w.rows - w.prompt_tokens)
    return [w.spec.nbytes(w.prompt_tokens)] + [suffix] * w.samples


def rank_shares(w: Workload) -> list[int]:
    """Bytes each SP rank copies out: its rows of every sample (``rank_byte_ranges``)."""
    return [sum(hi - lo for _, lo, hi in rank_byte_ranges(w, rank)) for rank in range(w.sp)]


@ray.remote(num_cpus=0)
class _Source:
    """Puts fresh objects on its node (the store a path's payloads live in)."""

    def make(self, sizes: Sequence[int]) -> list[Any]:
        self._held = [ray.put(np.ones(n, np.uint8)) for n in sizes]
        return [self._held]  # wrapped: the caller gets references, not values

    def drop(self) -> None:
        self._held = []

    def validate_s(self, w: Workload, runs: int) -> float:
        return validate_s(w, runs)  # on this node, as the adopted-key path validates

    def hold_arrays(self, sizes: Sequence[int]) -> None:
        self._arrays = [np.ones(n, np.uint8) for n in sizes]  # decoded, untimed

    def put_held(self) -> list[Any]:
        """What a rollout worker on bare Ray does: ``ray.put`` each sample, hand refs on."""
        self._held = [ray.put(array) for array in self._arrays]
        return [self._held]


@ray.remote(num_cpus=0)
class _Sink:
    """The trainer node's side: pulls objects, or copies a rank's share."""

    def pull_s(self, wrapped: list[list[Any]]) -> float:
        start = time.perf_counter()
        values = ray.get(wrapped[0], timeout=_DEADLINE_S)
        elapsed = time.perf_counter() - start
        del values
        return elapsed

    def warm(self, nbytes: int) -> None:
        self._src = np.ones(nbytes, np.uint8)
        self._dst = np.empty_like(self._src)
        np.copyto(self._dst, self._src)  # pages faulted in, as a rank's reused buffers

    def copy_s(self) -> float:
        start = time.perf_counter()
        np.copyto(self._dst, self._src)
        return time.perf_counter() - start

    def fetch_share(self, wrapped: list[list[Any]], shares: list[tuple[int, int, int]]) -> float:
        """A bare-Ray rank: fetch every object, copy its byte range of each (``(object,
        lo, hi)``; a shared prompt once per sample) into warm buffers, drop the views.
        Returns the seconds it took, on this rank's clock (as a bench rank times its
        read)."""
        start = time.perf_counter()
        values = ray.get(wrapped[0], timeout=_DEADLINE_S)
        sizes = [hi - lo for _, lo, hi in shares]
        if [out.size for out in getattr(self, "_out", [])] != sizes:  # a new workload
            self._out = [np.empty(n, np.uint8) for n in sizes]
        for out, (index, lo, hi) in zip(self._out, shares, strict=True):
            np.copyto(out, values[index][lo:hi])
        del values
        return time.perf_counter() - start


def validate_s(w: Workload, runs: int) -> float:
    """Best time (s) of one core validating the step's engine payloads, ``w.samples`` of
    ``w.rows`` rows (``canonicalize``: range, narrowing, distinct ids), as the adopted-key
    path does once per payload; one payload validated ``samples`` times (same work, less
    memory).

    Example:
        validate_s(BenchConfig.smoke().workloads[0], runs=3)  # e.g. 0.004
    """
    spec = w.spec
    raw = sample_routing(spec, w.rows, seed=5)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(w.samples):
            canonicalize(raw, spec, threads=1)
        best = min(best, time.perf_counter() - start)
    return best


def rank_byte_ranges(w: Workload, rank: int) -> list[tuple[int, int, int]]:
    """``(object, lo, hi)`` byte ranges rank ``rank`` copies: its rows of each sample."""
    lo_row, hi_row = rank_rows(w.rows, rank, w.sp)
    row = w.spec.row_nbytes
    if not w.prompt_tokens:
        return [(i, lo_row * row, hi_row * row) for i in range(w.samples)]
    prompt = w.prompt_tokens
    ranges = []
    for sample in range(w.samples):
        if lo_row < prompt:  # the shared prompt object, once per sample
            ranges.append((0, lo_row * row, min(hi_row, prompt) * row))
        if hi_row > prompt:
            start = max(lo_row, prompt) - prompt
            ranges.append((1 + sample, start * row, (hi_row - prompt) * row))
    return ranges


def _on(role: str) -> dict[str, Any]:
    return {"resources": {role: 0.01}}


class FloorRun(NamedTuple):
    """One run of Ray's own floor for a path's objects (``Probes.bare_ray``,
    ``bare_ray_fetch``)."""

    ms: float
    """The whole run, as the driver timed it (what a path's step is compared with)."""
    rank_ms: float
    """The slowest rank's own fetch and copy, on its clock (what a rank's ``read``
    phase is compared with: the same clock, without the calls to the ranks)."""


class Probes:
    """The limit's actors, started once per bench run (a Ray actor costs a worker process
    to start): a source on the rollout and on the engine node, SP sinks on the trainer.

    Example:
        probes = Probes()
        limit = probes.workload_limit(w, runs=5)
        probes.close()
    """

    def __init__(self) -> None:
        source: Any = _Source
        self._sources = {
            role: source.options(**_on(role)).remote() for role in SOURCE_NODE.values()
        }
        self._sinks: list[Any] = []

    def sinks(self, count: int) -> list[Any]:
        """``count`` sinks on the trainer node (started on first need, then reused)."""
        sink: Any = _Sink
        while len(self._sinks) < count:
            self._sinks.append(sink.options(**_on("trainer")).remote())
        return self._sinks[:count]

    def close(self) -> None:
        for actor in (*self._sources.values(), *self._sinks):
            ray.kill(actor)

    def workload_limit(self, w: Workload, *, runs: int) -> dict[str, Any]:
        """The limit of each routeplay path of ``w`` (ms), from the best of ``runs`` runs
        of each part; ``limit_ms`` is the lower of the two (the step's limit, any source).

        Example:
            probes.workload_limit(BenchConfig.smoke().workloads[0], runs=5)["by_path"]
        """
        copy_ms = 1e3 * self._best_copy_s(w, runs)
        pulls = {path: self._best_pull(w, role, runs) for path, role in SOURCE_NODE.items()}
        by_path = {path: round(copy_ms + pull_ms, 2) for path, (pull_ms, _) in pulls.items()}
        validate = self._sources["engine"].validate_s.remote(w, runs)
        return {
            "limit_ms": min(by_path.values()),
            "by_path": by_path,
            "copy_ms": round(copy_ms, 2),
            "pull_ms": {path: round(ms, 2) for path, (ms, _) in pulls.items()},
            "pull_core_ms": {path: round(cpu) for path, (_, cpu) in pulls.items()},
            "validate_ms": round(1e3 * ray.get(validate, timeout=_DEADLINE_S), 1),
            "runs": runs,
            "cross_node_bytes": sum(object_sizes(w)),
        }

    @contextmanager
    def bare_ray(self, w: Workload) -> Iterator[Callable[[], FloorRun]]:
        """Ray's own floor for the producer path's work (see the module docstring): yields
        a function that times one run, so runs can alternate with the producer
        path's and each pair sees the same moment of the machine.

        Example:
            with probes.bare_ray(w) as bare_run:
                floor_ms = bare_run().ms
        """
        source, fetch = self._sources["rollout"], self._ranks_fetch(w)
        ray.get(source.hold_arrays.remote(object_sizes(w)), timeout=_DEADLINE_S)

        def run() -> FloorRun:
            start = time.perf_counter()
            rank_s = fetch(ray.get(source.put_held.remote(), timeout=_DEADLINE_S))
            elapsed = time.perf_counter() - start
            ray.get(source.drop.remote(), timeout=_DEADLINE_S)
            return FloorRun(1e3 * elapsed, 1e3 * rank_s)

        try:
            run()  # warms the ranks' buffers
            yield run
        finally:
            ray.get(source.hold_arrays.remote([]), timeout=_DEADLINE_S)

    @contextmanager
    def bare_ray_fetch(self, w: Workload) -> Iterator[Callable[[], FloorRun]]:
        """Ray's own floor for the adopted-key path's work: the same objects already in
        the engine node's store (written untimed, as validation at ingest writes them
        while the engine runs), fetched and copied by the SP ranks with plain
        ``ray.get``; yields a function that times one run.

        Example:
            with probes.bare_ray_fetch(w) as bare_run:
                floor_ms = bare_run().ms
        """
        source, fetch = self._sources["engine"], self._ranks_fetch(w)

        def run() -> FloorRun:
            wrapped = ray.get(source.make.remote(object_sizes(w)), timeout=_DEADLINE_S)
            start = time.perf_counter()
            rank_s = fetch(wrapped)
            elapsed = time.perf_counter() - start
            ray.get(source.drop.remote(), timeout=_DEADLINE_S)
            return FloorRun(1e3 * elapsed, 1e3 * rank_s)

        run()  # warms the ranks' buffers
        yield run

    def _ranks_fetch(self, w: Workload) -> Callable[[list[list[Any]]], float]:
        """The SP ranks (sinks) fetching the given objects and copying their shares, at
        once; returns when every rank has (the caller drops the references after), with
        the slowest rank's own seconds."""
        ranks = self.sinks(w.sp)
        shares = [rank_byte_ranges(w, rank) for rank in range(w.sp)]

        def fetch(wrapped: list[list[Any]]) -> float:
            pairs = zip(ranks, shares, strict=True)
            calls = [rank.fetch_share.remote(wrapped, mine) for rank, mine in pairs]
            return float(max(ray.get(calls, timeout=_DEADLINE_S)))

        return fetch

    def _best_pull(self, w: Workload, source_role: str, runs: int) -> tuple[float, float]:
        """The fastest pull (ms) and the machine's busy core-ms during that call."""
        source, [sink] = self._sources[source_role], self.sinks(1)
        pulls: list[tuple[float, float]] = []
        for _ in range(runs):
            wrapped = ray.get(source.make.remote(object_sizes(w)), timeout=_DEADLINE_S)
            cpu_start = busy_core_ms()
            seconds = ray.get(sink.pull_s.remote(wrapped), timeout=_DEADLINE_S)
            pulls.append((1e3 * seconds, busy_core_ms() - cpu_start))
            del wrapped
            ray.get(source.drop.remote(), timeout=_DEADLINE_S)
        return min(pulls)

    def _best_copy_s(self, w: Workload, runs: int) -> float:
        ranks = self.sinks(w.sp)
        ray.get(
            [rank.warm.remote(n) for rank, n in zip(ranks, rank_shares(w), strict=True)],
            timeout=_DEADLINE_S,
        )
        slowest: list[float] = [
            max(ray.get([rank.copy_s.remote() for rank in ranks], timeout=_DEADLINE_S))
            for _ in range(runs)
        ]
        ray.get([rank.warm.remote(0) for rank in ranks], timeout=_DEADLINE_S)  # free
        return min(slowest)


def tightened(limit: dict[str, Any], floors_ms: dict[str, Sequence[float]]) -> dict[str, Any]:
    """``limit`` with each path's limit lowered to the best run of its Ray floor where
    that was faster (see the module docstring); ``probe_by_path`` keeps the probe's
    figures, ``floor_best_ms`` the floors' best runs.

    Example:
        tightened({"by_path": {"adopt": 230.0}, "limit_ms": 230.0}, {"adopt": [240.0, 221.5]})
        # {"by_path": {"adopt": 221.5}, "limit_ms": 221.5, ...}
    """
    best = {path: round(min(runs), 2) for path, runs in floors_ms.items() if runs}
    by_path = {path: min(ms, best.get(path, ms)) for path, ms in limit["by_path"].items()}
    return {
        **limit,
        "by_path": by_path,
        "limit_ms": min(by_path.values()),
        "probe_by_path": limit["by_path"],
        "floor_best_ms": best,
    }


def beaten(medians_ms: dict[str, float], limit: dict[str, Any]) -> list[str]:
    """The paths whose median beat their limit: each one a measurement to distrust.

    Example:
        beaten({"producer": 40.0, "adopt": 90.0}, {"by_path": {"producer": 45.0, "adopt": 50}})
        # ['producer: 40.0 ms < its limit 45.0 ms']
    """
    return [
        f"{path}: {medians_ms[path]} ms < its limit {limit['by_path'][path]} ms"
        for path in SOURCE_NODE
        if medians_ms[path] < limit["by_path"][path]
    ]
