"""Store calls written once, driven two ways: blocking (``drive``) or awaited (``adrive``).

A multi-step store call (acquire on every shard or none, adopt then lease, clone then
release) is a generator, a *flow*: it sends its Ray calls itself, yields a ``Wait`` for
the answers it needs, and receives them. The blocking face of ``RouteStore`` runs a flow
with ``drive`` (the backend's ``resolve``: ``ray.get``), the awaitable face with
``adrive`` (``aresolve``: ``await`` on Ray's references, on this event loop: no executor
thread, no ``ray.get``). Every decision, and every rescue, lives in the flow, so the two
faces cannot drift apart (as httpx's ``auth_flow``, one generator under ``Client`` and
``AsyncClient``).

Rescue: ``awaiting`` is where a flow waits. If the wait ends in anything but the call's
own answer (the task was cancelled, the deadline passed, ``KeyboardInterrupt``), the
calls are still in flight and will land; the flow's ``rescue`` then arranges that what
they grant is undone when they land (``PendingReleases.rescue``), so a cancelled call
leaves nothing behind. A call that answered with its own error granted nothing.

Pure Python (no Ray): unit tests drive flows with an in-process resolver.

Example:
    def _stats(self) -> Flow[list[TableStats]]:
        pending = self._backend.send(calls)
        return (yield from awaiting(pending, "stats"))

    drive(self._stats(), self._backend)            # blocking
    await adrive(self._stats(), self._backend)     # awaited
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

from routeplay.errors import RouteplayError, StoreTimeout

__all__ = ["Flow", "Resolver", "Wait", "adrive", "answered", "awaiting", "drive", "primed"]

R = TypeVar("R")
W = TypeVar("W")
W_contra = TypeVar("W_contra", contravariant=True)


@dataclass(frozen=True, slots=True)
class Wait:
    """What a flow waits for: the answers of calls it already sent."""

    pending: tuple[Any, ...]
    """The calls' pending results (Ray references, or settled values in process)."""
    what: str
    """Names the calls in errors."""
    timeout_s: float | None = None
    """Deadline for all of them; None: the backend's."""
    each: bool = False
    """Answer each result or the ``RouteplayError`` it raised (instead of raising the
    first error)."""


Flow: TypeAlias = Generator[Wait, Any, R]
"""A store call: yields ``Wait``s, receives their answers (a list, one per pending
result), returns the call's result."""


class Resolver(Protocol[W_contra]):
    """What answers what a flow yields: for a ``Wait``, the backend (or ``ray_calls.RAY``
    for actor clients); for a lifecycle step's ``Call``, ``routeplay.rollout.steps``."""

    def resolve(self, wait: W_contra) -> Any:
        """The answer, blocking this thread."""
        ...

    async def aresolve(self, wait: W_contra) -> Any:
        """The answer, awaited on the running event loop."""
        ...


def drive(flow: Generator[W, Any, R], resolver: Resolver[W]) -> R:
    """Run ``flow`` to its result, blocking on each wait.

    Example:
        handles = drive(store_flow, backend)
    """
    try:
        wait = next(flow)
        while True:
            try:
                answer = resolver.resolve(wait)
            except BaseException as exc:  # the flow decides: rescue, roll back, re-raise
                wait = flow.throw(exc)
            else:
                wait = flow.send(answer)
    except StopIteration as done:
        result: R = done.value
        return result


async def adrive(flow: Generator[W, Any, R], resolver: Resolver[W]) -> R:
    """Run ``flow`` to its result, awaiting each wait (a cancellation is thrown into
    the flow at the wait where it happened, so the flow rescues what is in flight).

    Example:
        handles = await adrive(store_flow, backend)
    """
    return await primed(flow, resolver)


def primed(flow: Generator[W, Any, R], resolver: Resolver[W]) -> Awaitable[R]:
    """Run ``flow`` now, up to its first wait (its first calls go out at once, not when
    a task next gets the loop), and return an awaitable of the rest (``adrive``'s).

    Example:
        pending = primed(store_flow, backend)   # the calls are sent
        handles = await pending
    """
    try:
        wait = next(flow)
    except StopIteration as done:
        return _ready(done.value)
    return _driven(flow, wait, resolver)


async def _ready(value: R) -> R:
    return value


async def _driven(flow: Generator[W, Any, R], wait: W, resolver: Resolver[W]) -> R:
    """``adrive`` from the flow's first wait on."""
    try:
        while True:
            try:
                answer = await resolver.aresolve(wait)
            except BaseException as exc:
                wait = flow.throw(exc)
            else:
                wait = flow.send(answer)
    except StopIteration as done:
        result: R = done.value
        return result


def answered(exc: BaseException) -> bool:
    """Whether a wait ended with the calls' own error (they granted nothing), rather
    than while they were still in flight (cancelled, timed out, interrupted).

    Example:
        answered(RoutesExpired("ttl"))          # True: nothing to undo
        answered(asyncio.CancelledError())      # False: rescue what is in flight
    """
    return isinstance(exc, RouteplayError) and not isinstance(exc, StoreTimeout)


def awaiting(
    pending: Sequence[Any],
    what: str,
    *,
    timeout_s: float | None = None,
    each: bool = False,
    rescue: Callable[[Sequence[Any]], None] | None = None,
) -> Flow[list[Any]]:
    """Wait for ``pending``; if the wait is abandoned with the calls in flight, hand
    them to ``rescue`` (which undoes what they grant when they land) and re-raise.

    Example:
        [grant] = yield from awaiting(pending, "acquire", rescue=self._undo_grants)
    """
    try:
        answer: list[Any] = yield Wait(tuple(pending), what, timeout_s, each)
    except BaseException as exc:
        if rescue is not None and not answered(exc):
            rescue(pending)
        raise
    return answer
