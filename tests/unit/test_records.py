"""``routeplay.core.records``: fast pickling and copies of frozen, slotted dataclasses
behave exactly as ``dataclasses`` does, for the classes a step ships by the thousand."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core.records import fast_state, replaced
from routeplay.rollout import SampleRouting
from routeplay.rollout.routing_terms import Origin


@fast_state
@dataclass(frozen=True, slots=True)
class _Row:
    at: int
    name: str = ""


@dataclass(frozen=True, slots=True)
class _Checked:
    at: int

    def __post_init__(self) -> None:
        if self.at < 0:
            raise ValueError("negative")


routings = st.builds(
    SampleRouting,
    sample_id=st.text(max_size=8),
    session_id=st.none() | st.text(max_size=8),
    origin=st.sampled_from(Origin),
    response_versions=st.lists(st.integers(0, 9), max_size=4).map(tuple),
    prompt_tokens=st.none() | st.integers(0, 100),
    retries=st.integers(0, 5),
)


@given(routings)
def test_a_sample_routing_pickles_back_equal(routing: SampleRouting) -> None:
    back = pickle.loads(pickle.dumps(routing))
    assert back == routing
    assert type(back) is SampleRouting


@given(routings, st.integers(0, 5), st.none() | st.integers(0, 9))
def test_replaced_makes_what_dataclasses_replace_makes(
    routing: SampleRouting, retries: int, prompt: int | None
) -> None:
    ours = replaced(routing, retries=retries, prompt_tokens=prompt)
    theirs = dataclasses.replace(routing, retries=retries, prompt_tokens=prompt)
    assert ours == theirs
    assert [getattr(ours, f.name) for f in dataclasses.fields(ours)] == [
        getattr(theirs, f.name) for f in dataclasses.fields(theirs)
    ]


def test_replaced_refuses_a_field_the_class_does_not_have() -> None:
    with pytest.raises(TypeError, match="no fields"):
        replaced(_Row(1), size=3)


def test_a_class_with_checks_is_replaced_through_its_checks() -> None:
    assert replaced(_Checked(1), at=2) == _Checked(2)
    with pytest.raises(ValueError, match="negative"):
        replaced(_Checked(1), at=-1)


def test_fast_state_round_trips_and_stays_frozen() -> None:
    row = pickle.loads(pickle.dumps(_Row(3, "a")))
    assert row == _Row(3, "a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.at = 4  # type: ignore[misc]


@dataclass(frozen=True, kw_only=True)
class _Unslotted(SampleRouting):
    tag: str = "t"
    weight: float


@dataclass(frozen=True)
class _NoFields:
    pass


def test_a_subclass_without_slots_is_copied_and_pickled_with_every_field() -> None:
    routing = _Unslotted(sample_id="1", weight=0.5, retries=1)
    copied = replaced(routing, retries=3, tag="u")
    assert copied == dataclasses.replace(routing, retries=3, tag="u")
    assert copied.weight == 0.5
    restored = pickle.loads(pickle.dumps(routing))
    assert type(restored) is _Unslotted
    assert (restored.tag, restored.weight, restored.retries) == ("t", 0.5, 1)


def test_a_class_without_fields_is_copied() -> None:
    assert replaced(_NoFields()) == _NoFields()
