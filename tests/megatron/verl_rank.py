"""verl's router-replay helpers as one rank of a CP x TP layout sees them, in one process.

verl's ``set_router_replay_data`` reads the rank from Megatron's parallel-state getters,
scatters rows over the TP ranks with Megatron's ``scatter_to_sequence_parallel_region``
(a split along the first dimension) and hands ids to the routers its own model walk
(``iter_model_routers``) finds. ``as_rank`` makes the getters answer for one rank and the
scatter keep that rank's part; ``RecordingRouter`` stands for a ``TopKRouter`` in that walk
and keeps what verl hands it.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch


class _Recorder:
    """What verl hands one router: its target ids and the replay mask."""

    def __init__(self) -> None:
        self.ids: Any = None
        self.mask: Any = None

    def set_target_indices(self, ids: Any, replay_mask: Any = None) -> None:
        self.ids, self.mask = ids, replay_mask


class RecordingRouter(torch.nn.Module):
    """A router of decoder layer ``layer_number`` (1-based, as Megatron numbers them)."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.router_replay = _Recorder()


def as_rank(
    rru: Any, monkeypatch: pytest.MonkeyPatch, *, tp: int, tp_rank: int, cp: int, cp_rank: int
) -> None:
    """verl's ``router_replay_utils`` (``rru``) as this rank sees it, on the CPU."""
    monkeypatch.setattr(rru, "device_name", "cpu")
    monkeypatch.setattr(rru, "TopKRouter", RecordingRouter)
    monkeypatch.setattr(rru.mpu, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(rru.mpu, "get_tensor_model_parallel_rank", lambda: tp_rank)
    monkeypatch.setattr(rru.mpu, "get_context_parallel_world_size", lambda: cp)
    monkeypatch.setattr(rru.mpu, "get_context_parallel_rank", lambda: cp_rank)
    # Megatron's scatter to the SP region keeps this TP rank's part of the first dimension.
    monkeypatch.setattr(rru, "scatter_to_sequence_parallel_region", lambda x: x.chunk(tp)[tp_rank])


def r3_targets(
    rru: Any,
    layout: Any,
    routes: Sequence[np.ndarray],
    tokens: Sequence[int],
    response: Sequence[int],
    num_layers: int,
) -> dict[int, tuple[Any, Any]]:
    """What verl's R3 (``forward_step``, mode R3) hands each router of this rank's model
    chunks for one micro-batch of samples: decoder layer -> (ids, replay mask). Rank
    state comes from ``as_rank``; ``layout`` (a ``MegatronLayout``) names the chunks'
    layers."""
    input_ids = torch.nested.as_nested_tensor(
        [torch.arange(t) for t in tokens], layout=torch.jagged
    )
    response_mask = torch.zeros(len(tokens), max(response), dtype=torch.bool)
    for i, n in enumerate(response):
        response_mask[i, :n] = True
    nested = torch.nested.as_nested_tensor(
        [torch.from_numpy(r.astype(np.int64)) for r in routes], layout=torch.jagged
    )
    aligned = rru.align_r3_router_replay_data(nested, input_ids)
    mask = rru.build_r3_replay_mask(input_ids, response_mask)
    config = types.SimpleNamespace(fp8=None, num_layers=num_layers)
    out = {}
    for vp in range(layout.chunks):
        chunk = torch.nn.ModuleList([RecordingRouter(d + 1) for d in layout.chunk_layers(vp)])
        rru.set_router_replay_data(aligned, None, config, vp, replay_mask=mask, model=chunk)
        for router in chunk:
            out[router.layer_number - 1] = (router.router_replay.ids, router.router_replay.mask)
    return out
