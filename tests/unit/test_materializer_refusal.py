"""A materializer owns the leases it is handed from the call on, refusals included: a
constructor that raises releases every one of them (there is no object left to close)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from faults import faulty_store

from routeplay.core import EngineKey, Handle, RouteSpec, Segment, canonicalize
from routeplay.errors import MisuseError
from routeplay.store import Lease, RouteStore, StoreConfig
from routeplay.train.materializer import Materializer
from routeplay.train.packing import PackingPlan, RankCoords, pack_samples

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def put(store: RouteStore, rows: int, seed: int) -> Handle:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    ids = np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)
    return store.put(canonicalize(ids, SPEC))


def step(store: RouteStore) -> tuple[PackingPlan, dict[str, Lease]]:
    """Two samples, one pack each, both on DP rank 0; a lease of the rank on each."""
    a, b = put(store, 4, seed=1), put(store, 4, seed=2)
    plan = pack_samples([("a", a, 5), ("b", b, 5)], 4)
    return plan, {"a": store.acquire(a, "rank0/a"), "b": store.acquire(b, "rank0/b")}


def stray(store: RouteStore, plan: PackingPlan, leases: dict[str, Lease]) -> None:
    extra = store.acquire(put(store, 4, seed=3), "rank0/c")
    Materializer(store, plan, RankCoords(), leases={**leases, "c": extra})


def keyed(store: RouteStore, plan: PackingPlan, leases: dict[str, Lease]) -> None:
    key = Handle.of(Segment(source=EngineKey(key="k", rows=4), start=0, stop=4, spec=SPEC))
    samples = [(s.sample_id, s.handle, s.tokens) for pack in plan.packs for s in pack.samples]
    Materializer(store, pack_samples([*samples, ("k", key, 5)], 4), RankCoords(), leases=leases)


REFUSALS: dict[str, tuple[Callable[[RouteStore, PackingPlan, dict[str, Lease]], None], str]] = {
    "prefetch": (
        lambda s, p, leases: Materializer(s, p, RankCoords(), leases=leases, prefetch=-1),  # type: ignore[func-returns-value]
        "prefetch",
    ),
    "order": (
        lambda s, p, leases: Materializer(s, p, RankCoords(), leases=leases, order=[0]),  # type: ignore[func-returns-value]
        "exactly once",
    ),
    "layout": (
        lambda s, p, leases: Materializer(s, p, RankCoords(sp_size=3), leases=leases),  # type: ignore[func-returns-value]
        "split evenly",
    ),
    "stray lease": (stray, "never reads"),
    "engine key": (keyed, "engine key"),
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_refusal_releases_every_lease_it_was_given(kind: str) -> None:
    store = RouteStore.local(StoreConfig(run=f"refused-{kind.replace(' ', '-')}"))
    plan, leases = step(store)
    build, message = REFUSALS[kind]
    with pytest.raises(MisuseError, match=message):
        build(store, plan, leases)
    assert store.leaks() == []  # a stray lease included: it was handed over too
    assert all(lease.released for lease in leases.values())
    assert store.stats().leases == 0


def test_a_release_that_fails_is_named_on_the_refusal_and_the_rest_still_end() -> None:
    store, faults = faulty_store("refused-dead")
    plan, leases = step(store)
    faults.lose_releases(leases["a"])
    with pytest.raises(MisuseError, match="exactly once") as refused:
        Materializer(store, plan, RankCoords(), leases=leases, order=[1])
    notes = getattr(refused.value, "__notes__", [])
    assert len(notes) == 1
    assert "RoutesLost" in notes[0]
    assert leases["b"].released
    assert not leases["a"].released  # the dead shard's lease: still counted by the store
    assert [leak.holder for leak in store.leaks()] == ["rank0/a"]
    faults.heal()
    leases["a"].release()
    assert store.leaks() == []


def test_a_materializer_that_starts_still_owns_its_leases_until_consumed() -> None:
    store = RouteStore.local(StoreConfig(run="accepted"))
    plan, leases = step(store)
    with Materializer(store, plan, RankCoords(), leases=leases, prefetch=0) as m:
        first = next(m)
        assert first.index == 0
        assert not any(lease.released for lease in leases.values())
    assert all(lease.released for lease in leases.values())
    assert store.leaks() == []
