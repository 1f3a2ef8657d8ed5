"""A real pipeline: two gloo processes (PP=2) run Megatron-Core's 1F1B schedule
(``forward_backward_pipelining_without_interleaving``, activations sent between the stages
by its p2p code) over three micro-batches with full recompute.

Each stage holds two of the four MoE layers; its session replays only those columns of
the step's routes (given whole, or as the stage's own read of its columns), and every
forward and recompute of its routers (several forwards in flight: 1F1B warm-up) must
route exactly the replayed ids, with nothing pending at the end.
On CPU the stage processes also need ``torch.cuda.synchronize`` (called by the p2p code
after ``batch_isend_irecv``) to do nothing.
"""

from __future__ import annotations

import socket
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'routeplay[megatron]')"
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STAGES, MICRO_BATCHES, SEQ, BATCH = 2, 3, 6, 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stage(rank: int, port: int, stage_read: bool) -> None:
    """One pipeline stage (a spawned process); raises if its routing differs. With
    ``stage_read`` the stage is given only its own MoE layers' columns (what
    ``Materializer(layers=layout.moe_layers(spec))`` reads), as micro-batches."""
    import os

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=STAGES)
    from helpers import cpu_patches, cpu_schedule, random_routing, routing_ids
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from test_megatron_recompute import build

    from routeplay.core import RouteSpec
    from routeplay.integrations.megatron import MegatronLayout, MegatronReplay
    from routeplay.train import MicroBatchRoutes
    from routeplay.train.replay_core import in_backward

    parallel_state.initialize_model_parallel(1, STAGES)
    spec = RouteSpec(num_layers=4, top_k=2, num_experts=8)
    try:
        with cpu_patches(), pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
            model = build(
                spec=spec,
                pipeline_model_parallel_size=STAGES,
                pipeline_dtype=torch.float32,
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
                pre_process=rank == 0,
                post_process=rank == STAGES - 1,
            )
            routes = [random_routing(spec, SEQ * BATCH, 7 + i) for i in range(MICRO_BATCHES)]
            tokens = [
                torch.randint(0, 32, (BATCH, SEQ), generator=torch.Generator().manual_seed(i))
                for i in range(MICRO_BATCHES)
            ]
            seen: dict[tuple[int, bool], list[Any]] = {}
            for i, layer in enumerate(model.decoder.layers):

                def keep(module: Any, args: Any, out: Any, i: int = i) -> None:
                    seen.setdefault((i, in_backward()), []).append(out[1].clone())

                layer.mlp.router.register_forward_hook(keep)
            count = iter(range(MICRO_BATCHES))

            layout = MegatronLayout(pp_size=STAGES, pp_rank=rank, num_layers=4)
            layers = layout.moe_layers(spec)
            given = [
                MicroBatchRoutes(
                    index=i,
                    packs=(),
                    routes=np.ascontiguousarray(r[:, list(layers)]),
                    mask=np.ones(len(r), bool),
                    layers=layers,
                )
                if stage_read
                else r
                for i, r in enumerate(routes)
            ]

            def forward_step(data: Any, model: Any) -> tuple[Any, Any]:
                i = next(count)
                position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
                with session.replay(given[i]):
                    output = model(tokens[i], position_ids, None, labels=tokens[i])
                return output, lambda losses: (losses.float().mean(), {})

            with MegatronReplay(model, spec, layout=layout) as session:
                with cpu_schedule():
                    get_forward_backward_func()(
                        forward_step_func=forward_step,
                        data_iterator=None,
                        model=[model],
                        num_microbatches=MICRO_BATCHES,
                        seq_length=SEQ,
                        micro_batch_size=BATCH,
                        forward_only=False,
                    )
                stats = session.stats()
            assert stats.pending == 0, stats
            assert stats.replayed == stats.recomputes == MICRO_BATCHES * 2, stats
            for i, layer in enumerate(model.decoder.layers):
                column = layer.layer_number - 1  # global: stage 1 holds layers 2 and 3
                assert column == 2 * rank + i
                for backward in (False, True):
                    maps = seen[i, backward]  # in micro-batch order (FIFO)
                    assert len(maps) == MICRO_BATCHES
                    for mb, routing_map in enumerate(maps):
                        rows = routes[mb].reshape(BATCH, SEQ, 4, 2).transpose(1, 0, 2, 3)
                        want = np.sort(rows.reshape(SEQ * BATCH, 4, 2)[:, column], axis=-1)
                        np.testing.assert_array_equal(routing_ids(routing_map), want)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


# A stage reading every layer (the plain read) runs in `make test-long`; a stage reading
# only its own layers, the path that differs, in `make test` (each spawns two processes).
@pytest.mark.parametrize(
    "stage_read",
    [
        pytest.param(False, marks=pytest.mark.long, id="all-layers"),
        pytest.param(True, id="stage-layers"),
    ],
)
def test_a_two_stage_1f1b_step_replays_each_stages_layers(stage_read: bool) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_stage, args=(_free_port(), stage_read), nprocs=STAGES)
