"""Every Ray wait of the store goes through here: a deadline, and Ray's exceptions
translated into routeplay's (``raise ... from``) so callers see one tree. ``get``
blocks (``ray.get``); ``get_as_created`` blocks too, pulling each object as it comes
to exist and handing them over in batches as they arrive; ``aget`` awaits Ray's
references on the running event loop (no thread, no ``ray.get``); all translate with
``translated``. ``RAY`` resolves a flow's waits (``routeplay.store.flow``) either way,
for clients of plain actors.

A wait's cancellation or deadline ends that wait only: what it waited on (a Ray
reference, a rescue marker other calls wait on too) is never cancelled by it, and a
plain future someone else cancelled is a typed error (``StoreFailure``), never a
``CancelledError`` for a caller that did not ask for one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import ray
from ray import exceptions as rex

from routeplay.errors import (
    EngineStoreLost,
    RouteplayError,
    RoutesLost,
    StoreFailure,
    StoreTimeout,
)
from routeplay.store.flow import Wait

__all__ = [
    "INLINE_LIMIT",
    "RAY",
    "RayWaits",
    "actor_where",
    "aget",
    "class_of",
    "get",
    "get_actor",
    "get_as_created",
    "in_object_store",
    "lost_index",
    "pull",
    "translated",
]

_LOST = (
    rex.OwnerDiedError,
    rex.ObjectLostError,
    rex.ObjectFetchTimedOutError,
    rex.ReferenceCountingAssertionError,
)


def get(refs: Any, *, timeout_s: float, what: str) -> Any:
    """``ray.get`` with a deadline; ``what`` names the payload or call for the error."""
    with translated(what, timeout_s):
        return ray.get(refs, timeout=timeout_s)


def get_as_created(
    refs: Sequence[Any], *, timeout_s: float, what: str
) -> Iterator[tuple[list[int], list[Any]]]:
    """The values of ``refs`` in batches as they arrive: each object is pulled to this
    node as soon as it exists, whatever the others do, and each batch is every object
    that has arrived when the batch is asked for (positions into ``refs``, values); one
    deadline for all of them.

    Why not one ``ray.get``: Ray's pull manager pulls a get's objects as one bundle and
    activates a bundle only once it knows every object's size, that is once every object
    exists (``PullManager::ActivateNextPullBundleRequest``). Blocks still being written
    (an adopted step's last payload, validated as the engine put it) would then cross
    only after the last one is written; fetched in batches of those that exist, a block
    written during a batch would wait for the whole batch. ``ray.wait`` with
    ``fetch_local`` pulls each object on its own (a bundle each), and Ray keeps pulling
    an object it has started on after the wait returns, so each block starts crossing
    once it exists, and each batch is copied while later ones still cross.

    When every object exists already (a trainer reading long after adoption, a
    producer's blocks, which exist before their handle does), one ``ray.get`` pulls them
    as one bundle, which was faster: 197 MB to 4 SP ranks on the bench's cluster took
    about 25 ms less than with the per-object waits (12 paired steps, twice). Then there
    is one batch, copied once all have arrived (Ray pins the whole bundle, as it does
    for the objects of any one batch). Existence is asked of each object's owner without
    waiting: an answer still on its way reads as "not yet", and the read takes the
    per-object way, correct only slower. A single object is not asked about: it is its
    own bundle either way (``ray.get`` pulls it once it exists, as the wait would), and
    the question is one more round trip to the raylet per read, which a trainer rank
    whose micro-batches each read one packed GRPO group made once per micro-batch.

    Ray has no call to stop such a pull: after an error, or when the caller stops
    early, the blocks already on their way still arrive (copies the node's store may
    evict). A block that arrives while the caller copies a batch waits, unpinned, for
    the next one; evicted meanwhile, the next wait pulls it again."""
    if not refs:
        return
    end = time.monotonic() + timeout_s
    remaining = list(range(len(refs)))
    unique = list(dict.fromkeys(refs))  # ray.wait refuses repeats
    with translated(what, timeout_s):
        one_bundle = len(unique) == 1 or _all_exist(unique)
    if one_bundle:
        yield remaining, _blocks(list(refs), end, what, timeout_s)
        return
    while remaining:
        pending = list(dict.fromkeys(refs[i] for i in remaining))  # ray.wait refuses repeats
        with translated(what, timeout_s):
            arrived = _arrived(pending, max(0.0, end - time.monotonic()))
        if not arrived:
            raise _not_arrived(what, len(pending), timeout_s)
        now = [i for i in remaining if refs[i] in arrived]
        remaining = [i for i in remaining if refs[i] not in arrived]
        yield now, _blocks([refs[i] for i in now], end, what, timeout_s)


def pull(refs: Sequence[Any]) -> None:
    """Start pulling ``refs`` to this node, without waiting: ``ray.wait`` with
    ``fetch_local`` asks for each object not here yet, and Ray keeps pulling what it
    started after the wait returns (a later ``ray.get`` finds it here, or joins the pull
    under way). Best effort: an object gone or not yet made is left to the read, which
    raises what it must."""
    unique = list(dict.fromkeys(refs))  # ray.wait refuses repeats
    if unique:
        with contextlib.suppress(rex.RayError, ValueError):
            ray.wait(unique, num_returns=len(unique), timeout=0, fetch_local=True)


def _blocks(refs: list[Any], end: float, what: str, timeout_s: float) -> list[Any]:
    """The values of ``refs`` by ``end`` (Ray's timeout says the blocks did not arrive;
    any other error, a writer's own ``StoreTimeout`` too, is translated as it is)."""
    with translated(what, timeout_s):
        try:
            return list(ray.get(refs, timeout=max(0.0, end - time.monotonic())))
        except rex.GetTimeoutError as exc:
            raise _not_arrived(what, len(refs), timeout_s) from exc


def _not_arrived(what: str, count: int, timeout_s: float) -> StoreTimeout:
    return StoreTimeout(
        "routing blocks did not arrive in time",
        where=what,
        expected=f"{count} more blocks on this node within {timeout_s}s",
        hint="Their writer (a key validator, a producer) is slow or hung, or the "
        "transfer is (a full object store on this node); a dead writer fails the "
        "read at once (RoutesLost).",
    )


def _all_exist(unique: list[Any]) -> bool:
    """Whether every object (no repeats) exists already, somewhere (without waiting or
    pulling)."""
    ready, _ = ray.wait(unique, num_returns=len(unique), timeout=0, fetch_local=False)
    return len(ready) == len(unique)


def _arrived(pending: list[Any], timeout_s: float) -> set[Any]:
    """The objects of ``pending`` that are on this node, once at least one is (waited
    for up to ``timeout_s``; empty if none came); an object whose task raised, or whose
    owner died, arrives as its error."""
    if not ray.wait(pending, num_returns=1, timeout=timeout_s, fetch_local=True)[0]:
        return set()
    here, _ = ray.wait(pending, num_returns=len(pending), timeout=0, fetch_local=True)
    return set(here)


def outcome_now(ref: Any) -> bool | None:
    """What the task behind ``ref`` came to, without waiting: True when it returned,
    False when it raised or its worker or owner died, None when it has not ended (or
    its result is not readable at once: it is treated as still running)."""
    return _ended(ref, 0.0)


def outcomes_now(refs: Sequence[Any]) -> list[bool | None]:
    """``outcome_now`` of each of ``refs``, with one wait and one get for all of them
    (each alone is a round trip through Ray's core worker: a take of a round of GRPO
    groups settles a hundred). Only where the joint get meets an error is each ended
    task asked alone."""
    unique = list(dict.fromkeys(refs))
    if not unique:
        return []
    ready, _ = ray.wait(unique, num_returns=len(unique), timeout=0, fetch_local=False)
    known: dict[Any, bool | None] = dict.fromkeys(ready, True)
    try:
        ray.get(ready, timeout=0)
    except rex.RayError:
        known = {ref: _ended(ref, 0.0) for ref in ready}
    return [known.get(ref) for ref in refs]


def succeeded(ref: Any, timeout_s: float) -> bool:
    """Whether the task behind ``ref`` returned (waits up to ``timeout_s``); False when it
    raised, its worker or owner died, or it did not finish in time."""
    return _ended(ref, timeout_s) is True


def _ended(ref: Any, timeout_s: float) -> bool | None:
    """``outcome_now`` after waiting up to ``timeout_s``."""
    try:
        ray.get(ref, timeout=timeout_s)
    except rex.GetTimeoutError:
        return None
    except rex.RayError:
        return False
    return True


async def aget(refs: Sequence[Any], *, timeout_s: float, what: str) -> list[Any]:
    """The values of ``refs`` (Ray references or ``concurrent.futures`` futures), awaited
    with a deadline, errors translated as ``get``'s. A cancellation is not an error: it
    propagates as it is (the calls stay in flight; the caller's flow rescues them).

    A cancellation or the deadline ends only this wait: each ref is awaited through a
    future of this wait's own, so nothing another caller waits on is cancelled."""
    gathered = asyncio.gather(*map(_awaitable, refs))
    gathered.add_done_callback(_retrieved)  # abandoned (cancelled, timed out): not an error
    with translated(what, timeout_s):
        return list(await asyncio.wait_for(gathered, timeout_s))


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _awaitable(ref: Any) -> Any:
    if isinstance(ref, concurrent.futures.Future):
        return _own_future(ref)
    # An ObjectRef is awaitable: each await makes a future of its own (Ray's
    # ``ObjectRef.future``), so cancelling it reaches neither the task nor other waiters.
    return ref


def _own_future(shared: concurrent.futures.Future[Any]) -> asyncio.Future[Any]:
    """A future of this waiter's own, settled like ``shared`` once it is done.

    Not ``asyncio.wrap_future``: it chains the two both ways, so a waiter cancelled (its
    task, or ``wait_for`` at the deadline) cancelled ``shared`` too. A rescue marker is
    shared by every call of the client that settles it: once cancelled, every waiter,
    and every later call, raised ``CancelledError`` (issue 38). Nothing flows back here."""
    loop = asyncio.get_running_loop()
    mine: asyncio.Future[Any] = loop.create_future()
    if shared.done():  # most markers a settle meets have landed already
        _settle_like(mine, shared)
        return mine

    def landed(done: concurrent.futures.Future[Any]) -> None:
        # On whichever thread completed it (Ray's), or here if it has just completed.
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(_settle_like, mine, done)

    shared.add_done_callback(landed)
    return mine


def _settle_like(mine: asyncio.Future[Any], shared: concurrent.futures.Future[Any]) -> None:
    """``mine`` as ``shared`` ended, unless this waiter has given up already. A ``shared``
    cancelled by someone else is an error of this wait (``translated`` names it), never a
    cancellation of the waiter's task."""
    if mine.done():
        return
    if shared.cancelled():
        mine.set_exception(concurrent.futures.CancelledError())
    elif (error := shared.exception()) is not None:
        mine.set_exception(error)
    else:
        mine.set_result(shared.result())


@contextlib.contextmanager
def translated(what: str, timeout_s: float) -> Iterator[None]:
    """Ray's exceptions (and a deadline's) raised inside, as routeplay's."""
    try:
        yield
    except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError) as exc:
        raise StoreTimeout(
            "a store call did not answer in time",
            where=what,
            expected=f"an answer within {timeout_s}s",
            hint="Is the store actor alive and the object store reachable?",
        ) from exc
    except concurrent.futures.CancelledError as exc:
        # A plain future (not the waiter's task: that is asyncio's CancelledError) that
        # someone cancelled: an error of the calls it stood for, not a cancellation of
        # whoever waits on it.
        raise StoreFailure(
            "a pending store result was cancelled by another caller",
            where=what,
            expected="its call's answer",
            found="a cancelled future",
            hint="Rescue markers refuse cancel(); a future handed to a wait must too.",
        ) from exc
    except _LOST as exc:
        raise RoutesLost(
            "routing payload is lost (its owner died or the object is gone)",
            where=what,
            found=type(exc).__name__,
            hint="The sample must be set aside; the rest of the store is unaffected.",
        ) from exc
    except rex.RayActorError as exc:
        raise RoutesLost(
            "the actor serving this call died", where=what, found=type(exc).__name__
        ) from exc
    except rex.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RouteplayError):
            raise cause from exc  # our own typed error, raised inside an actor
        raise StoreFailure(
            "a store actor failed", where=what, found=f"{type(cause).__name__}: {cause}"
        ) from exc


class RayWaits:
    """Resolves a flow's ``Wait`` on Ray: ``resolve`` blocks, ``aresolve`` awaits.

    ``each`` answers are per result, a ``RouteplayError`` in place of a failed one,
    under one deadline for the whole wait. ``default_timeout_s`` applies to waits that
    name none."""

    def __init__(self, default_timeout_s: float = 60.0) -> None:
        self.default_timeout_s = default_timeout_s

    def resolve(self, wait: Wait) -> list[Any]:
        timeout_s = self._deadline(wait)
        if not wait.each:
            return list(_get_all(wait.pending, timeout_s, wait.what))
        end = time.monotonic() + timeout_s
        return [
            _outcome(lambda ref=ref: _get_all([ref], max(0.0, end - time.monotonic()), wait.what))
            for ref in wait.pending
        ]

    async def aresolve(self, wait: Wait) -> list[Any]:
        timeout_s = self._deadline(wait)
        if not wait.each:
            return await aget(wait.pending, timeout_s=timeout_s, what=wait.what)
        answers = await asyncio.gather(
            *(_aoutcome(ref, timeout_s, wait.what) for ref in wait.pending)
        )
        return list(answers)

    def _deadline(self, wait: Wait) -> float:
        return self.default_timeout_s if wait.timeout_s is None else wait.timeout_s


def _get_all(pending: Sequence[Any], timeout_s: float, what: str) -> list[Any]:
    futures = [p for p in pending if isinstance(p, concurrent.futures.Future)]
    if not futures:
        return list(get(list(pending), timeout_s=timeout_s, what=what))
    with translated(what, timeout_s):  # rescue markers: plain futures, not references
        return [
            p.result(timeout_s)
            if isinstance(p, concurrent.futures.Future)
            else get(p, timeout_s=timeout_s, what=what)
            for p in pending
        ]


def _outcome(fetch: Any) -> Any:
    try:
        [value] = fetch()
    except RouteplayError as exc:
        return exc
    return value


async def _aoutcome(ref: Any, timeout_s: float, what: str) -> Any:
    try:
        [value] = await aget([ref], timeout_s=timeout_s, what=what)
    except RouteplayError as exc:
        return exc
    return value


RAY: Final = RayWaits()
"""Resolves waits on Ray references with the deadline each wait names."""


def actor_where(namespace: str, name: str) -> str:
    """How errors name a named actor.

    Example:
        actor_where("lmdeploy", "shared_store")  # 'Ray actor lmdeploy/shared_store'
    """
    return f"Ray actor {namespace}/{name}"


def class_of(actor: Any) -> str | None:
    """``module.Class`` an actor was created from, None if the handle does not say.

    Ray keeps the creating class's descriptor on every handle, even when this process
    cannot import that class (it then builds the handle on a placeholder class).

    Example:
        class_of(ray.get_actor("shared_store", namespace="lmdeploy"))  # 'lmdeploy....'
    """
    descriptor = getattr(actor, "_ray_actor_creation_function_descriptor", None)
    module = getattr(descriptor, "module_name", "")
    name = getattr(descriptor, "class_name", "")
    return f"{module}.{name}" if module and name else None


def get_actor(name: str, namespace: str) -> Any:
    """A named actor's handle; a missing one (a dead engine store) is ``EngineUnavailable``
    (a ``LifetimeError``), not Ray's ``ValueError: Failed to look up actor``."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as exc:
        raise EngineStoreLost(
            "the engine store actor is gone",
            where=actor_where(namespace, name),
            expected="a live engine store (start_engine_store)",
            found=str(exc).splitlines()[0][:200],
            hint="Its keys and their payloads are lost; restart it before the engine.",
        ) from exc


def lost_index(refs: list[Any], error: BaseException) -> int | None:
    """Which reference a lost-object error was about (Ray names it; nothing is fetched)."""
    lost_hex = getattr(error.__cause__, "object_ref_hex", None)
    hexes = [ref.hex() for ref in refs]
    return hexes.index(lost_hex) if lost_hex in hexes else None


INLINE_LIMIT: Final = 100 * 1024
"""Ray's ``max_direct_call_object_size`` default: task results up to this many
serialized bytes stay in their owner's heap instead of the object store."""


def in_object_store(refs: list[Any], *, timeout_s: float, what: str) -> list[Any]:
    """``refs`` (task results this process owns), each living in the object store.

    Ray keeps a task result under 100 KiB in its owner's heap ("inlined"): for a store
    shard that is unaccounted, unspillable memory growing with every small payload, and
    a reader's fetch is an RPC to the shard. Such a result is written to the object
    store once here (``ray.put``: the shard owns it, as it owned the result) and the
    inlined copy goes with its last reference. Only results known to be inlined (small,
    on no node, never spilled) are rewritten: anything else is kept as it is, so nothing
    is written twice.
    """
    places = ray.experimental.get_local_object_locations(refs)  # owner-side: no RPC
    inlined = [i for i, ref in enumerate(refs) if _is_inlined(places.get(ref))]
    if not inlined:
        return refs
    values = get([refs[i] for i in inlined], timeout_s=timeout_s, what=what)
    out = list(refs)
    for i, value in zip(inlined, values, strict=True):
        out[i] = ray.put(value)
    return out


def _is_inlined(place: dict[str, Any] | None) -> bool:
    if not place or place.get("node_ids") or place.get("did_spill"):
        return False
    size = place.get("object_size")
    return size is not None and size <= INLINE_LIMIT
