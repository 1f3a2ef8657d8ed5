"""How a ``SampleRouting`` pickles: as one flat tuple, its handle's and its lease's own
pickled state inlined, rebuilt by one call.

Why: a rollout worker hands every sample it finished to the driver (4,096 a step at
scale), and Ray's pickler calls a Python hook for every object that is not a builtin:
the sample, its handle, its lease and its origin each took one on the way out and a
constructor on the way in. Inlined, a sample costs one hook and one call; its handle and
lease are still made by their own pickled state (``Handle.__reduce__``,
``Lease.__reduce__``), so each keeps its own checks and pins nothing on arrival.

Example:
    >>> routing = SampleRouting(sample_id="7", retries=1)  # doctest: +SKIP
    >>> pickle.loads(pickle.dumps(routing)) == routing
    True
"""

from __future__ import annotations

from typing import Any, cast

from routeplay.rollout.routing_terms import Origin

__all__ = ["routing_reduced"]

_ORIGINS = {origin.value: origin for origin in Origin}

Reduced = tuple[Any, tuple[Any, ...]] | None
"""An object's ``__reduce__`` (constructor, arguments), or None for no object."""


def routing_reduced(routing: Any) -> tuple[Any, tuple[Any, ...]]:
    """``routing.__reduce__()`` (a ``SampleRouting``: typed ``Any``, as this module is
    imported by that one): its class and its fields, the handle and the lease as
    their own ``__reduce__`` (the lease's handle left out when it is the sample's). For
    ``SampleRouting`` itself: a subclass may add fields, so it pickles by its whole state."""
    handle = routing.handle
    lease: Reduced = None
    if routing.lease is not None:
        build, args = cast(tuple[Any, tuple[Any, ...]], routing.lease.__reduce__())
        same = args[1] is handle
        lease = (build, (args[0], None if same else args[1], *args[2:]))
    return (
        _restored_routing,
        (
            type(routing),
            routing.sample_id,
            routing.session_id,
            None if handle is None else handle.__reduce__(),
            lease,
            routing.origin.value,
            routing.unreleased,
            routing.response_versions,
            routing.prompt_tokens,
            routing.retries,
        ),
    )


def _restored_routing(
    cls: type[Any],
    sample_id: str,
    session_id: str | None,
    handle_reduced: Reduced,
    lease_reduced: Reduced,
    origin: str,
    *rest: Any,
) -> Any:
    handle = None if handle_reduced is None else _built(handle_reduced)
    lease = None
    if lease_reduced is not None:
        build, (store, lease_handle, *more) = lease_reduced
        lease = build(store, handle if lease_handle is None else lease_handle, *more)
    restored: Any = object.__new__(cls)
    restored.__setstate__((sample_id, session_id, handle, lease, _ORIGINS[origin], *rest))
    return restored


def _built(reduced: tuple[Any, tuple[Any, ...]]) -> Any:
    build, args = reduced
    return build(*args)
