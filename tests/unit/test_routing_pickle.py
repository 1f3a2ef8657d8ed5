"""A ``SampleRouting`` pickles as one flat tuple (``routeplay.rollout.routing_pickle``):
what arrives equals what left; a subclass keeps every field of its own (leased samples,
whose store pickles only as a Ray client: ``tests/ray/test_routing_pickle_ray.py``)."""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core import RouteSpec, canonicalize
from routeplay.rollout import SampleRouting
from routeplay.rollout.routing_terms import Origin
from routeplay.store import RouteStore, StoreConfig

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)


@given(
    sample_id=st.text(max_size=8),
    session_id=st.none() | st.text(max_size=8),
    origin=st.sampled_from(list(Origin)),
    versions=st.lists(st.integers(0, 9), max_size=4).map(tuple),
    prompt_tokens=st.none() | st.integers(0, 99),
    retries=st.integers(0, 5),
)
def test_a_leaseless_routing_arrives_equal(
    sample_id: str,
    session_id: str | None,
    origin: Origin,
    versions: tuple[int, ...],
    prompt_tokens: int | None,
    retries: int,
) -> None:
    routing = SampleRouting(
        sample_id=sample_id,
        session_id=session_id,
        origin=origin,
        response_versions=versions,
        prompt_tokens=prompt_tokens,
        retries=retries,
    )
    restored = pickle.loads(pickle.dumps(routing, protocol=5))
    assert restored == routing
    assert restored.origin is origin
    assert restored.lease is None
    assert restored.handle is None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Tagged(SampleRouting):
    tag: str = ""


def test_a_subclass_keeps_its_own_fields() -> None:
    routing = _Tagged(sample_id="3", tag="kept", retries=2)
    restored = pickle.loads(pickle.dumps(routing))
    assert type(restored) is _Tagged
    assert restored.tag == "kept"
    assert restored.retries == 2


def test_a_copy_names_the_same_lease_object() -> None:
    store = RouteStore.local(StoreConfig(run="copy"))
    rows = canonicalize(np.zeros((3, 2, 2), dtype=np.uint8) + np.array([0, 1], np.uint8), SPEC)
    handle = store.put(rows)
    lease = store.acquire(handle, "rollout/4", pin=False)
    routing = SampleRouting(sample_id="4", handle=handle, lease=lease, retries=1)
    copied = copy.copy(routing)
    assert copied == routing
    assert copied.lease is lease
    assert copied.handle is handle
    assert copy.deepcopy(SampleRouting(sample_id="5", retries=2)) == SampleRouting(
        sample_id="5", retries=2
    )
    lease.release()
