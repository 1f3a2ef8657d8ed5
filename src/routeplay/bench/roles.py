"""The actors of the data-path benchmark: an engine, a rollout worker, trainer ranks.

Each path's step starts when the engine has finished (its routing is in the engine-side
store, or decoded in the rollout worker's memory; on the adopted-key path, every sample
adopted as it completed, before the step) and ends when every SP rank holds its rows:

- **eager** (XTuner + LMDeploy today): the rollout worker ``get``s each key from
  ``shared_store``, ``np.asarray``s it and ``ray.put``s it again; every SP rank
  ``ray.get``s the whole sample, widens it to int64 and slices its rows.
- **producer** (routeplay): the rollout worker hands its decoded canonical arrays to the
  store with one write (``put_routes_many``); ranks acquire the step in one call per
  shard, copy their rows out of the blocks the grant carried, release at the step's end.
- **adopt** (routeplay, LMDeploy key): the rollout worker adopts each sample's key as it
  would when the sample completes (``adopt_each``: one ``adopt_key`` per sample, a GRPO
  group's keys in one call; the rows validated and narrowed once on the engine's node,
  each call timed here, before the step, as the rollout sees it); the step hands the
  adopted handles on (``adopted``), and ranks read as above.

Ranks report the routing bytes they held at their peak and a digest of their rows, so
the benchmark can check that every path delivered the same rows, and how long their
own method spent acquiring and reading (``RankRead``), so it can say where a step's
time goes.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import ray

from routeplay.bench.transfer_paths import make_routing
from routeplay.core import EngineKey, Handle, RouteSpec, canonicalize
from routeplay.store import Lease, RoutesProducer, RouteStore, producer_actor

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

__all__ = [
    "Adoption",
    "BenchEngine",
    "BenchRank",
    "BenchRollout",
    "RankRead",
    "rank_rows",
    "sample_routing",
]


def sample_routing(
    spec: RouteSpec, rows: int, seed: int, *, prompt_rows: int = 0, prompt_seed: int = 0
) -> npt.NDArray[Any]:
    """What an engine returns for one sample: uint16, every decoder layer. With
    ``prompt_rows``, the first rows come from ``prompt_seed`` (a GRPO group's prompt,
    routed alike by an engine with prefix caching)."""
    full = make_routing(spec, rows, all_layers=True, seed=seed)
    if prompt_rows:
        full[:prompt_rows] = make_routing(spec, prompt_rows, all_layers=True, seed=prompt_seed)
    return full


def rank_rows(rows: int, sp_rank: int, sp_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a sample that SP rank ``sp_rank`` trains on (contiguous split)."""
    bounds = np.linspace(0, rows, sp_size + 1).astype(int)
    return int(bounds[sp_rank]), int(bounds[sp_rank + 1])


class Adoption(NamedTuple):
    """One adoption call of the rollout worker, as it timed it."""

    ms: float
    """Milliseconds the call took, on the rollout's clock."""
    samples: int
    """Samples it adopted: 1, or a GRPO group's members (each adopted when it returns)."""


class RankRead(NamedTuple):
    """What a rank reports of one step."""

    peak_bytes: int
    """The most routing bytes it held at once."""
    digest: str
    """A digest of its rows ("" outside checked runs)."""
    acquire_s: float
    """Seconds its method spent acquiring leases (0 on the eager path)."""
    read_s: float
    """Seconds its method spent reading its rows."""


def _digest(arrays: Sequence[npt.NDArray[Any]]) -> str:
    sha = hashlib.sha256()
    for array in arrays:
        sha.update(np.ascontiguousarray(array).data)
    return sha.hexdigest()


class _BenchEngine(RoutesProducer):
    """LMDeploy's side: routing into ``shared_store`` (one write, via ``put_from``)."""

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec

    def keys(self, samples: Sequence[tuple[int, int, int, int]]) -> list[str]:
        """One key per ``(rows, seed, prompt_rows, prompt_seed)``."""
        store = ray.get_actor("shared_store", namespace="lmdeploy")
        out = []
        for rows, seed, prompt_rows, prompt_seed in samples:
            payload = sample_routing(
                self.spec, rows, seed, prompt_rows=prompt_rows, prompt_seed=prompt_seed
            )
            token, _ = self.stage_routes(payload, block_rows=0)
            me = ray.get_runtime_context().current_actor
            shape, dtype = payload.shape, str(payload.dtype)
            out.append(
                str(ray.get(store.put_from.remote(me, token, shape, dtype), timeout=_DEADLINE_S))
            )
        return out


class _BenchRollout(RoutesProducer):
    """The rollout worker of every path."""

    def __init__(self, store: RouteStore, spec: RouteSpec) -> None:
        self.store = store
        self.spec = spec
        self._decoded: list[Any] = []
        self._adopted: list[Handle] = []
        self._held: list[Any] = []

    def decode(self, samples: Sequence[tuple[int, int, int, int]]) -> int:
        """Untimed: what a worker holds once it decoded the engine's responses."""
        self._decoded = [
            canonicalize(
                sample_routing(self.spec, rows, seed, prompt_rows=p_rows, prompt_seed=p_seed),
                self.spec,
            )
            for rows, seed, p_rows, p_seed in samples
        ]
        return sum(routes.nbytes for routes in self._decoded)

    def produce(self, shared_prefix: int = 0) -> list[Handle]:
        """Producer path: one write per payload, one shard call for the batch."""
        batch, self._decoded = self._decoded, []
        return self.put_routes_many(self.store, batch, shared_prefix=shared_prefix)

    def adopt_each(
        self, keys: Sequence[str], rows: Sequence[int], shared_prefix: int = 0
    ) -> list[Adoption]:
        """Adopted-key path, before the step: each sample's key taken over one after
        another, as the rollout takes a sample over when it completes (``adopt_key``:
        back once the rows' validation has ended accepting them, at ingest or near the
        engine), or, with ``shared_prefix``, the GRPO group's keys in one call once the
        group is done (its prompt rows stored once). Each call is timed here, on the
        rollout's clock; the handles wait for ``adopted``."""
        engine_keys = [EngineKey(key=key, rows=n) for key, n in zip(keys, rows, strict=True)]
        groups = [engine_keys] if shared_prefix else [[key] for key in engine_keys]
        out = []
        for group in groups:
            start = time.perf_counter()
            if shared_prefix:
                handles = self.store.adopt_keys(group, self.spec, shared_prefix=shared_prefix)
            else:
                handles = [self.store.adopt_key(group[0], self.spec)]
            out.append(Adoption(1e3 * (time.perf_counter() - start), len(group)))
            self._adopted.extend(handles)
        return out

    def adopted(self) -> list[Handle]:
        """The step's hop on the adopted-key path: the handles adopted so far, handed on."""
        handles, self._adopted = self._adopted, []
        return handles

    def eager(self, keys: Sequence[str]) -> list[list[Any]]:
        """XTuner's path: get, np.asarray, put again (this worker owns the copies)."""
        engine_store = ray.get_actor("shared_store", namespace="lmdeploy")
        refs = []
        for key in keys:
            array = np.asarray(ray.get(engine_store.get.remote(key), timeout=_DEADLINE_S))
            refs.append(ray.put(array))
            del array
        self._held = refs  # the owner must outlive the trainers' reads
        return [refs]

    def drop(self) -> None:
        self._held, self._adopted = [], []


class _BenchRank:
    """One SP rank on the trainer node."""

    def __init__(self, store: RouteStore, spec: RouteSpec, sp_rank: int, sp_size: int) -> None:
        self.store = store
        self.spec = spec
        self.sp_rank = sp_rank
        self.sp_size = sp_size
        self._buffers: dict[int, list[npt.NDArray[Any]]] = {}  # reused across steps
        self._held: list[Lease] = []

    def read_eager(self, wrapped: list[list[Any]], check: bool = False) -> RankRead:
        """Whole sample, widened to int64, then sliced (peak: the int64 copy + the slices
        kept so far). ``check`` adds a digest of the rows (outside timed runs)."""
        start = time.perf_counter()
        peak, mine = 0, list[npt.NDArray[Any]]()
        layers = list(self.spec.moe_layer_indices())
        for ref in wrapped[0]:
            full = ray.get(ref, timeout=_DEADLINE_S)
            wide = full.astype(np.int64)
            del full
            lo, hi = rank_rows(wide.shape[0], self.sp_rank, self.sp_size)
            part = wide[lo:hi] if len(layers) == wide.shape[1] else wide[lo:hi][:, layers, :]
            rows = np.ascontiguousarray(part)
            peak = max(peak, wide.nbytes + rows.nbytes + sum(m.nbytes for m in mine))
            del wide, part
            mine.append(rows)
        read_s = time.perf_counter() - start
        digest = _digest([m.astype(self.spec.dtype) for m in mine]) if check else ""
        return RankRead(peak, digest, 0.0, read_s)

    def read_routeplay(
        self, handles: Sequence[Handle], holder: str, check: bool = False
    ) -> RankRead:
        """One acquire per shard for the step, leased reads (no shard call). The leases
        are held until ``flush`` (the step's end, untimed), as a trainer holds them until
        its step is done: a rank that released at once could free a payload another rank
        of the step has not acquired yet (its last lease gone: ``RoutesLost``)."""
        start = time.perf_counter()
        requests = [(h, *rank_rows(h.rows, self.sp_rank, self.sp_size)) for h in handles]
        leases = self.store.acquire_many([(h, holder) for h in handles])
        acquired = time.perf_counter()
        self._held.extend(leases)
        outs = self.store.read_many(requests, holder=holder, out=self._out(requests))
        read_s = time.perf_counter() - acquired
        digest = _digest(outs) if check else ""
        return RankRead(sum(o.nbytes for o in outs), digest, acquired - start, read_s)

    def flush(self) -> None:
        """The step is over: release its leases (one call per shard) and settle."""
        held, self._held = self._held, []
        self.store.release_many(held)
        self.store.flush()

    def _out(self, requests: Sequence[tuple[Handle, int, int]]) -> list[npt.NDArray[Any]]:
        shapes = [(hi - lo, *self.spec.row_shape) for _, lo, hi in requests]
        key = hash(tuple(shapes))
        if key not in self._buffers:
            self._buffers = {key: [np.empty(shape, self.spec.dtype) for shape in shapes]}
        return self._buffers[key]


BenchEngine: Any = producer_actor(_BenchEngine, num_cpus=0)
BenchRollout: Any = producer_actor(_BenchRollout, num_cpus=0)
BenchRank: Any = ray.remote(num_cpus=0)(_BenchRank)
