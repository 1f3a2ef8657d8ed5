"""Building blocks for the Megatron tests: routers as Megatron builds them, a step's routes in
a store, the materializer's rows per simulated rank, and the tokens Megatron gives that rank.

The expected routing of a simulated rank is derived independently of routeplay's layout
code: from the whole pack (sample rows at their offsets, distinct padding elsewhere), the
token positions Megatron's own split functions give the rank (or, for the THD per-sequence
CP cut that only TransformerEngine implements in Megatron, a direct transcription of
verl's ``preprocess_packed_seqs`` rule), indexed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.integrations.megatron import MegatronLayout
from routeplay.store import RouteStore, StoreConfig
from routeplay.train import Materializer, MicroBatchRoutes, PackingPlan, pack_samples

HIDDEN = 16


@contextlib.contextmanager
def cpu_patches() -> Iterator[None]:
    """Megatron-Core's GPU assumptions, patched for the block (see ``conftest.py``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        patch.setattr(moe_utils, "te_general_gemm", None, raising=False)
        # CheckpointFunction saves and restores the CUDA RNG state around the recompute
        # (the CPU state, which is what drives these tests, is saved too).
        patch.setattr(
            megatron_random,
            "_get_cuda_rng_state",
            lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8),
        )
        patch.setattr(megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
        yield


class _CudaTensorsOnCpu(torch.overrides.TorchFunctionMode):
    """Tensors Megatron's schedules create with ``device="cuda"`` are made on the CPU."""

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("device") == "cuda":  # the schedules' token counter
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cpu_schedule() -> contextlib.AbstractContextManager[Any]:
    """Around a ``get_forward_backward_func()`` call on CPU."""
    return _CudaTensorsOnCpu()


@dataclass(frozen=True)
class FakeGroup:
    """A process group as Megatron's split helpers use it: only ``size()`` and ``rank()``."""

    world: int
    me: int

    def size(self) -> int:
        return self.world

    def rank(self) -> int:
        return self.me


def random_routing(spec: RouteSpec, rows: int, seed: int) -> npt.NDArray[np.int64]:
    """Valid ``[rows, L, K]`` ids: K distinct experts per (row, layer)."""
    keys = np.random.default_rng(seed).random((rows, spec.num_layers, spec.num_experts))
    return np.argsort(keys, axis=-1)[..., : spec.top_k].astype(np.int64)


def transformer_config(spec: RouteSpec, **overrides: Any) -> TransformerConfig:
    """A tiny MoE config with routing replay on, CPU-initialized, no aux losses."""
    fields: dict[str, Any] = {
        "num_layers": spec.decoder_layers,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": 32,
        "num_attention_heads": 2,
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.top_k,
        "moe_enable_routing_replay": True,
        "use_cpu_initialization": True,
        "moe_router_load_balancing_type": "none",
        "add_bias_linear": False,
        "moe_token_dispatcher_type": "allgather",
    }
    return TransformerConfig(**(fields | overrides))


class Layer(torch.nn.Module):
    """The part of a TransformerLayer that matters here: ``mlp.router`` (MoE layers only)."""

    def __init__(self, mlp: torch.nn.Module | None) -> None:
        super().__init__()
        self.mlp = mlp


class Chunk(torch.nn.Module):
    """One model chunk: ``decoder.layers`` with Megatron's global layer numbers."""

    def __init__(self, config: TransformerConfig, layers: Sequence[int], spec: RouteSpec) -> None:
        super().__init__()
        moe = set(spec.moe_layer_indices())
        built = []
        for decoder in layers:
            router = None
            if decoder in moe:
                router = TopKRouter(
                    config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
                )
                router.set_layer_number(decoder + 1)  # as TransformerLayer does: 1-based, global
            built.append(Layer(torch.nn.ModuleDict({"router": router}) if router else None))
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(built)

    def routers(self) -> list[TopKRouter]:
        return [m for m in self.modules() if isinstance(m, TopKRouter)]


class Step:
    """A step's samples in a local route store, packed for a layout, and the whole packs."""

    def __init__(
        self,
        spec: RouteSpec,
        tokens: Sequence[int],
        pack_length: int,
        *,
        seed: int = 0,
        seq_align: int = 1,
        packs_per_micro_batch: int = 1,
        feeds_last_token: bool = False,
        dp_size: int = 1,
        pack_multiple: int | None = None,
    ) -> None:
        self.spec = spec
        self.store = RouteStore.local(StoreConfig(run=f"megatron-{seed}"))
        self.arrays: dict[str, npt.NDArray[Any]] = {}
        samples: list[tuple[str, Handle, int]] = []
        for i, count in enumerate(tokens):
            array = random_routing(spec, count - 1, seed + i)
            self.arrays[f"s{i}"] = array
            samples.append((f"s{i}", self.store.put(canonicalize(array, spec)), count))
        # The step's batch keeps every payload alive while each rank holds (and ends) its own.
        self.step_leases = [self.store.acquire(handle, "train/step") for _, handle, _ in samples]
        self.plan: PackingPlan = pack_samples(
            samples,
            pack_length,
            packs_per_micro_batch,
            dp_size=dp_size,
            seq_align=seq_align,
            feeds_last_token=feeds_last_token,
            pack_multiple=pack_multiple,
        )

    def whole_pack(self, index: int) -> npt.NDArray[Any]:
        """``[length, L, K]`` of a pack: sample rows at their offsets, distinct padding."""
        pack = self.plan.packs[index]
        full = np.empty((pack.length, *self.spec.row_shape), np.int64)
        full[:] = np.arange(self.spec.top_k) % self.spec.num_experts
        for s in pack.samples:
            full[s.offset : s.stop] = self.arrays[s.sample_id]
        return full

    def micro_batches(
        self, layout: MegatronLayout, layers: Sequence[int] | None = None
    ) -> list[MicroBatchRoutes]:
        """This rank's micro-batches, read through the materializer (copies kept); with
        ``layers``, only those MoE layers' columns (a pipeline stage's read)."""
        coords = layout.coords()
        leases = {
            s.sample_id: self.store.acquire(s.handle, f"rank {coords.describe()}")
            for mb in self.plan.schedule(coords.dp_rank)
            for s in self.plan.samples_of(mb)
        }
        with Materializer(
            self.store, self.plan, coords, leases=leases, prefetch=0, layers=layers
        ) as m:
            return list(m)


def thd_positions(step: Step, pack_index: int, layout: MegatronLayout) -> torch.Tensor:
    """Pack positions of the tokens one rank's routers see, in order, for a THD pack.

    CP: each sequence (a sample's span) is cut into ``2 * cp`` chunks and the rank keeps
    chunks ``r`` and ``2 * cp - 1 - r`` (verl ``preprocess_packed_seqs``); the tail past the
    last sequence is padding, split evenly. SP: Megatron's own scatter along TP.
    """
    pack = step.plan.packs[pack_index]
    cp, r = layout.cp_size, layout.cp_rank
    parts: list[torch.Tensor] = []
    end = 0
    for s in pack.samples:
        chunks = (
            torch.arange(s.offset, s.end).chunk(2 * cp)
            if cp > 1
            else [torch.arange(s.offset, s.end)]
        )
        parts += [chunks[r], chunks[2 * cp - 1 - r]] if cp > 1 else chunks
        end = s.end
    tail = torch.arange(end, pack.length)
    parts.append(tail.chunk(cp)[r] if cp > 1 and len(tail) else tail)
    local = torch.cat(parts)
    return _sp_scatter(local[:, None], layout)[:, 0]


def bshd_positions(step: Step, packs: Sequence[int], layout: MegatronLayout) -> torch.Tensor:
    """``[seq, batch]`` pack positions a rank's routers see for BSHD rows (one pack per row).

    CP: Megatron's ``get_batch_on_this_cp_rank``; then the ``[s, b]`` transpose Megatron's
    embedding makes, then Megatron's SP scatter along the sequence.
    """
    length = step.plan.packs[packs[0]].length
    rows = torch.stack([torch.arange(length) + 10_000 * i for i in range(len(packs))])
    batch = get_batch_on_this_cp_rank(
        {"tokens": rows}, cp_group=FakeGroup(layout.cp_size, layout.cp_rank)
    )
    return _sp_scatter(batch["tokens"].t().contiguous(), layout)


def _sp_scatter(local: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    if not layout.sequence_parallel:
        return local
    return scatter_to_sequence_parallel_region(
        local, group=FakeGroup(layout.tp_size, layout.tp_rank)
    )


def routing_ids(routing_map: torch.Tensor) -> npt.NDArray[np.int64]:
    """Sorted expert ids of each row of a ``[tokens, E]`` routing map (K per row)."""
    rows, experts = routing_map.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=routing_map.shape[0])
    top_k = int(counts.max())
    assert bool((counts == top_k).all()), "some token was routed to fewer experts"
    return experts.view(-1, top_k).numpy()
