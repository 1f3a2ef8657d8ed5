"""The actors of the realistic RL step (``routeplay.bench.rl_step``): an engine, one
rollout worker, the data-parallel trainer ranks.

Each step has GRPO groups whose members share their prompt's routing rows (routed alike,
as an engine with prefix caching routes them). The rollout worker starts every step
holding its answers decoded (``prepare``, untimed: what it holds once the engine has
answered), or, on the LMDeploy-key path, the keys the engine put (``StepEngine``, one
put per sample into routeplay's engine store, as LMDeploy's engine puts them). It then
hands each group on one of five ways:

- **producer** (routeplay): one coroutine per group (the worker is an asyncio actor, as
  XTuner's and verl's rollout workers are): its answers through
  ``aingest_and_finish_group`` with the worker's ``ProducerWriter`` (one payload, the
  prompt's rows once, each member's own lease granted by the write's call), then each
  member's ``complete``. The groups answered together are written and leased together,
  in one shard call (``AsyncRoutesProducer``, ``routeplay.store.client.coalesce``). The
  driver gets each member's ``SampleRouting`` (a handle and a lease: small).
- **adopt** (routeplay, LMDeploy keys): the same, each group's keys adopted together
  (``aadopt_keys_each(..., shared_prefix=..., pack=True)`` underneath; the groups whose
  keys arrived together in one shard call), then leased (one more call).
- **ray_floor** (Ray's own floor for the same objects): each group's canonical rows laid
  out as routeplay lays them (the prompt once, then each member's own rows) and
  ``ray.put`` once; the driver gets the references.
- **ray_owned** (Ray's own floor, the objects owned by a long-lived actor): what Ray
  itself offers for payloads that must outlive the worker that made them (a rollout
  worker restarted, scaled down or failed): an owner actor (``StepOwner``, on the head
  node, where routeplay's shard runs) calls the worker, which returns each group's
  objects laid out as the floor's; the owner keeps them, the driver gets the references
  and lets the owner drop them at the end.
- **verl** (``routeplay.bench.verl_path``): each sample widened to int16 and padded to the
  full prompt + response width, the worker's samples concatenated into one batch and
  returned to the driver whole.

The ranks (``StepRank``) read their share: through ``Materializer.leasing`` (routeplay:
one lease over the payloads of their share), by ``ray.get`` of their groups' objects and
a copy of each sample's rows into its pack (Ray), or from the chunk their call carried
(verl). Each reports how long it spent acquiring, reading and releasing, and, on a
checked run, a digest of every sample's rows, so the step can check that all five paths
delivered the same rows.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import ray

from routeplay.bench import gc_meter, verl_path
from routeplay.bench.workloads import RLStepShape
from routeplay.core import EngineKey, Routes, RouteSpec, canonicalize
from routeplay.core.wires import Engine, EngineRouting
from routeplay.rollout import ProducerWriter, SampleRouting, aingest_and_finish_group
from routeplay.rollout.routing_groups import adiscard_all
from routeplay.store import AsyncRoutesProducer, RoutesProducer, RouteStore, producer_actor
from routeplay.train import Materializer, PackingPlan, RankCoords

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

VERSION = 1
"""The weight version every sample is generated at (the buffer sees nothing stale)."""

__all__ = [
    "VERSION",
    "RankShare",
    "StepEngine",
    "StepOwner",
    "StepRank",
    "StepRollout",
    "engine_routing",
    "rows_digest",
    "sample_id",
]


def sample_id(group: int, member: int) -> str:
    """A sample's id, the same on every path (digests are compared by it)."""
    return f"{group}.{member}"


@functools.cache
def _valid_rows(spec: RouteSpec) -> npt.NDArray[np.uint16]:
    """1,024 top-k rows of distinct experts to draw a step's routing from."""
    rng = np.random.default_rng(0)
    order = np.argsort(rng.random((1024, spec.num_experts)), axis=1)
    return order[:, : spec.top_k].astype(np.uint16)


def engine_routing(shape: RLStepShape, group: int, seed: int) -> list[npt.NDArray[np.uint16]]:
    """A group's routing as the engine returns it (uint16, every decoder layer, one
    array per member), its first ``shared_prompt`` rows the same in every member; the
    same arrays for the same ``(group, seed)`` in every process."""
    spec = shape.spec
    valid = _valid_rows(spec)
    rng = np.random.default_rng([seed, group])
    layers, prompt = spec.decoder_layers, shape.shared_prompt
    prompt_rows = valid[rng.integers(0, len(valid), size=(prompt, layers))]
    out = []
    for _ in range(shape.group):
        rows = np.empty((shape.rows, layers, spec.top_k), dtype=np.uint16)
        rows[:prompt] = prompt_rows
        rows[prompt:] = valid[rng.integers(0, len(valid), size=(shape.rows - prompt, layers))]
        out.append(rows)
    return out


class RankShare(NamedTuple):
    """What a rank reports of one step."""

    samples: int
    """Samples whose rows it read."""
    acquire_s: float
    """Seconds its method spent acquiring leases (0 off routeplay)."""
    read_s: float
    """Seconds its method spent reading its rows (verl: copying the chunk its call
    carried, already pulled and unpickled before the method ran)."""
    release_s: float
    """Seconds its method spent ending its leases (routeplay: the materializer's last
    releases and waiting for all of them to land)."""
    digests: tuple[tuple[str, str], ...]
    """``(sample id, digest of its rows)`` per sample, on a checked run (else empty)."""


def rows_digest(rows: npt.NDArray[Any]) -> str:
    """A short digest of one sample's rows (canonical dtype, contiguous)."""
    return hashlib.sha256(np.ascontiguousarray(rows).data).hexdigest()[:24]


class _Settles:
    """A bench process's garbage collections: settled before a timed run, counted during
    it (``routeplay.bench.gc_meter``)."""

    def settle(self) -> None:
        gc_meter.settle()

    def collected(self) -> dict[str, Any]:
        return gc_meter.collected()


class _StepEngine(RoutesProducer):
    """LMDeploy's side: each sample's routing into the engine store, one put each."""

    def __init__(self, shape: RLStepShape) -> None:
        self.shape = shape

    def put_step(self, groups: int, seed: int) -> list[list[str]]:
        """Each group's keys, one per member; every payload written once, owned by the
        engine store (``put_from``: it takes the staged array from this actor)."""
        store = ray.get_actor("shared_store", namespace="lmdeploy")
        me = ray.get_runtime_context().current_actor
        out = []
        for group in range(groups):
            pending = []
            for payload in engine_routing(self.shape, group, seed):
                token, _ = self.stage_routes(payload, block_rows=0)
                shape, dtype = payload.shape, str(payload.dtype)
                pending.append(store.put_from.remote(me, token, shape, dtype))
            out.append([str(key) for key in ray.get(pending, timeout=_DEADLINE_S)])
        return out


class _StepRollout(AsyncRoutesProducer, _Settles):
    """The rollout worker: the step's answers, handed on one of four ways. An asyncio
    actor with one coroutine per GRPO group, as XTuner's and verl's rollout workers run
    their samples: the groups whose answers land together are handed on together."""

    def __init__(self, store: RouteStore, shape: RLStepShape) -> None:
        self.store = store
        self.shape = shape
        self.spec = shape.spec
        self._writer = ProducerWriter(producer=self, store=store)
        self._decoded: list[list[Routes]] = []

    def prepare(self, groups: int, seed: int) -> int:
        """Untimed: the step's answers decoded and validated (what a worker holds once
        the engine has answered); returns their canonical bytes."""
        self._decoded = [
            [canonicalize(rows, self.spec) for rows in engine_routing(self.shape, group, seed)]
            for group in range(groups)
        ]
        return sum(routes.nbytes for group in self._decoded for routes in group)

    async def write_groups(self) -> list[list[SampleRouting]]:
        """Producer path: each group's answers written together, each member finished."""
        shape = self.shape
        answers = [
            [
                EngineRouting(
                    engine=Engine.VLLM,
                    prompt_tokens=shape.shared_prompt,
                    completion_tokens=shape.tokens - shape.shared_prompt,
                    routes=routes,
                )
                for routes in group
            ]
            for group in self._decoded
        ]
        return list(
            await asyncio.gather(*(self._ingest(g, routings) for g, routings in enumerate(answers)))
        )

    async def adopt_groups(self, keys: Sequence[Sequence[str]]) -> list[list[SampleRouting]]:
        """LMDeploy-key path: each group's keys adopted together, each member finished."""
        shape = self.shape
        answers = [
            [
                EngineRouting(
                    engine=Engine.LMDEPLOY,
                    prompt_tokens=shape.shared_prompt,
                    completion_tokens=shape.tokens - shape.shared_prompt,
                    key=EngineKey(key=key, rows=shape.rows),
                )
                for key in group_keys
            ]
            for group_keys in keys
        ]
        return list(
            await asyncio.gather(*(self._ingest(g, routings) for g, routings in enumerate(answers)))
        )

    async def _ingest(self, group: int, routings: Sequence[EngineRouting]) -> list[SampleRouting]:
        """One group as a rollout worker writes it (``routeplay.rollout``): a
        continuation per member with the group's prompt, then one
        ``aingest_and_finish_group`` (carried rows: the group written and every member's
        lease ``rollout/<id>`` granted by the same call; keys: adopted, then leased),
        then each member's ``complete``. A refused member fails the bench: every answer
        is valid."""
        shape = self.shape
        prompt = tuple(range(group * shape.shared_prompt, (group + 1) * shape.shared_prompt))
        conts = [
            SampleRouting(sample_id=sample_id(group, member)).continuation(prompt_ids=prompt)
            for member in range(len(routings))
        ]
        finished = await aingest_and_finish_group(
            conts, routings, writer=self._writer, store=self.store, weight_version=VERSION,
            spec=self.spec,
        )  # fmt: skip
        done = [result for result in finished if isinstance(result, SampleRouting)]
        refused = [result for result in finished if not isinstance(result, SampleRouting)]
        if refused:  # the others' leases end first: the run fails, nothing is left held
            await adiscard_all(done)
            raise refused[0]
        response = shape.tokens - shape.shared_prompt
        return [
            routing.complete(prompt_tokens=shape.shared_prompt, response_tokens=response)
            for routing in done
        ]

    def put_groups(self) -> list[list[Any]]:
        """Ray's floor: each group's rows laid out as routeplay's payload (the prompt's
        rows once, then each member's own) and ``ray.put`` once; the references, wrapped
        so that they reach the driver as references."""
        return [[ray.put(rows) for rows in self._laid_out()]]

    def owned_groups(self) -> Any:
        """Ray's floor with an owner: the same arrays as ``put_groups``, returned to the
        caller (one return value per group: the caller owns them; Ray stores them in
        this node's object store)."""
        arrays = tuple(self._laid_out())
        return arrays if len(arrays) > 1 else arrays[0]

    def _laid_out(self) -> Iterator[npt.NDArray[Any]]:
        prompt = self.shape.shared_prompt
        for group in self._decoded:
            arrays = [routes.array for routes in group]
            yield np.concatenate([arrays[0][:prompt], *(a[prompt:] for a in arrays)])

    def verl_groups(self) -> Any:
        """verl's path: every sample int16 and padded, the worker's samples one batch."""
        shape = self.shape
        return verl_path.sample_batch(
            [routes.array for group in self._decoded for routes in group],
            [sample_id(g, m) for g, group in enumerate(self._decoded) for m in range(len(group))],
            prompt_length=shape.shared_prompt,
            response_length=shape.tokens - shape.shared_prompt,
            prompt_tokens=shape.shared_prompt,
        )


class _StepOwner:
    """Ray's floor with an owner: a long-lived actor that calls the rollout worker and so
    owns the objects it returns (they outlive the worker), as an application without
    routeplay would keep payloads alive past their writer."""

    def __init__(self, rollout: Any) -> None:
        self._rollout = rollout
        self._held: list[Any] = []

    def make(self, groups: int) -> list[list[Any]]:
        """The step's group objects, made by the rollout worker and owned here; returns
        once every one exists (the references, wrapped, to the driver)."""
        refs = self._rollout.owned_groups.options(num_returns=groups).remote()
        refs = list(refs) if groups > 1 else [refs]
        # Not fetched here: the bytes stay on the worker's node until a rank reads them
        # (a failed call fails the rank's read, and so the run).
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_DEADLINE_S, fetch_local=False)
        if len(ready) != len(refs):
            raise RuntimeError(f"{len(refs) - len(ready)} of {len(refs)} groups never made")
        self._held = refs
        return [refs]

    def drop(self) -> None:
        """The end of the step: the owner lets its objects go (the driver's and the
        ranks' references are gone by then)."""
        self._held = []


class _StepRank(_Settles):
    """One data-parallel trainer rank."""

    def __init__(self, store: RouteStore, shape: RLStepShape, dp_rank: int) -> None:
        self.store = store
        self.shape = shape
        self.spec = shape.spec
        self.dp_rank = dp_rank
        self._buffers: dict[tuple[int, ...], npt.NDArray[Any]] = {}  # reused across steps

    def read_routeplay(self, plan: PackingPlan, holder: str, check: bool = False) -> RankShare:
        """Lease this rank's share (``Materializer.leasing``: one lease over every payload
        its samples read, its blocks pulled as one bundle), read it one micro-batch at
        a time, then wait for the lease's release to land."""
        coords = RankCoords(dp_rank=self.dp_rank)
        samples = sum(len(plan.samples_of(mb)) for mb in plan.schedule(self.dp_rank))
        start = time.perf_counter()
        materializer = Materializer.leasing(
            self.store, plan, coords, holder=f"{holder}/dp{self.dp_rank}", prefetch=1
        )
        acquired = time.perf_counter()
        digests: list[tuple[str, str]] = []
        with materializer as micro_batches:
            for mb in micro_batches:
                if check:
                    digests.extend(_micro_batch_digests(plan, mb.index, mb.routes))
            read = time.perf_counter()
        self.store.flush()
        released = time.perf_counter()
        return RankShare(
            samples, acquired - start, read - acquired, released - read, tuple(digests)
        )

    def read_ray(self, wrapped: list[list[Any]], groups: Sequence[int], check: bool) -> RankShare:
        """Ray's floor: one ``ray.get`` of this rank's group objects, each sample's rows
        copied into its pack (prompt rows, then its own), as the materializer lays a pack
        out; the views are dropped at the end."""
        shape = self.shape
        prompt, rows = shape.shared_prompt, shape.rows
        own = rows - prompt
        pack = self._buffer((shape.pack_length, *self.spec.row_shape), self.spec.dtype)
        digests: list[tuple[str, str]] = []
        start = time.perf_counter()
        arrays = ray.get(wrapped[0], timeout=_DEADLINE_S)
        for group, array in zip(groups, arrays, strict=True):
            for member in range(shape.group):
                at = member * rows
                pack[at : at + prompt] = array[:prompt]
                pack[at + prompt : at + rows] = array[
                    prompt + member * own : prompt + (member + 1) * own
                ]
                if check:
                    digests.append((sample_id(group, member), rows_digest(pack[at : at + rows])))
        del arrays
        read_s = time.perf_counter() - start
        return RankShare(len(groups) * shape.group, 0.0, read_s, 0.0, tuple(digests))

    def read_verl(self, chunk: Any, check: bool) -> RankShare:
        """verl's rank: its chunk arrived whole with the call (pulled and unpickled before
        this method runs); its rows are copied once (where verl moves them to the
        device)."""
        start = time.perf_counter()
        routed = verl_path.routed_experts(chunk)
        mine = self._buffer(routed.shape, routed.dtype)
        np.copyto(mine, routed)
        read_s = time.perf_counter() - start
        digests: tuple[tuple[str, str], ...] = ()
        if check:
            rows = self.shape.rows
            narrow = mine[:, :rows].astype(self.spec.dtype)
            digests = tuple(
                (sid, rows_digest(narrow[i])) for i, sid in enumerate(verl_path.sample_ids(chunk))
            )
        return RankShare(len(routed), 0.0, read_s, 0.0, digests)

    def _buffer(self, shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
        if shape not in self._buffers:
            self._buffers = {shape: np.empty(shape, dtype)}
        return self._buffers[shape]


def _micro_batch_digests(
    plan: PackingPlan, index: int, routes: npt.NDArray[Any]
) -> list[tuple[str, str]]:
    """Each sample's rows in one micro-batch (one SP/CP rank: its packs back to back)."""
    out, base = [], 0
    for pack_index in plan.micro_batches[index]:
        pack = plan.packs[pack_index]
        for sample in pack.samples:
            rows = routes[base + sample.offset : base + sample.stop]
            out.append((sample.sample_id, rows_digest(rows)))
        base += pack.length
    return out


StepEngine: Any = producer_actor(_StepEngine, num_cpus=0)
StepRollout: Any = producer_actor(_StepRollout, num_cpus=0)
StepRank: Any = ray.remote(num_cpus=0)(_StepRank)
StepOwner: Any = ray.remote(num_cpus=0)(_StepOwner)
