"""The realistic RL step: routeplay wired with its public API only, as a new user wires it
(``routeplay.rollout``'s group calls), next to Ray's own floor for the same objects and to
verl's path, at several step sizes, in one run.

A step (``RLStepShape``: GRPO groups of 8 sharing a 512-token prompt, 1,024 tokens a
sample, Qwen3-30B-A3B, 4 data-parallel ranks on the trainer node, one route-store shard)
starts when the engine has answered every sample (``routeplay.bench.rl_roles``) and ends
when every rank has read its rows and nothing is held any more. Its phases, each timed
on the driver's clock, one after the other:

- generation: ``writes`` (the rollout worker hands each group on: routeplay's
  ``aingest_and_finish_group``, one coroutine per group; Ray's ``ray.put`` per group;
  verl's int16 batch, returned to the driver) and ``buffer`` (every group into
  routeplay's ``ReplayBuffer`` at once, ``add_all``; verl's ``DataProto.concat`` of its
  workers' outputs; nothing for Ray);
- the trainer's step: ``batch`` (``buffer.sample`` and ``TrainingBatch``, which takes
  the leases over; verl's ``chunk``; Ray's split of the references), ``reads`` (the
  ranks' reads of their share: routeplay packs the batch with ``pack_samples`` over the
  DP ranks, sends each rank its ``plan.share``, and each rank reads it through
  ``Materializer.leasing``: one lease over the payloads of its share)
  and ``releases`` (the batch closes; verl and Ray drop their references).

Before each run (not timed) the driver and every role's process run a full garbage
collection, and the run reports the CPU of the collections its own allocations
triggered in them (``gc_cpu_ms``, ``gc_full``; ``routeplay.bench.gc_meter``: without the
settle, a run paid for the collections the path before it left pending). Between two
phases (not timed) the store's ``stats()`` is read, so each phase gets its
shard calls per operation and their CPU (``routeplay.store.shard.call_meter``); after the
step every lease and payload must be gone (a leak fails the run, ``RuntimeError``), and
on the LMDeploy-key path every engine key too. The first run of each path is checked
(every path must deliver the same rows, by a digest of each sample's rows) and not
counted; the timed runs go round the paths, the first path rotating.

Example:
    results = rl_steps(RLStepShape(samples=(64,), runs=1), progress=print)
    results["points"][0]["paths"]["producer"]["median_ms"]
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import psutil
import ray

from routeplay.bench import gc_meter, verl_path
from routeplay.bench.host_cpu import busy_core_ms
from routeplay.bench.measure import cluster, joined, kill_all, on, prepared_at_ingest
from routeplay.bench.rl_roles import (
    VERSION,
    RankShare,
    StepEngine,
    StepOwner,
    StepRank,
    StepRollout,
)
from routeplay.bench.workloads import RLStepShape
from routeplay.core import Handle
from routeplay.rollout import BufferConfig, ReplayBuffer, SampleRouting, TrainingBatch
from routeplay.store import RouteStore, StoreConfig, StoreStats, start_engine_store
from routeplay.store.engine.service import LMDEPLOY_NAME, LMDEPLOY_NAMESPACE
from routeplay.train import pack_samples

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

__all__ = [
    "GENERATION",
    "PATHS",
    "PHASES",
    "TRAINER",
    "rl_point",
    "rl_steps",
    "step_digest",
    "unique_rows",
]

PATHS = ("producer", "adopt", "ray_floor", "ray_owned", "verl")
GENERATION = ("writes", "buffer")
TRAINER = ("batch", "reads", "releases")
PHASES = GENERATION + TRAINER

VERL_PEAK_COPIES = 7
"""verl's path holds its padded int16 batch about this many times over at its peak (the
rollout worker's per-sample rows, their concatenation, its consolidated copy, the
``torch.save`` buffer and its bytes while the batch is pickled, the object the bytes
land in, and the driver's copy while it chunks the batch for the ranks): a point whose
estimate exceeds 80% of the machine's available memory skips that path (named in
``skipped``) rather than swap, or be killed, on a shared host. Measured at 4,096 samples
(a 3.0 GiB batch) with the skip overridden, on a 24 GiB host with 22.1 GiB available:
the rollout worker alone reached 17.7 GiB resident while it returned the batch, the
driver held 3.6 GiB, and Ray's memory monitor killed the ranks at 22.5 GiB used (95% of
the node: 7.5 batches, Ray's own processes included) before the step ended. Seven
counts the path's copies (the rollout worker's peak and the driver's add up to 7.1 batches
between them); six, the figure before, let a host with 22.5 GiB available try."""


def rl_steps(
    shape: RLStepShape, *, address: str | None = None, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every point of ``shape`` (one per step size), on a local cluster of its own
    (``shape.store_bytes`` per node) or on the cluster at ``address``."""
    nodes = cluster(shape.store_bytes) if address is None else joined(address)
    with nodes:
        store = StoreConfig(run="bench-rl", resources=(("head", 0.01),), timeout_s=120).build()
        # As we recommend it (docs/engine-store.md): the engine store knows the model and
        # validates each payload as the engine puts it; a group's adoption then lays out
        # the members' validated blocks, validating none again.
        start_engine_store(resources={"engine": 0.01}, spec=shape.spec)
        try:
            points = []
            for samples in shape.samples:
                progress(f"rl step x{samples}")
                points.append(rl_point(store, shape, samples))
            end = store.stats()
        finally:
            store.shutdown()
    return {
        "shape": dataclasses.asdict(shape),
        "verl_batch": verl_path.kind(),
        "points": points,
        "store_end": {"live_payloads": end.live_payloads, "leases": end.leases},
    }


def rl_point(
    store: RouteStore,
    shape: RLStepShape,
    samples: int,
    *,
    place: Callable[[str], dict[str, Any]] = on,
) -> dict[str, Any]:
    """One step size: a checked run per path, then ``shape.runs`` rounds of all paths.
    ``place`` gives each role's actor options (default: on its role's node).

    Example:
        point = rl_point(store, RLStepShape(), 256)
        point["paths"]["verl"]["median_ms"] / point["paths"]["producer"]["median_ms"]
    """
    skipped = _skipped(shape, samples)
    paths = [path for path in PATHS if path not in skipped]
    bench = _StepBench(store, shape, samples, place)
    try:
        checked = {path: bench.run(path, check=True) for path in paths}
        digests = {path: run["digest"] for path, run in checked.items()}
        if len(set(digests.values())) != 1:
            raise RuntimeError(f"rl step x{samples}: the paths delivered different rows: {digests}")
        timed: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
        for round_ in range(shape.runs):
            turn = round_ % len(paths)
            for path in paths[turn:] + paths[:turn]:
                timed[path].append(bench.run(path))
    finally:
        bench.close()
    summaries = {path: _summary(runs, samples) for path, runs in timed.items()}
    floor = summaries.get("ray_floor", {}).get("median_ms")
    owned = summaries.get("ray_owned", {}).get("median_ms")
    for summary in summaries.values():
        summary["over_ray_floor"] = _ratio(summary["median_ms"], floor)
        summary["over_ray_owned"] = _ratio(summary["median_ms"], owned)
    verl = summaries.get("verl", {}).get("median_ms")
    return {
        "samples": samples,
        "groups": shape.groups(samples),
        "digest": next(iter(digests.values())),
        "canonical_bytes": samples * shape.spec.nbytes(shape.rows),
        "unique_bytes": shape.groups(samples) * shape.spec.nbytes(unique_rows(shape)),
        "verl_bytes": _verl_bytes(shape, samples),
        "paths": summaries,
        "skipped": skipped,
        "rows_identical_across_paths": True,
        "verl_over_producer": _ratio(verl, summaries.get("producer", {}).get("median_ms")),
        "verl_over_adopt": _ratio(verl, summaries.get("adopt", {}).get("median_ms")),
    }


class _PhaseMeter:
    """Times one step's phases on the driver's clock and reads the store's meters
    between them (untimed): each phase's shard calls, per operation, and their CPU."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store
        self.ms: dict[str, float] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self.call_cpu_ms: dict[str, float] = {}
        self.process_cpu_ms: dict[str, float] = {}
        self._start = time.perf_counter()
        self._last = store.stats()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.ms[name] = (time.perf_counter() - start) * 1e3
        now = self.store.stats()
        before = dict(self._last.calls_by_op)
        self.calls[name] = {
            op: n - before.get(op, 0) for op, n in now.calls_by_op if n > before.get(op, 0)
        }
        self.call_cpu_ms[name] = now.call_cpu_ms - self._last.call_cpu_ms
        self.process_cpu_ms[name] = now.process_cpu_ms - self._last.process_cpu_ms
        self._last = now

    @property
    def last(self) -> StoreStats:
        """The store's stats as read after the last phase."""
        return self._last

    def figures(self) -> dict[str, Any]:
        """The step's figures: ``ms`` is the sum of its phases; ``wall_ms`` also holds
        the meter's own reads between them."""
        return {
            "ms": sum(self.ms.values()),
            "wall_ms": (time.perf_counter() - self._start) * 1e3,
            "phases_ms": dict(self.ms),
            "calls_by_phase": self.calls,
            "shard_calls": sum(sum(ops.values()) for ops in self.calls.values()),
            "shard_call_cpu_ms": sum(self.call_cpu_ms.values()),
            "shard_process_cpu_ms": sum(self.process_cpu_ms.values()),
        }


class _StepBench:
    """One step size's actors, replay buffer and runs."""

    def __init__(
        self,
        store: RouteStore,
        shape: RLStepShape,
        samples: int,
        place: Callable[[str], dict[str, Any]],
    ) -> None:
        self.store = store
        self.shape = shape
        self.samples = samples
        self.groups = shape.groups(samples)
        self.step = 0
        self.engine = StepEngine.options(**place("engine")).remote(shape)
        self.rollout = StepRollout.options(**place("rollout")).remote(store, shape)
        self.ranks = [
            StepRank.options(**place("trainer")).remote(store, shape, r) for r in range(shape.dp)
        ]
        # Where routeplay's shard runs (rl_steps: on the head node).
        self.owner = StepOwner.options(**place("head")).remote(self.rollout)
        self.engine_store = ray.get_actor(LMDEPLOY_NAME, namespace=LMDEPLOY_NAMESPACE)
        self.buffer: ReplayBuffer[SampleRouting] = BufferConfig().build(store)
        ray.get(self.rollout.prepare.remote(self.groups, samples), timeout=_DEADLINE_S)

    def run(self, path: str, *, check: bool = False) -> dict[str, Any]:
        """One step through ``path``; its figures (and, when ``check``, its digest)."""
        self.step += 1
        keys = None
        if path == "adopt":  # the engine has put every sample's routing: not in the step
            before = prepared_at_ingest(self.engine_store)
            keys = ray.get(
                self.engine.put_step.remote(self.groups, self.samples), timeout=_DEADLINE_S
            )
            # An engine store with a spec: the step's payloads are validated at ingest.
            if prepared_at_ingest(self.engine_store) > before:
                self._validated_at_ingest(keys[-1][-1])
        self._settle()
        meter = _PhaseMeter(self.store)
        busy = busy_core_ms()
        steps = {
            "producer": self._routeplay,
            "adopt": self._routeplay,
            "ray_floor": self._ray_floor,
            "ray_owned": self._ray_owned,
            "verl": self._verl,
        }
        shares = steps[path](meter, check, keys)
        core_ms = busy_core_ms() - busy
        collections = self._collections()
        self._check_nothing_left(path, meter.last)
        slowest = max(shares, key=lambda s: s.acquire_s + s.read_s + s.release_s)
        figures = meter.figures()
        figures["core_ms"] = round(core_ms)
        figures.update(collections)
        figures["rank_ms"] = {
            "acquire": slowest.acquire_s * 1e3,
            "read": slowest.read_s * 1e3,
            "release": slowest.release_s * 1e3,
        }
        if sum(s.samples for s in shares) != self.samples:
            raise RuntimeError(f"{path}: the ranks read {[s.samples for s in shares]} samples")
        if check:
            figures["digest"] = _step_digest(path, shares, self.samples)
        return figures

    def _settle(self) -> None:
        """Untimed: a full garbage collection in the driver and each role's process, so
        a run is not charged for what the path before it left (``gc_meter``)."""
        ray.get([role.settle.remote() for role in self._collecting()], timeout=_DEADLINE_S)
        gc_meter.settle()

    def _collections(self) -> dict[str, Any]:
        """The collections the run's own allocations triggered, by process (CPU ms), and
        how many were full (generation 2), over every process."""
        rollout, *ranks = ray.get(
            [role.collected.remote() for role in self._collecting()], timeout=_DEADLINE_S
        )
        driver = gc_meter.collected()
        every = [driver, rollout, *ranks]
        return {
            "gc_cpu_ms": {
                "driver": driver["cpu_ms"],
                "rollout": rollout["cpu_ms"],
                "ranks": round(sum(rank["cpu_ms"] for rank in ranks), 2),
            },
            "gc_full": sum(one["by_generation"][2] for one in every),
        }

    def _collecting(self) -> list[Any]:
        """The roles whose collections a run counts: the rollout worker, then the ranks."""
        return [self.rollout, *self.ranks]

    def _routeplay(
        self, meter: _PhaseMeter, check: bool, keys: list[list[str]] | None
    ) -> list[RankShare]:
        with meter.phase("writes"):
            if keys is None:
                groups = ray.get(self.rollout.write_groups.remote(), timeout=_DEADLINE_S)
            else:
                groups = ray.get(self.rollout.adopt_groups.remote(keys), timeout=_DEADLINE_S)
        with meter.phase("buffer"):
            self.buffer.add_all(
                {f"{self.step}/{group}": states for group, states in enumerate(groups)}
            )
            del groups  # the buffer's states hold the leases now
        with meter.phase("batch"):
            batch = TrainingBatch(self.step, self.buffer.sample(self.groups, VERSION))
        try:
            with meter.phase("reads"):
                samples = [(s.sample_id, _handle(s), self.shape.tokens) for s in batch.states]
                plan = pack_samples(samples, self.shape.pack_length, 1, dp_size=self.shape.dp)
                reads = [  # each rank gets its share of the plan (its own samples)
                    rank.read_routeplay.remote(plan.share(r), batch.holder, check)
                    for r, rank in enumerate(self.ranks)
                ]
                shares: list[RankShare] = ray.get(reads, timeout=_DEADLINE_S)
        except BaseException:
            batch.close()
            raise
        with meter.phase("releases"):
            batch.close()
        return shares

    def _ray_floor(self, meter: _PhaseMeter, check: bool, _: object) -> list[RankShare]:
        with meter.phase("writes"):
            [refs] = ray.get(self.rollout.put_groups.remote(), timeout=_DEADLINE_S)
        read = self._read_refs(meter, refs, check)
        with meter.phase("releases"):
            del refs  # the objects go with their last reference
        return read

    def _ray_owned(self, meter: _PhaseMeter, check: bool, _: object) -> list[RankShare]:
        """Ray's floor for objects that outlive their writer: made by the rollout worker,
        owned by ``StepOwner``; read as the floor reads them."""
        with meter.phase("writes"):
            [refs] = ray.get(self.owner.make.remote(self.groups), timeout=_DEADLINE_S)
        read = self._read_refs(meter, refs, check)
        with meter.phase("releases"):
            del refs
            ray.get(self.owner.drop.remote(), timeout=_DEADLINE_S)  # the owner's go last
        return read

    def _read_refs(self, meter: _PhaseMeter, refs: list[Any], check: bool) -> list[RankShare]:
        """Ray's buffer, batch and reads: the driver keeps the references and sends each
        rank its share of the groups."""
        with meter.phase("buffer"):
            pass  # Ray has no buffer: the driver keeps the references
        with meter.phase("batch"):
            shares = np.array_split(np.arange(len(refs)), self.shape.dp)
        with meter.phase("reads"):
            reads = [
                rank.read_ray.remote([[refs[g] for g in share]], share.tolist(), check)
                for rank, share in zip(self.ranks, shares, strict=True)
            ]
            return list(ray.get(reads, timeout=_DEADLINE_S))

    def _verl(self, meter: _PhaseMeter, check: bool, _: object) -> list[RankShare]:
        with meter.phase("writes"):
            output = ray.get(self.rollout.verl_groups.remote(), timeout=_DEADLINE_S)
        with meter.phase("buffer"):
            batch = verl_path.concat([output])
            del output
        with meter.phase("batch"):
            chunks = verl_path.chunk(batch, self.shape.dp)
        with meter.phase("reads"):
            reads = [
                rank.read_verl.remote(chunk, check)
                for rank, chunk in zip(self.ranks, chunks, strict=True)
            ]
            read: list[RankShare] = ray.get(reads, timeout=_DEADLINE_S)
        with meter.phase("releases"):
            del batch, chunks, reads
        return read

    def _validated_at_ingest(self, last_key: str) -> None:
        """Untimed, as the producer path's decoding: wait until the engine store's
        validations of the step's payloads have ended (while a real engine still
        generates). They run one at a time in the order put, so the last key's tells."""
        deadline = time.monotonic() + _DEADLINE_S
        while ray.get(self.engine_store.validated.remote(last_key), timeout=_DEADLINE_S) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rl step x{self.samples}: validations at ingest never ended")
            time.sleep(0.01)

    def _check_nothing_left(self, path: str, stats: StoreStats) -> None:
        """Fail the run on anything the step left behind (after its last phase)."""
        left = []
        if stats.leases or stats.live_payloads:
            holders = sorted({leak.holder for leak in self.store.leaks()})[:5]
            left.append(
                f"{stats.leases} leases ({', '.join(holders)}), {stats.live_payloads} payloads"
            )
        if path == "adopt":
            keys = ray.get(self.engine_store.stats.remote(), timeout=_DEADLINE_S).live_keys
            if keys:
                left.append(f"{keys} engine keys")
        if self.buffer.stats().samples:
            left.append(f"{self.buffer.stats().samples} samples in the buffer")
        if left:
            raise RuntimeError(f"rl step x{self.samples} ({path}) leaked: {'; '.join(left)}")

    def close(self) -> None:
        self.buffer.close()
        kill_all([self.engine, self.rollout, self.owner, *self.ranks])


def _handle(routing: SampleRouting) -> Handle:
    if routing.handle is None:  # never: every member finished with a handle
        raise RuntimeError(f"sample {routing.sample_id} reached the batch without routing")
    return routing.handle


def _step_digest(path: str, shares: Sequence[RankShare], samples: int) -> str:
    """One digest of every sample's rows, whichever rank read it and in whatever order;
    a sample read twice or never fails the run."""
    pairs = [pair for share in shares for pair in share.digests]
    ids = {sid for sid, _ in pairs}
    if len(pairs) != samples or len(ids) != samples:
        raise RuntimeError(f"{path}: {len(ids)} distinct samples in {len(pairs)} reads")
    return step_digest(pairs)


def step_digest(pairs: Iterable[tuple[str, str]]) -> str:
    """The digest of a step's rows from ``(sample id, rows_digest(rows))`` pairs, in any
    order.

    Example:
        >>> step_digest([("0.1", "b"), ("0.0", "a")]) == step_digest([("0.0", "a"), ("0.1", "b")])
        True
    """
    return hashlib.sha256(repr(sorted(pairs)).encode()).hexdigest()


def _summary(runs: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Medians over a path's timed runs (the last run's calls per operation: the same
    from run to run)."""
    ms = [run["ms"] for run in runs]
    calls = _median(run["shard_calls"] for run in runs)
    return {
        "runs": len(runs),
        "median_ms": round(statistics.median(ms), 1),
        "min_ms": round(min(ms), 1),
        "max_ms": round(max(ms), 1),
        "per_sample_ms": round(statistics.median(ms) / samples, 3),
        "phases_ms": {p: _median(run["phases_ms"][p] for run in runs) for p in PHASES},
        "generation_ms": _median(sum(run["phases_ms"][p] for p in GENERATION) for run in runs),
        "trainer_ms": _median(sum(run["phases_ms"][p] for p in TRAINER) for run in runs),
        "shard_calls": calls,
        "shard_calls_per_sample": round(calls / samples, 2),
        "calls_by_phase": runs[-1]["calls_by_phase"],
        "shard_call_cpu_ms": _median(run["shard_call_cpu_ms"] for run in runs),
        "shard_process_cpu_ms": _median(run["shard_process_cpu_ms"] for run in runs),
        "rank_ms": {
            k: _median(run["rank_ms"][k] for run in runs) for k in ("acquire", "read", "release")
        },
        "core_ms": _median(run["core_ms"] for run in runs),
        "gc_cpu_ms": {
            k: _median(run["gc_cpu_ms"][k] for run in runs) for k in ("driver", "rollout", "ranks")
        },
        "gc_full": _median(run["gc_full"] for run in runs),
        "wall_ms": _median(run["wall_ms"] for run in runs),
    }


def _median(values: Iterable[float]) -> float:
    return round(statistics.median(values), 2)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 2)


def unique_rows(shape: RLStepShape) -> int:
    """Rows a GRPO group stores: its prompt's once, then each member's own.

    Example:
        >>> unique_rows(RLStepShape(tokens=256, shared_prompt=128, group=4))  # 255 rows each
        636
    """
    return shape.shared_prompt + shape.group * (shape.rows - shape.shared_prompt)


def _verl_bytes(shape: RLStepShape, samples: int) -> int:
    """verl's batch: every sample int16, padded to the whole prompt + response width."""
    spec = shape.spec
    return samples * shape.tokens * spec.num_layers * spec.top_k * np.dtype(np.int16).itemsize


def _skipped(shape: RLStepShape, samples: int) -> dict[str, str]:
    """Paths this point cannot run here without swapping, each with why."""
    need = VERL_PEAK_COPIES * _verl_bytes(shape, samples)
    available = int(psutil.virtual_memory().available)
    if need <= 0.8 * available:
        return {}
    return {
        "verl": f"needs ~{need / 2**30:.1f} GiB of memory at its peak "
        f"({VERL_PEAK_COPIES} x its {_verl_bytes(shape, samples) / 2**30:.1f} GiB batch), "
        f"{available / 2**30:.1f} GiB available"
    }
