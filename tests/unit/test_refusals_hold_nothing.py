"""A refusal kept in a result list holds no frame: its traceback would hold the frames
it passed through, and those the result list that holds it, a cycle only the garbage
collector breaks. In an engine store that cycle kept a whole take's validations at
ingest and raw references (found under load: the object store did not return to its
baseline); in a rollout worker, a group's rows. Each test holds something in the
caller's frame, gets a refusal, and checks that the caller's objects go with the
caller's frame, the garbage collector off."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from routeplay.core import EngineKey, Handle, RouteSpec, canonicalize
from routeplay.core.wires import Engine, EngineRouting
from routeplay.errors import AlreadyConsumed, RowCountMismatch
from routeplay.rollout import SampleRouting, finish_all, ingest_routing_group
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.engine.key_check import take_checked_many
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=4, top_k=2, num_experts=16)


class Held:
    """What a caller's frame holds while the call refuses something."""


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _rows(rows: int, seed: int) -> np.ndarray:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


def test_a_key_refused_by_a_take_holds_nothing_of_the_take(no_gc: None) -> None:
    backend = RouteStore.local(StoreConfig(run="run-a")).backend
    assert isinstance(backend, LocalBackend)
    engine = backend.engine_store()
    raw = engine.put(_rows(10, 1))
    key = EngineKey(key=raw, rows=10)
    take_checked_many(engine, [key], SPEC, "run-a")  # consumed

    def take() -> tuple[weakref.ref[Held], list[Any]]:
        held = Held()  # as the engine store's offered validations in its take's frame
        return weakref.ref(held), take_checked_many(engine, [key], SPEC, "run-a")

    gone, [refused] = take()
    assert isinstance(refused, AlreadyConsumed)
    assert refused.__traceback__ is None
    assert gone() is None


def _answer(rows: int, seed: int) -> EngineRouting:
    return EngineRouting(
        engine=Engine.VLLM, prompt_tokens=4, completion_tokens=rows - 3,
        routes=canonicalize(_rows(rows, seed), SPEC),
    )  # fmt: skip


def test_a_member_refused_by_a_group_ingest_holds_nothing_of_the_group(no_gc: None) -> None:
    store = RouteStore.local(StoreConfig(run="run-g"))
    fresh = [SampleRouting(sample_id=f"s{i}").continuation() for i in range(2)]
    first = ingest_routing_group(fresh, [_answer(10, 2), _answer(10, 3)], writer=store,
                                 weight_version=1)  # fmt: skip
    turns = finish_all(fresh, store, first)

    def ingest() -> tuple[weakref.ref[Held], list[Any]]:
        held = Held()  # as a worker's frame holds its group's answers
        conts = [routing.continuation() for routing in turns]
        answers = [_answer(14, 4), _answer(6, 5)]  # the second is shorter than its history
        return weakref.ref(held), ingest_routing_group(
            conts, answers, writer=store, weight_version=2
        )

    gone, (kept, refused) = ingest()
    assert isinstance(kept, Handle)
    assert isinstance(refused, RowCountMismatch)
    assert refused.__traceback__ is None
    assert gone() is None
