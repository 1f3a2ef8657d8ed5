"""Adopted engine keys in the route-store client (``KeyAdoption``, a part of
``RouteStore``, over its ``StoreCore``): ``adopt_keys`` has a shard consume an engine
store's keys and keep their rows validated and narrowed once on the engine's node
(``routeplay.store.engine.ingest`` where the engine store validated them as they were
put); ``free_engine_keys`` releases the keys of a sample that is dropped unread. A key
of another run is refused (``StoreCore.scoped``).

Fail closed: every adoption returns a handle only for rows whose validation ended
accepting them (``routeplay.store.shard.adoption``), waiting for a validation still running,
so a bad capture is refused here, on the rollout side where its sample can be set aside,
and never by a trainer's read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from routeplay.core.handle import EngineKey, Handle, Segment, StoreRef
from routeplay.core.spec import RouteSpec
from routeplay.errors import RouteplayError
from routeplay.store.client.coalesce import Coalescer
from routeplay.store.client.core import StoreCore
from routeplay.store.client.releases import Undo
from routeplay.store.engine.key_check import check_start_rows
from routeplay.store.flow import Flow
from routeplay.store.shard.adoption import KeyBatch
from routeplay.store.shard.api import ShardApi, ShardCall, shard_call

__all__ = ["KeyAdoption"]


class KeyAdoption:
    """Adopt and free engine-store keys (a part of ``RouteStore``).

    Example:
        keys = KeyAdoption(core)
        handles = store.adopt_keys(keys, spec)
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def adopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle:
        """Take an engine-store key over in one call: the shard consumes the key (a key
        whose metadata does not fit ``spec`` is freed, not leaked, and refused) and has
        its rows validated and narrowed once, on the engine store's node, into a block
        the shard owns (or takes the block the engine store validated at ingest). The
        handle comes back only once the rows are known valid: a bad capture (an id out
        of range, a repeated id, fill rows) raises its typed error here, the key consumed
        and its payload dropped; a validation that does not end within the store's
        timeout raises ``StoreTimeout``. Readers only copy; the trainer node pulls
        compact bytes. A payload with up to ``key.trailing_rows`` extra rows keeps
        ``[0, rows)`` (a slice).

        ``start_row=S`` (a resume or a later turn: the history's rows) stores only the
        rows ``[S, rows)``: the handle covers those ``rows - S`` rows, to append to the
        history; the rows before ``S`` are dropped on the engine's node, unread by
        anyone (``routeplay.store.engine.key_check`` says why they are not compared).

        Example:
            new = store.adopt_key(routing.key, spec, weight_version=2, start_row=history.rows)
            handle = history + new
        """
        flow = self._adopt_keys([key], spec, weight_version, 0, [start_row], False)
        return self._core.drive(flow)[0]

    async def aadopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle:
        """Awaitable ``adopt_key`` (LMDeploy's and SGLang's keys alike; cancelled in
        flight: the key is consumed and its payload dropped).

        Example:
            new = await store.aadopt_key(routing.key, spec, start_row=history.rows)
        """
        adopted = await self.aadopt_keys_each(
            [key], spec, weight_version=weight_version, start_rows=[start_row]
        )
        return _all_adopted(adopted)[0]

    def adopt_keys(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle]:
        """``adopt_key`` for a batch in one call (one engine-store call per engine store,
        validations pipelined on the engine's node, all waited for). A refused key is
        freed and its error raised; keys of the batch adopted before it expire unleased
        (TTL).

        ``shared_prefix=P`` (the keys of one GRPO group): validated together, and the
        first ``P`` stored rows that are verified equal across keys are stored once, as
        in ``put_many``; ``pack`` stores the group as one payload. ``start_rows``: per
        key, as ``adopt_key``'s ``start_row``. ``adopt_keys_each`` sets refused keys
        aside.

        Example:
            handles = store.adopt_keys(group_keys, spec, shared_prefix=prompt_tokens)
        """
        flow = self._adopt_keys(keys, spec, weight_version, shared_prefix, start_rows, pack)
        return self._core.drive(flow)

    async def aadopt_keys(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle]:
        """Awaitable ``adopt_keys``.

        Example:
            handles = await store.aadopt_keys(group_keys, spec, shared_prefix=prompt_tokens)
        """
        adopted = await self.aadopt_keys_each(
            keys,
            spec,
            weight_version=weight_version,
            shared_prefix=shared_prefix,
            start_rows=start_rows,
            pack=pack,
        )
        return _all_adopted(adopted)

    def _adopt_keys(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        weight_version: int,
        shared_prefix: int,
        start_rows: Sequence[int] | None,
        pack: bool,
    ) -> Flow[list[Handle]]:
        results = yield from self._adopt_keys_each(
            keys, spec, weight_version, shared_prefix, start_rows, pack
        )
        return _all_adopted(results)

    def adopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle | RouteplayError]:
        """``adopt_keys`` that sets a refused key aside: per key, its handle or the typed
        error that refused it (its metadata, another run's, consumed, expired; in a group
        its rows too), so one bad member of a group costs only that member and the
        others are still written together (one payload with ``pack``). Every key, alone
        or in a group, is answered once its rows' validation has ended.

        Example:
            out = store.adopt_keys_each(keys, spec, shared_prefix=600, pack=True)
            good = [h for h in out if isinstance(h, Handle)]
        """
        flow = self._adopt_keys_each(keys, spec, weight_version, shared_prefix, start_rows, pack)
        return self._core.drive(flow)

    async def aadopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle | RouteplayError]:
        """Awaitable ``adopt_keys_each`` (cancelled in flight: the keys are consumed and
        their payloads dropped). Concurrent calls of this process (one coroutine per
        group or sample) go out together, one call per shard, each batch adopted as its
        own call would be; a call that fails as a whole fails each of them (their keys
        may be consumed: none is sent again).

        Example:
            out = await store.aadopt_keys_each(keys, spec, shared_prefix=600, pack=True)
        """
        if not keys:
            return []
        scoped = tuple(self._core.scoped(key) for key in keys)
        starts = check_start_rows(scoped, start_rows)
        batch = KeyBatch(keys=scoped, spec=spec, shared_prefix=shared_prefix,
                         starts=tuple(starts), pack=pack)  # fmt: skip
        [outcome] = await self._key_adoptions.submit([(batch, weight_version)])
        if isinstance(outcome, RouteplayError):
            raise outcome
        return outcome

    @functools.cached_property
    def _key_adoptions(
        self,
    ) -> Coalescer[tuple[KeyBatch, int], list[Handle | RouteplayError] | RouteplayError]:
        return Coalescer(run=lambda items: self._core.adrive(self._adopt_key_batches(items)),
                         undo=self._drop_adopted, retry_alone=False)  # fmt: skip

    def _adopt_key_batches(
        self, items: Sequence[tuple[KeyBatch, int]]
    ) -> Flow[list[list[Handle | RouteplayError] | RouteplayError]]:
        """Many callers' keys, one call per shard (a lone caller's: ``adopt_keys``)."""
        if len(items) == 1:
            [(batch, version)] = items
            one = yield from self._adopt_keys_each(
                batch.keys, batch.spec, version, batch.shared_prefix, batch.starts, batch.pack
            )
            return [one]
        yield from self._core.releases.settle(wait=False)
        by_shard: dict[int, list[int]] = {}
        for at, (batch, _) in enumerate(items):
            by_shard.setdefault(self._core.pick_shard(batch.keys[0].key), []).append(at)
        shards = sorted(by_shard)
        pending = [
            self._core.backend.send_adopt_key_batches(i, [items[at][0] for at in by_shard[i]])
            for i in shards
        ]
        answers = yield from self._core.wait_for(
            pending,
            f"adopt the engine keys of {len(items)} callers",
            timeout_s=2 * self._core.config.timeout_s,
            undo=_discard_batches(shards),
        )
        out: list[list[Handle | RouteplayError] | RouteplayError] = [[] for _ in items]
        for shard, outcomes in zip(shards, answers, strict=True):
            for at, outcome in zip(by_shard[shard], outcomes, strict=True):
                batch, version = items[at]
                out[at] = outcome if isinstance(outcome, RouteplayError) else (
                    _handles_of(outcome, batch.spec, version))  # fmt: skip
        return out

    def _drop_adopted(
        self, outcomes: Sequence[list[Handle | RouteplayError] | RouteplayError]
    ) -> None:
        """The payloads adopted for callers that gave up before their batch landed."""
        refs = [
            src
            for outcome in outcomes
            if not isinstance(outcome, RouteplayError)
            for handle in outcome
            if isinstance(handle, Handle)
            for src in handle.sources()
            if isinstance(src, StoreRef)
        ]
        self._core.discard_written(refs)

    def _adopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        weight_version: int,
        shared_prefix: int,
        start_rows: Sequence[int] | None,
        pack: bool,
    ) -> Flow[list[Handle | RouteplayError]]:
        if not keys:
            return []
        keys = [self._core.scoped(key) for key in keys]
        starts = check_start_rows(keys, start_rows)
        yield from self._core.releases.settle(wait=False)
        shard = self._core.pick_shard(keys[0].key)
        pending = self._core.backend.send_adopt_keys(shard, keys, spec, shared_prefix, starts, pack)
        # The shard itself waits up to timeout_s for the engine store; give it room (its
        # first call to a store also asks its protocol: past this, the undo frees it all).
        [results] = yield from self._core.wait_for(
            [pending],
            f"adopt {len(keys)} engine keys",
            timeout_s=2 * self._core.config.timeout_s,
            undo=_discard_adopted(shard),
        )
        return _handles_of(results, spec, weight_version)

    def free_engine_keys(self, handle: Handle) -> int:
        """Release the engine-store keys a dropped sample still references (never read);
        returns how many were live. Keys already consumed or expired are skipped.

        Example:
            store.free_engine_keys(dropped.handle)
        """
        return self._core.drive(self._free_keys(_engine_keys(handle)))

    async def afree_engine_keys(self, handle: Handle) -> int:
        """Awaitable ``free_engine_keys``.

        Example:
            await store.afree_engine_keys(dropped.handle)
        """
        return await self._core.adrive(self._free_keys(_engine_keys(handle)))

    def free_key(self, key: EngineKey) -> bool:
        """Release one unread engine-store key of this run (idempotent); True if it was
        live. A key of another run is refused (``RunMismatch``) and stays live.

        Example:
            store.free_key(routing.key)
        """
        return self._core.drive(self._free_keys([key])) > 0

    async def afree_key(self, key: EngineKey) -> bool:
        """Awaitable ``free_key``.

        Example:
            await store.afree_key(routing.key)
        """
        return await self._core.adrive(self._free_keys([key])) > 0

    def _free_keys(self, keys: Sequence[EngineKey]) -> Flow[int]:
        """Free keys (one engine-store call each, all sent first); how many were live."""
        scoped = [self._core.scoped(key) for key in keys]
        if not scoped:
            return 0
        yield from self._core.backend.ask_engines(scoped)
        pending = [self._core.backend.send_free_key(key, self._core.run) for key in scoped]
        where = ", ".join(sorted({f"{key.namespace}/{key.actor}" for key in scoped}))
        answers = yield from self._core.wait_for(pending, f"{where}.free", ends=True)
        return sum(bool(live) for live in answers)


def _all_adopted(results: Sequence[Handle | RouteplayError]) -> list[Handle]:
    """Every key's handle, or the first refusal raised (``adopt_keys``: all or an error)."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if isinstance(result, Handle)]


def _handles_of(
    results: Sequence[Any], spec: RouteSpec, weight_version: int
) -> list[Handle | RouteplayError]:
    """Per key of an adoption, its handle (a ``StoreRef``'s rows, or row ranges) or the
    typed error that refused it; anything else failed the call."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, RouteplayError):
            raise result  # not a refusal of one key: the call failed
    return [
        result
        if isinstance(result, RouteplayError)
        else _handle_of(
            result if isinstance(result, tuple) else ((result, 0, result.rows),),
            spec,
            weight_version,
        )
        for result in results
    ]


def _discard_batches(shards: Sequence[int]) -> Undo:
    """Undo of a batched engine-key adopt abandoned in flight (one call per shard in
    ``shards``): drop every payload it stored, batch by batch (keys stay consumed)."""

    def undo(at: int, outcomes: Sequence[Any]) -> list[ShardCall[list[str]]]:
        per_batch = _discard_adopted(shards[at])
        return [
            call
            for outcome in outcomes
            if not isinstance(outcome, BaseException)
            for call in per_batch(at, outcome)
        ]

    return undo


def _discard_adopted(shard: int) -> Undo:
    """Undo of an engine-key adopt: drop every payload it stored (keys stay consumed)."""

    def undo(_: int, results: Sequence[Any]) -> list[ShardCall[list[str]]]:
        pids: dict[str, None] = {}
        for result in results:
            if isinstance(result, StoreRef):
                pids[result.payload_id] = None
            elif isinstance(result, tuple):
                pids.update((ref.payload_id, None) for ref, _, _ in result)
        return [shard_call(shard, ShardApi.discard, list(pids))]

    return undo


def _engine_keys(handle: Handle) -> list[EngineKey]:
    return [src for src in handle.sources() if isinstance(src, EngineKey)]


def _handle_of(
    ranges: Sequence[tuple[StoreRef, int, int]], spec: RouteSpec, weight_version: int
) -> Handle:
    """A handle of stored row ranges ``(payload, start, stop)``, in order."""
    segments = [
        Segment(source=ref, start=start, stop=stop, spec=spec, weight_version=weight_version)
        for ref, start, stop in ranges
    ]
    return Handle(spec, segments)
