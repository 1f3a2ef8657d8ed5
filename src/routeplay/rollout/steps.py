"""Lifecycle steps written once, run blocking (``run_step``) or awaited (``arun_step``).

A lifecycle step (``finish``: acquire the new lease, then release the replaced one, then
the borrowed one) makes several store calls in an order that is the rule. It is written
once, as a generator that yields a ``Call`` for each store call and receives its result
(or has its error thrown in, so ``try``/``except`` in the step means what it says). A
``Call`` carries both faces of one store call: ``blocking`` (``lease.release()``) and
``awaited`` (``lease.arelease()``). ``run_step`` runs the blocking one of each call in
turn; ``arun_step`` awaits the awaitable one on the running event loop. So the sync
step and its ``a``-twin make the same calls in the same order, by construction; no
executor thread, no ``ray.get`` in the awaited face (the store's own awaitable calls
are flows over awaited Ray references: ``routeplay.store.flow``).

A face runs only its own half of each ``Call``: a blocking step may be handed a store
that has no awaitable methods, and the other way round.

Example:
    def _release(lease: Lease) -> Step[None]:
        yield releasing(lease)

    run_step(_release(lease))           # blocking
    await arun_step(_release(lease))    # awaited
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

from routeplay.rollout.releasing import attach_notes
from routeplay.store.client.lease import Lease
from routeplay.store.flow import adrive, drive

__all__ = ["Call", "Step", "arun_step", "cloning", "ending_while", "releasing", "run_step"]

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Call(Generic[R]):
    """One store call of a step, in both faces (each looked up when it runs, so a
    wrapped or patched method is the one called)."""

    blocking: Callable[[], R]
    """The call, blocking this thread."""
    awaited: Callable[[], Awaitable[R]]
    """The same call, awaitable."""


Step: TypeAlias = Generator[Call[Any], Any, R]
"""A lifecycle step: yields ``Call``s, receives their results, returns the step's."""


class _Calls:
    """Answers a step's ``Call``: its blocking half, or its awaitable half awaited."""

    def resolve(self, call: Call[Any]) -> Any:
        return call.blocking()

    async def aresolve(self, call: Call[Any]) -> Any:
        return await call.awaited()


_CALLS = _Calls()


def run_step(step: Step[R]) -> R:
    """Run ``step`` to its result, making each call blocking (the store's ``drive``:
    an error is thrown into the step at the call that raised it).

    Example:
        handle = run_step(stitch_step(routing, spec, store, 2, history))
    """
    return drive(step, _CALLS)


async def arun_step(step: Step[R]) -> R:
    """Run ``step`` to its result, awaiting each call (the store's ``adrive``: a
    cancellation is thrown into the step at the call where it happened; the store
    call's own flow rescues what it sent).

    Example:
        handle = await arun_step(stitch_step(routing, spec, store, 2, history))
    """
    return await adrive(step, _CALLS)


def releasing(lease: Lease) -> Call[None]:
    """``lease.release()`` / ``lease.arelease()``.

    Example:
        yield releasing(lease)
    """
    return Call(lambda: lease.release(), lambda: lease.arelease())


def ending_while(leases: Sequence[Lease], cause: BaseException, what: str) -> Step[None]:
    """Release ``leases`` (one call per shard) while ``cause`` propagates: each is tried,
    and one that fails is named in a note on ``cause``, never raised over it.

    Example:
        yield from ending_while(granted, exc, "the group's granted leases")
    """
    if not leases:
        return
    errors: list[BaseException | None] = yield Call(
        lambda: Lease.release_each(leases), lambda: Lease.arelease_each(leases)
    )
    attach_notes(cause, [error for error in errors if error is not None], f"releasing {what}")


def cloning(lease: Lease, holder: str) -> Call[Lease]:
    """``lease.clone(holder)`` / ``lease.aclone(holder)``.

    Example:
        mine = yield cloning(lease, "buffer/g")
    """
    return Call(lambda: lease.clone(holder), lambda: lease.aclone(holder))
