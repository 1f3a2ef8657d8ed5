"""Lifecycle steps over many samples at once: one store call per shard, not per sample.

A step moves thousands of samples: a GRPO group enters the replay buffer, a batch takes
the sampled groups over, the batch ends them. ``SampleRouting``'s own steps make one
waited call per sample and lease (``claim`` is a clone, ``hand_over`` a release); these
make the same moves for a whole group or batch with one call per store shard:

    step                          does, in this order                     on failure
    ----------------------------  --------------------------------------  --------------------
    claim_all(rs, holder, store)  clone every live lease (one call per    nothing claimed (a
                                  shard), acquire the leaseless handles   failure ends the
                                  (``acquire_many``)                       clones made)
    hand_over_all(rs, leases)     release every own + unreleased lease    a failed lease rides
                                  (one waited call per shard), hold the   in its sample's
                                  new ones                                ``unreleased``
    take_over_all(rs, h, store)   claim_all, then hand_over_all           claim fails: unchanged
    finish_all(conts, store, hs)  acquire every ``rollout/<id>`` lease,    acquire fails: the
                                  then end every replaced own lease and   borrowed leases end,
                                  every borrowed lease (one call each     the own stay
                                  per shard)
    discard_all(rs)               release every lease each names          stuck ones ride along
    discard_failures(rs)          discard_all, keeping only the failures  (position, value, error)
    expire_all(rs)                discard_all, then reset (a retry)       ``Expiry`` per sample

The order inside each is ``SampleRouting``'s: a new lease exists before the one it
replaces ends, so rows shared by the two never reach zero leases. A shard that fails a
batched release fails every lease it held: each such lease stays live, named in its
sample's ``unreleased`` (retried by the next release), exactly as a per-sample release
failing would leave it. Each step is a step generator (``routeplay.rollout.steps``) with
a blocking and an awaitable face (the ``a``-prefixed twins), as ``SampleRouting``'s.

Example:
    >>> routings = [s.sample_routing for s in group]
    >>> taken = take_over_all(routings, "buffer/g", store)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from routeplay.core.handle import Handle
from routeplay.core.records import replaced
from routeplay.rollout.releasing import first_error
from routeplay.rollout.routing_continuation import RoutingContinuation
from routeplay.rollout.routing_terms import sample_holder
from routeplay.rollout.sample_routing import Expiry, SampleRouting
from routeplay.rollout.steps import Call, Step, arun_step, ending_while, run_step
from routeplay.store.client.lease import Holders, Lease, holders_of

__all__ = [
    "AsyncManyLeaseSource",
    "ManyLeaseSource",
    "aclaim_all",
    "adiscard_all",
    "adiscard_failures",
    "aexpire_all",
    "afinish_all",
    "ahand_over_all",
    "atake_over_all",
    "claim_all",
    "discard_all",
    "discard_failures",
    "expire_all",
    "finish_all",
    "finish_all_step",
    "hand_over_all",
    "take_over_all",
]


class ManyLeaseSource(Protocol):
    """What ``claim_all`` needs for samples without a live lease: ``acquire_many``."""

    def acquire_many(
        self, items: Sequence[tuple[Handle, str]], *, pin: bool = ...
    ) -> list[Lease]: ...


class AsyncManyLeaseSource(Protocol):
    """What ``aclaim_all`` needs: ``RouteStore.aacquire_many``."""

    async def aacquire_many(
        self, items: Sequence[tuple[Handle, str]], *, pin: bool = ...
    ) -> list[Lease]: ...


Source = ManyLeaseSource | AsyncManyLeaseSource


def claim_all(
    routings: Sequence[SampleRouting], holder: Holders, store: ManyLeaseSource | None = None
) -> list[Lease | None]:
    """``claim`` for every sample: per sample the new lease of ``holder`` (or of its own
    holder in a list, one per sample; None for one with neither a live lease nor,
    without ``store``, a handle), all or none.

    Example:
        >>> mine = claim_all([s.sample_routing for s in group], "buffer/g", store)  # doctest: +SKIP
    """
    return run_step(_claim_all(routings, holder, store))


async def aclaim_all(
    routings: Sequence[SampleRouting],
    holder: Holders,
    store: AsyncManyLeaseSource | None = None,
) -> list[Lease | None]:
    """Awaitable ``claim_all``.

    Example:
        >>> mine = await aclaim_all(routings, "buffer/g", store)  # doctest: +SKIP
    """
    return await arun_step(_claim_all(routings, holder, store))


def hand_over_all(
    routings: Sequence[SampleRouting], leases: Sequence[Lease | None]
) -> list[SampleRouting]:
    """``hand_over`` for every sample: its own (and unreleased) leases end, the new one
    (from ``claim_all``) takes its place; a sample given None is left as it is.

    Example:
        >>> routings = hand_over_all(routings, mine)  # doctest: +SKIP
    """
    return run_step(_hand_over_all(routings, leases))


async def ahand_over_all(
    routings: Sequence[SampleRouting], leases: Sequence[Lease | None]
) -> list[SampleRouting]:
    """Awaitable ``hand_over_all``.

    Example:
        >>> routings = await ahand_over_all(routings, mine)  # doctest: +SKIP
    """
    return await arun_step(_hand_over_all(routings, leases))


def take_over_all(
    routings: Sequence[SampleRouting], holder: Holders, store: ManyLeaseSource | None = None
) -> list[SampleRouting]:
    """``holder`` (or each sample's own holder in a list, one per sample: many groups
    entering a buffer at once) takes every sample over: its leases first (all or
    none), then the old ones end (one atomic call per shard when every lease is live on
    one shard, else two calls per shard).

    Example:
        >>> routings = take_over_all(routings, "train/step-3")  # doctest: +SKIP
    """
    return run_step(_take_over_all(routings, holder, store))


async def atake_over_all(
    routings: Sequence[SampleRouting],
    holder: Holders,
    store: AsyncManyLeaseSource | None = None,
) -> list[SampleRouting]:
    """Awaitable ``take_over_all``.

    Example:
        >>> routings = await atake_over_all(routings, "train/step-3")  # doctest: +SKIP
    """
    return await arun_step(_take_over_all(routings, holder, store))


def discard_all(
    routings: Sequence[SampleRouting],
) -> list[tuple[SampleRouting, Exception | None]]:
    """``discard`` for every sample: per sample its next value (no own lease; leases
    whose release failed in ``unreleased``) and its first error, or None.

    Example:
        >>> outcomes = discard_all([s.sample_routing for s in batch.states])  # doctest: +SKIP
    """
    return run_step(_discard_all(routings))


def discard_failures(
    routings: Sequence[SampleRouting],
) -> list[tuple[int, SampleRouting, Exception]]:
    """``discard_all`` for a holder that keeps none of the samples (a training batch
    closing, a buffer dropping its groups): only the samples whose release failed, as
    ``(position, value with the failed leases in unreleased, first error)``. The
    others' leaseless values are not built: a step ends thousands of samples.

    Example:
        >>> failed = discard_failures([s.sample_routing for s in batch.states])  # doctest: +SKIP
    """
    return run_step(_discard_failures(routings))


async def adiscard_failures(
    routings: Sequence[SampleRouting],
) -> list[tuple[int, SampleRouting, Exception]]:
    """Awaitable ``discard_failures``.

    Example:
        >>> failed = await adiscard_failures(routings)  # doctest: +SKIP
    """
    return await arun_step(_discard_failures(routings))


async def adiscard_all(
    routings: Sequence[SampleRouting],
) -> list[tuple[SampleRouting, Exception | None]]:
    """Awaitable ``discard_all``.

    Example:
        >>> outcomes = await adiscard_all(routings)  # doctest: +SKIP
    """
    return await arun_step(_discard_all(routings))


def finish_all(
    conts: Sequence[RoutingContinuation[SampleRouting]],
    store: ManyLeaseSource,
    handles: Sequence[Handle],
) -> list[SampleRouting]:
    """``finish`` for many continuations (a group after ``ingest_routing_group``): every
    new lease (``rollout/<id>``) in one ``acquire_many``, then every replaced own lease
    and every borrowed lease ended in one call per shard. If the new leases cannot be
    taken, the borrowed leases end and the inputs' own leases are left to the caller.

    Example:
        >>> out = ingest_routing_group(conts, answers, writer=store,  # doctest: +SKIP
        ...                            weight_version=3)
        >>> routings = finish_all(conts, store, out)  # doctest: +SKIP
    """
    return run_step(finish_all_step(conts, store, handles))


async def afinish_all(
    conts: Sequence[RoutingContinuation[SampleRouting]],
    store: AsyncManyLeaseSource,
    handles: Sequence[Handle],
) -> list[SampleRouting]:
    """Awaitable ``finish_all``.

    Example:
        >>> routings = await afinish_all(conts, store, handles)  # doctest: +SKIP
    """
    return await arun_step(finish_all_step(conts, store, handles))


def expire_all(routings: Sequence[SampleRouting]) -> list[Expiry]:
    """``expire_retryably`` for every sample (stale samples back for regeneration).

    Example:
        >>> expiries = expire_all(routings)  # doctest: +SKIP
    """
    return run_step(_expire_all(routings))


async def aexpire_all(routings: Sequence[SampleRouting]) -> list[Expiry]:
    """Awaitable ``expire_all``.

    Example:
        >>> expiries = await aexpire_all(routings)  # doctest: +SKIP
    """
    return await arun_step(_expire_all(routings))


# --------------------------------------------------------------------------- the steps


def _claim_all(
    routings: Sequence[SampleRouting], holder: Holders, store: Source | None
) -> Step[list[Lease | None]]:
    holders = holders_of(holder, len(routings))
    out: list[Lease | None] = [None] * len(routings)
    live = [i for i, r in enumerate(routings) if r.lease is not None and not r.lease.released]
    bare = [
        i
        for i, r in enumerate(routings)
        if i not in set(live) and r.handle is not None and store is not None
    ]
    if live:
        leases = [cast(Lease, routings[i].lease) for i in live]
        mine = [holders[i] for i in live]
        clones: list[Lease] = yield Call(
            lambda: Lease.clone_all(leases, mine), lambda: Lease.aclone_all(leases, mine)
        )
        for i, clone in zip(live, clones, strict=True):
            out[i] = clone
    if bare:
        items = [(cast(Handle, routings[i].handle), holders[i]) for i in bare]
        try:
            acquired: list[Lease] = yield _acquiring_many(cast(Source, store), items)
        except BaseException as exc:  # nothing claimed: end the clones already made
            made = [lease for lease in out if lease is not None]
            yield from ending_while(made, exc, "the clones already made")
            raise
        for i, lease in zip(bare, acquired, strict=True):
            out[i] = lease
    return out


def _hand_over_all(
    routings: Sequence[SampleRouting], leases: Sequence[Lease | None]
) -> Step[list[SampleRouting]]:
    moving = [i for i, lease in enumerate(leases) if lease is not None]
    released = yield from _released([routings[i] for i in moving])
    out = list(routings)
    for i, (after, _) in zip(moving, released, strict=True):
        out[i] = replaced(after, lease=leases[i])
    return out


def _take_over_all(
    routings: Sequence[SampleRouting], holder: Holders, store: Source | None
) -> Step[list[SampleRouting]]:
    live = [r.lease for r in routings if r.lease is not None and not r.lease.released]
    every_live = len(live) == len(routings) and not any(r.unreleased for r in routings)
    if every_live and Lease.one_shard(live):
        moved: Moved = yield _moving(live, holder)
        return [
            replaced(r, lease=lease, unreleased=(old,) if error else ())
            for r, old, lease, error in zip(routings, live, *moved, strict=True)
        ]
    leases = yield from _claim_all(routings, holder, store)
    return (yield from _hand_over_all(routings, leases))


Moved = tuple[list[Lease], list[BaseException | None]]
"""The new leases of a move, and per old lease the error that left it live (or None)."""


def _moving(leases: list[Lease], holder: Holders) -> Call[Moved]:
    """Leases of one shard moved to ``holder``. Blocking: one atomic call per shard (the
    new leases first, then the old end, under the shard's lock). Awaited: a clone, then a
    release, as ``take_over`` does, so a cancellation in flight leaves the old leases
    untouched (a cancelled move could hand its new leases to no one); an old lease whose
    release failed rides in its sample's ``unreleased``."""

    def transfer() -> Moved:
        return Lease.transfer_all(leases, holder), [None] * len(leases)

    async def clone_then_end() -> Moved:
        clones = await Lease.aclone_all(leases, holder)
        return clones, await Lease.arelease_each(leases)

    return Call(transfer, clone_then_end)


def _discard_all(
    routings: Sequence[SampleRouting],
) -> Step[list[tuple[SampleRouting, Exception | None]]]:
    return (yield from _released(routings))


def _expire_all(routings: Sequence[SampleRouting]) -> Step[list[Expiry]]:
    released = yield from _released(routings)
    out: list[Expiry] = []
    for after, error in released:
        if error is None:
            out.append(Expiry(retry=after.reset(), stuck=None, error=None))
        else:
            clean, _ = after.take_unreleased()
            out.append(Expiry(retry=clean.reset(), stuck=after, error=error))
    return out


def finish_all_step(
    conts: Sequence[RoutingContinuation[SampleRouting]],
    store: Source,
    handles: Sequence[Handle],
    granted: Sequence[Lease | None] | None = None,
) -> Step[list[SampleRouting]]:
    """The step of ``finish_all``, for a caller composing it (``ingest_and_finish_group``):
    ``granted`` holds, per member, the ``rollout/<id>`` lease its write already granted
    (None: acquired here, with the others in one call per shard). If the acquire fails,
    the granted leases end with the borrowed ones.

    Example:
        >>> routings = run_step(finish_all_step(conts, store, handles, leases))  # doctest: +SKIP
    """
    given: list[Lease | None] = list(granted) if granted is not None else [None] * len(conts)
    borrowed: list[Lease] = []
    try:
        closing = [cont.finishing() for cont in conts]
        borrowed = [lease for _, lease, _ in closing if lease is not None]
        bare = [i for i, lease in enumerate(given) if lease is None]
        items = [(handles[i], sample_holder(closing[i][0].sample_id)) for i in bare]
        acquired: list[Lease] = (yield _acquiring_many(store, items)) if items else []
    except BaseException as exc:  # nothing taken: the borrowed and granted leases end,
        ended = [*borrowed, *(lease for lease in given if lease is not None)]  # the own stay
        yield from ending_while(ended, exc, "the group's borrowed and granted leases")
        raise
    for i, lease in zip(bare, acquired, strict=True):
        given[i] = lease
    # The replaced own leases and the borrowed ones end together (a failure rides along
    # in that sample's ``unreleased``): the borrowed lease counts as one more own lease.
    routings = [
        r if b is None else replaced(r, unreleased=(*r.unreleased, b)) for r, b, _ in closing
    ]
    try:
        released = yield from _released(routings)
    except BaseException as exc:  # cancelled mid-release: nobody will hold the new leases
        new = [lease for lease in given if lease is not None]
        yield from ending_while(new, exc, "the group's new leases")
        raise
    return [
        after.attach(handle, cast(Lease, lease), origin)
        for (after, _), (_, _, origin), handle, lease in zip(
            released, closing, handles, given, strict=True
        )
    ]


def _released(
    routings: Sequence[SampleRouting],
) -> Step[list[tuple[SampleRouting, Exception | None]]]:
    """Every lease the samples name (own, then unreleased) released in one call per
    shard; per sample its value with no own lease and its failed leases in
    ``unreleased``, and its first error."""
    named, errors = yield from _release_named(routings)
    if not any(errors):  # the common case: every lease ended, nothing stuck, no error
        return [(_leaseless(routing), None) for routing in routings]
    return _outcomes(routings, named, errors)


def _release_named(
    routings: Sequence[SampleRouting],
) -> Step[tuple[list[list[Lease]], list[BaseException | None]]]:
    """Every lease each sample names, and per lease (flat, in order) its release's error."""
    named = [_named_leases(r) for r in routings]
    flat = [lease for leases in named for lease in leases]
    errors: list[BaseException | None] = (
        (yield Call(lambda: Lease.release_each(flat), lambda: Lease.arelease_each(flat)))
        if flat
        else []
    )
    return named, errors


def _outcomes(
    routings: Sequence[SampleRouting],
    named: Sequence[Sequence[Lease]],
    errors: Sequence[BaseException | None],
) -> list[tuple[SampleRouting, Exception | None]]:
    """Per sample its value after a release with errors: no own lease, the failed ones
    in ``unreleased``, and its first error (or None)."""
    out: list[tuple[SampleRouting, Exception | None]] = []
    at = 0
    for routing, leases in zip(routings, named, strict=True):
        mine = errors[at : at + len(leases)]
        at += len(leases)
        stuck = tuple(lease for lease, error in zip(leases, mine, strict=True) if error)
        failures = [cast(Exception, error) for error in mine if error is not None]
        error = first_error(failures, f"releasing sample {routing.sample_id}")
        out.append((replaced(routing, lease=None, unreleased=stuck), error))
    return out


def _discard_failures(
    routings: Sequence[SampleRouting],
) -> Step[list[tuple[int, SampleRouting, Exception]]]:
    named, errors = yield from _release_named(routings)
    if not any(errors):  # nothing failed: no sample's value is built (nobody keeps them)
        return []
    outcomes = _outcomes(routings, named, errors)
    return [(at, after, error) for at, (after, error) in enumerate(outcomes) if error is not None]


def _leaseless(routing: SampleRouting) -> SampleRouting:
    """``routing`` without its leases: itself when it names none (a frozen value: a
    fresh sample finishing has nothing to end, and thousands finish a step)."""
    if routing.lease is None and not routing.unreleased:
        return routing
    return replaced(routing, lease=None, unreleased=())


def _named_leases(routing: SampleRouting) -> list[Lease]:
    """The sample's own lease (if any), then its stuck ones."""
    if not routing.unreleased:
        return [] if routing.lease is None else [routing.lease]
    return [lease for lease in (routing.lease, *routing.unreleased) if lease is not None]


def _acquiring_many(store: Source, items: list[tuple[Handle, str]]) -> Call[list[Lease]]:
    """Unpinned, as ``routing_terms.acquiring``: the samples' leases keep rows alive,
    nobody reads through them here."""
    blocking, awaited = cast(ManyLeaseSource, store), cast(AsyncManyLeaseSource, store)
    return Call(
        lambda: blocking.acquire_many(items, pin=False),
        lambda: awaited.aacquire_many(items, pin=False),
    )
