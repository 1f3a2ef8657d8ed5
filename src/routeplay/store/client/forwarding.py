"""``forward``: a client method that hands its call to one of the client's parts.

``RouteStore`` is one class over small parts (the write path, the read path, leases,
adopted keys, accounting); each public method is one line in its class body,
``acquire_many = forward("_leases", Leases.acquire_many)``. The forwarded method keeps
the part's name, docstring and signature (``help()`` and ``inspect.signature`` show the
part's), an awaitable stays a coroutine function, and mypy types every call through it
as the part's method without its ``self``. A subclass may override a forwarded method
and call ``super()``, as any method; the calls the parts make among themselves do not go
through it (``put`` -> ``put_many``, ``acquire`` -> ``acquire_many``, ``read`` ->
``read_many``): override the method a caller calls.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

__all__ = ["forward"]

P = ParamSpec("P")
R = TypeVar("R")
Part = TypeVar("Part")


def forward(
    part: str, method: Callable[Concatenate[Part, P], R]
) -> Callable[Concatenate[Any, P], R]:
    """A method that calls ``method`` on the object in attribute ``part`` of its owner.

    Example:
        class Client:
            acquire_many = forward("_leases", Leases.acquire_many)
    """
    if inspect.iscoroutinefunction(method):
        run = cast(Callable[..., Any], method)

        async def forwarded_await(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await run(getattr(self, part), *args, **kwargs)

        return cast(Callable[Concatenate[Any, P], R], functools.wraps(method)(forwarded_await))

    def forwarded(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(self, part), *args, **kwargs)

    return functools.wraps(method)(forwarded)
