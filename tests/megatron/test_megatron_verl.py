"""``MegatronReplay`` on verl's own patched routers (verl 0.9.1, from the package index).

verl's ``apply_router_replay_patch()`` gives every ``TopKRouter`` verl's ``RouterReplay``
(``verl.utils.megatron.router_replay_patch``), which compares its action with verl's own
``RouterReplayAction`` enum and pops a replay mask per backward replay. The session must
drive those routers with verl's enum: a training step through Megatron's own schedule,
forward and recompute, routes exactly the replayed ids, its drift is measured (not a
quiet 0.0), and its gradients equal the same step on megatron-core's own ``RouterReplay``.
Driven with megatron-core's enum (what the session did before), verl's routers route
natively: the session's first-forward check refuses that.

verl's patch rewrites megatron-core classes process-wide; the fixture undoes it after each
test, so the other Megatron tests in this process see megatron-core as it ships.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'routeplay[megatron]')"
)
verl_patch = pytest.importorskip(
    "verl.utils.megatron.router_replay_patch",
    reason="verl is not installed (make test installs it)",
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from gpt_step import (
        MICRO_BATCHES,
        MODES,
        SPEC,
        TOKENS,
        Calls,
        build,
        check_routing,
        reference_step,
        step_routes,
        train_step,
    )
    from gpt_step import grads as grads_of
    from megatron.core.transformer.moe import router_replay as mcore_replay
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

from routeplay.errors import ReplayNotApplied  # noqa: E402
from routeplay.integrations.megatron import MegatronReplay  # noqa: E402
from routeplay.integrations.megatron import routers as megatron_routers  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron_cpu"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

_PATCHED = {  # what apply_router_replay_patch() sets on megatron-core's classes
    TopKRouter: ("__init__", "routing", "_router_replay_patched"),
    TransformerConfig: ("__init__", "_verl_router_patched"),
    MoEAlltoAllTokenDispatcher: ("preprocess", "_preprocess_patched"),
}
_ABSENT = object()


@pytest.fixture(scope="module")
def reference(megatron_world: None) -> tuple[list[Any], dict[str, Any]]:
    """The step without recompute, on megatron-core's own ``RouterReplay``."""
    return reference_step()


@pytest.fixture
def verl_routers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """verl's router-replay patch applied for one test, then undone."""
    utils = importlib.import_module("verl.utils.megatron.router_replay_utils")
    monkeypatch.setattr(utils, "device_name", "cpu")  # 'cuda' on a host without GPUs
    saved = {(cls, name): cls.__dict__.get(name, _ABSENT) for cls, names in _PATCHED.items()
             for name in names}  # fmt: skip
    signature = TransformerConfig.__init__.__dict__.get("__signature__", _ABSENT)
    original_init = TransformerConfig.__init__
    verl_patch.apply_router_replay_patch()
    try:
        yield
    finally:
        verl_patch.RouterReplay.router_instances.clear()
        for (cls, name), value in saved.items():
            if value is _ABSENT:
                if name in cls.__dict__:
                    delattr(cls, name)
            else:
                setattr(cls, name, value)
        if signature is _ABSENT:
            original_init.__dict__.pop("__signature__", None)  # verl sets it on the original
        else:
            original_init.__signature__ = signature  # type: ignore[attr-defined]


def _verl_routers(model: Any) -> list[Any]:
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers
    assert all(isinstance(r.router_replay, verl_patch.RouterReplay) for r in routers)
    return routers


@pytest.mark.usefixtures("verl_routers")
@pytest.mark.parametrize("mode", ["none", "full-uniform-1", "selective-moe"])
def test_verl_routers_replay_exactly_through_a_training_step(
    mode: str, reference: tuple[list[Any], dict[str, Any]]
) -> None:
    fields, recomputed = MODES[mode]
    model = build(**fields)
    _verl_routers(model)
    calls = Calls(model)
    routes = step_routes()
    with MegatronReplay(model, SPEC) as session:
        losses = train_step(model, session, routes, calls)
        stats, drift = session.stats(), session.drift()
    assert stats.replayed == MICRO_BATCHES * SPEC.num_layers
    assert stats.recomputes == MICRO_BATCHES * recomputed
    assert stats.pending == 0
    check_routing(calls, routes, recomputed)  # forward and recompute: the replayed ids
    assert drift.routes == MICRO_BATCHES * TOKENS * SPEC.num_layers
    assert drift.route_share is not None
    assert drift.route_share > 0.3  # random routes: far from the routers' own choice
    ref_losses, ref_grads = reference
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    got = grads_of(model)
    assert got.keys() == ref_grads.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    for router in _verl_routers(model):  # nothing left set on verl's instances
        replay = router.router_replay
        assert replay.router_replay_action is None
        assert replay.target_topk_idx is None
        assert replay.replay_backward_list == []
        assert replay.replay_backward_mask_list == []


@pytest.mark.usefixtures("verl_routers")
def test_megatron_cores_actions_on_verls_routers_fail_the_first_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the session did before: megatron-core's enum members set on verl's
    ``RouterReplay`` match none of verl's, the routers route natively, and the drift read
    0.0. The session's first-forward check now names the layer instead."""
    monkeypatch.setattr(  # the old behaviour: megatron-core's enum, whatever the instance
        megatron_routers, "replay_actions", lambda replay, where="": mcore_replay.RouterReplayAction
    )
    model = build()
    _verl_routers(model)
    with (
        MegatronReplay(model, SPEC) as session,
        pytest.raises(ReplayNotApplied, match="MoE layer 0") as refused,
    ):
        train_step(model, session, step_routes())
    assert "router_replay_patch.RouterReplay" in str(refused.value)
