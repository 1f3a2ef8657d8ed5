"""``ingest_and_finish_group``: a GRPO group's answers written and its members leased
by one shard call, and every other member finished as ``finish_all`` finishes it.

The calls are counted by the shard (``stats().calls_by_op``); the rows are read back
through each member's own lease, and the store is empty once every member is released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from routeplay.core import EngineKey, Handle, Routes, RouteSpec, read_response
from routeplay.core.wires import Engine, EngineRouting
from routeplay.errors import HandleError, RouteplayError, RoutesLost
from routeplay.rollout import (
    Origin,
    SampleRouting,
    aingest_and_finish_group,
    ingest_and_finish_group,
    sample_holder,
)
from routeplay.rollout.fake_engines import FakeLmdeployKey, FakeSglang
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.client.write_path import LeasedPut, LeasedWrite, shared_samples
from routeplay.store.remote.backend import LocalBackend
from routeplay.store.shard.api import ShardApi, shard_call
from routeplay.store.write_plan import plan_batch

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
PROMPT, FIRST, SECOND = 6, 4, 3


def truth(rows: int, seed: int) -> npt.NDArray[np.uint8]:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)


def member_rows(member: int) -> npt.NDArray[np.uint8]:
    """A member's whole rows: the group's prompt, then its own (two requests' worth)."""
    return np.concatenate([truth(PROMPT, 1), truth(FIRST + SECOND - 1, 10 + member)])


def answer(member: int, tokens: int, new: int, start_row: int = 0) -> EngineRouting:
    """SGLang's answer carrying a member's rows from ``start_row`` on."""
    body = FakeSglang(spec=SPEC).respond(
        member_rows(member)[: tokens + new - 1],
        prompt_tokens=tokens,
        completion_tokens=new,
        start_row=start_row,
    )
    return read_response(Engine.SGLANG, body, SPEC, start_row=start_row)


def continuations(routings: Sequence[SampleRouting]) -> list[Any]:
    return [r.continuation(prompt_ids=range(PROMPT)) for r in routings]


def calls_of(store: RouteStore, before: dict[str, int]) -> dict[str, int]:
    after = dict(store.stats().calls_by_op)
    return {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}


def finish_fresh(store: RouteStore, size: int) -> list[SampleRouting]:
    fresh = [SampleRouting(sample_id=f"m{m}") for m in range(size)]
    answers = [answer(m, PROMPT, FIRST) for m in range(size)]
    out = ingest_and_finish_group(
        continuations(fresh), answers, writer=store, store=store, weight_version=0
    )
    assert all(isinstance(r, SampleRouting) for r in out)
    return [r for r in out if isinstance(r, SampleRouting)]


@pytest.mark.parametrize("size", [1, 4, 16])
def test_a_fresh_group_is_written_and_leased_in_one_call(size: int) -> None:
    store = RouteStore.local(StoreConfig(run=f"fresh-{size}"))
    before = dict(store.stats().calls_by_op)
    done = finish_fresh(store, size)
    assert calls_of(store, before) == {"adopt_leased": 1}
    stats = store.stats()
    assert stats.live_payloads == 1
    assert stats.shared_prefix_bytes_saved == (size - 1) * SPEC.nbytes(PROMPT)
    assert dict(stats.leases_by_holder) == {sample_holder(f"m{m}"): 1 for m in range(size)}
    for m, routing in enumerate(done):
        assert routing.lease is not None
        assert routing.lease.holder == sample_holder(f"m{m}")
        assert routing.origin is Origin.PRODUCED
        assert routing.handle is not None
        np.testing.assert_array_equal(
            store.read(routing.handle), member_rows(m)[: PROMPT + FIRST - 1]
        )
    for routing in done[:-1]:
        routing.release()
    assert store.stats().live_payloads == 1  # the last member still holds the payload
    done[-1].release()
    assert store.stats().live_payloads == 0
    assert store.leaks() == []


def test_a_refused_member_costs_only_itself_and_its_continuation_stays_open() -> None:
    store = RouteStore.local(StoreConfig(run="refused"))
    fresh = [SampleRouting(sample_id=f"m{m}") for m in range(3)]
    conts = continuations(fresh)
    answers = [
        answer(0, PROMPT, FIRST),
        answer(1, PROMPT, FIRST, start_row=2),
        answer(2, PROMPT, FIRST),
    ]
    out = ingest_and_finish_group(conts, answers, writer=store, store=store, weight_version=0)
    assert isinstance(out[1], HandleError)
    assert "skips rows" in str(out[1])
    good = [r for r in out if isinstance(r, SampleRouting)]
    assert [r.sample_id for r in good] == ["m0", "m2"]
    assert dict(store.stats().leases_by_holder) == {"rollout/m0": 1, "rollout/m2": 1}
    conts[1].abandon()  # the caller's to abandon, as after ingest_routing_group
    for routing in good:
        routing.release()
    assert store.stats().live_payloads == 0
    assert store.leaks() == []


def test_a_group_of_resumes_is_written_then_leased_and_ends_its_old_leases() -> None:
    store = RouteStore.local(StoreConfig(run="resumes"))
    first = finish_fresh(store, 3)
    before = dict(store.stats().calls_by_op)
    answers = [answer(m, PROMPT + FIRST, SECOND, start_row=PROMPT + FIRST - 1) for m in range(3)]
    out = ingest_and_finish_group(
        continuations(first), answers, writer=store, store=store, weight_version=1
    )
    # History rows are leased with the new ones: the write cannot lease them (another
    # payload), so the resumes take the path ingest_routing_group + finish_all takes.
    assert calls_of(store, before) == {"adopt_many": 1, "lease_many": 1, "release_many": 1}
    resumed = [r for r in out if isinstance(r, SampleRouting)]
    assert len(resumed) == 3
    assert all(r.released for r in (f.lease for f in first) if r is not None)
    for m, routing in enumerate(resumed):
        assert routing.handle is not None
        np.testing.assert_array_equal(store.read(routing.handle), member_rows(m))
        routing.release()
    assert store.stats().live_payloads == 0
    assert store.leaks() == []


def test_a_group_of_engine_keys_is_adopted_then_leased() -> None:
    backend = LocalBackend("keys", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="keys"), backend)
    fake = FakeLmdeployKey(spec=SPEC, put=backend.engine_store().put)
    fresh = [SampleRouting(sample_id=f"m{m}") for m in range(3)]
    answers = [
        read_response(
            Engine.LMDEPLOY,
            fake.respond(member_rows(m)[: PROMPT + FIRST], prompt_tokens=PROMPT,
                         completion_tokens=FIRST),
            SPEC,
        )
        for m in range(3)
    ]  # fmt: skip
    before = dict(store.stats().calls_by_op)
    out = ingest_and_finish_group(
        continuations(fresh), answers, writer=store, store=store, weight_version=0, spec=SPEC
    )
    assert set(calls_of(store, before)) == {"adopt_keys", "lease_many"}
    done = [r for r in out if isinstance(r, SampleRouting)]
    assert [r.lease.holder for r in done if r.lease] == [sample_holder(f"m{m}") for m in range(3)]
    for m, routing in enumerate(done):
        assert routing.handle is not None
        np.testing.assert_array_equal(
            store.read(routing.handle), member_rows(m)[: PROMPT + FIRST - 1]
        )
        routing.release()
    assert store.leaks() == []
    assert backend.engine_store().stats().live_keys == 0


class _KeysFail:
    """A writer whose key adoption fails in transit (its shard died), after the group's
    carried rows were written and leased through the real store."""

    def __init__(self, store: RouteStore) -> None:
        self.store = store

    def put_leased_many(self, *args: Any, **kwargs: Any) -> Any:
        return self.store.put_leased_many(*args, **kwargs)

    def adopt_keys_each(self, keys: Sequence[EngineKey], *args: Any, **kwargs: Any) -> Any:
        raise RoutesLost("the shard adopting the keys died", where="test")

    def put_many(self, *args: Any, **kwargs: Any) -> Any:
        return self.store.put_many(*args, **kwargs)

    def free_key(self, key: EngineKey) -> bool:
        return self.store.free_key(key)


def test_leases_the_write_granted_end_if_a_later_write_of_the_group_fails() -> None:
    backend = LocalBackend("mixed", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="mixed"), backend)
    fake = FakeLmdeployKey(spec=SPEC, put=backend.engine_store().put)
    keyed = read_response(
        Engine.LMDEPLOY,
        fake.respond(
            member_rows(2)[: PROMPT + FIRST], prompt_tokens=PROMPT, completion_tokens=FIRST
        ),
        SPEC,
    )
    fresh = [SampleRouting(sample_id=f"m{m}") for m in range(3)]
    answers = [answer(0, PROMPT, FIRST), answer(1, PROMPT, FIRST), keyed]
    with pytest.raises(RoutesLost):
        ingest_and_finish_group(
            continuations(fresh), answers, writer=_KeysFail(store), store=store,  # type: ignore[arg-type]
            weight_version=0, spec=SPEC,
        )  # fmt: skip
    stats = store.stats()
    assert stats.leases == 0  # the two members' leases, granted with their write, ended
    assert stats.live_payloads == 0
    assert store.leaks() == []


def test_the_awaited_face_finishes_concurrent_groups_alike() -> None:
    store = RouteStore.local(StoreConfig(run="awaited"))

    async def group(g: int) -> list[SampleRouting | RouteplayError]:
        fresh = [SampleRouting(sample_id=f"g{g}.{m}") for m in range(4)]
        answers = [answer(m, PROMPT, FIRST) for m in range(4)]
        return await aingest_and_finish_group(
            continuations(fresh), answers, writer=store, store=store, weight_version=0
        )

    async def main() -> list[list[SampleRouting | RouteplayError]]:
        return list(await asyncio.gather(*(group(g) for g in range(3))))

    groups = asyncio.run(main())
    holders = {sample_holder(f"g{g}.{m}"): 1 for g in range(3) for m in range(4)}
    assert dict(store.stats().leases_by_holder) == holders
    for done in groups:
        for m, routing in enumerate(done):
            assert isinstance(routing, SampleRouting)
            assert routing.handle is not None
            assert isinstance(routing.handle, Handle)
            np.testing.assert_array_equal(
                store.read(routing.handle), member_rows(m)[: PROMPT + FIRST - 1]
            )
            routing.release()
    assert store.leaks() == []
    assert store.stats().live_payloads == 0


def _key_answer(backend: LocalBackend, member: int) -> EngineRouting:
    fake = FakeLmdeployKey(spec=SPEC, put=backend.engine_store().put)
    body = fake.respond(
        member_rows(member)[: PROMPT + FIRST], prompt_tokens=PROMPT, completion_tokens=FIRST
    )
    return read_response(Engine.LMDEPLOY, body, SPEC)


def test_a_mixed_group_leases_its_carried_members_in_the_write_and_the_rest_after() -> None:
    backend = LocalBackend("mixed-ok", shards=2, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="mixed-ok", shards=2), backend)
    fresh = [SampleRouting(sample_id=f"m{m}") for m in range(4)]
    conts = continuations(fresh)
    answers = [
        answer(0, PROMPT, FIRST),
        _key_answer(backend, 1),
        answer(2, PROMPT, FIRST, start_row=3),  # refused: skips rows it has no history for
        answer(3, PROMPT, FIRST),
    ]
    before = dict(store.stats().calls_by_op)
    out = ingest_and_finish_group(
        conts, answers, writer=store, store=store, weight_version=0, spec=SPEC
    )
    calls = calls_of(store, before)
    assert calls["adopt_leased"] == 1  # members 0 and 3, leased by their write
    assert calls["lease_many"] == 1  # member 1, adopted from its key, then leased
    assert isinstance(out[2], HandleError)
    conts[2].abandon()
    for m in (0, 1, 3):
        routing = out[m]
        assert isinstance(routing, SampleRouting)
        assert routing.lease is not None
        assert routing.lease.holder == sample_holder(f"m{m}")
        assert routing.handle is not None
        np.testing.assert_array_equal(
            store.read(routing.handle), member_rows(m)[: PROMPT + FIRST - 1]
        )
        routing.release()
    assert store.stats().leases == 0
    assert store.stats().live_payloads == 0
    assert store.leaks() == []


class _AcquireFails:
    """A lease source whose acquire fails (its shard died)."""

    def acquire_many(self, *args: Any, **kwargs: Any) -> Any:
        raise RoutesLost("the shard granting the leases died", where="test")


def test_leases_the_write_granted_end_if_the_others_cannot_be_leased() -> None:
    backend = LocalBackend("acquire-fails", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="acquire-fails"), backend)
    fresh = [SampleRouting(sample_id=f"m{m}") for m in range(3)]
    answers = [answer(0, PROMPT, FIRST), answer(1, PROMPT, FIRST), _key_answer(backend, 2)]
    with pytest.raises(RoutesLost):
        ingest_and_finish_group(
            continuations(fresh), answers, writer=store, store=_AcquireFails(),  # type: ignore[arg-type]
            weight_version=0, spec=SPEC,
        )  # fmt: skip
    stats = store.stats()
    assert stats.leases == 0  # the two carried members' leases, granted by their write
    assert stats.live_payloads == 1  # the key's adopted payload, never leased: its TTL's
    assert stats.unleased_payloads == 1


def _two_puts_leased_in_one_write(
    store: RouteStore, backend: LocalBackend
) -> tuple[list[LeasedPut], LeasedWrite]:
    """Two groups of two written and their members leased by one ``adopt_leased``, as a
    producer's coalesced puts are: the second put's payload and sample indices follow
    the first's."""
    puts: list[LeasedPut] = []
    blocks: list[Any] = []
    payloads: list[Any] = []
    for put in range(2):
        batch = [Routes(array=member_rows(2 * put + m), spec=SPEC) for m in range(2)]
        layout = plan_batch(batch, pack=True)
        more_blocks, more = store.layout_blocks(layout, SPEC)
        blocks += more_blocks
        payloads += more
        puts.append(LeasedPut(layout, SPEC, 0, [sample_holder(f"p{put}.{m}") for m in range(2)]))
    samples, holders = shared_samples(puts)
    refs = backend.put_blocks(blocks)
    call = shard_call(0, ShardApi.adopt_leased, refs, payloads, 0, samples, holders)
    [(stored, grant)] = backend.call([call], "two leased puts")
    return puts, LeasedWrite(0, list(stored), grant)


def test_each_put_of_a_shared_leased_write_gets_its_own_rows_and_leases() -> None:
    backend = LocalBackend("shared-write", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="shared-write"), backend)
    puts, written = _two_puts_leased_in_one_write(store, backend)
    out = store.leased_handles(puts, written)
    assert [[lease.holder for _, lease in pairs] for pairs in out] == [p.holders for p in puts]
    for put, pairs in enumerate(out):
        for m, (handle, _) in enumerate(pairs):
            np.testing.assert_array_equal(store.read(handle), member_rows(2 * put + m))
    store.release_many([lease for pairs in out for _, lease in pairs])
    store.flush()
    assert (store.stats().leases, store.stats().live_payloads) == (0, 0)


def test_a_shared_leased_write_whose_later_put_cannot_be_built_ends_every_lease() -> None:
    # The first put's pairs are built before the second fails: nobody receives them
    # (a producer's coalesced write fails for every caller), so its leases end too.
    backend = LocalBackend("broken-put", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="broken-put"), backend)
    puts, written = _two_puts_leased_in_one_write(store, backend)
    short = puts[1]._replace(holders=puts[1].holders[:1])  # its samples cannot be paired
    assert store.stats().leases == 4
    with pytest.raises(ValueError, match="zip"):
        store.leased_handles([puts[0], short], written)
    store.flush()
    assert (store.stats().leases, store.stats().live_payloads) == (0, 0)
    assert store.leaks() == []


def test_a_shared_leased_write_with_more_leases_than_samples_ends_every_lease() -> None:
    # The grant's two leases past the first put's samples would be ended by no put:
    # the write is refused and all four leases end, not only the unpaired two.
    backend = LocalBackend("extra-leases", shards=1, ttl_s=600.0)
    store = RouteStore(StoreConfig(run="extra-leases"), backend)
    puts, written = _two_puts_leased_in_one_write(store, backend)
    assert store.stats().leases == 4
    with pytest.raises(ValueError, match="4 leases for 2 samples"):
        store.leased_handles(puts[:1], written)
    store.flush()
    assert (store.stats().leases, store.stats().live_payloads) == (0, 0)
    assert store.leaks() == []
