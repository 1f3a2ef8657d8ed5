"""R3 for verl 0.9.1's FSDP engine, which has none: ``RouteplayHFReplay`` around verl's own
``FSDPEngineWithLMHead`` (its ``prepare_model_inputs``, the padding-free token stream, its
log-prob head, its ``forward_backward_batch`` with dynamic micro-batches) on a tiny
transformers MoE with gradient checkpointing.

The loss and every gradient equal those of the same forward and backward run inside
routeplay's own ``replay`` block over the expected rows (each sample's routes, then a
padding row for its last token), so the checkpointed recompute in the backward replayed
the same experts. Closing the block before the backward makes the recompute route
natively, which torch's checkpoint refuses: the comparison can fail. On CPU verl's device
helpers answer "cpu" (a fixture); ``forward_backward_batch`` runs in a gloo world of one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
fsdp_impl = pytest.importorskip(
    "verl.workers.engine.fsdp.transformer_impl",
    reason="verl's FSDP engine does not import (make test installs its dependencies)",
)
import verl_fsdp_engine as verl_cpu  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from routeplay.core import Routes  # noqa: E402
from routeplay.errors import MisuseError  # noqa: E402
from routeplay.integrations.verl_fsdp import RouteplayHFReplay, VerlHFReplay  # noqa: E402
from routeplay.store import RouteStore, StoreConfig  # noqa: E402
from routeplay.train.hf import find_routers, replay  # noqa: E402

TOKENS = [5, 7, 4, 6, 3]


class Engine(RouteplayHFReplay, fsdp_impl.FSDPEngineWithLMHead):
    """verl's FSDP engine with routeplay's HF replay."""


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    verl_cpu.on_cpu(monkeypatch)


@pytest.fixture(scope="module")
def one_rank_world() -> Iterator[None]:
    """``torch.distributed`` with one gloo rank (verl's batch code all-reduces its token
    count), made here unless a world exists already, and ended only if made here."""
    made = not torch.distributed.is_initialized()
    if made:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield
    if made:
        torch.distributed.destroy_process_group()


def _stored(store: RouteStore, spec: Any, seed: int) -> tuple[list[Any], list[Any]]:
    rows = verl_cpu.routes(spec, TOKENS, seed)
    return rows, [store.put_leased(Routes(array=r, spec=spec), "verl/step") for r in rows]


def test_verls_fsdp_step_replays_the_stores_rows_through_the_recompute() -> None:
    model = verl_cpu.checkpointed_model()
    spec = find_routers(model).spec
    store = RouteStore.local(StoreConfig(run="verl-fsdp"))
    rows, leased = _stored(store, spec, seed=3)
    engine = verl_cpu.engine(Engine, model)
    engine.routeplay_replay = VerlHFReplay(store, model)
    micro = verl_cpu.batch(TOKENS, [h for h, _ in leased])
    loss, _ = engine.forward_step(micro, verl_cpu.loss, forward_only=False)
    loss.backward()  # forward_backward_batch's backward: the block is still open
    engine.routeplay_replay.close()
    got = verl_cpu.grads(model)

    # The reference: verl's own forward_step inside routeplay's replay block.
    plain = verl_cpu.engine(fsdp_impl.FSDPEngineWithLMHead, model)
    every = verl_cpu.expected_rows(spec, rows, list(range(len(TOKENS))))
    with replay(model, every):
        want_loss, _ = plain.forward_step(
            verl_cpu.batch(TOKENS, None), verl_cpu.loss, forward_only=False
        )
        want_loss.backward()
    want = verl_cpu.grads(model)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    # Closed before the backward, the recompute routes natively: torch's checkpoint
    # finds a different forward (other experts ran) and refuses.
    with replay(model, every):
        early, _ = plain.forward_step(verl_cpu.batch(TOKENS, None), verl_cpu.loss, False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        early.backward()
    model.zero_grad(set_to_none=True)
    for _, lease in leased:
        lease.release()
    assert store.leaks() == []


def test_a_micro_batch_without_handles_runs_natively_and_ulysses_is_refused() -> None:
    model = verl_cpu.checkpointed_model()
    store = RouteStore.local(StoreConfig(run="verl-fsdp-2"))
    engine = verl_cpu.engine(Engine, model)
    engine.routeplay_replay = VerlHFReplay(store, model)
    plain = verl_cpu.engine(fsdp_impl.FSDPEngineWithLMHead, model)
    with torch.no_grad():
        native, _ = plain.forward_step(verl_cpu.batch(TOKENS, None), verl_cpu.loss, True)
        through, _ = engine.forward_step(verl_cpu.batch(TOKENS, None), verl_cpu.loss, True)
    torch.testing.assert_close(through, native, rtol=0, atol=0)
    engine.use_ulysses_sp = True
    with pytest.raises(MisuseError, match="Ulysses"):
        engine.forward_step(verl_cpu.batch(TOKENS, None), verl_cpu.loss, forward_only=True)


@pytest.mark.usefixtures("one_rank_world")
def test_verls_batch_replays_every_micro_batch_through_its_backward() -> None:
    model = verl_cpu.checkpointed_model()
    spec = find_routers(model).spec
    store = RouteStore.local(StoreConfig(run="verl-fsdp-batch"))
    rows, leased = _stored(store, spec, seed=5)
    engine = verl_cpu.engine(Engine, model)
    engine.routeplay_replay = VerlHFReplay(store, model)
    seen: list[list[int]] = []

    def loss_fn(model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, dict]:
        seen.append(data["uid"].tolist())
        return verl_cpu.loss(model_output, data)

    engine.forward_backward_batch(verl_cpu.batch(TOKENS, [h for h, _ in leased]), loss_fn)
    got = verl_cpu.grads(model)
    assert len(seen) > 1  # verl split the batch into micro-batches by tokens
    assert engine.routeplay_replay._block is None  # closed at the end of the batch

    # The reference: the same micro-batches, each replayed in routeplay's own block.
    plain = verl_cpu.engine(fsdp_impl.FSDPEngineWithLMHead, model)
    for uids in seen:
        micro = tu.index_select_tensor_dict(verl_cpu.batch(TOKENS, None), uids)
        with replay(model, verl_cpu.expected_rows(spec, rows, uids)):
            loss, _ = plain.forward_step(micro, verl_cpu.loss, forward_only=False)
            loss.backward()
    want = verl_cpu.grads(model)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for _, lease in leased:
        lease.release()
    assert store.leaks() == []


@pytest.mark.usefixtures("one_rank_world")
def test_a_loss_that_raises_mid_batch_aborts_the_open_block() -> None:
    model = verl_cpu.checkpointed_model()
    spec = find_routers(model).spec
    store = RouteStore.local(StoreConfig(run="verl-fsdp-raise"))
    _, leased = _stored(store, spec, seed=7)
    engine = verl_cpu.engine(Engine, model)
    engine.routeplay_replay = VerlHFReplay(store, model)

    def failing(model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, dict]:
        raise RuntimeError("the loss failed")

    with pytest.raises(RuntimeError, match="the loss failed"):
        engine.forward_backward_batch(verl_cpu.batch(TOKENS, [h for h, _ in leased]), failing)
    assert engine.routeplay_replay._block is None
    with torch.no_grad():
        model(input_ids=torch.arange(3, 9)[None])  # native again: no replay left behind
    for _, lease in leased:
        lease.release()
    assert store.leaks() == []
