"""EngineStore without Ray: a dict-backed fake object store with Ray-like reference
counting (an entry lives exactly as long as its reference object), and a fake clock."""

from __future__ import annotations

import hashlib
import itertools
import pickle
import re
import weakref
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from routeplay.errors import AlreadyConsumed, MisuseError, RoutesExpired
from routeplay.store.engine.engine_store import EngineStore

HEX56 = re.compile(r"[0-9a-f]{56}")
TTL = 10.0
MACHINE_TTL = 4.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRef:
    """Stands in for a Ray ObjectRef: a 56-hex id, weak-referenceable, no cycles."""

    __slots__ = ("__weakref__", "_hex")

    def __init__(self, hex_id: str) -> None:
        self._hex = hex_id

    def hex(self) -> str:
        return self._hex


class FakeObjectStore:
    """Objects by id; an entry is released when the last reference to its FakeRef goes,
    as Ray's reference counting does. CPython frees refs at once (no cycles), no gc needed."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self._ids = itertools.count()

    def put(self, data: Any) -> FakeRef:
        hex_id = hashlib.sha224(f"object-{next(self._ids)}".encode()).hexdigest()
        ref = FakeRef(hex_id)
        self.objects[hex_id] = data
        weakref.finalize(ref, self.objects.pop, hex_id, None)
        return ref

    def get(self, ref: FakeRef) -> Any:
        return self.objects[ref.hex()]

    @staticmethod
    def key_of(ref: FakeRef) -> str:
        return ref.hex()


def _store(ttl_s: float | None = TTL) -> tuple[EngineStore[FakeRef], FakeObjectStore, Clock]:
    objects, clock = FakeObjectStore(), Clock()
    store: EngineStore[FakeRef] = EngineStore(
        put_object=objects.put,
        get_object=objects.get,
        key_of=objects.key_of,
        ttl_s=ttl_s,
        clock=clock,
    )
    return store, objects, clock


# -- LMDeploy's contract -----------------------------------------------------------------
def test_put_returns_the_hex_of_the_object_reference() -> None:
    store, objects, _ = _store()
    first, second = store.put("a"), store.put("b")
    assert HEX56.fullmatch(first)
    assert HEX56.fullmatch(second)
    assert first != second
    assert objects.objects == {first: "a", second: "b"}


def test_get_returns_the_data_once() -> None:
    store, objects, _ = _store()
    payload = {"routed_experts": [[1, 2], [3, 4]]}
    key = store.put(payload)
    assert store.get(key) == payload
    assert objects.objects == {}  # the store dropped its reference: the object is freed
    with pytest.raises(AlreadyConsumed) as caught:
        store.get(key)
    err = caught.value
    assert isinstance(err, KeyError)  # what LMDeploy clients catch
    assert isinstance(err, MisuseError)
    message = str(err)
    assert message.startswith("engine key consumed"), message  # not KeyError's quoted repr
    assert key in message
    assert "read once" in message


def test_a_second_get_is_caught_by_except_key_error() -> None:
    store, _, _ = _store()
    key = store.put(1)
    store.get(key)
    with pytest.raises(KeyError):
        store.get(key)


def test_the_error_survives_pickling_as_ray_ships_it() -> None:
    store, _, _ = _store()
    key = store.put(1)
    store.get(key)
    with pytest.raises(AlreadyConsumed) as caught:
        store.get(key)
    shipped = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(shipped, AlreadyConsumed)
    assert isinstance(shipped, KeyError)
    assert str(shipped) == str(caught.value)


def test_an_unknown_key_is_a_key_error_too() -> None:
    store, _, _ = _store()
    with pytest.raises(KeyError, match="unknown engine key") as caught:
        store.get("0" * 56)
    assert isinstance(caught.value, AlreadyConsumed)
    assert "0" * 56 in str(caught.value)


def test_clear_drops_every_key_and_counts_them_as_freed() -> None:
    store, objects, _ = _store()
    keys = [store.put(i) for i in range(3)]
    store.get(keys[0])
    store.clear()
    assert store.keys() == []
    assert objects.objects == {}
    stats = store.stats()
    assert (stats.live_keys, stats.puts, stats.consumed, stats.freed) == (0, 3, 1, 2)
    for key in keys[1:]:
        with pytest.raises(AlreadyConsumed, match="engine key freed"):
            store.get(key)
    store.clear()  # clearing an empty store is fine
    assert store.stats().freed == 2


# -- additions ---------------------------------------------------------------------------
def test_get_ref_hands_out_the_reference_and_consumes() -> None:
    store, objects, _ = _store()
    key = store.put("payload")
    refs = store.get_ref(key)
    assert isinstance(refs, list)
    assert len(refs) == 1
    [ref] = refs
    assert isinstance(ref, FakeRef)
    assert ref.hex() == key
    assert objects.get(ref) == "payload"
    with pytest.raises(AlreadyConsumed):
        store.get_ref(key)
    with pytest.raises(AlreadyConsumed):
        store.get(key)
    # The caller's reference is now the only one: dropping it frees the object.
    del refs, ref
    assert objects.objects == {}
    assert store.stats().consumed == 1


def test_peek_does_not_consume() -> None:
    store, objects, _ = _store()
    key = store.put("payload")
    assert store.peek(key) == "payload"
    assert store.peek(key) == "payload"
    assert store.keys() == [key]
    assert store.stats().consumed == 0
    assert store.get(key) == "payload"
    with pytest.raises(AlreadyConsumed):
        store.peek(key)
    assert objects.objects == {}


def test_free_is_idempotent() -> None:
    store, objects, _ = _store()
    key = store.put("payload")
    assert store.free(key) is True
    assert objects.objects == {}
    assert store.free(key) is False
    assert store.free("f" * 56) is False
    with pytest.raises(AlreadyConsumed, match="freed"):
        store.get(key)
    stats = store.stats()
    assert (stats.live_keys, stats.freed, stats.consumed) == (0, 1, 0)


def test_free_after_get_is_a_no_op() -> None:
    store, _, _ = _store()
    key = store.put(1)
    store.get(key)
    assert store.free(key) is False
    stats = store.stats()
    assert (stats.consumed, stats.freed) == (1, 0)


def test_keys_are_listed_oldest_first() -> None:
    store, _, clock = _store(ttl_s=None)
    keys = []
    for step in (0.0, 3.0, 3.0, 7.5):  # equal timestamps keep put order
        clock.now = step
        keys.append(store.put(step))
    assert store.keys() == keys
    store.get(keys[1])
    assert store.keys() == [keys[0], *keys[2:]]


# -- TTL ---------------------------------------------------------------------------------
def test_keys_older_than_the_ttl_are_dropped() -> None:
    store, objects, clock = _store()
    old = store.put("old")
    clock.now = 6.0
    young = store.put("young")
    clock.now = 12.0  # old is 12s old, young 6s
    assert store.expire() == [old]
    assert store.keys() == [young]
    assert set(objects.objects) == {young}
    with pytest.raises(RoutesExpired) as caught:
        store.get(old)
    assert old in str(caught.value)
    assert "ttl 10.0s" in str(caught.value)
    with pytest.raises(RoutesExpired):
        store.peek(old)
    with pytest.raises(RoutesExpired):
        store.get_ref(old)
    assert store.free(old) is False
    stats = store.stats()
    assert (stats.live_keys, stats.puts, stats.expired, stats.consumed, stats.freed) == (
        1,
        2,
        1,
        0,
        0,
    )
    assert store.get(young) == "young"


def test_reading_an_overdue_key_expires_it_without_a_reaper() -> None:
    store, objects, clock = _store()
    key = store.put("late")
    clock.now = 30.0
    with pytest.raises(RoutesExpired, match="expired before anyone consumed it"):
        store.get(key)
    assert objects.objects == {}
    assert store.stats().expired == 1


def test_a_put_expires_overdue_keys() -> None:
    store, objects, clock = _store()
    old = store.put("old")
    clock.now = 11.0
    new = store.put("new")
    assert set(objects.objects) == {new}
    assert store.keys() == [new]
    with pytest.raises(RoutesExpired):
        store.get(old)


def test_consumed_keys_do_not_expire_later() -> None:
    store, _, clock = _store()
    key = store.put("x")
    store.get(key)
    clock.now = 100.0
    assert store.expire() == []
    with pytest.raises(AlreadyConsumed, match="consumed"):
        store.get(key)
    stats = store.stats()
    assert (stats.consumed, stats.expired) == (1, 0)


def test_no_ttl_never_expires() -> None:
    store, objects, clock = _store(ttl_s=None)
    key = store.put("forever")
    clock.now = 1e9
    assert store.expire() == []
    assert store.stats().live_keys == 1
    assert store.keys() == [key]
    assert store.get(key) == "forever"
    assert objects.objects == {}


def test_keys_does_not_list_keys_past_their_ttl() -> None:
    store, _, clock = _store()
    store.put("old")
    clock.now = 20.0
    assert store.keys() == []


# -- validation at ingest (the result kept next to its key) -----------------------------
@pytest.mark.parametrize("fate", ["get", "free", "expire", "clear"])
def test_an_ingest_result_goes_with_its_key(fate: str) -> None:
    store, objects, clock = _store()
    key = store.put("raw")
    canonical = objects.put("canonical")  # what the validator wrote, held by the entry
    assert store.prepare(key, [canonical], nbytes=9) is True
    assert store.prepared(key) == [canonical]
    del canonical
    assert set(objects.objects.values()) == {"raw", "canonical"}
    if fate == "get":
        assert store.get(key) == "raw"  # LMDeploy's get still answers the raw payload
    elif fate == "free":
        store.free(key)
    elif fate == "expire":
        clock.now = 2 * TTL
        store.expire()
    else:
        store.clear()
    assert objects.objects == {}  # both went: nothing prepared outlives its key
    assert store.prepared(key) is None
    stats = store.stats()
    assert (stats.prepared, stats.prepared_bytes) == (1, 9)


def test_a_key_gone_before_its_ingest_result_drops_the_result() -> None:
    store, _, _ = _store()
    key = store.put("raw")
    store.free(key)
    assert store.prepare(key, ["late"], nbytes=9) is False
    assert store.stats().prepared == 0
    assert store.prepared("f" * 56) is None


# -- random sequences against a model ----------------------------------------------------
class EngineStoreMachine(RuleBasedStateMachine):
    """Random put/get/get_ref/peek/free/clear/tick sequences against a plain model."""

    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        self.store, self.objects, self.clock = _store(ttl_s=MACHINE_TTL)
        self.live: dict[str, tuple[int, float]] = {}  # key -> (data, created)
        self.fate: dict[str, str] = {}  # key -> consumed / freed / expired
        self.counts = {"puts": 0, "consumed": 0, "freed": 0, "expired": 0}
        self.next_data = 0

    def _gone(self, key: str, why: str) -> None:
        del self.live[key]
        self.fate[key] = why
        self.counts[why] += 1

    def _refused(self, key: str, op: str) -> None:
        error = RoutesExpired if self.fate.get(key) == "expired" else AlreadyConsumed
        with pytest.raises(error):
            getattr(self.store, op)(key)

    @rule(target=keys)
    def put(self) -> str:
        data, self.next_data = self.next_data, self.next_data + 1
        key = self.store.put(data)
        assert HEX56.fullmatch(key)
        assert key not in self.live
        assert key not in self.fate
        self.live[key] = (data, self.clock.now)
        self.counts["puts"] += 1
        return key

    @rule(key=keys)
    def get(self, key: str) -> None:
        if key not in self.live:
            self._refused(key, "get")
            return
        assert self.store.get(key) == self.live[key][0]
        self._gone(key, "consumed")

    @rule(key=keys)
    def get_ref(self, key: str) -> None:
        if key not in self.live:
            self._refused(key, "get_ref")
            return
        [ref] = self.store.get_ref(key)
        assert ref.hex() == key
        assert self.objects.get(ref) == self.live[key][0]
        self._gone(key, "consumed")
        # dropping `ref` on return frees the object: checked by the invariant

    @rule(key=keys)
    def peek(self, key: str) -> None:
        if key not in self.live:
            self._refused(key, "peek")
            return
        assert self.store.peek(key) == self.live[key][0]

    @rule(key=keys)
    def free(self, key: str) -> None:
        was_live = key in self.live
        assert self.store.free(key) is was_live
        if was_live:
            self._gone(key, "freed")

    @rule()
    def unknown_key(self) -> None:
        with pytest.raises(KeyError):
            self.store.get("e" * 56)

    @rule()
    def clear(self) -> None:
        self.store.clear()
        for key in list(self.live):
            self._gone(key, "freed")

    @rule(seconds=st.sampled_from([0, 1, 2, 4]))
    def tick_and_expire(self, seconds: int) -> None:
        self.clock.now += seconds  # whole seconds: keys reach exactly the TTL too
        due = [
            key
            for key, (_, created) in self.live.items()
            if created <= self.clock.now - MACHINE_TTL
        ]
        assert sorted(self.store.expire()) == sorted(due)
        for key in due:
            self._gone(key, "expired")

    @invariant()
    def stats_match_the_model(self) -> None:
        stats = self.store.stats()
        assert stats.puts == self.counts["puts"]
        assert stats.consumed == self.counts["consumed"]
        assert stats.freed == self.counts["freed"]
        assert stats.expired == self.counts["expired"]
        assert stats.live_keys == len(self.live)
        assert stats.live_keys == stats.puts - stats.consumed - stats.freed - stats.expired

    @invariant()
    def keys_are_the_live_ones_oldest_first(self) -> None:
        assert self.store.keys() == list(self.live)  # the model's dict is in put order

    @invariant()
    def only_live_keys_keep_objects(self) -> None:
        assert set(self.objects.objects) == set(self.live)


TestEngineStoreMachine = EngineStoreMachine.TestCase
TestEngineStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
