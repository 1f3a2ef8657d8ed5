"""The actors of verl's data path against routeplay's (``routeplay.bench.verl_step``): one
rollout worker and the trainer's DP x TP x PP Megatron rank actors.

The rollout worker starts every step holding the step's decoded routing (untimed: what
it holds once generation is done) and hands it on one of two ways:

- **verl** (``routeplay.bench.verl_path``, verl's own ``DataProto``): each sample widened
  to int16 and zero-padded to the whole prompt + response width, the batch returned to
  the driver whole;
- **routeplay**: each sample written once (one producer put for the batch, canonical
  uint8), the handles returned.

A rank (``VerlRank``) gets, per pass, verl's chunk of its DP rank as a call argument
(pulled and deserialized whole, every layer, before its method runs) or its chunk's
handles, and reads only its rows (its sequence-parallel part, as Megatron scatters
them) of its stage's MoE layers through the ``Materializer``. On a checked step the rank
keeps what verl's chunk gave it (each sample un-padded, its layers) and compares every
row the materializer laid out against it: the two paths must deliver the same rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import ray

from routeplay.bench import verl_path
from routeplay.bench.verl_figures import RankPass, RowsCheck, rank_name
from routeplay.bench.workloads import VerlStepShape
from routeplay.core import Handle, Routes
from routeplay.integrations.megatron import MegatronLayout
from routeplay.store import RoutesProducer, RouteStore, producer_actor
from routeplay.train import Materializer, MicroBatchRoutes, PackingPlan, local_ranges, pack_samples

__all__ = ["VerlRank", "VerlRollout", "sample_rows"]


def sample_rows(shape: VerlStepShape, sample: int) -> npt.NDArray[Any]:
    """A sample's routing as decoded (canonical dtype, ``prompt + response - 1`` rows,
    every MoE layer), drawn from 512 top-k rows of distinct experts; the same array in
    every process."""
    spec = shape.spec
    prompt, response = shape.lengths(sample)
    rng = np.random.default_rng(sample)
    block = np.argsort(rng.random((512, spec.num_experts)), axis=1)[:, : spec.top_k]
    picks = rng.integers(0, 512, size=(prompt + response - 1) * spec.num_layers)
    return block[picks].reshape(-1, spec.num_layers, spec.top_k).astype(spec.dtype)


class _VerlRollout(RoutesProducer):
    """One rollout worker holding the step's decoded routing (untimed: generation)."""

    def __init__(self, store: RouteStore, shape: VerlStepShape) -> None:
        self.store, self.shape = store, shape
        self.rows = [sample_rows(shape, s) for s in range(shape.samples)]

    def verl_batch(self) -> Any:
        """verl's batch: every sample int16, padded to the prompt + response width (its
        prompt left-padded), concatenated."""
        shape = self.shape
        parts = [
            verl_path.sample_batch(
                [rows],
                [str(s)],
                prompt_length=shape.prompt,
                response_length=shape.response,
                prompt_tokens=shape.lengths(s)[0],
            )
            for s, rows in enumerate(self.rows)
        ]
        return verl_path.concat(parts)

    def write(self) -> list[Handle]:
        """routeplay's path: every sample written once, one producer put for the batch."""
        batch = [Routes(array=rows, spec=self.shape.spec) for rows in self.rows]  # valid
        return self.put_routes_many(self.store, batch)


class _VerlRank:
    """One trainer rank: DP ``dp``, TP ``tp`` (sequence parallel), PP stage ``pp``."""

    def __init__(self, store: RouteStore, shape: VerlStepShape, dp: int, tp: int, pp: int) -> None:
        self.store, self.shape = store, shape
        first, last = shape.stage_layers()
        self.layout = MegatronLayout(
            dp_rank=0,  # the rank gets its own chunk: a plan of one DP rank
            tp_size=shape.tp,
            tp_rank=tp,
            sequence_parallel=True,
            pp_size=shape.pp,
            pp_rank=pp,
            num_layers=shape.spec.decoder_layers,
            first_stage_layers=first,
            last_stage_layers=last,
            qkv_format="thd",
        )
        self.layers = self.layout.moe_layers(shape.spec)
        self.name = rank_name(dp, tp, pp)
        self._verl_rows: dict[str, npt.NDArray[Any]] = {}  # a checked step's, per sample

    def verl_pass(self, chunk: Any, check: bool = False) -> RankPass:
        """The chunk arrived deserialized (every layer, int16, padded): the bytes it
        brought into this process, held at once. On a checked step, each sample's rows
        of this stage's layers are kept for the routeplay pass to compare with."""
        routed = verl_path.routed_experts(chunk)
        if check:
            self._verl_rows = {
                sid: self._unpadded(routed[i], int(sid))
                for i, sid in enumerate(verl_path.sample_ids(chunk))
            }
        nbytes = int(routed.nbytes)
        return RankPass(nbytes, nbytes)

    def _unpadded(self, padded: npt.NDArray[Any], sample: int) -> npt.NDArray[Any]:
        prompt, response = self.shape.lengths(sample)
        start = self.shape.prompt - prompt  # the prompt is left-padded
        rows = padded[start : start + prompt + response - 1][:, list(self.layers)]
        return np.ascontiguousarray(rows.astype(self.shape.spec.dtype))

    def routeplay_pass(
        self, samples: list[tuple[str, Handle, int]], check: bool = False
    ) -> RankPass:
        """This rank's rows of its stage's layers, micro-batch by micro-batch: the bytes
        copied into this process, and the most routing held at once. On a checked step,
        every row is compared with what verl's chunk gave this rank."""
        align = self.layout.seq_align()
        plan = pack_samples(samples, self.shape.pack_tokens, feeds_last_token=True, seq_align=align)
        rows_check = _Comparison(self._verl_rows, self.name) if check else None
        with Materializer.leasing(
            self.store,
            plan,
            self.layout.coords(),
            holder=f"train/{self.name}",
            layers=self.layers,
        ) as materializer:
            for mb in materializer:
                if rows_check is not None:
                    rows_check.add(plan, self.layout, mb)
        self.store.flush()
        stats = materializer.stats()
        result = None if rows_check is None else rows_check.result()
        return RankPass(stats.bytes_out, stats.peak_resident_bytes, result)


class _Comparison:
    """The routeplay rows of one rank's micro-batches against verl's rows of its chunk."""

    def __init__(self, verl_rows: dict[str, npt.NDArray[Any]], name: str) -> None:
        self.verl_rows, self.name = verl_rows, name
        self.rows = self.compared = 0
        self.ours, self.theirs = hashlib.sha256(), hashlib.sha256()

    def add(self, plan: PackingPlan, layout: MegatronLayout, mb: MicroBatchRoutes) -> None:
        self.rows += int(mb.mask.sum())
        for sample_id, lo, hi, got in _pieces(plan, layout, mb):
            if sample_id not in self.verl_rows:
                raise RuntimeError(
                    f"{self.name}: routeplay gave it sample {sample_id}, which verl's chunk "
                    f"did not (it had {sorted(self.verl_rows)[:5]})"
                )
            want = self.verl_rows[sample_id][lo:hi]
            for digest, rows in ((self.ours, got), (self.theirs, want)):
                digest.update(f"{sample_id}:{lo}:{hi}".encode())
                digest.update(np.ascontiguousarray(rows).data)
            self.compared += hi - lo

    def result(self) -> RowsCheck:
        return RowsCheck(
            self.rows, self.compared, self.ours.hexdigest()[:24], self.theirs.hexdigest()[:24]
        )


def _pieces(
    plan: PackingPlan, layout: MegatronLayout, mb: MicroBatchRoutes
) -> Iterator[tuple[str, int, int, npt.NDArray[Any]]]:
    """``(sample id, first row, stop row, its rows in the micro-batch)`` for each part of
    a sample the rank holds, in the micro-batch's row order (its packs, each cut by
    ``local_ranges``: the materializer's layout, recomputed from the plan)."""
    coords, out = layout.coords(), 0
    for index in mb.packs:
        pack = plan.packs[index]
        for start, stop in local_ranges(pack, coords):
            for sample in pack.samples:
                lo, hi = max(start, sample.offset), min(stop, sample.stop)
                if lo < hi:
                    rows = mb.routes[out + lo - start : out + hi - start]
                    yield sample.sample_id, lo - sample.offset, hi - sample.offset, rows
            out += stop - start


VerlRollout: Any = producer_actor(_VerlRollout, num_cpus=0)
VerlRank: Any = ray.remote(num_cpus=0)(_VerlRank)
