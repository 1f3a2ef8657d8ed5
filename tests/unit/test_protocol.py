"""The protocol number moves with the calls between routeplay's processes, and a peer's
answer is judged exactly (``routeplay.store.remote.protocol``; the Ray side, with a copy of
routeplay of another protocol, is in ``tests/ray/test_engine_store_guard.py``)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay import __version__
from routeplay.core import EngineKey, RouteSpec, StoreRef
from routeplay.errors import ProtocolMismatch
from routeplay.store.engine.engine_store import EngineStoreStats, PayloadMeta
from routeplay.store.engine.ingest import Prepared, Validated
from routeplay.store.remote.actors import EngineStoreShell, StoreShardShell
from routeplay.store.remote.protocol import PROTOCOL, _question, check_answer
from routeplay.store.shard.lease_table import LeakRecord, TableStats
from routeplay.store.shard.shard import Grant, StoredPayload

SURFACE_BY_PROTOCOL = {1: "208d16fe", 2: "e694b8b5", 3: "ced42a86", 4: "f538f4cf", 5: "42e03faa"}
"""The first 8 hex digits of ``_surface``'s digest, per protocol number."""


EXCHANGED = (
    EngineKey,
    StoreRef,
    RouteSpec,
    StoredPayload,
    Grant,
    TableStats,
    LeakRecord,
    EngineStoreStats,
    PayloadMeta,
    Validated,
    Prepared,
)
"""What those actors send and answer: a changed field changes the protocol too."""


def _surface() -> str:
    """Every public method, with its signature, of the actors that outlive upgrades (a
    detached engine store and a run's shards, joined by name), and every field of what
    they exchange."""
    methods = [
        f"{actor.__name__}.{name}{inspect.signature(method)}"
        for actor in (StoreShardShell, EngineStoreShell)
        for name, method in inspect.getmembers(actor, inspect.isfunction)
        if not name.startswith("_")
    ]
    fields = [
        f"{kind.__name__}.{field.name}: {field.type}"
        for kind in EXCHANGED
        for field in dataclasses.fields(kind)
    ]
    return "\n".join([*methods, *fields])


def test_a_changed_call_between_processes_bumps_the_protocol() -> None:
    digest = hashlib.sha256(_surface().encode()).hexdigest()[:8]
    assert SURFACE_BY_PROTOCOL.get(PROTOCOL) == digest, (
        "a shard's or an engine store's calls changed: an older peer would answer them "
        f"another way. Bump PROTOCOL in routeplay/store/remote/protocol.py to {PROTOCOL + 1} and "
        f"add {PROTOCOL + 1}: {digest!r} to SURFACE_BY_PROTOCOL (keep the old entries)."
    )


def test_the_question_answers_for_the_routeplay_it_runs_on() -> None:
    assert _question()(object()) == (PROTOCOL, __version__)


def test_the_question_tells_an_old_routeplay_from_an_actor_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    question = _question()
    monkeypatch.delitem(sys.modules, "routeplay.store.remote.protocol")
    before = question(object())
    monkeypatch.delitem(sys.modules, "routeplay")
    foreign = question(object())
    with pytest.raises(ProtocolMismatch, match="found a routeplay from before protocol"):
        check_answer(before, "here", "hint")
    with pytest.raises(ProtocolMismatch, match="found an actor that does not run routeplay"):
        check_answer(foreign, "here", "hint")


ANSWERS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=3) | st.tuples(inner),
    max_leaves=6,
)


@given(answer=ANSWERS)
def test_any_answer_passes_only_as_this_protocol_or_is_refused_typed(answer: object) -> None:
    """A peer's answer crosses a process boundary: whatever it is, the check raises
    ``ProtocolMismatch`` (nothing else) unless it is exactly ``(PROTOCOL, version)``."""
    try:
        check_answer(answer, "here", "hint")
    except ProtocolMismatch as refused:
        message = str(refused)
    else:
        message = ""
    if message:
        assert "found " in message
        return
    assert isinstance(answer, tuple)
    assert len(answer) == 2
    assert type(answer[0]) is int
    assert answer[0] == PROTOCOL


def test_another_release_of_this_protocol_passes() -> None:
    check_answer((PROTOCOL, "9.9.9"), "here", "hint")  # another release, same calls


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        ((PROTOCOL + 1, "9.9.9"), f"found protocol {PROTOCOL + 1} (routeplay 9.9.9)"),
        ((PROTOCOL - 1, "0.0.1"), f"found protocol {PROTOCOL - 1} (routeplay 0.0.1)"),
        (None, "found an answer that names no protocol: None"),
        ("garbage", "found an answer that names no protocol: 'garbage'"),
        ((True, "0.2.0"), "found an answer that names no protocol"),  # True == 1, not a number
        ((float(PROTOCOL), "0.2.0"), "found an answer that names no protocol"),
    ],
)
def test_any_other_answer_is_refused_with_both_sides_named(answer: object, found: str) -> None:
    with pytest.raises(ProtocolMismatch) as refused:
        check_answer(answer, "Ray actor lmdeploy/shared_store", "Restart it.")
    message = str(refused.value)
    assert found in message
    assert f"expected protocol {PROTOCOL} (routeplay {__version__})" in message
    assert "lmdeploy/shared_store" in message
    assert message.endswith("Restart it.")
