"""routeplay's per-rank rows and masks against verl 0.9.1's own ``set_router_replay_data``.

verl's Megatron engine (``transformer_impl.forward_step``, R3) aligns each sample's rollout
routes with its input ids (``align_r3_router_replay_data``: one placeholder row for the
last token), builds the replay mask (``build_r3_replay_mask``: every row but each
sequence's last), then ``set_router_replay_data`` packs the sequences THD-style
(``preprocess_thd_engine``: per-sequence padding to ``2 * cp * tp``, zigzag CP), scatters
the CP-local rows over the TP ranks (sequence parallelism) and hands each router of the
rank's model its layer's ids and the mask.

Here verl's functions run unchanged in one process for every rank of a CP x TP x PP
layout (uneven pipeline stages and virtual stages included): Megatron's parallel-state
getters answer for the rank, the SP scatter is Megatron's split along the first dimension,
and the routers are recorders found by verl's own model walk. routeplay's side is what a
verl rank would run: the samples in the route store, ``pack_samples`` with the layout's
alignment, and ``Materializer(layers=layout.moe_layers(spec))``. Every rank's rows (where
either side replays) and masks must be equal, for every layer the rank's routers hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (make test)")
rru = pytest.importorskip(
    "verl.utils.megatron.router_replay_utils",
    reason="verl is not installed (make test installs it)",
)

from verl_rank import as_rank, r3_targets  # noqa: E402

from routeplay.core import Routes, RouteSpec  # noqa: E402
from routeplay.integrations.megatron import MegatronLayout  # noqa: E402
from routeplay.store import RouteStore, StoreConfig  # noqa: E402
from routeplay.train import Materializer, pack_samples  # noqa: E402

SPEC = RouteSpec(num_layers=8, top_k=2, num_experts=16)
TOKENS = [9, 14, 5, 11]  # each sample's input ids (prompt + response)
RESPONSE = [4, 6, 2, 5]


def _verl_rank(layout: MegatronLayout, routes: list[np.ndarray], monkeypatch: Any) -> dict:
    """verl's ids and mask per global decoder layer, for one rank."""
    tp, cp = layout.tp_size, layout.cp_size
    as_rank(rru, monkeypatch, tp=tp, tp_rank=layout.tp_rank, cp=cp, cp_rank=layout.cp_rank)
    return r3_targets(rru, layout, routes, TOKENS, RESPONSE, SPEC.num_layers)


LAYOUTS = [
    {"cp_size": 2, "tp_size": 2},
    {"cp_size": 1, "tp_size": 2},
    {"cp_size": 2, "tp_size": 1},
    {"cp_size": 2, "tp_size": 2, "pp_size": 2, "vp_size": 2},
    {"cp_size": 1, "tp_size": 2, "pp_size": 3, "first_stage_layers": 2, "last_stage_layers": 2},
]


@pytest.mark.parametrize("fields", LAYOUTS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
def test_every_rank_gets_the_rows_and_mask_verl_gives_its_routers(
    fields: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    routes = [
        np.argsort(rng.random((t - 1, SPEC.num_layers, SPEC.num_experts)), axis=-1)[
            ..., : SPEC.top_k
        ].astype(SPEC.dtype)
        for t in TOKENS
    ]
    store = RouteStore.local(StoreConfig(run="verl-layout"))
    # The driver's batch holds every sample's lease while the ranks read.
    batch = [store.put_leased(Routes(array=r, spec=SPEC), "verl/batch") for r in routes]
    samples = [
        (f"s{i}", handle, t) for i, ((handle, _), t) in enumerate(zip(batch, TOKENS, strict=True))
    ]
    pp, tp, cp = fields.get("pp_size", 1), fields["tp_size"], fields["cp_size"]
    for pp_rank in range(pp):
        for cp_rank in range(cp):
            for tp_rank in range(tp):
                layout = MegatronLayout(
                    **fields,
                    pp_rank=pp_rank,
                    cp_rank=cp_rank,
                    tp_rank=tp_rank,
                    sequence_parallel=tp > 1,
                    qkv_format="thd",
                    num_layers=SPEC.num_layers,
                )
                want = _verl_rank(layout, routes, monkeypatch)
                align = layout.seq_align()
                plan = pack_samples(
                    samples, 1024, feeds_last_token=True, seq_align=align, pack_multiple=align
                )
                layers = layout.moe_layers(SPEC)
                assert sorted(want) == list(layers)  # all-MoE spec: MoE layer = decoder layer
                with Materializer.leasing(
                    store, plan, layout.coords(), holder="verl/rank", layers=layers
                ) as materializer:
                    [mb] = list(materializer)
                mask = torch.from_numpy(mb.mask)
                for column, layer in enumerate(layers):
                    ids, verl_mask = want[layer]
                    assert torch.equal(verl_mask.bool(), mask), (layout, layer)
                    got = torch.from_numpy(mb.routes[:, column].astype(np.int64))
                    assert torch.equal(ids[mask], got[mask]), (layout, layer)
    for _, lease in batch:
        lease.release()
    assert store.leaks() == []  # every rank's leases ended with its materializer
