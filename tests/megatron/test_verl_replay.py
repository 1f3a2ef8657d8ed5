"""routeplay's own replay inside verl 0.9.1's Megatron engine (verl's R3 off).

An engine class with ``RouteplayReplay`` before verl's ``MegatronEngineWithLMHead`` reads,
in verl's own ``prepare_model_inputs``, only this rank's rows of its stage's layers for the
micro-batch (``VerlReplay``). The model chunk's forward then runs Megatron-Core's real
``TopKRouter``s inside ``session.replay``. On a CP2 x TP2 x PP2 rank, every router routes
each real token to exactly the experts verl's own ``set_router_replay_data`` would have
given it (run unchanged, as in ``test_verl_layout``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (make test)")
engine_impl = pytest.importorskip(
    "verl.workers.engine.megatron.transformer_impl",
    reason="verl's Megatron engine does not import (make test installs its dependencies)",
)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from helpers import HIDDEN, Chunk, routing_ids, transformer_config
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.megatron import router_replay_utils as rru  # noqa: E402
from verl_rank import as_rank, r3_targets  # noqa: E402

from routeplay.core import Routes, RouteSpec  # noqa: E402
from routeplay.errors import MisuseError  # noqa: E402
from routeplay.integrations.megatron import MegatronLayout, MegatronReplay  # noqa: E402
from routeplay.integrations.verl import ROUTING_KEY  # noqa: E402
from routeplay.integrations.verl_replay import RouteplayReplay, VerlReplay  # noqa: E402
from routeplay.store import RouteStore, StoreConfig  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron_cpu"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SPEC = RouteSpec(num_layers=8, top_k=2, num_experts=8)
TOKENS = [9, 14, 5, 11]
RESPONSE = [4, 6, 2, 5]


class Engine(RouteplayReplay, engine_impl.MegatronEngineWithLMHead):
    """verl's engine with routeplay's replay."""


class Model(Chunk):
    """A model chunk whose forward runs its routers on the rank's tokens."""

    def forward(self, hidden: Any) -> list[Any]:
        return [router(hidden)[1] for router in self.routers()]


def _routes() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        np.argsort(rng.random((t - 1, SPEC.num_layers, SPEC.num_experts)), axis=-1)[
            ..., : SPEC.top_k
        ].astype(SPEC.dtype)
        for t in TOKENS
    ]


def _micro_batch(handles: list[Any]) -> Any:
    return tu.get_tensordict(
        {
            "input_ids": torch.nested.as_nested_tensor(
                [torch.arange(t) for t in TOKENS], layout=torch.jagged
            ),
            "loss_mask": torch.nested.as_nested_tensor(
                [torch.arange(t) >= t - n for t, n in zip(TOKENS, RESPONSE, strict=True)],
                layout=torch.jagged,
            ),
            ROUTING_KEY: handles,
        }
    )


@pytest.mark.parametrize("rank", [(0, 0, 0), (1, 1, 1), (0, 1, 1)], ids=str)
def test_megatron_routers_replay_what_verls_r3_would_give_them(
    rank: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    pp_rank, cp_rank, tp_rank = rank
    layout = MegatronLayout(
        cp_size=2,
        cp_rank=cp_rank,
        tp_size=2,
        tp_rank=tp_rank,
        sequence_parallel=True,
        pp_size=2,
        pp_rank=pp_rank,
        num_layers=SPEC.num_layers,
        qkv_format="thd",
    )
    routes = _routes()
    as_rank(rru, monkeypatch, tp=2, tp_rank=tp_rank, cp=2, cp_rank=cp_rank)
    want = r3_targets(rru, layout, routes, TOKENS, RESPONSE, SPEC.num_layers)
    store = RouteStore.local(StoreConfig(run="verl-replay"))
    batch = [store.put_leased(Routes(array=r, spec=SPEC), "verl/step") for r in routes]
    model = Model(transformer_config(SPEC), layout.chunk_layers(0), SPEC)
    engine = object.__new__(Engine)
    with (
        MegatronReplay([model], SPEC, layout=layout) as session,
        VerlReplay(store, session, layout, [model]) as replay,
    ):
        engine.routeplay_replay = replay
        inputs = engine.prepare_model_inputs(_micro_batch([h for h, _ in batch]))
        assert inputs["routed_experts"] is None  # verl's R3 is off: nothing for it
        some_mask = next(iter(want.values()))[1]
        maps = model(torch.randn(len(some_mask), 1, HIDDEN))
        assert session.stats().replayed == len(maps) == len(want)
    for router, routing_map in zip(model.routers(), maps, strict=True):
        ids, mask = want[router.layer_number - 1]
        keep = mask.bool().numpy()
        got = routing_ids(routing_map)[keep]
        np.testing.assert_array_equal(got, np.sort(ids.numpy(), axis=-1)[keep])
    for _, lease in batch:
        lease.release()
    assert store.leaks() == []


def test_a_forward_before_its_rows_were_read_is_refused() -> None:
    layout = MegatronLayout(num_layers=SPEC.num_layers)
    model = Model(transformer_config(SPEC), layout.chunk_layers(0), SPEC)
    store = RouteStore.local(StoreConfig(run="verl-replay-2"))
    with (
        MegatronReplay([model], SPEC, layout=layout) as session,
        VerlReplay(store, session, layout, [model]),
        pytest.raises(MisuseError, match="before its micro-batch's routes were read"),
    ):
        model(torch.randn(4, 1, HIDDEN))


def _put(store: RouteStore, spec: RouteSpec, tokens: list[int]) -> list[Any]:
    rng = np.random.default_rng(1)
    rows = [
        np.argsort(rng.random((t - 1, spec.num_layers, spec.num_experts)), axis=-1)[
            ..., : spec.top_k
        ].astype(spec.dtype)
        for t in tokens
    ]
    return [store.put_leased(Routes(array=r, spec=spec), "verl/step")[0] for r in rows]


def _handles_batch(handles: list[Any], tokens: list[int]) -> Any:
    ids = torch.nested.as_nested_tensor([torch.arange(t) for t in tokens], layout=torch.jagged)
    return tu.get_tensordict({"input_ids": ids, ROUTING_KEY: handles})


def test_a_chunk_of_dense_layers_runs_natively_beside_a_replayed_one() -> None:
    spec = RouteSpec(num_layers=6, top_k=2, num_experts=8, layer_map=tuple(range(2, 8)))
    layout = MegatronLayout(pp_size=2, pp_rank=0, vp_size=2, num_layers=8)  # chunk 0: 0-1
    chunks = [Model(transformer_config(spec), layout.chunk_layers(v), spec) for v in range(2)]
    store = RouteStore.local(StoreConfig(run="verl-replay-dense"))
    batch = _handles_batch(_put(store, spec, [5, 7]), [5, 7])
    with (
        MegatronReplay(chunks, spec, layout=layout) as session,
        VerlReplay(store, session, layout, chunks) as replay,
    ):
        for chunk in chunks:  # verl prepares the micro-batch before each chunk's forward
            replay.prepare(batch)
            chunk(torch.randn(12, 1, HIDDEN))
        assert session.stats().replayed == len(chunks[1].routers()) == 2


def test_each_prepare_serves_one_forward_and_no_handles_runs_natively() -> None:
    layout = MegatronLayout(num_layers=SPEC.num_layers)
    model = Model(transformer_config(SPEC), layout.chunk_layers(0), SPEC)
    store = RouteStore.local(StoreConfig(run="verl-replay-once"))
    batch = _handles_batch(_put(store, SPEC, [5, 7]), [5, 7])
    plain = tu.get_tensordict({"input_ids": batch["input_ids"]})
    engine = object.__new__(Engine)
    with (
        MegatronReplay([model], SPEC, layout=layout) as session,
        VerlReplay(store, session, layout, [model]) as replay,
    ):
        replay.prepare(batch)
        model(torch.randn(12, 1, HIDDEN))
        with pytest.raises(MisuseError, match="before its micro-batch's routes were read"):
            model(torch.randn(12, 1, HIDDEN))  # never the last micro-batch's rows again
        engine.routeplay_replay = replay
        replay.prepare(batch)
        with pytest.raises(KeyError):  # verl's own inputs want a loss mask: nothing read
            engine.prepare_model_inputs(plain)
        replay.prepare(plain)
        model(torch.randn(20, 1, HIDDEN))  # native: no rows, no replay block
        assert session.stats().replayed == len(model.routers())


def test_a_forward_inside_an_except_block_keeps_its_recompute_markers() -> None:
    layout = MegatronLayout(num_layers=SPEC.num_layers)
    model = Model(transformer_config(SPEC), layout.chunk_layers(0), SPEC)
    store = RouteStore.local(StoreConfig(run="verl-replay-except"))
    batch = _handles_batch(_put(store, SPEC, [5, 7]), [5, 7])
    with (
        MegatronReplay([model], SPEC, layout=layout) as session,
        VerlReplay(store, session, layout, [model]) as replay,
    ):
        replay.prepare(batch)
        model(torch.randn(12, 1, HIDDEN))
        kept = session.stats().pending
        try:
            raise ValueError("handled around the forward (a retry loop)")
        except ValueError:
            replay.prepare(batch)
            model(torch.randn(12, 1, HIDDEN))
        assert session.stats().pending == 2 * kept > 0
