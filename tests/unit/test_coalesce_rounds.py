"""Bounded rounds of a ``Coalescer`` and ``flow.primed``: a round that fills goes at
once, its call on the wire before the loop runs the next coroutine, so a rollout
worker's copy into the object store overlaps the layout of its later groups."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routeplay.store.client.coalesce import Coalescer
from routeplay.store.flow import Wait, primed


class Echo:
    """A ``run`` that records each batch when it is called (not when awaited)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, items: list[int]) -> Any:
        self.batches.append(list(items))

        async def answer() -> list[int]:
            return [item * 10 for item in items]

        return answer()


@given(st.integers(1, 40), st.integers(1, 8))
def test_rounds_of_at_most_n_requests_answer_each_caller_its_own(
    requests: int, per_round: int
) -> None:
    echo = Echo()
    coalescer: Coalescer[int, int] = Coalescer(run=echo, round_requests=per_round)

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(coalescer.submit([i, i + 100]) for i in range(requests)))

    got = asyncio.run(main())
    assert got == [[i * 10, (i + 100) * 10] for i in range(requests)]
    sizes = [len(batch) // 2 for batch in echo.batches]
    assert all(size <= per_round for size in sizes)
    assert sum(sizes) == requests
    assert sizes[:-1] == [per_round] * (len(sizes) - 1)  # full rounds, then the rest


def test_a_full_round_is_sent_before_the_next_coroutine_runs() -> None:
    """The round's call starts inside the submit that filled it: the coroutines gathered
    after it see it sent already."""
    echo = Echo()
    coalescer: Coalescer[int, int] = Coalescer(run=echo, round_requests=2)
    seen: list[int] = []

    async def put(i: int) -> list[int]:
        seen.append(len(echo.batches))  # rounds sent when this coroutine starts
        return await coalescer.submit([i])

    async def main() -> None:
        await asyncio.gather(*(put(i) for i in range(5)))

    asyncio.run(main())
    assert seen == [0, 0, 1, 1, 2]  # the third coroutine already finds the first round sent
    assert echo.batches == [[0, 1], [2, 3], [4]]


class Resolver:
    def __init__(self) -> None:
        self.waited: list[Wait] = []

    def resolve(self, wait: Wait) -> Any:
        raise AssertionError("blocking resolve in an awaited flow")

    async def aresolve(self, wait: Wait) -> Any:
        self.waited.append(wait)
        return ["answer"]


def test_primed_runs_a_flow_to_its_first_wait_at_once() -> None:
    sent: list[str] = []

    def flow() -> Generator[Wait, Any, str]:
        sent.append("call")  # what a flow's first step does: send its calls
        [answer] = yield Wait((object(),), "call")
        return f"got {answer}"

    resolver = Resolver()
    pending = primed(flow(), resolver)
    assert sent == ["call"]  # sent before anything awaited it
    assert resolver.waited == []
    assert asyncio.run(_awaited(pending)) == "got answer"
    assert len(resolver.waited) == 1


def test_primed_answers_a_flow_that_never_waits() -> None:
    def flow() -> Generator[Wait, Any, int]:
        return 7
        yield  # a generator all the same

    assert asyncio.run(_awaited(primed(flow(), Resolver()))) == 7


def test_a_run_that_raises_at_once_fails_only_its_caller() -> None:
    calls: list[list[int]] = []

    def run(items: list[int]) -> Any:
        calls.append(items)
        if 0 in items:
            raise ValueError("bad item")

        async def answer() -> list[int]:
            return items

        return answer()

    coalescer: Coalescer[int, int] = Coalescer(run=run, round_requests=2)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(coalescer.submit([i]) for i in range(4)), return_exceptions=True
        )

    got = asyncio.run(main())
    assert isinstance(got[0], ValueError)  # the bad request fails alone (retried alone)
    assert got[1:] == [[1], [2], [3]]


async def _awaited(pending: Any) -> Any:
    return await pending


@pytest.fixture(autouse=True)
def _no_stray_loop() -> None:
    asyncio.set_event_loop(None)
