"""Replay through Megatron-Core's own training step: ``get_forward_backward_func()`` over
several micro-batches of a real ``GPTModel`` (MoE layers, local experts, CPU), in every
activation-recompute mode a user turns on.

Each mode is checked against what Megatron really ran: the ``routing_map`` of every router
call, forward and backward recompute, per micro-batch, must name exactly the replayed ids
(chosen to differ from the router's own choice, so ignoring replay fails), the gradients
must equal those of the same step without recompute, and nothing may stay queued when the
step ends. Plus: old-logprob passes under ``no_grad`` keep nothing, and the routers of
multi-token-prediction layers stay native.

The model and the step are ``gpt_step``'s (shared with the verl tests).
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
    from gpt_step import (
        BATCH,
        MICRO_BATCHES,
        MODES,
        SEQ,
        SPEC,
        TOKENS,
        VOCAB,
        Calls,
        build,
        check_routing,
        grads,
        reference_step,
        router_order,
        step_routes,
        train_step,
    )
    from helpers import routing_ids
    from megatron.core.transformer.moe.router import TopKRouter

from routeplay.errors import MisuseError  # noqa: E402
from routeplay.integrations.megatron import MegatronReplay  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron_cpu"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def reference(megatron_world: None) -> tuple[list[Any], dict[str, Any]]:
    """The step without recompute, on megatron-core's own ``RouterReplay``."""
    return reference_step()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_training_step_replays_the_ids_in_forward_and_recompute(
    mode: str, reference: tuple[list[Any], dict[str, Any]]
) -> None:
    fields, recomputed = MODES[mode]
    model = build(**fields)
    calls = Calls(model)
    routes = step_routes()
    with MegatronReplay(model, SPEC, drift=True) as session:  # diagnostics on, as by default
        losses = train_step(model, session, routes, calls)
        stats = session.stats()
        drift = session.drift()
    assert drift.routes == MICRO_BATCHES * TOKENS * SPEC.num_layers  # forwards only
    assert drift.route_share is not None
    assert drift.route_share > 0.3  # the replayed routes differ from the routers' own
    assert stats.pending == 0  # also the layers "block" does not recompute
    assert stats.replayed == MICRO_BATCHES * SPEC.num_layers
    assert stats.recomputes == MICRO_BATCHES * recomputed
    check_routing(calls, routes, recomputed)
    ref_losses, ref_grads = reference
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    got = grads(model)
    assert got.keys() == ref_grads.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_replay_really_changes_the_routing_and_the_gradients(
    reference: tuple[list[Any], dict[str, Any]],
) -> None:
    """The routes differ from the router's own choice: ignoring them would fail the above."""
    model = build(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    calls = Calls(model)
    train_step(model, None, step_routes(), calls)  # native, no session
    differ = [
        float((routing_ids(calls.maps[i, layer, False][0]) != router_order(mb)[:, layer]).mean())
        for i, mb in enumerate(step_routes())
        for layer in range(SPEC.num_layers)
    ]
    assert min(differ) > 0.3
    native = grads(model)
    assert any(not torch.allclose(native[n], g) for n, g in reference[1].items())


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_around_layers_replays_each_forward(
    reentrant: bool, reference: tuple[list[Any], dict[str, Any]]
) -> None:
    from torch.utils.checkpoint import checkpoint

    model = build()
    calls = Calls(model)

    class Checkpointed(torch.nn.Module):
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.inner = layer

        def forward(self, hidden_states: Any, **kwargs: Any) -> Any:
            def run(hidden: Any) -> Any:
                return self.inner(hidden_states=hidden, **kwargs)

            return checkpoint(run, hidden_states, use_reentrant=reentrant)

    model.decoder.layers = torch.nn.ModuleList(Checkpointed(ly) for ly in model.decoder.layers)
    routes = step_routes()
    with MegatronReplay(model, SPEC) as session:
        losses = train_step(model, session, routes, calls)
        stats = session.stats()
    assert stats.pending == 0
    assert stats.recomputes == MICRO_BATCHES * SPEC.num_layers
    check_routing(calls, routes, SPEC.num_layers)
    torch.testing.assert_close(losses, reference[0], rtol=1e-5, atol=0)
    for name, grad in grads(model).items():
        ref = reference[1][name.replace(".inner.", ".")]
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("early_stop", [True, False])
def test_probs_that_are_a_non_reentrant_checkpoints_output_wait_for_its_recompute(
    early_stop: bool,
) -> None:
    """The shape that once failed: the router's probabilities are the checkpoint's output.

    A non-reentrant checkpoint recomputes when the backward first unpacks a tensor it saved,
    which here is after the gradient has reached the probabilities: the marker must outlive
    that gradient. Two micro-batches in flight; layer 0 runs uncheckpointed (its markers go
    at the end of each backward), layers 1 and 2 through the checkpoint. With torch's
    default early stop the recompute ends inside the router (its last saved tensor), so
    its forward hooks do not run there: the gradients show the replayed ids were used.
    """
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    model = build()  # its routers only, called one by one
    routers = [layer.mlp.router for layer in model.decoder.layers]
    calls = Calls(model)
    hidden = [
        torch.randn(SEQ, BATCH, 16, generator=torch.Generator().manual_seed(i), requires_grad=True)
        for i in range(2)
    ]
    routes = step_routes()[:2]
    weights = torch.randn(TOKENS, SPEC.num_experts, generator=torch.Generator().manual_seed(9))

    def step(checkpointed: bool) -> tuple[list[Any], list[Any]]:
        for x in hidden:
            x.grad = None
        for router in routers:
            router.weight.grad = None
        with MegatronReplay(model, SPEC) as session:
            losses = []
            for i, x in enumerate(hidden):
                calls.micro_batch = i
                with session.replay(routes[i]):
                    probs = [
                        checkpoint(lambda h, r=r: r(h)[0], x, use_reentrant=False)
                        if checkpointed and layer > 0
                        else r(x)[0]
                        for layer, r in enumerate(routers)
                    ]
                losses.append(sum((p * weights).sum() for p in probs))
            assert session.stats().pending == 2 * SPEC.num_layers
            for i, loss in enumerate(losses):
                calls.micro_batch = i
                loss.backward()
                assert session.stats().pending == (1 - i) * SPEC.num_layers
            assert session.stats().recomputes == (2 * 2 if checkpointed else 0)
        return [x.grad.clone() for x in hidden], [r.weight.grad.clone() for r in routers]

    want = step(checkpointed=False)
    with set_checkpoint_early_stop(early_stop):
        got = step(checkpointed=True)
    for i, mb in enumerate(routes):
        order = router_order(mb)
        for layer in range(SPEC.num_layers):
            forwards = calls.maps[i, layer, False]
            assert len(forwards) == 2  # one per step
            for routing_map in forwards:
                np.testing.assert_array_equal(routing_ids(routing_map), order[:, layer])
            again = calls.maps.get((i, layer, True), [])
            assert len(again) == (1 if layer > 0 and not early_stop else 0)
            for routing_map in again:
                assert torch.equal(routing_map, forwards[1])
    for ref, grad in zip(want[0] + want[1], got[0] + got[1], strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7)


def test_several_forwards_in_flight_recompute_in_order() -> None:
    """Pipeline warm-up: every micro-batch's forward before the first backward."""
    model = build(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    calls = Calls(model)
    routes = step_routes()
    tokens = [
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(i))
        for i in range(MICRO_BATCHES)
    ]
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    with MegatronReplay(model, SPEC) as session:
        losses = []
        for i in range(MICRO_BATCHES):
            calls.micro_batch = i
            with session.replay(routes[i]):
                losses.append(model(tokens[i], position_ids, None, labels=tokens[i]).mean())
        assert session.stats().pending == MICRO_BATCHES * SPEC.num_layers
        for i, loss in enumerate(losses):
            calls.micro_batch = i
            loss.backward()
        assert session.stats().pending == 0
    check_routing(calls, routes, SPEC.num_layers)


def test_an_old_logprob_pass_under_no_grad_keeps_nothing() -> None:
    model = build(recompute_granularity="selective", recompute_modules=["moe"])
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    with MegatronReplay(model, SPEC) as session:
        for routes in step_routes():
            with torch.no_grad(), session.replay(routes):
                model(tokens, position_ids, None)
        assert session.stats().pending == 0
        assert session.stats().replayed == MICRO_BATCHES * SPEC.num_layers


def test_a_recompute_nobody_kept_is_refused_with_a_true_hint() -> None:
    model = build(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    [routes, *_] = step_routes()
    with MegatronReplay(model, SPEC, recompute=False) as session:
        with session.replay(routes):
            loss = model(tokens, position_ids, None, labels=tokens).mean()
        assert session.stats().pending == 0
        with pytest.raises(MisuseError, match="recompute=False"):
            loss.backward()
    with MegatronReplay(model, SPEC) as session:
        with session.replay(routes):
            loss = model(tokens, position_ids, None).sum()  # logits: no in-place loss
        loss.backward(retain_graph=True)
        assert session.stats().recomputes == SPEC.num_layers
        with pytest.raises(MisuseError, match="run each backward once"):
            loss.backward()  # recomputes again forwards already recomputed


def test_routers_of_multi_token_prediction_layers_stay_native() -> None:
    model = build(
        mtp=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    mtp = [r for r in routers if all(r is not ly.mlp.router for ly in model.decoder.layers)]
    assert len(mtp) == 1
    seen: list[tuple[Any, Any, Any]] = []

    def keep(module: Any, args: Any, out: Any) -> None:
        with torch.no_grad():  # what the router's own top-k picks from the same scores
            logits = module.gating(args[0]).view(-1, SPEC.num_experts)
        native = torch.topk(logits, SPEC.top_k, dim=-1).indices.sort(dim=-1).values
        seen.append((module.router_replay.router_replay_action, out[1].detach(), native))

    mtp[0].register_forward_hook(keep)
    calls = Calls(model)
    routes = step_routes()
    with MegatronReplay(model, SPEC) as session:
        train_step(model, session, routes, calls)
        assert session.stats().pending == 0
    check_routing(calls, routes, SPEC.num_layers)
    assert len(seen) == 2 * MICRO_BATCHES  # forward and recompute of each micro-batch
    for action, routing_map, native in seen:
        assert action is None
        np.testing.assert_array_equal(routing_ids(routing_map), native.numpy())
