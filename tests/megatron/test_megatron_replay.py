"""Replay through the real Megatron-Core ``TopKRouter`` / ``MoELayer``, rank by rank.

For each simulated layout (TP with sequence parallelism, CP, both, BSHD, PP with virtual
stages) every rank reads its rows through the materializer, its routers run on the tokens
Megatron gives that rank, and Megatron's own ``routing_map`` must name exactly the experts
of those tokens in the whole pack. Also: recompute in the backward replays each forward's
ids (FIFO over micro-batches), R2 records then replays, gradients reach the gate, what
would misroute is refused, and Megatron's global replay state is clear after every session.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'routeplay[megatron]')"
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from helpers import (
        HIDDEN,
        Chunk,
        Step,
        bshd_positions,
        routing_ids,
        thd_positions,
        transformer_config,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router_replay import (  # noqa: F401 (NativeAlways's enum)
        RouterReplay,
        RouterReplayAction,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from routeplay.core import RouteSpec  # noqa: E402
from routeplay.errors import (  # noqa: E402
    DuplicateExperts,
    ExpertOutOfRange,
    MisuseError,
    ReplayNotApplied,
    RowCountMismatch,
    SpecMismatch,
)
from routeplay.integrations.megatron import (  # noqa: E402
    MegatronLayout,
    MegatronReplay,
    find_megatron_routers,
)
from routeplay.train.replay_core import in_backward  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron_cpu"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=8)
TOKENS = [9, 14, 3, 22, 6]  # odd lengths: alignment padding inside every sequence


def features(length: int, seed: int = 0) -> Any:
    """A fixed hidden state per pack position (the same token looks the same on any rank)."""
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def expected(step: Step, pack: int, positions: Any, column: int) -> np.ndarray:
    return np.sort(step.whole_pack(pack)[positions.numpy(), column], axis=-1)


def check_global_state_clear() -> None:
    for instance in RouterReplay.global_router_replay_instances:
        assert instance.target_topk_idx is None
        assert instance.recorded_topk_idx is None
        assert instance.router_replay_action is None
        assert instance.replay_backward_list == []


def ranks(**fields: Any) -> list[MegatronLayout]:
    """Every rank of a TP x CP group (PP = 1)."""
    tp, cp = fields.get("tp_size", 1), fields.get("cp_size", 1)
    return [
        MegatronLayout(**fields, tp_rank=t, cp_rank=c)  # type: ignore[arg-type]
        for c in range(cp)
        for t in range(tp)
    ]


# -- the layer split ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pp", "vp", "first", "last"),
    [(2, None, None, None), (2, 2, None, None), (4, 2, None, None), (3, None, 2, 2), (3, 2, 2, 2)],
)
def test_layer_split_matches_megatron(pp: int, vp: int | None, first: Any, last: Any) -> None:
    layers = 16 if first is None else 8
    spec = RouteSpec(num_layers=layers, top_k=2, num_experts=8)
    config = transformer_config(
        spec,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=torch.float32,
    )
    # Every other decoder layer dense: a stage's read columns are its MoE layers only.
    sparse = RouteSpec(
        num_layers=layers // 2, top_k=2, num_experts=8, layer_map=tuple(range(1, layers, 2))
    )
    seen: list[int] = []
    read: list[int] = []
    for rank in range(pp):
        layout = MegatronLayout(
            pp_size=pp,
            pp_rank=rank,
            vp_size=vp,
            num_layers=layers,
            first_stage_layers=first,
            last_stage_layers=last,
        )
        built: list[int] = []
        for stage in range(vp or 1):
            stage_arg = stage if vp else None
            offset = get_transformer_layer_offset(config, vp_stage=stage_arg, pp_rank=rank)
            count = get_num_layers_to_build(config, vp_stage=stage_arg, pp_rank=rank)
            assert layout.chunk_layers(stage) == range(offset, offset + count)
            built += list(range(offset, offset + count))
        seen += built
        assert layout.moe_layers(spec) == tuple(sorted(built))
        mine = layout.moe_layers(sparse)
        assert mine == tuple(sparse.layer_map.index(d) for d in sorted(built) if d % 2)
        read += mine
    assert sorted(seen) == list(range(layers))
    assert sorted(read) == list(range(sparse.num_layers))  # each MoE layer read by one stage


def test_the_layout_reads_megatrons_parallel_state() -> None:
    config = transformer_config(SPEC)
    layout = MegatronLayout.from_parallel_state(config, qkv_format="bshd")
    assert layout == MegatronLayout(num_layers=3, qkv_format="bshd")
    assert layout.coords().cp_split == "pack_zigzag"
    assert layout.chunk_layers() == range(3)


# -- THD: per-sequence CP, SP scatter ------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"tp_size": 2, "sequence_parallel": True},
        {"cp_size": 2},
        {"tp_size": 2, "sequence_parallel": True, "cp_size": 2},
    ],
    ids=["tp2-sp", "cp2", "tp2-sp-cp2"],
)
@pytest.mark.parametrize("feeds_last_token", [False, True])
def test_thd_ranks_route_their_tokens_to_the_replayed_experts(
    fields: dict[str, Any], feeds_last_token: bool
) -> None:
    layouts = ranks(**fields, dp_rank=0) + ranks(**fields, dp_rank=1)
    align = layouts[0].seq_align()
    step = Step(
        SPEC,
        TOKENS,
        pack_length=48,
        seq_align=align,
        feeds_last_token=feeds_last_token,
        dp_size=2,
        # verl feeds whole sequences and sizes each micro-batch to its padded sequences.
        pack_multiple=align if feeds_last_token else None,
    )
    config = transformer_config(SPEC)  # the router is the same on every TP rank
    covered = 0
    for layout in layouts:
        chunk = Chunk(config, range(SPEC.num_layers), SPEC)
        with MegatronReplay(chunk, SPEC, layout=layout) as session:
            for mb in step.micro_batches(layout):
                [pack] = mb.packs
                positions = thd_positions(step, pack, layout)
                assert mb.routes.shape[0] == len(positions)
                x = features(step.plan.packs[pack].length)[positions][:, None, :]
                with session.replay(mb):
                    for column, router in enumerate(chunk.routers()):
                        probs, routing_map = router(x)
                        np.testing.assert_array_equal(
                            routing_ids(routing_map), expected(step, pack, positions, column)
                        )
                        assert bool((probs[routing_map] > 0).all())
                covered += len(positions)
        check_global_state_clear()
    # Over the TP x CP x DP ranks, every position of every pack was routed exactly once.
    assert covered == sum(p.length for p in step.plan.packs)


def test_sp_scatter_of_cp_local_rows_matches_materialized_sp_rows() -> None:
    # verl hands every TP rank the CP-local rows and scatters them itself: same tokens.
    step = Step(SPEC, TOKENS, pack_length=64, seq_align=8)
    config = transformer_config(SPEC)
    for layout in ranks(tp_size=2, sequence_parallel=True, cp_size=2):
        cp_local = MegatronLayout(cp_size=2, cp_rank=layout.cp_rank)
        chunk = Chunk(config, range(SPEC.num_layers), SPEC)
        with MegatronReplay(chunk, SPEC, layout=layout) as session:
            for mb in step.micro_batches(cp_local):
                [pack] = mb.packs
                positions = thd_positions(step, pack, layout)
                x = features(64)[positions][:, None, :]
                with session.replay(mb, sp_scatter=True):
                    for column, router in enumerate(chunk.routers()):
                        _, routing_map = router(x)
                        np.testing.assert_array_equal(
                            routing_ids(routing_map), expected(step, pack, positions, column)
                        )


# -- BSHD: whole-row zigzag CP, sequence-major flattening ---------------------------------------


def test_bshd_rows_are_flattened_sequence_major_like_megatron() -> None:
    step = Step(SPEC, [20, 11, 30, 7], pack_length=32, packs_per_micro_batch=2)
    config = transformer_config(SPEC)
    for layout in ranks(tp_size=2, sequence_parallel=True, cp_size=2, qkv_format="bshd"):
        chunk = Chunk(config, range(SPEC.num_layers), SPEC)
        with MegatronReplay(chunk, SPEC, layout=layout) as session:
            for mb in step.micro_batches(layout):
                grid = bshd_positions(step, mb.packs, layout)  # [seq, batch]
                rows = grid // 10_000  # which row of the batch (which pack)
                positions = grid % 10_000
                x = features(32)[positions]  # [seq, batch, hidden]
                truth = np.stack([step.whole_pack(p) for p in mb.packs])  # [batch, 32, L, K]
                with session.replay(mb):
                    for column, router in enumerate(chunk.routers()):
                        _, routing_map = router(x)
                        want = truth[
                            rows.reshape(-1).numpy(), positions.reshape(-1).numpy(), column
                        ]
                        np.testing.assert_array_equal(
                            routing_ids(routing_map), np.sort(want, axis=-1)
                        )


# -- PP with virtual stages, dense layers in between ------------------------------------------


@pytest.mark.parametrize("stage_read", [False, True], ids=["all-layers", "stage-layers"])
def test_pipeline_ranks_replay_exactly_the_layers_their_chunks_hold(stage_read: bool) -> None:
    """Each PP rank (two virtual stages each, dense layers between) replays exactly its
    chunks' layers, from the whole rows or from a read of its own MoE layers only
    (``layout.moe_layers``: a quarter of the columns here, in two ranges)."""
    spec = RouteSpec(num_layers=6, top_k=2, num_experts=8, layer_map=(1, 2, 3, 5, 6, 7))
    config = transformer_config(spec)
    step = Step(spec, TOKENS, pack_length=64)
    replayed: list[int] = []
    for pp_rank in range(2):
        layout = MegatronLayout(pp_size=2, pp_rank=pp_rank, vp_size=2, num_layers=8)
        chunks = [Chunk(config, layout.chunk_layers(v), spec) for v in range(2)]
        routers = find_megatron_routers(chunks, spec, layout=layout)
        assert [(r.chunk, r.decoder_layer) for r in routers] == [
            (v, d) for v in range(2) for d in layout.chunk_layers(v) if d in spec.layer_map
        ]
        layers = layout.moe_layers(spec) if stage_read else None
        assert layout.moe_layers(spec) == tuple(sorted(r.moe_layer for r in routers))
        with MegatronReplay(chunks, spec, layout=layout) as session:
            for mb in step.micro_batches(layout, layers):
                assert mb.routes.shape[1] == (len(layers) if layers else spec.num_layers)
                [pack] = mb.packs
                positions = torch.arange(64)
                x = features(64)[:, None, :]
                for v, chunk in enumerate(chunks):
                    with session.replay(mb, chunk=v):
                        for router in chunk.routers():
                            _, routing_map = router(x)
                            column = spec.layer_map.index(router.layer_number - 1)
                            np.testing.assert_array_equal(
                                routing_ids(routing_map), expected(step, pack, positions, column)
                            )
                            replayed.append(column)
        # Chunks passed in the wrong order hold layers the layout gives the other stage.
        with pytest.raises(SpecMismatch, match="does not build"):
            find_megatron_routers(chunks[::-1], spec, layout=layout)
    assert sorted(set(replayed)) == list(range(spec.num_layers))
    check_global_state_clear()


# -- a real MoE layer with local experts; gradients -------------------------------------------


def test_moe_layer_runs_the_replayed_experts_and_gradients_reach_the_gate() -> None:
    config = transformer_config(SPEC)
    experts = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    submodules = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=experts))
    pg = ProcessGroupCollection.use_mpu_process_groups()
    layer = MoELayer(config, submodules=submodules, layer_number=1, pg_collection=pg)
    layer.set_layer_number(2)  # decoder layer 1 -> MoE column 1
    maps: list[Any] = []
    layer.router.register_forward_hook(lambda m, a, out: maps.append(out[1]))
    step = Step(SPEC, TOKENS, pack_length=64)
    [mb, *_] = step.micro_batches(MegatronLayout())
    x = features(64)[:, None, :].requires_grad_(True)
    with MegatronReplay(layer, SPEC) as session:
        with session.replay(mb):
            out, _ = layer(x)
        (out * torch.randn_like(out)).sum().backward()
        assert session.stats().replayed == 1
    np.testing.assert_array_equal(
        routing_ids(maps[0]), expected(step, mb.packs[0], torch.arange(64), 1)
    )
    assert float(layer.router.weight.grad.abs().sum()) > 0
    assert float(x.grad.abs().sum()) > 0
    check_global_state_clear()


# -- recompute in the backward, several micro-batches in flight ---------------------------------


def _loss(router: Any, x: Any) -> Any:
    probs, _ = router(x)
    weights = torch.linspace(0.5, 2.0, probs.shape[-1])
    return (probs * weights).sum()


def test_recompute_replays_each_forward_in_order() -> None:
    from torch.utils.checkpoint import checkpoint

    config = transformer_config(SPEC)
    chunk = Chunk(config, range(SPEC.num_layers), SPEC)
    step = Step(SPEC, [40, 30, 50, 20], pack_length=64)
    mbs = step.micro_batches(MegatronLayout())
    current = [0]  # the micro-batch whose forward or backward is running
    forwards: dict[tuple[int, int], Any] = {}
    recomputes: dict[tuple[int, int], Any] = {}
    for column, router in enumerate(chunk.routers()):

        def keep(module: Any, args: Any, out: Any, column: int = column) -> None:
            seen = recomputes if in_backward() else forwards
            assert (current[0], column) not in seen
            seen[current[0], column] = out[1]

        router.register_forward_hook(keep)
    x = features(64)[:, None, :]
    with MegatronReplay(chunk, SPEC) as session:
        losses = []
        for i, mb in enumerate(mbs):  # forwards of every micro-batch first (pipeline warm-up)
            current[0] = i
            with session.replay(mb):
                losses.append(
                    sum(checkpoint(_loss, r, x, use_reentrant=False) for r in chunk.routers())
                )
        assert session.stats().pending == len(mbs) * SPEC.num_layers
        for i, loss in enumerate(losses):  # then the backwards, oldest first
            current[0] = i
            loss.backward()
        stats = session.stats()
    assert stats.recomputes == len(mbs) * SPEC.num_layers
    assert stats.pending == 0
    assert forwards.keys() == recomputes.keys()
    for (i, column), routing_map in recomputes.items():
        assert torch.equal(routing_map, forwards[i, column])
        np.testing.assert_array_equal(
            routing_ids(routing_map), expected(step, mbs[i].packs[0], torch.arange(64), column)
        )
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in chunk.routers())
    check_global_state_clear()


def test_an_unannounced_recompute_is_refused_not_routed_natively() -> None:
    from torch.utils.checkpoint import checkpoint

    spec = RouteSpec(num_layers=1, top_k=2, num_experts=8)
    chunk = Chunk(transformer_config(SPEC), range(1), spec)
    mb = Step(spec, [40], pack_length=64).micro_batches(MegatronLayout())[0]
    [router] = chunk.routers()
    with MegatronReplay(chunk, spec, recompute=False) as session:  # "nothing is recomputed"
        with session.replay(mb):
            loss = checkpoint(_loss, router, features(64)[:, None, :], use_reentrant=False)
        with pytest.raises(MisuseError, match="recompute=False"):
            loss.backward()
    check_global_state_clear()


# -- R2 ----------------------------------------------------------------------------------------


def test_r2_replays_what_the_old_logprob_pass_chose() -> None:
    config = transformer_config(SPEC)
    chunk = Chunk(config, range(SPEC.num_layers), SPEC)
    x = features(64)[:, None, :]
    with MegatronReplay(chunk, SPEC) as session:
        with torch.no_grad(), session.record() as recording:
            native = [routing_ids(router(x)[1]) for router in chunk.routers()]
        assert recording.layers == (0, 1, 2)
        assert recording.numpy().dtype == SPEC.dtype
        assert recording.nbytes == 3 * 64 * SPEC.top_k  # uint8 on the device
        with torch.no_grad():  # the policy moves between the two passes
            for router in chunk.routers():
                router.weight.add_(torch.randn_like(router.weight))
        with session.replay(recording):
            replayed = [routing_ids(router(x)[1]) for router in chunk.routers()]
    for layer, (old, again) in enumerate(zip(native, replayed, strict=True)):
        np.testing.assert_array_equal(old, again)
        np.testing.assert_array_equal(np.sort(recording.numpy()[:, layer], axis=-1), old)
    recording.close()
    assert recording.nbytes == 0
    check_global_state_clear()


# -- refusals ----------------------------------------------------------------------------------


@pytest.fixture
def one_router() -> tuple[Chunk, Any]:
    chunk = Chunk(transformer_config(SPEC), range(SPEC.num_layers), SPEC)
    mb = Step(SPEC, [40], pack_length=64).micro_batches(MegatronLayout())[0]
    return chunk, mb


def test_rows_naming_an_expert_twice_are_refused(one_router: tuple[Chunk, Any]) -> None:
    chunk, mb = one_router
    zero = mb.routes.copy()
    zero[5] = 0  # a zero-filled padding row
    with MegatronReplay(chunk, SPEC) as session:
        with pytest.raises(DuplicateExperts, match="all zeros"), session.replay(zero):
            pass
        with pytest.raises(DuplicateExperts), session.replay(torch.from_numpy(zero)):
            pass
        with pytest.raises(DuplicateExperts), session.replay(lambda layer: zero[:, layer]):
            chunk.routers()[0](features(64)[:, None, :])
    check_global_state_clear()


def test_ids_out_of_range_wrong_shapes_and_row_counts_are_refused(
    one_router: tuple[Chunk, Any],
) -> None:
    chunk, mb = one_router
    x = features(64)[:, None, :]
    router = chunk.routers()[0]
    bad = mb.routes.astype(np.int64)
    bad[3, 2, 1] = 8
    with MegatronReplay(chunk, SPEC) as session:
        with pytest.raises(ExpertOutOfRange), session.replay(bad):
            pass
        with pytest.raises(SpecMismatch, match="shape"), session.replay(mb.routes[:, :, :1]):
            pass
        with pytest.raises(RowCountMismatch), session.replay(mb):
            router(x[:40])  # the router sees 40 tokens, the routes have 64 rows
        # A block no router ran in: a replay that did not happen.
        with (
            pytest.raises(ReplayNotApplied, match="no router of the model chunk ran"),
            session.replay(mb),
        ):
            pass
        with pytest.raises(MisuseError, match="no router in that model chunk"):
            session.replay(mb, chunk=1).__enter__()
    check_global_state_clear()


def test_routers_of_multi_token_prediction_layers_are_left_native() -> None:
    chunk = Chunk(transformer_config(SPEC), range(3), SPEC)
    mtp = Chunk(transformer_config(SPEC), range(1), RouteSpec(num_layers=1, top_k=2, num_experts=8))
    mtp.is_mtp_layer = True  # as later Megatron-Core releases mark MTP routers
    chunk.mtp = mtp
    routers = find_megatron_routers(chunk, SPEC)
    assert [r.name for r in routers] == [f"decoder.layers.{i}.mlp.router" for i in range(3)]


def test_sessions_refuse_routers_without_replay_and_a_second_session() -> None:
    plain = Chunk(transformer_config(SPEC, moe_enable_routing_replay=False), range(3), SPEC)
    with pytest.raises(MisuseError, match="moe_enable_routing_replay"):
        MegatronReplay(plain, SPEC)
    older = Chunk(transformer_config(SPEC), range(3), SPEC)
    del older.routers()[1].router_replay.replay_backward_list  # a RouterReplay without a FIFO
    with pytest.raises(MisuseError, match="replay_backward_list"):
        MegatronReplay(older, SPEC)
    chunk = Chunk(transformer_config(SPEC), range(3), SPEC)
    with MegatronReplay(chunk, SPEC), pytest.raises(MisuseError, match="another"):
        MegatronReplay(chunk, SPEC)
    MegatronReplay(chunk, SPEC).close()  # the first one closed: a new one opens


class NativeAlways(RouterReplay):
    """A ``RouterReplay`` (beside megatron-core's action enum) whose replay is a no-op."""

    def get_replay_topk(
        self,
        scores: Any,
        topk: int,
        num_groups: Any = None,
        group_topk: Any = None,
        default_compute_topk: Any = None,
    ) -> Any:
        return default_compute_topk(scores, topk, num_groups, group_topk)


def _swap_replays(chunk: Chunk, cls: type) -> None:
    for router in chunk.routers():
        router.router_replay = cls()


def test_a_router_that_ignores_the_replayed_ids_fails_the_first_forward(
    one_router: tuple[Chunk, Any],
) -> None:
    chunk, mb = one_router
    x = features(64)[:, None, :]
    with MegatronReplay(chunk, SPEC) as session, session.replay(mb):
        chunk.routers()[0](x)  # a router that replays: checked once, then not again
        chunk.routers()[0](x)
    _swap_replays(chunk, NativeAlways)
    with (
        MegatronReplay(chunk, SPEC) as session,
        session.replay(mb),
        pytest.raises(ReplayNotApplied, match=r"MoE layer 1 \(decoder.layers.1.mlp.router\)"),
    ):
        chunk.routers()[1](x)
    check_global_state_clear()


def test_a_router_replay_without_its_action_enum_is_refused_by_name(
    one_router: tuple[Chunk, Any],
) -> None:
    chunk, _ = one_router
    foreign = type("RouterReplay", (RouterReplay,), {"__module__": "some_framework.patch"})
    _swap_replays(chunk, foreign)
    with pytest.raises(MisuseError, match=r"some_framework\.patch\.RouterReplay"):
        MegatronReplay(chunk, SPEC)


def test_an_error_mid_forward_leaves_no_replay_state_behind(one_router: tuple[Chunk, Any]) -> None:
    chunk, mb = one_router
    x = features(64)[:, None, :]
    native = [routing_ids(r(x)[1]) for r in chunk.routers()]

    def fail_mid_forward() -> None:
        with MegatronReplay(chunk, SPEC) as session, session.replay(mb):
            chunk.routers()[0](x)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_mid_forward()
    check_global_state_clear()
    # Hooks are gone: the routers route natively again.
    assert all(
        np.array_equal(routing_ids(r(x)[1]), n)
        for r, n in zip(chunk.routers(), native, strict=True)
    )
