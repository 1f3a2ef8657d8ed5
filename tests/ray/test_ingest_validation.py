"""An engine store that knows the spec validates payloads as they are put: adopting a
key then takes canonical rows that already exist (``routeplay.store.engine.ingest``). Each
test checks what a reader gets against the raw payload, and that the store returns to
its baseline: the raw payload, the ingest result and the adopted block all go."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from typing import Any

import numpy as np
import psutil
import pytest
import ray
from store_probe import created_bytes, kill_and_wait, used_bytes, wait_until

from routeplay.bench.transfer_paths import make_routing
from routeplay.core import EngineKey, RouteSpec, preset
from routeplay.errors import AlreadyConsumed, DuplicateExperts, LifetimeError, RoutesLost
from routeplay.store import RouteStore, StoreConfig, start_engine_store
from routeplay.store.engine.ingest import Prepared, Validated, decide, settle
from routeplay.store.remote import ray_calls

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = preset("glm-4.5-air")  # 46 decoder layers, the first dense: LMDeploy sends all 46
ROWS = 300
NAME = "ingest_store"


@pytest.fixture(scope="module")
def engine_store() -> Any:
    return start_engine_store(name=NAME, ttl_s=60, spec=SPEC)


@pytest.fixture(scope="module")
def store() -> RouteStore:
    return StoreConfig(run="run-ingest", timeout_s=20).build()


def _put(engine_store: Any, raw: np.ndarray) -> str:
    return str(ray.get(engine_store.put.remote(raw), timeout=20))


def _canonical(raw: np.ndarray) -> np.ndarray:
    return raw[:, list(SPEC.moe_layer_indices()), :].astype(SPEC.dtype)


def _read(store: RouteStore, key: EngineKey, start_row: int = 0) -> np.ndarray:
    handle = store.adopt_key(key, SPEC, start_row=start_row)
    with store.acquire(handle, "train/ingest"):
        return np.array(store.read(handle))


def _read_or_error(store: RouteStore, handle: Any) -> np.ndarray | LifetimeError:
    try:
        return np.array(store.read(handle))
    except LifetimeError as exc:
        return exc


def _settled(baseline: int) -> bool:
    return wait_until(lambda: used_bytes() <= baseline, timeout_s=30)


def _created() -> int:
    return sum(node.created_bytes for node in created_bytes().values())


def _put_and_wait(where: Any, raw: np.ndarray, *, at_ingest: bool) -> str:
    """Put as LMDeploy does and wait until every write of the put is done: the raw
    payload twice (the argument, then the store's own put) and, at ingest, the canonical
    block, written as the validation ends."""
    start = _created()
    key = _put(where, raw)
    put = 2 * raw.nbytes + (SPEC.nbytes(raw.shape[0]) if at_ingest else 0)
    assert wait_until(lambda: _created() - start >= put)
    return key


def _read_written(store: RouteStore, key: EngineKey) -> tuple[np.ndarray, int]:
    """The rows of an adopt + read, and the object-store bytes it wrote."""
    start = _created()
    rows = _read(store, key)
    return rows, _created() - start


@pytest.mark.parametrize("at_ingest", [True, False])
def test_a_payload_is_validated_once_at_ingest_and_adopted_ready_made(
    engine_store: Any, store: RouteStore, at_ingest: bool
) -> None:
    """With the spec, the adopt + read writes nothing (the block exists); without it
    (the control), the adopt writes the canonical block: the same rows either way."""
    where = engine_store if at_ingest else start_engine_store(name="ingest_none", ttl_s=60)
    baseline = used_bytes()
    before = ray.get(where.stats.remote(), timeout=20)
    raw = make_routing(SPEC, ROWS, all_layers=True, seed=1)
    actor = NAME if at_ingest else "ingest_none"
    key = EngineKey(key=_put_and_wait(where, raw, at_ingest=at_ingest), rows=ROWS, actor=actor)
    rows, written = _read_written(store, key)
    np.testing.assert_array_equal(rows, _canonical(raw))
    after = ray.get(where.stats.remote(), timeout=20)
    if at_ingest:
        assert written < SPEC.nbytes(ROWS) // 2, written  # read as it was written at ingest
        assert after.prepared - before.prepared == 1
        assert after.prepared_bytes - before.prepared_bytes == SPEC.nbytes(ROWS)
    else:
        assert written >= SPEC.nbytes(ROWS), written  # validated and written at adoption
        assert after.prepared == before.prepared
        ray.kill(where)
    store.flush()
    assert _settled(baseline)


def test_a_trailing_row_and_a_history_are_left_out_of_what_is_read(
    engine_store: Any, store: RouteStore
) -> None:
    baseline = used_bytes()
    raw = make_routing(SPEC, ROWS + 1, all_layers=True, seed=2)  # LMDeploy's trailing row
    key = _put_and_wait(engine_store, raw, at_ingest=True)
    trailing = EngineKey(key=key, rows=ROWS, actor=NAME, trailing_rows=1)
    rows, written = _read_written(store, trailing)
    np.testing.assert_array_equal(rows, _canonical(raw)[:ROWS])
    assert written < SPEC.nbytes(ROWS) // 2, written  # the ingest block, its last row unread
    resumed = EngineKey(key=_put(engine_store, raw), rows=ROWS, actor=NAME, trailing_rows=1)
    new_rows = _read(store, resumed, start_row=120)  # a resume: only rows past the history
    np.testing.assert_array_equal(new_rows, _canonical(raw)[120:ROWS])
    store.flush()
    assert _settled(baseline)


@pytest.mark.parametrize("settled", [True, False], ids=["ended", "still-running"])
def test_a_payload_refused_at_ingest_is_refused_by_the_adoption(
    engine_store: Any, store: RouteStore, settled: bool
) -> None:
    """The adoption, not a trainer's read, refuses it: with the refusal known to the
    engine store before the adoption, or with the validation still running (waited for).
    The key is consumed and every byte goes."""
    baseline = used_bytes()
    bad = make_routing(SPEC, ROWS, all_layers=True, seed=3)
    bad[7, 3] = 0  # a zero-padded row in MoE layer 2 (decoder layer 3)
    key = _put(engine_store, bad)
    if settled:
        assert wait_until(lambda: ray.get(engine_store.validated.remote(key)) is False)
    with pytest.raises(DuplicateExperts, match="row 7, layer 2"):
        store.adopt_key(EngineKey(key=key, rows=ROWS, actor=NAME), SPEC)
    assert key not in ray.get(engine_store.keys.remote(), timeout=20)
    store.flush()
    assert store.stats().live_payloads == 0
    assert _settled(baseline)


@pytest.mark.parametrize("settled", [True, False], ids=["ended", "still-running"])
def test_a_group_of_keys_validated_at_ingest_is_adopted_from_their_blocks(
    engine_store: Any, store: RouteStore, settled: bool
) -> None:
    """A GRPO group's keys (``adopt_keys_each(..., shared_prefix=..., pack=True)``): each
    member's block validated at ingest is laid out as it is, a validation still running
    is waited for; a member refused at ingest is refused by the adoption alone, the
    others read their exact rows, and every byte goes."""
    baseline = used_bytes()
    prompt, own = 64, 40
    shared = make_routing(SPEC, prompt, all_layers=True, seed=11)
    raws = [
        np.concatenate([shared, make_routing(SPEC, own, all_layers=True, seed=12 + m)])
        for m in range(3)
    ]
    raws[1][prompt + 5, 3] = 0  # a zero-padded row in member 1's own rows
    keys = [EngineKey(key=_put(engine_store, raw), rows=prompt + own, actor=NAME) for raw in raws]
    if settled:
        assert wait_until(
            lambda: all(ray.get(engine_store.validated.remote(k.key)) is not None for k in keys)
        )
    out = store.adopt_keys_each(keys, SPEC, shared_prefix=prompt, pack=True)
    assert isinstance(out[1], DuplicateExperts)
    assert "row 69, layer 2" in str(out[1])
    leases = store.acquire_many([(out[0], "train/group"), (out[2], "train/group")])
    for handle, raw in ((out[0], raws[0]), (out[2], raws[2])):
        np.testing.assert_array_equal(np.array(store.read(handle)), _canonical(raw))
    store.release_many(leases)
    assert not set(k.key for k in keys) & set(ray.get(engine_store.keys.remote(), timeout=20))
    store.flush()
    assert store.stats().live_payloads == 0
    assert _settled(baseline)


def test_another_spec_validates_the_raw_payload_as_before(store: RouteStore) -> None:
    other = preset("qwen3-30b-a3b")
    engine_store = start_engine_store(name="ingest_other", ttl_s=60, spec=SPEC)
    try:
        raw = make_routing(other, ROWS, all_layers=True, seed=4)
        key = EngineKey(key=_put(engine_store, raw), rows=ROWS, actor="ingest_other")
        handle = store.adopt_key(key, other)  # the store's spec does not fit: not at ingest
        with store.acquire(handle, "train/other"):
            rows = store.read(handle)
        np.testing.assert_array_equal(rows, raw.astype(other.dtype))
        assert ray.get(engine_store.stats.remote(), timeout=20).prepared == 0
    finally:
        ray.kill(engine_store)


def test_unadopted_keys_free_their_ingest_result(engine_store: Any) -> None:
    baseline = used_bytes()
    keys = [_put(engine_store, make_routing(SPEC, ROWS, all_layers=True, seed=s)) for s in (5, 6)]
    assert ray.get(engine_store.free.remote(keys[0]), timeout=20)
    assert (
        ray.get(engine_store.get.remote(keys[1]), timeout=20).dtype == np.uint16
    )  # LMDeploy's get
    assert _settled(baseline)


def test_a_killed_engine_store_leaves_exact_rows_or_a_lifetime_error_and_no_bytes() -> None:
    """The engine store owns blocks validated at ingest: once it is killed, a read gets
    the exact rows (while Ray still has them) or ``RoutesLost``, never other rows or an
    untyped error, and the orphaned bytes are freed. The block exists before the kill:
    killed while a validation still runs, Ray 2.60 may store that task's result after
    its owner died and keep it with no owner and no reference (seen 3 times in 16; 0 in
    30 once the block existed), which no process of routeplay can free
    (docs/engine-store.md)."""
    baseline = used_bytes()
    dying = start_engine_store(name="ingest_dying", ttl_s=60, spec=SPEC)
    reader = StoreConfig(run="run-ingest-dying", timeout_s=20).build()
    try:
        raw = make_routing(SPEC, ROWS, all_layers=True, seed=7)
        key = EngineKey(
            key=_put_and_wait(dying, raw, at_ingest=True), rows=ROWS, actor="ingest_dying"
        )
        handle = reader.adopt_key(key, SPEC)
        kill_and_wait(dying)
        with reader.acquire(handle, "train/dying"):
            outcome = _read_or_error(reader, handle)
        if isinstance(outcome, LifetimeError):
            assert "lost" in str(outcome).lower()
        else:
            np.testing.assert_array_equal(outcome, _canonical(raw))
    finally:
        reader.shutdown()
    # Ray may keep a byte of the killed actor's own state in the object store (seen: 1
    # byte, 1 time in 4); a payload here is 220 kB raw, its canonical block 108 kB.
    assert _settled(baseline + 1024)


SETTLE: dict[str, Any] = {"outcomes": ray_calls.outcomes_now}  # what the engine store passes


@ray.remote(num_returns=2)
def _slow_ingest(refuse: bool, rows: int) -> tuple[None, np.ndarray]:
    """An ingest validation that takes a while (status, block), as ``KeyValidator.ingest``."""
    time.sleep(1.5)
    if refuse:
        raise DuplicateExperts("duplicate expert ids", where="engine key k, row 7, layer 2")
    return None, np.zeros((rows, *SPEC.row_shape), SPEC.dtype)


@pytest.mark.parametrize("refuse", [False, True])
def test_the_engine_store_settles_ended_validations_without_waiting(refuse: bool) -> None:
    status, block = _slow_ingest.remote(refuse, ROWS)
    ready = Prepared(spec=SPEC, rows=ROWS, status=status, canonical=[block])
    [running] = settle([ready], **SETTLE)
    assert running.outcome is None  # not waited for: the validation sleeps 1.5 s
    assert wait_until(lambda: ray_calls.outcome_now(status) is not None)
    # A key named twice (consumed once, then refused) and one without a validation.
    ended, twice, again, none = settle([ready, ready, ready, None], **SETTLE)
    assert ended.outcome is (not refuse)
    assert twice.outcome is (not refuse)
    assert again.outcome is (not refuse)  # the same status, looked up again
    assert none is None


@ray.remote
def _runs_long() -> None:
    """A validation still running whenever it is looked up (cancelled by the test)."""
    time.sleep(300)


@ray.remote
def _ends(refuse: bool) -> None:
    if refuse:
        raise DuplicateExperts("duplicate expert ids", where="engine key k, row 7, layer 2")


def test_statuses_looked_up_at_once_tell_returned_refused_and_running_apart() -> None:
    """``outcomes_now``: one wait and one get for every status of a take, and where the
    joint get meets a refusal, each ended one asked alone (the refusal is one of them)."""
    valid, refused = _ends.remote(False), _ends.remote(True)
    running = _runs_long.remote()
    assert ray_calls.succeeded(valid, 20)
    assert wait_until(lambda: ray_calls.outcome_now(refused) is False)
    got = ray_calls.outcomes_now([valid, refused, running, valid])
    assert got == [True, False, None, True]
    assert ray_calls.outcomes_now([valid, valid]) == [True, True]
    assert ray_calls.outcomes_now([]) == []
    ray.cancel(running, force=True)


def test_settling_is_best_effort_the_keys_are_consumed_already() -> None:
    ready = Prepared(spec=SPEC, rows=ROWS, status=ray.put(None), canonical=[ray.put(0)])

    def broken(statuses: list[Any]) -> list[bool | None]:
        raise ray.exceptions.RaySystemError("the raylet is gone")

    assert settle([ready], outcomes=broken) == [ready]


def test_the_engine_store_hands_a_validated_key_over_as_its_block_alone(
    engine_store: Any,
) -> None:
    raw = make_routing(SPEC, ROWS, all_layers=True, seed=4)
    key = EngineKey(key=_put(engine_store, raw), rows=ROWS, actor=NAME)
    # The block is written before the validator's reply reaches the engine store: wait
    # until the store itself sees the validation ended.
    assert wait_until(lambda: ray.get(engine_store.validated.remote(key.key)) is True)
    taken, _, waits = ray.get(
        engine_store.take_offered_many.remote([key], SPEC, None, [0]), timeout=20
    )
    # Decided where the outcome is known: no raw payload, no status, nothing to wait for.
    assert isinstance(taken[0], Validated)
    assert waits == [None]
    np.testing.assert_array_equal(ray.get(taken[0].canonical[0], timeout=20), _canonical(raw))


def _prepared(outcome: bool | None, rows: int = ROWS, spec: RouteSpec = SPEC) -> Prepared:
    return Prepared(spec=spec, rows=rows, status="status", canonical=["block"], outcome=outcome)


@pytest.mark.parametrize(
    ("ready", "start", "decided", "waited"),
    [
        (_prepared(None), 0, False, True),  # running: the adopter waits for its status
        (_prepared(True), 0, True, False),  # ended valid: its block alone
        (_prepared(False), 0, False, True),  # refused or lost: the status says which
        (_prepared(None, rows=ROWS + 1), 0, False, True),
        (_prepared(True, rows=ROWS + 1), 0, True, False),
        (_prepared(None), 3, False, True),  # a resume's rows
        (_prepared(True), 3, True, False),
        (_prepared(None, spec=replace(SPEC, num_experts=SPEC.num_experts * 2)), 0, False, False),
        (None, 0, False, False),  # not validated at ingest
    ],
)
def test_decide_sends_a_block_alone_the_raw_payload_or_what_must_be_waited_for(
    ready: Prepared | None, start: int, decided: bool, waited: bool
) -> None:
    key = EngineKey(key="ab" * 28, rows=ROWS)
    [out], [wait] = decide([["raw"]], [ready], [key], [start], SPEC)
    assert isinstance(out, Validated) is decided
    assert out == (Validated(canonical=["block"], rows=ready.rows) if decided else ["raw"])
    assert (wait is ready) if waited else (wait is None)
    refused = RoutesLost("gone")
    assert decide([refused], [ready], [key], [start], SPEC) == ([refused], [None])


def test_a_key_adopted_twice_in_one_call_gives_its_rows_once_and_a_refusal(
    engine_store: Any, store: RouteStore
) -> None:
    raw = make_routing(SPEC, ROWS, all_layers=True, seed=6)
    key = EngineKey(key=_put_and_wait(engine_store, raw, at_ingest=True), rows=ROWS, actor=NAME)
    handle, again = store.adopt_keys_each([key, key], SPEC)
    assert isinstance(again, AlreadyConsumed)
    with store.acquire(handle, "train/twice"):
        np.testing.assert_array_equal(store.read(handle), _canonical(raw))
    store.flush()


def test_groups_adopted_at_once_share_their_calls_and_each_refusal_is_its_members_alone(
    engine_store: Any, store: RouteStore
) -> None:
    """Three GRPO groups adopted by concurrent coroutines (one ``adopt_key_batches``: a
    round of groups, one take, one layout call, one hand-over): a member with a bad row
    and a member whose key was consumed already are refused alone, every other member
    reads its exact rows, and every byte goes."""
    baseline = used_bytes()
    prompt, own = 32, 24
    groups: list[list[np.ndarray]] = []
    for g in range(3):
        shared = make_routing(SPEC, prompt, all_layers=True, seed=40 + g)
        groups.append(
            [
                np.concatenate(
                    [shared, make_routing(SPEC, own, all_layers=True, seed=50 + 4 * g + m)]
                )
                for m in range(3)
            ]
        )
    groups[1][2][prompt + 3, 4] = 0  # a zero-padded row in group 1, member 2's own rows
    keys = [
        [EngineKey(key=_put(engine_store, raw), rows=prompt + own, actor=NAME) for raw in group]
        for group in groups
    ]
    taken = _read(store, keys[2][0])  # consumed before the groups are adopted
    np.testing.assert_array_equal(taken, _canonical(groups[2][0]))

    async def adopt_all() -> list[list[Any]]:
        return list(
            await asyncio.gather(
                *(
                    store.aadopt_keys_each(group, SPEC, shared_prefix=prompt, pack=True)
                    for group in keys
                )
            )
        )

    before = dict(store.stats().calls_by_op)
    out = asyncio.run(adopt_all())
    calls = dict(store.stats().calls_by_op)
    assert calls.get("adopt_key_batches", 0) - before.get("adopt_key_batches", 0) == 1
    assert isinstance(out[1][2], DuplicateExperts)
    assert isinstance(out[2][0], AlreadyConsumed)
    good = [(g, m) for g in range(3) for m in range(3) if (g, m) not in ((1, 2), (2, 0))]
    leases = store.acquire_many([(out[g][m], "train/groups") for g, m in good])
    for g, m in good:
        np.testing.assert_array_equal(np.array(store.read(out[g][m])), _canonical(groups[g][m]))
    store.release_many(leases)
    store.flush()
    assert store.stats().live_payloads == 0
    assert _settled(baseline)


def _validator_pids() -> set[int]:
    return {
        process.pid
        for process in psutil.process_iter(["cmdline"])
        if (process.info["cmdline"] or [""])[0].startswith("ray::KeyValidatorShell")
    }


def _kill_validators() -> int:
    """SIGKILL every key validator's process (an engine node's OOM killer would), then
    wait until as many run again (restarted: a step later, as between two steps); how
    many were killed."""
    killed = _validator_pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: len(_validator_pids() - killed) >= len(killed), timeout_s=60)
    return len(killed)


def test_a_validator_killed_between_adoptions_is_started_again(
    engine_store: Any, store: RouteStore
) -> None:
    """The shard's validator on the engine node (and the engine store's, for ingest) dies
    between two steps: the next groups are adopted as before, not refused for good."""
    baseline = used_bytes()
    prompt, own = 16, 8

    def adopt_groups(seed: int) -> None:
        groups = []
        for g in range(2):
            shared = make_routing(SPEC, prompt, all_layers=True, seed=seed + g)
            own_rows = [make_routing(SPEC, own, all_layers=True, seed=seed + 10 + 3 * g + m)
                        for m in range(2)]  # fmt: skip
            groups.append([np.concatenate([shared, rows]) for rows in own_rows])
        keys = [
            [EngineKey(key=_put(engine_store, raw), rows=prompt + own, actor=NAME) for raw in g]
            for g in groups
        ]

        async def both() -> list[list[Any]]:
            return list(await asyncio.gather(*(
                store.aadopt_keys_each(k, SPEC, shared_prefix=prompt, pack=True) for k in keys
            )))  # fmt: skip

        out = asyncio.run(both())
        handles = [h for group in out for h in group]
        leases = store.acquire_many([(h, "train/restart") for h in handles])
        for handle, raw in zip(handles, [raw for g in groups for raw in g], strict=True):
            np.testing.assert_array_equal(np.array(store.read(handle)), _canonical(raw))
        store.release_many(leases)
        store.flush()

    adopt_groups(70)
    assert _kill_validators() >= 1
    adopt_groups(90)
    assert store.stats().live_payloads == 0
    assert _settled(baseline)


def test_a_hand_over_the_validator_cannot_make_is_a_lost_round_not_bad_blocks() -> None:
    """A validator restarted between a round's layout and its hand-over has nothing
    staged: the take says so (its marker), and the round is lost with a typed error,
    never adopted as blocks that hold an error."""
    from routeplay.store.remote.actors import KeyValidator, _RayAdoption

    validator = KeyValidator.remote()

    class Shell:  # what a shard gives its adoption steps: its validators, its deadline
        _timeout_s = 20.0

        def _validator(self, node: str) -> Any:
            return validator

    with pytest.raises(RoutesLost, match="restarted before handing over"):
        _RayAdoption(Shell()).take_group("node", "never-staged", 3)  # type: ignore[arg-type]
    kill_and_wait(validator)
