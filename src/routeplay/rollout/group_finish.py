"""A GRPO group's answers written and its members finished, the leases granted by the
write's own call.

``ingest_routing_group`` then ``finish_all`` takes two store calls for a group: the write
(its payload, no lease), then one ``acquire_many`` for every member's ``rollout/<id>``
lease. ``ingest_and_finish_group`` makes one for a group whose answers carry their rows
and whose members are all fresh (a GRPO group's first answers): written and leased
together (``put_leased_many``: ``RouteStore``'s, or a producer's ``ProducerWriter``, whose
concurrent groups share one shard call), so no TTL can drop a payload between its write
and its lease either. A group with a resumed member (whose lease must cover its history
too, another payload) or with engine-store keys is written as ``ingest_routing_group``
writes it, and its members leased with one call per shard. The finish then ends every
replaced own lease and every borrowed lease, as ``finish_all`` does.

Example:
    >>> conts = [s.routing.continuation(prompt_ids=s.prompt) for s in group]  # doctest: +SKIP
    >>> out = ingest_and_finish_group(conts, answers, writer=writer, store=store,
    ...                               weight_version=3, spec=spec)  # doctest: +SKIP
    >>> routed = [r for r in out if isinstance(r, SampleRouting)]  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from routeplay.core.handle import Handle
from routeplay.errors import RouteplayError
from routeplay.rollout.group_ingest import (
    AsyncLeasedBatchWriter,
    LeasedBatchWriter,
    ingest_group_step,
)
from routeplay.rollout.routing_groups import (
    AsyncManyLeaseSource,
    ManyLeaseSource,
    finish_all_step,
)
from routeplay.rollout.steps import Step, arun_step, run_step

if TYPE_CHECKING:
    from collections.abc import Sequence

    from routeplay.core.spec import RouteSpec
    from routeplay.core.wires import EngineRouting
    from routeplay.rollout.routing_continuation import RoutingContinuation
    from routeplay.rollout.sample_routing import SampleRouting

__all__ = ["aingest_and_finish_group", "ingest_and_finish_group"]

Finished = list["SampleRouting | RouteplayError"]


def ingest_and_finish_group(
    conts: Sequence[RoutingContinuation[SampleRouting]],
    routings: Sequence[EngineRouting],
    *,
    writer: LeasedBatchWriter,
    store: ManyLeaseSource,
    weight_version: int,
    spec: RouteSpec | None = None,
) -> Finished:
    """Each member's next ``SampleRouting`` (its ``rollout/<id>`` lease held), or the
    typed error that refused its answer: ``ingest_routing_group`` and ``finish_all`` in
    one, the write of a group of fresh members granting their leases in the same call.

    A refused member costs only itself; its continuation stays open, for the caller to
    abandon (its borrowed lease). If the finish cannot take the leases still missing,
    every lease the write granted ends with the borrowed ones and the inputs' own leases
    are left to the caller, as with ``finish_all``.

    Example:
        >>> out = ingest_and_finish_group(conts, answers, writer=writer,  # doctest: +SKIP
        ...                               store=store, weight_version=3, spec=spec)
        >>> [r.lease.holder for r in out if isinstance(r, SampleRouting)]  # doctest: +SKIP
        ['rollout/g0.0', 'rollout/g0.1']
    """
    return run_step(_ingest_and_finish(conts, routings, writer, store, weight_version, spec))


async def aingest_and_finish_group(
    conts: Sequence[RoutingContinuation[SampleRouting]],
    routings: Sequence[EngineRouting],
    *,
    writer: AsyncLeasedBatchWriter,
    store: AsyncManyLeaseSource,
    weight_version: int,
    spec: RouteSpec | None = None,
) -> Finished:
    """Awaitable ``ingest_and_finish_group``: an asyncio rollout worker's coroutines,
    one per group, share one shard call for the groups answered together.

    Example:
        >>> out = await aingest_and_finish_group(conts, answers, writer=writer,  # doctest: +SKIP
        ...                                      store=store, weight_version=3)
    """
    step = _ingest_and_finish(conts, routings, writer, store, weight_version, spec)
    return await arun_step(step)


def _ingest_and_finish(
    conts: Sequence[RoutingContinuation[SampleRouting]],
    routings: Sequence[EngineRouting],
    writer: LeasedBatchWriter | AsyncLeasedBatchWriter,
    store: ManyLeaseSource | AsyncManyLeaseSource,
    weight_version: int,
    spec: RouteSpec | None,
) -> Step[Finished]:
    results, granted = yield from ingest_group_step(
        conts, routings, writer, weight_version, spec, lease=True
    )
    kept = [i for i, result in enumerate(results) if isinstance(result, Handle)]
    handles = [result for result in results if isinstance(result, Handle)]
    finished = yield from finish_all_step(
        [conts[i] for i in kept], store, handles, [granted[i] for i in kept]
    )
    by_member = dict(zip(kept, finished, strict=True))
    return [
        by_member[i] if i in by_member else cast(RouteplayError, result)
        for i, result in enumerate(results)
    ]
