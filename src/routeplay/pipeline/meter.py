"""The run's memory picture, read from Ray's raylets and the route store.

Object-store numbers come from ``routeplay.store.remote.accounting`` (every alive node summed):
bytes in use now, and the cumulative bytes and objects ever created, whose growth over
the run is what "one write per payload" is measured by. Ray frees an object
asynchronously (its owner learns from every borrower that the reference is gone, which
takes up to a few seconds), so bytes in use are sampled in the background rather than
only at phase ends, and teardown waits for them to settle back to the baseline.

Those counters are the cluster's, not the run's: Ray cannot say which job wrote an
object. So the meter also records who else used the cluster while the run did (other
routeplay runs, by their route store's shard actors, and other Ray drivers), at start,
at every sample and at the end; ``sharing()`` hands that over, and the report evaluates
the counter-based figures only when nobody else was seen. A run that started and ended
between two samples (0.25 s) can go unseen.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray._private import state as ray_state

from routeplay.pipeline.metrics import Point, Timeline
from routeplay.store import RouteStore
from routeplay.store.remote.accounting import node_store_stats

__all__ = ["Meter", "Sharing", "StoreTotals", "cluster_users"]

_STORE_PREFIX = "routeplay.store."
"""The route store names its shard actors ``routeplay.store.<run>.<shard>``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreTotals:
    """Object-store counters summed over nodes."""

    used_bytes: int
    created_bytes: int
    created_objects: int

    @classmethod
    def now(cls) -> StoreTotals:
        """Read every alive node's raylet."""
        nodes = node_store_stats().values()
        return cls(
            used_bytes=sum(n.used_bytes for n in nodes),
            created_bytes=sum(n.created_bytes for n in nodes),
            created_objects=sum(n.created_objects for n in nodes),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Sharing:
    """Who else used the cluster while a run did (seen at any of its samples).

    Example:
        >>> Sharing(other_runs=("demo-1a2b3c4d",), other_jobs=()).shared
        True
    """

    other_runs: tuple[str, ...]
    """Other routeplay runs whose route store was alive (their run ids)."""
    other_jobs: tuple[str, ...]
    """Other Ray jobs (driver processes) that were alive (their job ids)."""

    @property
    def shared(self) -> bool:
        """True when anyone else was seen: Ray's object-store counters are then not
        this run's alone."""
        return bool(self.other_runs or self.other_jobs)


def cluster_users(namespace: str = "routeplay") -> tuple[set[str], set[str]]:
    """Run ids of the routeplay route stores alive in ``namespace`` and the ids of the
    alive Ray jobs, now (two GCS calls)."""
    list_actors: Any = ray.util.list_named_actors  # untyped in Ray
    list_jobs: Any = ray_state.jobs  # the GCS job table: one entry per driver
    runs = {
        actor["name"][len(_STORE_PREFIX) :].rpartition(".")[0]
        for actor in list_actors(all_namespaces=True)
        if actor["namespace"] == namespace and actor["name"].startswith(_STORE_PREFIX)
    }
    jobs = {str(job["JobID"]) for job in list_jobs() if not job["IsDead"]}
    return runs, jobs


class Meter:
    """Samples the object store (every ``interval_s``, in a thread) and the route store
    (at each phase end) into a ``Timeline``; a context manager that stops the thread."""

    def __init__(self, store: RouteStore, *, interval_s: float = 0.25) -> None:
        self._store = store
        self._t0 = time.monotonic()
        self.start = StoreTotals.now()
        self.timeline = Timeline()
        self._own = (store.run, ray.get_runtime_context().get_job_id())
        self._seen: tuple[set[str], set[str]] = (set(), set())
        self._seen_lock = threading.Lock()  # the sampler thread and the loop both look
        self._look_around()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._sample, args=(interval_s,), name="routeplay-meter", daemon=True
        )
        self._thread.start()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            used = StoreTotals.now().used_bytes
            self.timeline.usage.append((round(time.monotonic() - self._t0, 3), used))
            self._look_around()

    def _look_around(self) -> None:
        """Add the other runs and jobs alive now to those seen."""
        runs, jobs = cluster_users(self._store.config.namespace)
        with self._seen_lock:
            self._seen[0].update(runs - {self._own[0]})
            self._seen[1].update(jobs - {self._own[1]})

    def sharing(self) -> Sharing:
        """Everyone else seen on the cluster since the meter started, up to now."""
        self._look_around()
        with self._seen_lock:
            runs, jobs = tuple(sorted(self._seen[0])), tuple(sorted(self._seen[1]))
        return Sharing(other_runs=runs, other_jobs=jobs)

    def settle(self, *, timeout_s: float = 10.0) -> int:
        """Wait until object-store usage is back at the baseline (or ``timeout_s``);
        returns the bytes in use above the baseline (0 when everything was freed)."""
        deadline = time.monotonic() + timeout_s
        excess = StoreTotals.now().used_bytes - self.start.used_bytes
        while excess > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            excess = StoreTotals.now().used_bytes - self.start.used_bytes
        # The settled usage closes the sampled curve (the sampler may have stopped first).
        settled = (round(time.monotonic() - self._t0, 3), self.start.used_bytes + excess)
        self.timeline.usage.append(settled)
        return max(0, excess)

    def close(self) -> None:
        """Stop sampling (idempotent)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def point(self, step: int, phase: str) -> Point:
        """Record (and return) where memory and leases stand now."""
        totals = StoreTotals.now()
        stats = self._store.stats()
        self._look_around()
        point = Point(
            t_s=round(time.monotonic() - self._t0, 3),
            step=step,
            phase=phase,
            object_store_bytes=totals.used_bytes,
            routing_bytes=stats.live_bytes,
            leases=stats.leases,
            live_payloads=stats.live_payloads,
        )
        self.timeline.add(point)
        return point

    def written(self) -> StoreTotals:
        """Growth of the cumulative counters since the meter started (used: now)."""
        now = StoreTotals.now()
        return StoreTotals(
            used_bytes=now.used_bytes,
            created_bytes=now.created_bytes - self.start.created_bytes,
            created_objects=now.created_objects - self.start.created_objects,
        )

    @property
    def elapsed_s(self) -> float:
        """Seconds since the meter started."""
        return time.monotonic() - self._t0
