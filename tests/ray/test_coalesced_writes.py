"""An asyncio rollout worker's concurrent group writes on real Ray (issue 39): groups
answered together are written in one shard call (one call back to the worker), each
coroutine gets its own members' handles and rows, and a coroutine cancelled mid-write
leaves nothing stored (a batch that fails is retried put by put: ``test_coalesce``).
``aingest_and_finish_group`` makes that one call lease every member too."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from routeplay.core import EngineKey, Handle, RouteSpec, canonicalize
from routeplay.core.wires import Engine, EngineRouting
from routeplay.errors import DuplicateExperts
from routeplay.rollout import (
    ProducerWriter,
    SampleRouting,
    afinish_all,
    aingest_and_finish_group,
    aingest_routing_group,
    ingest_and_finish_group,
)
from routeplay.store import RouteStore, StoreConfig, start_engine_store
from routeplay.store.joined_rows import JoinedRows
from routeplay.store.remote.producer import (
    WRITE_ROUND,
    AsyncRoutesProducer,
    RoutesProducer,
    producer_actor,
)

pytestmark = pytest.mark.usefixtures("ray_local")

SPEC = RouteSpec(num_layers=3, top_k=2, num_experts=16)
PROMPT, TOKENS, GROUP = 12, 20, 4


def member_rows(group: int, member: int) -> np.ndarray[Any, Any]:
    """A member's rows: its group's prompt rows, then its own (fixed seeds)."""

    def draw(n: int, seed: int) -> np.ndarray[Any, Any]:
        keys = np.random.default_rng(seed).random((n, SPEC.num_layers, SPEC.num_experts))
        return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)

    return np.concatenate(
        [draw(PROMPT, group), draw(TOKENS - 1 - PROMPT, 1000 + 10 * group + member)]
    )


def answers(group: int) -> list[EngineRouting]:
    return [
        EngineRouting(
            engine=Engine.VLLM,
            prompt_tokens=PROMPT,
            completion_tokens=TOKENS - PROMPT,
            routes=canonicalize(member_rows(group, m), SPEC),
        )
        for m in range(GROUP)
    ]


def release_all(store: RouteStore, finished: list[list[SampleRouting]]) -> None:
    """Release every member's lease: nothing stays leased or stored."""
    for group in finished:
        for routing in group:
            routing.release()
    assert store.stats().leases == 0
    assert store.stats().live_payloads == 0


@pytest.fixture(scope="module")
def store() -> Iterator[RouteStore]:
    built = StoreConfig(run=f"coalesced-{uuid.uuid4().hex[:6]}", timeout_s=30).build()
    yield built
    built.shutdown()


@producer_actor
class GroupWorker(AsyncRoutesProducer):
    """A rollout worker with one coroutine per GRPO group, as an asyncio framework runs it."""

    async def write_groups(
        self,
        store: RouteStore,
        groups: int,
        *,
        leased: bool = False,
        sizes: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        """Each group by its own coroutine: ``aingest_routing_group`` then ``afinish_all``,
        or (``leased``) ``aingest_and_finish_group``; ``sizes``: group ``g``'s first
        ``sizes[g]`` members only (leased)."""
        before = dict((await store.astats()).calls_by_op)
        writer = ProducerWriter(producer=self, store=store)

        async def one(group: int) -> list[Any]:
            prompt = tuple(range(group * 100, group * 100 + PROMPT))
            size = sizes[group] if sizes else GROUP
            conts = [
                SampleRouting(sample_id=f"{group}.{m}").continuation(prompt_ids=prompt)
                for m in range(size)
            ]
            if leased:
                return await aingest_and_finish_group(
                    conts, answers(group)[:size], writer=writer, store=store, weight_version=0
                )
            written = await aingest_routing_group(
                conts, answers(group), writer=writer, weight_version=0, spec=SPEC
            )
            handles = [h for h in written if isinstance(h, Handle)]
            assert len(handles) == GROUP, written
            return await afinish_all(conts, store, handles)

        finished = await asyncio.gather(*(one(g) for g in range(groups)))
        after = dict((await store.astats()).calls_by_op)
        return {
            "calls": {
                op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)
            },
            "finished": finished,
            "saved": (await store.astats()).shared_prefix_bytes_saved,
            "staged": self.staged_count(),
        }

    async def cancel_one_leased(self, store: RouteStore) -> dict[str, Any]:
        """``cancel_one`` for leased puts: the caller that gave up has its lease ended
        when the batch lands, and with it its payload."""
        rows = [canonicalize(member_rows(g, 1), SPEC) for g in (5, 6)]
        keep = asyncio.ensure_future(self.aput_routes_leased_many(store, [rows[0]], "test/a"))
        drop = asyncio.ensure_future(self.aput_routes_leased_many(store, [rows[1]], "test/b"))
        await asyncio.sleep(0)  # both submitted: one batch
        drop.cancel()
        [(handle, lease)] = await keep
        for _ in range(200):
            stats = await store.astats()
            if stats.live_payloads == 1 and stats.leases == 1:
                break
            await asyncio.sleep(0.05)
        stats = await store.astats()
        kept = await store.aacquire(handle, "test/kept")  # before the writer's lease ends
        await lease.arelease()
        return {
            "live": stats.live_payloads,
            "holders": dict(stats.leases_by_holder),
            "kept": kept,
            "rows": rows[0],
        }

    async def cancel_one(self, store: RouteStore) -> dict[str, Any]:
        """Two puts together; one caller gives up while the shard adopts: its payload
        is dropped when the batch lands, the other's stays."""
        rows = [canonicalize(member_rows(g, 1), SPEC) for g in (5, 6)]
        keep = asyncio.ensure_future(self.aput_routes(store, rows[0]))
        drop = asyncio.ensure_future(self.aput_routes(store, rows[1]))
        await asyncio.sleep(0)  # both submitted: one batch
        drop.cancel()
        handle = await keep
        for _ in range(200):  # the dropped payload goes once the batch has landed
            if (await store.astats()).live_payloads == 1:
                break
            await asyncio.sleep(0.05)
        return {"live": (await store.astats()).live_payloads, "handle": handle, "rows": rows[0]}

    async def adopt_groups(self, store: RouteStore, groups: int) -> dict[str, Any]:
        """Each group's LMDeploy keys (member 1 of group 1 with a duplicated expert)
        adopted by its own coroutine, as the groups' answers land together."""
        engine = ray.get_actor("shared_store", namespace="lmdeploy")

        async def keys_of(group: int) -> list[EngineKey]:
            keys = []
            for m in range(GROUP):
                rows = member_rows(group, m)
                if (group, m) == (1, 1):
                    rows[PROMPT + 1, 1] = rows[PROMPT + 1, 1, 0]
                keys.append(EngineKey(key=await engine.put.remote(rows), rows=TOKENS - 1))
            return keys

        answered = await asyncio.gather(*(keys_of(g) for g in range(groups)))
        before = dict((await store.astats()).calls_by_op)  # the engine has answered

        async def one(keys: list[EngineKey]) -> list[Any]:
            return await store.aadopt_keys_each(keys, SPEC, shared_prefix=PROMPT, pack=True)

        adopted = await asyncio.gather(*(one(keys) for keys in answered))
        after = dict((await store.astats()).calls_by_op)
        return {
            "calls": {
                op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)
            },
            "adopted": adopted,
        }


@producer_actor
class ThreadedWorker(RoutesProducer):
    """A rollout worker that blocks on its engine (a threaded actor)."""

    def finish_group(self, store: RouteStore, group: int) -> dict[str, Any]:
        before = dict(store.stats().calls_by_op)
        conts = [
            SampleRouting(sample_id=f"t{group}.{m}").continuation(prompt_ids=range(PROMPT))
            for m in range(GROUP)
        ]
        writer = ProducerWriter(producer=self, store=store)
        finished = ingest_and_finish_group(
            conts, answers(group), writer=writer, store=store, weight_version=0
        )
        after = dict(store.stats().calls_by_op)
        calls = {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}
        return {"calls": calls, "finished": finished, "staged": self.staged_count()}


def test_a_blocking_producers_group_is_written_and_leased_in_one_call(store: RouteStore) -> None:
    result = ray.get(ThreadedWorker.remote().finish_group.remote(store, 3), timeout=120)
    assert result["calls"] == {"adopt_from_leased": 1}
    [group] = [result["finished"]]
    assert [r.lease.holder for r in group] == [f"rollout/t3.{m}" for m in range(GROUP)]
    for m, routing in enumerate(group):
        np.testing.assert_array_equal(routing.lease.read(), member_rows(3, m))
    assert result["staged"] == 0
    release_all(store, [group])


def test_groups_answered_together_are_written_in_one_shard_call(store: RouteStore) -> None:
    result = ray.get(GroupWorker.remote().write_groups.remote(store, 12), timeout=120)
    # 12 groups of 4: one adopt (one call back to the worker), one lease call for all.
    assert result["calls"] == {"adopt_from_many": 1, "lease_many": 1}
    finished = result["finished"]
    holders = [r.lease.holder for group in finished for r in group]
    assert holders == [f"rollout/{g}.{m}" for g in range(12) for m in range(GROUP)]
    for g, group in enumerate(finished):
        for m, routing in enumerate(group):
            np.testing.assert_array_equal(routing.lease.read(), member_rows(g, m))
    assert result["saved"] > 0  # each group's prompt rows stored once
    assert result["staged"] == 0
    release_all(store, finished)


def test_more_groups_than_a_round_go_in_rounds_each_member_its_own_rows(
    store: RouteStore,
) -> None:
    """40 groups answered together: a round of ``WRITE_ROUND`` puts is sent as soon as it
    fills (its blocks cross while the next round is laid out), the rest in a second; the
    members' leases follow in as many lease calls as the adopt answers land in."""
    result = ray.get(GroupWorker.remote().write_groups.remote(store, 40), timeout=120)
    assert WRITE_ROUND < 40 <= 2 * WRITE_ROUND
    assert result["calls"]["adopt_from_many"] == 2
    assert 1 <= result["calls"]["lease_many"] <= 2
    finished = result["finished"]
    for g, group in enumerate(finished):
        for m, routing in enumerate(group):
            np.testing.assert_array_equal(routing.lease.read(), member_rows(g, m))
    assert result["staged"] == 0
    release_all(store, finished)


def test_a_group_is_stored_as_its_pieces_and_read_from_them_without_a_copy(
    store: RouteStore,
) -> None:
    """The producer never joins a group (one copy less on the write path): the object
    the shard holds is the prompt's rows and each member's own, back to back in the
    object store, read as zero-copy views, and a member's rows read from them whole."""
    result = ray.get(GroupWorker.remote().write_groups.remote(store, 1), timeout=120)
    [group] = result["finished"]
    handle = group[2].handle
    with store.hold_blocks([(handle, 0, handle.rows)], holder="test/held") as held:
        [block] = held._views.values()
        assert type(block) is JoinedRows
        assert [p.shape[0] for p in block.pieces] == [PROMPT] + [TOKENS - 1 - PROMPT] * GROUP
        assert not any(p.flags.writeable for p in block.pieces)  # views of the object store
        [rows] = store.read_many([(handle, 0, handle.rows)], holder="test/held", held=held)
    np.testing.assert_array_equal(rows, member_rows(0, 2))
    release_all(store, [group])


def test_groups_answered_together_are_written_and_leased_in_one_shard_call(
    store: RouteStore,
) -> None:
    # 12 groups of 4: one call writes every group and leases its 48 members.
    result = ray.get(GroupWorker.remote().write_groups.remote(store, 12, leased=True), timeout=120)
    assert result["calls"] == {"adopt_from_leased": 1}
    finished = result["finished"]
    holders = [r.lease.holder for group in finished for r in group]
    assert holders == [f"rollout/{g}.{m}" for g in range(12) for m in range(GROUP)]
    for g, group in enumerate(finished):
        for m, routing in enumerate(group):
            np.testing.assert_array_equal(routing.lease.read(), member_rows(g, m))
    assert result["staged"] == 0
    release_all(store, finished)


def test_more_leased_groups_than_a_round_go_in_rounds(store: RouteStore) -> None:
    result = ray.get(GroupWorker.remote().write_groups.remote(store, 40, leased=True), timeout=120)
    assert result["calls"] == {"adopt_from_leased": 2}  # a full round, then the rest
    finished = result["finished"]
    for g, group in enumerate(finished):
        for m, routing in enumerate(group):
            np.testing.assert_array_equal(routing.lease.read(), member_rows(g, m))
    release_all(store, finished)


def test_groups_of_other_sizes_written_together_each_get_their_own_leases(
    store: RouteStore,
) -> None:
    """One call for groups of 1 to 4 members (each its own payloads and samples, so the
    batch's payload and lease indices shift by a different count per group)."""
    sizes = (3, 1, 4, 2, 1, 4)
    worker = GroupWorker.remote()
    result = ray.get(
        worker.write_groups.remote(store, len(sizes), leased=True, sizes=sizes), timeout=120
    )
    assert result["calls"] == {"adopt_from_leased": 1}
    finished = result["finished"]
    assert [len(group) for group in finished] == list(sizes)
    holders = [r.lease.holder for group in finished for r in group]
    assert holders == [f"rollout/{g}.{m}" for g, size in enumerate(sizes) for m in range(size)]
    for g, group in enumerate(finished):
        for m, routing in enumerate(group):
            np.testing.assert_array_equal(routing.lease.read(), member_rows(g, m))
    release_all(store, finished)


def test_a_leased_put_cancelled_mid_write_ends_its_lease_and_payload(store: RouteStore) -> None:
    result = ray.get(GroupWorker.remote().cancel_one_leased.remote(store), timeout=120)
    assert result["live"] == 1
    assert result["holders"] == {"test/a": 1}
    with result["kept"] as lease:
        np.testing.assert_array_equal(lease.read(), result["rows"].array)
    store.flush()
    assert store.stats().live_payloads == 0


def test_a_put_cancelled_mid_write_leaves_nothing_stored(store: RouteStore) -> None:
    result = ray.get(GroupWorker.remote().cancel_one.remote(store), timeout=120)
    assert result["live"] == 1  # the cancelled caller's payload went when its batch landed
    with store.acquire(result["handle"], "test/kept") as lease:
        np.testing.assert_array_equal(lease.read(), result["rows"].array)
    assert store.stats().live_payloads == 0


def test_engine_keys_of_groups_answered_together_are_adopted_in_one_call(
    store: RouteStore,
) -> None:
    start_engine_store(ttl_s=60)
    result = ray.get(GroupWorker.remote().adopt_groups.remote(store, 6), timeout=120)
    assert result["calls"] == {"adopt_key_batches": 1}
    assert isinstance(result["adopted"][1][1], DuplicateExperts)  # refused in its group alone
    kept = [
        (g, m, handle)
        for g, group in enumerate(result["adopted"])
        for m, handle in enumerate(group)
        if (g, m) != (1, 1)
    ]
    assert all(isinstance(handle, Handle) for _, _, handle in kept)
    leases = store.acquire_many([(handle, "test/keys") for _, _, handle in kept])
    for (g, m, _), lease in zip(kept, leases, strict=True):
        np.testing.assert_array_equal(lease.read(), member_rows(g, m))
    store.release_many(leases)
    store.flush()
    assert store.stats().live_payloads == 0
