"""Concurrent awaitable store calls of one process, sent as one batch.

XTuner's and verl's rollout workers run one coroutine per sample: each finishes its
sample (``afinish``: an acquire, then releases) when its answer lands, so a step's
thousands of samples would make thousands of shard calls, one each. A ``Coalescer``
gathers the requests made on one event loop before it next runs its ready callbacks and
sends them as one batch (one call per shard): no timer, no added wait beyond one turn
of the loop, and a lone request goes out alone. With ``round_requests`` a round that
fills goes at once, and the next requests start another: its call is on the wire while
the loop still runs the coroutines after it.

Each waiter gets only its own results. A batch that fails is retried request by
request, so one bad request (another run's handle, a released lease) fails only its
caller. The batch runs as a task of its own, so a waiter cancelled (or past its
deadline) ends only its own wait: when the batch lands, ``undo`` ends what it granted
that waiter (its leases), as the store's own rescues do.

Example:
    >>> acquires = Coalescer(run=lambda items: store.aacquire_many(items),
    ...                      undo=lambda leases: store.release_many(leases))  # doctest: +SKIP
    >>> [lease] = await acquires.submit([(handle, "rollout/a")])  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["Coalescer"]

I = TypeVar("I")  # noqa: E741 (an item of a request)
O = TypeVar("O")  # noqa: E741 (its result)


@dataclass(slots=True)
class _Request(Generic[I, O]):
    items: list[I]
    waiter: asyncio.Future[list[O]]


@dataclass(slots=True)
class _Round(Generic[I, O]):
    """The requests gathered on one loop since its last batch was sent."""

    requests: list[_Request[I, O]] = field(default_factory=list)


class Coalescer(Generic[I, O]):
    """Requests (lists of items) awaited concurrently on one loop, sent as one batch.

    ``run`` sends a batch of items and answers one result per item, in order; ``undo``
    ends the results of a waiter that gave up before its batch landed (None: nothing to
    end, e.g. releases). ``retry_alone=False``: a batch that fails fails every request
    in it with its error, none is sent again (for requests that a failed attempt may
    have consumed: engine keys). ``round_requests``: the most requests a round holds;
    ``run`` is called when its round is sent (a run that sends its call before it first
    awaits, ``flow.primed``, has it on the wire at once).
    """

    def __init__(
        self,
        run: Callable[[list[I]], Awaitable[list[O]]],
        undo: Callable[[list[O]], object] | None = None,
        *,
        retry_alone: bool = True,
        round_requests: int | None = None,
    ) -> None:
        self._run = run
        self._undo = undo
        self._retry_alone = retry_alone
        self._round_requests = round_requests
        self._rounds: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Round[I, O]] = (
            weakref.WeakKeyDictionary()
        )
        self._tasks: set[asyncio.Task[None]] = set()  # batches in flight (kept alive)

    async def submit(self, items: Sequence[I]) -> list[O]:
        """This request's results, sent with every request made on this loop meanwhile."""
        loop = asyncio.get_running_loop()
        current = self._rounds.get(loop)
        if current is None:
            current = self._rounds[loop] = _Round()
            loop.call_soon(self._send, loop, current)  # after every coroutine ready now ran
        request: _Request[I, O] = _Request(list(items), loop.create_future())
        current.requests.append(request)
        if self._round_requests is not None and len(current.requests) >= self._round_requests:
            self._send(loop, current)  # a full round goes now, while later ones gather
        try:
            return await request.waiter
        except asyncio.CancelledError:
            # Cancelled in the loop turn its batch landed in: the waiter holds results
            # nobody will take (``_deliver`` saw it pending); end them as a late waiter's.
            _undo_unclaimed(request.waiter, self._undo)
            raise

    def _send(self, loop: asyncio.AbstractEventLoop, round_: _Round[I, O]) -> None:
        if self._rounds.get(loop) is not round_:
            return  # sent already (it filled up)
        requests = self._rounds.pop(loop).requests
        items = [item for request in requests for item in request.items]
        # ``run`` is called here, not in the task: a run that sends its call before it
        # first awaits (``flow.primed``) has it on the wire before the loop moves on.
        task = loop.create_task(self._batch(requests, self._call(items)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _call(self, items: list[I]) -> Awaitable[list[O]]:
        """``run(items)``; an error it raises before answering is its answer, awaited."""
        try:
            return self._run(items)
        except Exception as exc:
            return _raising(exc)

    async def _batch(self, requests: list[_Request[I, O]], call: Awaitable[list[O]]) -> None:
        try:
            batch = await _outcome(call)
        except BaseException:  # the batch itself was cancelled (its flow rescued its calls)
            if inspect.iscoroutine(call) and inspect.getcoroutinestate(call) == "CORO_CREATED":
                call.close()  # cancelled before it ran: nothing was sent
            for request in requests:
                request.waiter.cancel()
            raise
        if not isinstance(batch, BaseException):
            at = 0
            for request in requests:
                _deliver(request, batch[at : at + len(request.items)], self._undo)
                at += len(request.items)
        elif len(requests) == 1 or not self._retry_alone:
            for request in requests:
                _deliver(request, batch, self._undo)
        else:  # which request failed? each on its own: only its caller fails
            for at, request in enumerate(requests):
                try:
                    outcome = await _outcome(self._call(request.items))
                except BaseException:
                    for left in requests[at:]:
                        left.waiter.cancel()
                    raise
                _deliver(request, outcome, self._undo)


async def _raising(exc: Exception) -> Any:
    raise exc


async def _outcome(call: Awaitable[list[O]]) -> list[O] | BaseException:
    try:
        return await call
    except Exception as exc:
        return exc


def _undo_unclaimed(
    waiter: asyncio.Future[list[O]], undo: Callable[[list[O]], object] | None
) -> None:
    """``undo`` the results a waiter got but its caller never took (no-op otherwise)."""
    if undo is None or not waiter.done() or waiter.cancelled():
        return
    if waiter.exception() is None:
        undo(waiter.result())


def _deliver(
    request: _Request[Any, O],
    outcome: list[O] | BaseException,
    undo: Callable[[list[O]], object] | None,
) -> None:
    """Hand a request its outcome; a waiter that gave up has what it was granted ended."""
    if request.waiter.done():  # cancelled (or past its deadline): nobody will take them
        if undo is not None and not isinstance(outcome, BaseException):
            undo(outcome)
        return
    if isinstance(outcome, BaseException):
        request.waiter.set_exception(outcome)
    else:
        request.waiter.set_result(outcome)
