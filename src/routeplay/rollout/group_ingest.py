"""A GRPO group's answers written together, for any sample type that embeds a
``SampleRouting``.

The members of one group (fresh, resumed or next turns alike) can replace each
``RoutingContinuation.ingest`` with one ``ingest_routing_group``: their new rows are
written in *one* call as one payload (the group's verified-equal prompt rows once),
then each member finishes on its own. Engine keys (LMDeploy, XTuner's SGLang) are
adopted together the same way: each key from its history's end (only the rows past the
history are stored), the prompt once. A member whose answer or key is refused gets its
typed error in its place and costs only itself.

The step is written once (``Step``) and run blocking or awaited
(``aingest_routing_group``: ``aput_many`` / ``aadopt_keys_each`` / ``afree_key``).

Example:
    >>> conts = [s.routing.continuation(prompt_ids=s.prompt) for s in group]  # doctest: +SKIP
    >>> out = ingest_routing_group(conts, answers, writer=store, weight_version=3, spec=spec)
    >>> done = [c.finish(store, h) for c, h in zip(conts, out) if isinstance(h, Handle)]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

from routeplay.core.handle import Handle
from routeplay.errors import MisuseError, RouteplayError
from routeplay.rollout.adapters import check_continues, new_rows
from routeplay.rollout.routing_terms import sample_holder
from routeplay.rollout.steps import Call, Step, arun_step, ending_while, run_step
from routeplay.store.client.lease import Lease

if TYPE_CHECKING:
    from collections.abc import Sequence

    from routeplay.core.handle import EngineKey
    from routeplay.core.routes import Routes
    from routeplay.core.spec import RouteSpec
    from routeplay.core.wires import EngineRouting
    from routeplay.rollout.routing_continuation import RoutingContinuation

__all__ = [
    "AsyncBatchWriter",
    "AsyncLeasedBatchWriter",
    "BatchWriter",
    "LeasedBatchWriter",
    "aingest_routing_group",
    "ingest_group_step",
    "ingest_routing_group",
]

GroupResult = list[Handle | RouteplayError]


class BatchWriter(Protocol):
    """What a group ingest writes through: ``RouteStore`` (or a producer's
    ``ProducerWriter``): ``put_many`` for rows carried in the answers, ``adopt_keys_each``
    and ``free_key`` for engine-store keys."""

    def put_many(
        self,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]: ...

    def adopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle | RouteplayError]: ...

    def free_key(self, key: EngineKey) -> bool: ...


class AsyncBatchWriter(Protocol):
    """``BatchWriter``'s awaitable face (``RouteStore``'s ``a``-twins)."""

    async def aput_many(
        self,
        batch: Sequence[Routes],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
    ) -> list[Handle]: ...

    async def aadopt_keys_each(
        self,
        keys: Sequence[EngineKey],
        spec: RouteSpec,
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        start_rows: Sequence[int] | None = None,
        pack: bool = False,
    ) -> list[Handle | RouteplayError]: ...

    async def afree_key(self, key: EngineKey) -> bool: ...


class LeasedBatchWriter(BatchWriter, Protocol):
    """A ``BatchWriter`` that leases what it writes in the same call (``RouteStore``,
    ``ProducerWriter``): what ``ingest_and_finish_group`` writes fresh members through."""

    def put_leased_many(
        self,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = ...,
    ) -> list[tuple[Handle, Lease]]: ...


class AsyncLeasedBatchWriter(AsyncBatchWriter, Protocol):
    """``LeasedBatchWriter``'s awaitable face."""

    async def aput_leased_many(
        self,
        batch: Sequence[Routes],
        holders: str | Sequence[str],
        *,
        weight_version: int = 0,
        shared_prefix: int = 0,
        pack: bool = False,
        pin: bool = ...,
    ) -> list[tuple[Handle, Lease]]: ...


def ingest_routing_group(
    conts: Sequence[RoutingContinuation[Any]],
    routings: Sequence[EngineRouting],
    *,
    writer: BatchWriter,
    weight_version: int,
    spec: RouteSpec | None = None,
) -> GroupResult:
    """Each member's routing after its answer (``ingest`` for a whole group), or the
    typed error that refused the member's answer: the rows each history lacks are
    written in one call as one payload. When every member is fresh (no history) and
    was continued with the same ``prompt_ids``, the prompt's rows are shared where
    verified equal (stored once, the saving counted).

    Rows carried in the answers go through one ``put_many``; engine-store keys through
    one ``adopt_keys_each`` (``spec`` required), each key from its history's end, so a
    resume or a later turn stores only its new rows. A member whose answer cannot
    continue its history, or whose key is refused (metadata, rows, run, consumed,
    expired), is set aside with its error; the others are written together.

    Ownership: the handles hold no lease yet; finish the members together with
    ``finish_all`` (one call per store shard for the group; a set-aside member's
    continuation is for the caller to abandon).

    Example:
        >>> out = ingest_routing_group(conts, answers, writer=w, weight_version=3)  # doctest: +SKIP
        >>> kept = [(c, h) for c, h in zip(conts, out) if isinstance(h, Handle)]
        >>> routed = finish_all([c for c, _ in kept], store, [h for _, h in kept])
    """
    return run_step(_group_step(conts, routings, writer, weight_version, spec))


async def aingest_routing_group(
    conts: Sequence[RoutingContinuation[Any]],
    routings: Sequence[EngineRouting],
    *,
    writer: AsyncBatchWriter,
    weight_version: int,
    spec: RouteSpec | None = None,
) -> GroupResult:
    """Awaitable ``ingest_routing_group`` (the same calls in the same order, awaited).

    Example:
        >>> out = await aingest_routing_group(conts, answers, writer=store,  # doctest: +SKIP
        ...                                   weight_version=3, spec=spec)
    """
    return await arun_step(_group_step(conts, routings, writer, weight_version, spec))


def _group_step(
    conts: Sequence[RoutingContinuation[Any]],
    routings: Sequence[EngineRouting],
    writer: BatchWriter | AsyncBatchWriter,
    weight_version: int,
    spec: RouteSpec | None,
) -> Step[GroupResult]:
    results, _ = yield from ingest_group_step(conts, routings, writer, weight_version, spec)
    return results


def ingest_group_step(
    conts: Sequence[RoutingContinuation[Any]],
    routings: Sequence[EngineRouting],
    writer: BatchWriter | AsyncBatchWriter,
    weight_version: int,
    spec: RouteSpec | None,
    *,
    lease: bool = False,
) -> Step[tuple[GroupResult, list[Lease | None]]]:
    """The step of a group ingest, for a caller composing it: per member its result
    and, with ``lease``, the ``rollout/<id>`` lease its write granted (None: none). With
    ``lease``, the members whose rows the answers carry are written and leased in one
    call (the writer's ``put_leased_many``, unpinned) when all of them are fresh (no
    history: a resumed member's lease must cover its history too, another payload);
    otherwise, and for members that answer with a key, they are written as without it.
    Granted leases end if a later write of the group fails.

    Example:
        >>> step = ingest_group_step(conts, answers, writer, 3, spec, lease=True)  # doctest: +SKIP
        >>> results, granted = run_step(step)  # doctest: +SKIP
    """
    for cont in conts:
        cont.check_open("ingest an answer")
    group = _Group(conts, routings, writer, weight_version, spec, lease=lease)
    carried: list[tuple[int, Routes]] = []
    keyed: list[tuple[int, EngineKey]] = []
    for index, (cont, routing) in enumerate(zip(conts, routings, strict=True)):
        try:
            check_continues(routing, cont.history)
            if routing.key is None:
                rows = new_rows(routing, cont.history)
                if rows is None:
                    group.out[index] = group.kept(index)
                else:
                    carried.append((index, rows))
            elif routing.key.rows <= cont.rows:  # nothing new: never adopt what none keeps
                yield group.freeing(routing.key)
                group.out[index] = group.kept(index)
            else:
                keyed.append((index, routing.key))
        except RouteplayError as exc:  # without its frames: they hold the group's rows
            group.out[index] = exc.with_traceback(None)  # in a cycle through ``group.out``
    if carried:
        yield from group.put_carried(carried)
    if keyed:
        try:
            yield from group.adopt_keyed(keyed)
        except BaseException as exc:  # the leases granted with the carried rows end too
            granted = [lease for lease in group.granted if lease is not None]
            group.granted = [None] * len(conts)
            yield from ending_while(granted, exc, "the leases the group's write granted")
            raise
    results = [result for result in group.out if result is not None]
    return results, group.granted


class _Group:
    """One group ingest: its members, its writer's two faces, each member's result."""

    def __init__(
        self,
        conts: Sequence[RoutingContinuation[Any]],
        routings: Sequence[EngineRouting],
        writer: BatchWriter | AsyncBatchWriter,
        weight_version: int,
        spec: RouteSpec | None,
        *,
        lease: bool = False,
    ) -> None:
        self.conts, self.routings, self.spec = conts, routings, spec
        self.blocking = cast("LeasedBatchWriter", writer)
        self.awaited = cast("AsyncLeasedBatchWriter", writer)
        self.weight_version = weight_version
        self.lease = lease
        self.out: list[Handle | RouteplayError | None] = [None] * len(conts)
        self.granted: list[Lease | None] = [None] * len(conts)

    def kept(self, index: int) -> Handle:
        return _kept(self.conts[index], self.routings[index], self.spec)

    def freeing(self, key: EngineKey) -> Call[bool]:
        return Call(lambda: self.blocking.free_key(key), lambda: self.awaited.afree_key(key))

    def put_carried(self, carried: Sequence[tuple[int, Routes]]) -> Step[None]:
        batch = [rows for _, rows in carried]
        shared = _shared_prompt([self.conts[i] for i, _ in carried])
        version = self.weight_version
        if self.lease and all(self.conts[i].history is None for i, _ in carried):
            # Fresh members: written and each leased to ``rollout/<id>`` in one call
            # (unpinned: the worker keeps the rows alive, it does not read them).
            holders = [sample_holder(self.conts[i].routing.sample_id) for i, _ in carried]
            pairs: list[tuple[Handle, Lease]] = yield Call(
                lambda: self.blocking.put_leased_many(
                    batch, holders, weight_version=version, shared_prefix=shared, pack=True,
                    pin=False,
                ),
                lambda: self.awaited.aput_leased_many(
                    batch, holders, weight_version=version, shared_prefix=shared, pack=True,
                    pin=False,
                ),
            )  # fmt: skip
            for (index, _), (handle, lease) in zip(carried, pairs, strict=True):
                self.out[index] = handle
                self.granted[index] = lease
            return
        written: list[Handle] = yield Call(
            lambda: self.blocking.put_many(
                batch, weight_version=version, shared_prefix=shared, pack=True
            ),
            lambda: self.awaited.aput_many(
                batch, weight_version=version, shared_prefix=shared, pack=True
            ),
        )
        for (index, _), handle in zip(carried, written, strict=True):
            self.out[index] = self.kept(index) + handle

    def adopt_keyed(self, keyed: Sequence[tuple[int, EngineKey]]) -> Step[None]:
        keys = [key for _, key in keyed]
        spec = _key_spec(self.conts, self.spec)
        shared = _shared_prompt([self.conts[i] for i, _ in keyed])
        starts = [self.conts[i].rows for i, _ in keyed]
        version = self.weight_version
        adopted: list[Handle | RouteplayError] = yield Call(
            lambda: self.blocking.adopt_keys_each(
                keys,
                spec,
                weight_version=version,
                shared_prefix=shared,
                start_rows=starts,
                pack=True,
            ),
            lambda: self.awaited.aadopt_keys_each(
                keys,
                spec,
                weight_version=version,
                shared_prefix=shared,
                start_rows=starts,
                pack=True,
            ),
        )
        for (index, _), result in zip(keyed, adopted, strict=True):
            self.out[index] = self.kept(index) + result if isinstance(result, Handle) else result


def _kept(cont: RoutingContinuation[Any], routing: EngineRouting, spec: RouteSpec | None) -> Handle:
    """The member's history, or an empty handle of its spec."""
    if cont.history is not None:
        return cont.history
    if routing.routes is not None:
        return Handle(routing.routes.spec)
    return Handle(_key_spec([cont], spec))


def _key_spec(conts: Sequence[RoutingContinuation[Any]], spec: RouteSpec | None) -> RouteSpec:
    if spec is not None:
        return spec
    raise MisuseError(
        "adopting engine-store keys in a group needs the model's spec",
        expected="ingest_routing_group(..., spec=spec)",
        found="spec=None",
        where=f"group of {', '.join(c.routing.sample_id for c in conts[:3])}",
    )


def _shared_prompt(conts: Sequence[RoutingContinuation[Any]]) -> int:
    """Prompt rows fresh members of one group may share (0 unless all are fresh and
    were continued with one non-empty prompt); ``put_many`` shares only rows it
    verified equal."""
    prompts = {cont.prompt_ids for cont in conts}
    if len(prompts) != 1 or any(cont.history is not None for cont in conts):
        return 0
    return len(next(iter(prompts)))
