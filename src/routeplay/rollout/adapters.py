"""Engine adapters: one engine response in, one routing handle in the route store out.

Every adapter ends in ``stitch``, which is also the partial-rollout rule: the sample's
history rows (with their own weight versions) are kept, and only rows the history does
not have yet are stored and appended as a new segment:

- a full-sequence response (vLLM, LMDeploy, SGLang without a start row) contributes
  ``current[history.rows:]`` (never the whole array again: no duplicated rows);
- a response whose request asked for rows from a start row (SGLang, vLLM) must start
  at or before ``history.rows``;
- an engine-store key (LMDeploy, XTuner's SGLang) holds the whole sequence: it is
  adopted from row ``history.rows`` (``RouteStore.adopt_key(start_row=...)``), so the
  store keeps only rows ``[history.rows, T)``, sliced where the key is validated; the
  history rows behind the key are dropped there (not compared with the history's own:
  ``routeplay.store.engine.key_check`` says why).

Where routing sits in each body is ``routeplay.core.wires``' business; adapters only
call it.

Row counts are checked at every resume against the response's token counts.

``stitch`` is a step (``routeplay.rollout.steps``): ``stitch`` runs it blocking over a
``RoutesWriter``, ``astitch`` awaited over an ``AsyncRoutesWriter`` (``RouteStore``'s
``aput``/``aadopt_key``/``afree_key``); an adapter's ``read`` decodes (no store call), so
``RoutingContinuation.aingest`` is ``read`` then ``astitch``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from routeplay.core.handle import EngineKey, Handle
from routeplay.core.routes import Routes
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import expected_rows
from routeplay.core.wires import ENGINES, Engine, EngineRouting, read_response
from routeplay.core.wires import vllm as vllm_wire
from routeplay.errors import HandleError, MisuseError, RouteplayError, RowCountMismatch
from routeplay.rollout.steps import Call, Step, arun_step, run_step

if TYPE_CHECKING:  # both load Ray; adapters only call them
    from routeplay.store.client.lease import Lease
    from routeplay.store.client.route_store import RouteStore
    from routeplay.store.remote.producer import AsyncRoutesProducer, RoutesProducer

__all__ = [
    "ADAPTERS",
    "AsyncRoutesWriter",
    "EngineAdapter",
    "HttpAdapter",
    "ProducerWriter",
    "ReadingAdapter",
    "RoutesWriter",
    "VllmInProcessAdapter",
    "astitch",
    "check_continues",
    "new_rows",
    "stitch",
    "stitch_step",
]


class RoutesWriter(Protocol):
    """Where adapters put routing: a ``RouteStore`` (or a producer actor's one-write put)."""

    def put(self, routes: Routes, *, weight_version: int = 0) -> Handle: ...

    def adopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle: ...

    def free_key(self, key: EngineKey) -> bool: ...


class AsyncRoutesWriter(Protocol):
    """The awaitable ``RoutesWriter`` (``RouteStore``'s, ``ProducerWriter``'s twins)."""

    async def aput(self, routes: Routes, *, weight_version: int = 0) -> Handle: ...

    async def aadopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle: ...

    async def afree_key(self, key: EngineKey) -> bool: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerWriter:
    """The ``RoutesWriter`` of a producer actor: one-write puts, owned by the store."""

    producer: RoutesProducer
    """The actor itself (``self`` inside a ``producer_actor`` class)."""
    store: RouteStore
    """The run's route store."""

    def put(self, routes: Routes, *, weight_version: int = 0) -> Handle:
        """Stage in the producer, adopted by a shard: one object-store write."""
        return self.producer.put_routes(self.store, routes, weight_version=weight_version)

    async def aput(self, routes: Routes, *, weight_version: int = 0) -> Handle:
        """Awaitable ``put`` (an asyncio producer actor).

        Example:
            >>> handle = await writer.aput(routes, weight_version=2)  # doctest: +SKIP
        """
        producer = self._async_producer()
        return await producer.aput_routes(self.store, routes, weight_version=weight_version)

    def _async_producer(self) -> AsyncRoutesProducer:
        from routeplay.store.remote.producer import AsyncRoutesProducer  # loads Ray: only here

        producer = self.producer
        if not isinstance(producer, AsyncRoutesProducer):
            raise MisuseError(
                "an awaitable put needs an asyncio producer",
                expected="a producer actor class deriving from AsyncRoutesProducer",
                found=type(producer).__name__,
                hint="A threaded producer (RoutesProducer) puts with the blocking put().",
            )
        return producer

    def adopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle:
        """Engine-store keys stay lazy: adopted without reading (rows from ``start_row``)."""
        return self.store.adopt_key(key, spec, weight_version=weight_version, start_row=start_row)

    async def aadopt_key(
        self, key: EngineKey, spec: RouteSpec, *, weight_version: int = 0, start_row: int = 0
    ) -> Handle:
        """Awaitable ``adopt_key``."""
        return await self.store.aadopt_key(
            key, spec, weight_version=weight_version, start_row=start_row
        )

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
        """A group's engine-store keys, adopted together (``RouteStore.adopt_keys_each``).

        Example:
            >>> out = writer.adopt_keys_each(keys, spec, pack=True)  # doctest: +SKIP
        """
        return self.store.adopt_keys_each(
            keys,
            spec,
            weight_version=weight_version,
            shared_prefix=shared_prefix,
            start_rows=start_rows,
            pack=pack,
        )

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
        """Awaitable ``adopt_keys_each``.

        Example:
            >>> out = await writer.aadopt_keys_each(keys, spec, pack=True)  # doctest: +SKIP
        """
        return await self.store.aadopt_keys_each(
            keys,
            spec,
            weight_version=weight_version,
            shared_prefix=shared_prefix,
            start_rows=start_rows,
            pack=pack,
        )

    def free_key(self, key: EngineKey) -> bool:
        """Drop a key nobody will read."""
        return self.store.free_key(key)

    async def afree_key(self, key: EngineKey) -> bool:
        """Awaitable ``free_key``."""
        return await self.store.afree_key(key)

    def put_many(
        self,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]:
        """Stage a batch in the producer, adopted by a shard in one call.

        Example:
            >>> handles = writer.put_many(group, shared_prefix=600, pack=True)  # doctest: +SKIP
        """
        return self.producer.put_routes_many(
            self.store, batch, weight_version=weight_version, shared_prefix=shared_prefix, pack=pack
        )

    async def aput_many(
        self,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]:
        """Awaitable ``put_many`` (an asyncio producer actor): the batches of its
        concurrent coroutines go out in one shard call (``AsyncRoutesProducer``).

        Example:
            >>> handles = await writer.aput_many(group, shared_prefix=600)  # doctest: +SKIP
        """
        producer = self._async_producer()
        return await producer.aput_routes_many(
            self.store, batch, weight_version=weight_version, shared_prefix=shared_prefix, pack=pack
        )

    def put_leased_many(
        self,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = False,
    ) -> list[tuple[Handle, Lease]]:
        """``put_many`` with a lease per sample (``holders``: one, or one per sample) in
        the same shard call (``RoutesProducer.put_routes_leased_many``).

        Example:
            >>> pairs = writer.put_leased_many(group, holders, shared_prefix=600)  # doctest: +SKIP
        """
        return self.producer.put_routes_leased_many(
            self.store, batch, holders, weight_version=weight_version,
            shared_prefix=shared_prefix, pack=pack, pin=pin,
        )  # fmt: skip

    async def aput_leased_many(
        self,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = False,
    ) -> list[tuple[Handle, Lease]]:
        """Awaitable ``put_leased_many``: the groups of concurrent coroutines written
        and their members leased in one shard call (``AsyncRoutesProducer``).

        Example:
            >>> pairs = await writer.aput_leased_many(group, holders)  # doctest: +SKIP
        """
        producer = self._async_producer()
        return await producer.aput_routes_leased_many(
            self.store, batch, holders, weight_version=weight_version,
            shared_prefix=shared_prefix, pack=pack, pin=pin,
        )  # fmt: skip


class EngineAdapter(Protocol):
    """Turns one engine response into the sample's full routing handle."""

    @property
    def name(self) -> str: ...

    def read(
        self, response: Any, *, spec: RouteSpec, where: str = "", start_row: int = 0
    ) -> EngineRouting:
        """The response's routing, decoded and validated (no store call)."""
        ...

    def ingest(
        self,
        response: Any,
        *,
        spec: RouteSpec,
        writer: RoutesWriter,
        weight_version: int,
        history: Handle | None = None,
        where: str = "",
        start_row: int = 0,
    ) -> Handle: ...


class ReadingAdapter(ABC):
    """An engine adapter from its ``read``: ``ingest`` reads the answer, then stitches
    its new rows onto the history (``stitch``)."""

    __slots__ = ()

    @abstractmethod
    def read(
        self, response: Any, *, spec: RouteSpec, where: str = "", start_row: int = 0
    ) -> EngineRouting:
        """The answer's routing, decoded and validated."""

    def ingest(
        self,
        response: Any,
        *,
        spec: RouteSpec,
        writer: RoutesWriter,
        weight_version: int,
        history: Handle | None = None,
        where: str = "",
        start_row: int = 0,
    ) -> Handle:
        """Decode, validate, store (or adopt the key) and stitch onto ``history``.

        ``start_row``: the first routing row the request asked for (engines never echo it).

        Example:
            >>> handle = ADAPTERS["sglang"].ingest(body, spec=spec, writer=store,  # doctest: +SKIP
            ...                                    weight_version=2)
        """
        routing = self.read(response, spec=spec, where=where, start_row=start_row)
        return stitch(
            routing, spec=spec, writer=writer, weight_version=weight_version, history=history
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpAdapter(ReadingAdapter):
    """Reads a whole HTTP response body of one engine (its wire format, its fields)."""

    name: str
    """Adapter name (e.g. ``sglang``)."""
    engine: Engine
    """Engine whose response format this reads."""
    choice: int = 0
    """Choice index of OpenAI-style bodies."""

    def read(
        self, response: Any, *, spec: RouteSpec, where: str = "", start_row: int = 0
    ) -> EngineRouting:
        """The body's routing, decoded and validated (``ingest`` without the store).

        Example:
            >>> routing = ADAPTERS["sglang"].read(body, spec=spec, start_row=5)  # doctest: +SKIP
        """
        return read_response(
            self.engine, response, spec, choice=self.choice, where=where, start_row=start_row
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmInProcessAdapter(ReadingAdapter):
    """Reads a vLLM ``RequestOutput`` (prompt rows + each completion's rows)."""

    name: str = "vllm-inprocess"
    """Adapter name."""
    choice: int = 0
    """Which completion of the request."""

    def read(
        self, response: Any, *, spec: RouteSpec, where: str = "", start_row: int = 0
    ) -> EngineRouting:
        """The output's routing, concatenated and validated (``start_row`` unused: the
        output carries every row).

        Example:
            >>> routing = ADAPTERS["vllm-inprocess"].read(output, spec=spec)  # doctest: +SKIP
        """
        return vllm_wire.WIRE.read_output(response, spec, choice=self.choice, where=where)


def stitch(
    routing: EngineRouting,
    *,
    spec: RouteSpec,
    writer: RoutesWriter,
    weight_version: int,
    history: Handle | None = None,
) -> Handle:
    """The sample's routing after this response: history rows, then only the new rows.

    Example:
        >>> handle = stitch(routing, spec=spec, writer=store, weight_version=2)  # doctest: +SKIP
    """
    return run_step(stitch_step(routing, spec, writer, weight_version, history))


async def astitch(
    routing: EngineRouting,
    *,
    spec: RouteSpec,
    writer: AsyncRoutesWriter,
    weight_version: int,
    history: Handle | None = None,
) -> Handle:
    """Awaitable ``stitch``.

    Example:
        >>> handle = await astitch(routing, spec=spec, writer=store,  # doctest: +SKIP
        ...                        weight_version=2)
    """
    return await arun_step(stitch_step(routing, spec, writer, weight_version, history))


def stitch_step(
    routing: EngineRouting,
    spec: RouteSpec,
    writer: RoutesWriter | AsyncRoutesWriter,
    weight_version: int,
    history: Handle | None,
) -> Step[Handle]:
    """``stitch`` as a step (each face calls only its own half of ``writer``).

    Example:
        >>> handle = run_step(stitch_step(routing, spec, store, 2, None))  # doctest: +SKIP
    """
    blocking, awaited = cast("RoutesWriter", writer), cast("AsyncRoutesWriter", writer)
    kept = history if history is not None else Handle(spec)
    _check_total(routing, kept.rows)
    if routing.key is not None:
        key = routing.key
        if key.rows <= kept.rows:  # nothing new: never adopt what no handle keeps
            yield Call(lambda: blocking.free_key(key), lambda: awaited.afree_key(key))
            return kept
        start = kept.rows
        adopted: Handle = yield Call(
            lambda: blocking.adopt_key(key, spec, weight_version=weight_version, start_row=start),
            lambda: awaited.aadopt_key(key, spec, weight_version=weight_version, start_row=start),
        )
        return kept + adopted
    fresh = new_rows(routing, history)
    if fresh is None:
        return kept
    put: Handle = yield Call(
        lambda: blocking.put(fresh, weight_version=weight_version),
        lambda: awaited.aput(fresh, weight_version=weight_version),
    )
    return kept + put


def new_rows(routing: EngineRouting, history: Handle | None) -> Routes | None:
    """The rows of an answer carrying its routing that ``history`` lacks (checked as
    ``stitch`` checks them), to be written; None when there are none. A batched writer
    (a GRPO group's members) writes many of these at once.

    Example:
        >>> fresh = new_rows(read_response("vllm", body, spec), history)  # doctest: +SKIP
    """
    kept = history.rows if history is not None else 0
    routes = routing.routes
    if routes is None:
        raise HandleError(
            "an engine-store key has no rows to write in a batch",
            expected="routing carried in the answer",
            found="an engine key",
            hint="Adopt keys one by one (stitch) or with RouteStore.adopt_keys.",
        )
    _check_total(routing, kept)
    if routes.start_row > kept:
        raise HandleError(
            "the response skips rows the history does not have",
            expected=f"rows from at most {kept} (the request's start row <= history)",
            found=f"rows from {routes.start_row}",
        )
    fresh = routes.tail(kept)
    return fresh if fresh.rows else None


def check_continues(routing: EngineRouting, history: Handle | None) -> None:
    """Refuse an answer that cannot continue ``history`` (the checks ``stitch`` makes,
    for carried rows and engine keys alike), before anything is written: a group's
    member is set aside on its own.

    Example:
        >>> check_continues(read_response("lmdeploy", body, spec), cont.history)  # doctest: +SKIP
    """
    if routing.routes is not None:
        new_rows(routing, history)
        return
    _check_total(routing, history.rows if history is not None else 0)


def _check_total(routing: EngineRouting, kept: int) -> None:
    total = _total_rows(routing)
    if total is not None and total < kept:
        raise RowCountMismatch(
            "the resumed response has fewer rows than the history it continues",
            expected=f"at least {kept} rows",
            found=f"{total} rows",
        )


def _total_rows(routing: EngineRouting) -> int | None:
    if routing.prompt_tokens is None or routing.completion_tokens is None:
        if routing.routes is not None:
            return routing.routes.stop_row
        return routing.key.rows if routing.key is not None else None
    return expected_rows(routing.prompt_tokens, routing.completion_tokens)


ADAPTERS: dict[str, EngineAdapter] = {
    **{engine.value: HttpAdapter(name=engine.value, engine=engine) for engine in ENGINES},
    "vllm-inprocess": VllmInProcessAdapter(),
}
"""One HTTP adapter per engine of the wire registry, plus vLLM in process."""
