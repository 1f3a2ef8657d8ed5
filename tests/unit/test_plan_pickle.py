"""A ``PackingPlan`` pickles as columns (``routeplay.train.plan_pickle``): the plan that
arrives equals the one sent (packs, samples with their spans, handles, micro-batches,
ranks), a rank's share reads the same rows after the trip, and its handles are still
checked where they land."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import random_routing

from routeplay.core import Handle, RouteSpec, canonicalize
from routeplay.core.handle import Segment, StoreRef
from routeplay.errors import HandleError
from routeplay.store import RouteStore, StoreConfig
from routeplay.train import Materializer, PackingPlan, RankCoords, pack_samples
from routeplay.train.packing import Pack, PackedSample

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


def _store() -> RouteStore:
    return RouteStore.local(StoreConfig(run="plan-pickle"))


def _put(store: RouteStore, rows: int, seed: int) -> Handle:
    return store.put(canonicalize(random_routing(SPEC, rows, seed), SPEC))


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.lists(st.integers(2, 12), min_size=1, max_size=12),
    dp_size=st.integers(1, 3),
    protocol=st.sampled_from([2, 5]),
)
def test_a_plan_and_each_share_arrive_equal(tokens: list[int], dp_size: int, protocol: int) -> None:
    store = _store()
    samples = [(f"s{i}", _put(store, n - 1, i), n) for i, n in enumerate(tokens)]
    plan = pack_samples(samples, pack_max_length=16, dp_size=dp_size)
    for sent in (plan, *(plan.share(r) for r in range(dp_size))):
        restored = pickle.loads(pickle.dumps(sent, protocol=protocol))
        assert restored == sent
        assert [[s.span for s in p.samples] for p in restored.packs] == [
            [s.span for s in p.samples] for p in sent.packs
        ]


def test_spans_and_padding_packs_survive_the_trip() -> None:
    store = _store()
    a, b, c = (_put(store, n - 1, n) for n in (9, 5, 12))
    plan = PackingPlan.from_packs(
        [[("a", a, 9), ("b", b, 5)], [("c", c, 12, (4, 11))]], pack_max_length=16, dp_size=4
    )
    restored = pickle.loads(pickle.dumps(plan))
    assert restored == plan
    assert restored.schedule(3) == plan.schedule(3)
    assert [p.samples for p in restored.packs[2:]] == [(), ()]  # DP padding packs


def test_a_share_reads_the_same_rows_after_the_trip() -> None:
    store = _store()
    samples = [(f"s{i}", _put(store, 6, i), 7) for i in range(12)]
    keep = store.acquire_many([(h, "test/keep") for _, h, _ in samples])
    plan = pack_samples(samples, pack_max_length=16, dp_size=2)
    for rank in range(2):
        share = plan.share(rank)
        arrived = pickle.loads(pickle.dumps(share, protocol=5))
        coords = RankCoords(dp_rank=rank)
        with (
            Materializer(store, share, coords) as sent_mbs,
            Materializer(store, arrived, coords) as arrived_mbs,
        ):
            for one, two in zip(sent_mbs, arrived_mbs, strict=True):
                np.testing.assert_array_equal(one.routes, two.routes)
                np.testing.assert_array_equal(one.mask, two.mask)
    store.release_many(keep)


def test_a_handle_whose_rows_left_its_source_is_refused_where_it_lands() -> None:
    store = _store()
    handle = _put(store, 6, 1)
    plan = pack_samples([("s", handle, 7)], pack_max_length=8)
    [segment] = handle.segments
    assert isinstance(segment.source, StoreRef)
    short = StoreRef(payload_id=segment.source.payload_id, run=segment.source.run, rows=3)
    forged = Handle.__new__(Handle)  # as a corrupted sender would make it
    bad = Segment.__new__(Segment)
    for name, value in (
        ("source", short),
        ("start", 0),
        ("stop", 6),
        ("spec", SPEC),
        ("weight_version", 0),
    ):
        object.__setattr__(bad, name, value)
    for name, value in (("spec", SPEC), ("segments", (bad,)), ("_rows", 6)):
        object.__setattr__(forged, name, value)
    sample = plan.packs[0].samples[0]
    object.__setattr__(sample, "handle", forged)
    with pytest.raises(HandleError, match="outside their source"):
        pickle.loads(pickle.dumps(plan))


@dataclass(frozen=True, slots=True, kw_only=True)
class _TaggedSample(PackedSample):
    weight: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class _TaggedPack(Pack):
    source: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class _TaggedPlan(PackingPlan):
    step: int = 0


def test_subclasses_keep_their_own_fields() -> None:
    store = _store()
    a, b = _put(store, 6, 1), _put(store, 4, 2)
    tagged = _TaggedSample(sample_id="a", handle=a, tokens=7, offset=0, weight=0.5)
    plain = PackedSample(sample_id="b", handle=b, tokens=5, offset=8)
    packs = (
        Pack(samples=(plain,), length=16),
        _TaggedPack(samples=(tagged,), length=16, source="x"),
    )
    plan = _TaggedPlan(spec=SPEC, packs=packs, micro_batches=((0,), (1,)), step=42)
    restored = pickle.loads(pickle.dumps(plan, protocol=5))
    assert restored == plan
    assert type(restored) is _TaggedPlan
    assert restored.step == 42
    assert type(restored.packs[1]) is _TaggedPack
    assert restored.packs[1].source == "x"
    assert type(restored.packs[1].samples[0]) is _TaggedSample
    assert restored.packs[1].samples[0].weight == 0.5
    assert type(restored.packs[0].samples[0]) is PackedSample
    base = PackingPlan(spec=SPEC, packs=packs, micro_batches=((0,), (1,)))
    assert pickle.loads(pickle.dumps(base)) == base  # a subclass inside a plain plan
