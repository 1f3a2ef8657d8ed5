"""``routeplay.core.records``: fast pickling and copies of frozen, slotted dataclasses
behave exactly as ``dataclasses`` does, for the classes a step ships by the thousand."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.core.records import fast_state, replaced, slot_builder
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


_FIELD_VALUES = {
    "sample_id": st.text(max_size=4),
    "session_id": st.none() | st.text(max_size=4),
    "origin": st.sampled_from(Origin),
    "response_versions": st.lists(st.integers(0, 9), max_size=3).map(tuple),
    "prompt_tokens": st.none() | st.integers(0, 9),
    "retries": st.integers(0, 5),
    "lease": st.none(),
    "unreleased": st.just(()),
    "handle": st.none(),
}


@given(routings, st.fixed_dictionaries({}, optional=_FIELD_VALUES))
def test_replaced_matches_dataclasses_replace_whatever_fields_change(
    routing: SampleRouting, changes: dict[str, object]
) -> None:
    ours = replaced(routing, **changes)
    theirs = dataclasses.replace(routing, **changes)
    assert type(ours) is SampleRouting
    assert [getattr(ours, f.name) for f in dataclasses.fields(ours)] == [
        getattr(theirs, f.name) for f in dataclasses.fields(theirs)
    ]
    assert routing == dataclasses.replace(routing)  # the original is left as it was


@fast_state
@dataclass(frozen=True, slots=True)
class _Empty:
    pass


def test_a_fast_state_of_the_wrong_length_is_refused_and_an_empty_one_round_trips() -> None:
    row = object.__new__(_Row)
    with pytest.raises(ValueError, match="unpack"):
        row.__setstate__((1,))
    with pytest.raises(ValueError, match="unpack"):
        row.__setstate__((1, "a", 2))
    assert pickle.loads(pickle.dumps(_Empty())) == _Empty()


@given(st.integers(-5, 5), st.text(max_size=5))
def test_slot_builder_makes_what_the_constructor_makes(at: int, name: str) -> None:
    built = slot_builder(_Row, ("at", "name"))(at, name)
    assert type(built) is _Row
    assert built == _Row(at, name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.at = 1  # type: ignore[misc]


def test_slot_builder_refuses_a_half_built_object_or_an_unslotted_class() -> None:
    with pytest.raises(TypeError, match="every field"):
        slot_builder(_Row, ("at",))
    with pytest.raises(TypeError, match="every field"):
        slot_builder(_Row, ("at", "at"))
    with pytest.raises(TypeError, match="every field"):
        slot_builder(_Unslotted, tuple(f.name for f in dataclasses.fields(_Unslotted)))
