"""Engine keys adopted by concurrent coroutines of one process go out in one call per
shard (``RouteStore.aadopt_keys_each``, issue 39): each group is adopted as its own call
would adopt it (its prompt once, a bad key refused in its group alone), a lone call is
an ``adopt_keys`` as before, and a caller that gives up has its payloads dropped."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt

from routeplay.core import EngineKey, Handle, RouteSpec
from routeplay.errors import DuplicateExperts, RouteplayError
from routeplay.store import RouteStore, StoreConfig
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)
PROMPT, ROWS, GROUP = 6, 10, 3


def member_rows(group: int, member: int) -> npt.NDArray[np.uint8]:
    """The group's prompt rows, then the member's own (fixed seeds)."""

    def draw(n: int, seed: int) -> npt.NDArray[np.uint8]:
        keys = np.random.default_rng(seed).random((n, SPEC.num_layers, SPEC.num_experts))
        return np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8)

    return np.concatenate([draw(PROMPT, group), draw(ROWS - PROMPT, 100 * group + member)])


def key_store(run: str) -> tuple[RouteStore, LocalBackend]:
    backend = LocalBackend(run, shards=1, ttl_s=600.0)
    return RouteStore(StoreConfig(run=run), backend), backend


def group_keys(backend: LocalBackend, group: int, bad: int | None = None) -> list[EngineKey]:
    keys = []
    for member in range(GROUP):
        rows = member_rows(group, member)
        if member == bad:
            rows[PROMPT + 1, 1] = rows[PROMPT + 1, 1, 0]  # a duplicated expert
        keys.append(EngineKey(key=backend.engine_store().put(rows), rows=ROWS))
    return keys


def calls(store: RouteStore) -> dict[str, int]:
    return dict(store.stats().calls_by_op)


def adopt(store: RouteStore, keys: list[EngineKey]) -> Any:
    return store.aadopt_keys_each(keys, SPEC, shared_prefix=PROMPT, pack=True)


def test_groups_adopted_together_go_in_one_call_each_adopted_as_alone() -> None:
    store, backend = key_store("adopt-together")
    groups = [group_keys(backend, g, bad=1 if g == 2 else None) for g in range(4)]
    before = calls(store)

    async def run() -> list[list[Handle | RouteplayError]]:
        return list(await asyncio.gather(*(adopt(store, keys) for keys in groups)))

    out = asyncio.run(run())
    after = calls(store)
    assert after.get("adopt_key_batches", 0) - before.get("adopt_key_batches", 0) == 1
    assert after.get("adopt_keys", 0) == before.get("adopt_keys", 0)
    assert isinstance(out[2][1], DuplicateExperts)  # refused in its own group only
    for g, results in enumerate(out):
        for m, result in enumerate(results):
            if g == 2 and m == 1:
                continue
            assert isinstance(result, Handle)
            np.testing.assert_array_equal(store.read(result), member_rows(g, m))
    stats = store.stats()
    assert stats.live_payloads == 4  # one payload per group, its prompt once
    assert stats.shared_prefix_bytes_saved == (3 * 2 + 1) * SPEC.nbytes(PROMPT)
    assert backend.engine_store().stats().live_keys == 0


def test_a_lone_group_is_one_adopt_keys_call() -> None:
    store, backend = key_store("adopt-alone")
    before = calls(store)
    out = asyncio.run(adopt(store, group_keys(backend, 0)))
    assert all(isinstance(h, Handle) for h in out)
    after = calls(store)
    assert after["adopt_keys"] - before.get("adopt_keys", 0) == 1
    assert "adopt_key_batches" not in after


def test_a_caller_that_gives_up_has_its_payloads_dropped() -> None:
    store, backend = key_store("adopt-cancel")
    groups = [group_keys(backend, g) for g in range(2)]

    async def run() -> list[Handle | RouteplayError]:
        kept = asyncio.ensure_future(adopt(store, groups[0]))
        dropped = asyncio.ensure_future(adopt(store, groups[1]))
        await asyncio.sleep(0)  # both submitted: one batch
        dropped.cancel()
        out: list[Handle | RouteplayError] = await kept
        await asyncio.sleep(0)  # the batch has landed: the dropped caller's undo ran
        return out

    kept = asyncio.run(run())
    store.flush()
    assert store.stats().live_payloads == 1  # the kept group's payload only
    for m, handle in enumerate(kept):
        assert isinstance(handle, Handle)
        np.testing.assert_array_equal(store.read(handle), member_rows(0, m))
    assert backend.engine_store().stats().live_keys == 0  # both groups' keys consumed
