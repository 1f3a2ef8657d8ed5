"""How a ``SampleRouting`` pickles: as one flat tuple, rebuilt by one call.

Why: a rollout worker hands every sample it finished to the driver (4,096 a step at
scale), and a frozen slotted dataclass pickled the standard way costs a ``copyreg``
call and a state walk each way, and its origin an enum's own ``__reduce_ex__`` and
lookup. Here the sample is one ``__reduce__`` and one constructor; its handle and its
leases are pickled as the objects they are, so the pickler's memo keeps them shared (a
lease named twice in one payload arrives as one lease, as releasing it must see).
A subclass, which may add fields, pickles by every field it has
(``routeplay.core.records.fields_reduced``).

Example:
    >>> routing = SampleRouting(sample_id="7", retries=1)  # doctest: +SKIP
    >>> pickle.loads(pickle.dumps(routing)) == routing
    True
"""

from __future__ import annotations

from typing import Any

from routeplay.rollout.routing_terms import Origin

__all__ = ["routing_reduced"]

_ORIGINS = {origin.value: origin for origin in Origin}


def routing_reduced(routing: Any) -> tuple[Any, tuple[Any, ...]]:
    """``routing.__reduce__()`` (a ``SampleRouting``: typed ``Any``, as this module is
    imported by that one): its class and its fields, its origin by value."""
    return (
        _restored_routing,
        (
            type(routing),
            routing.sample_id,
            routing.session_id,
            routing.handle,
            routing.lease,
            routing.origin.value,
            routing.unreleased,
            routing.response_versions,
            routing.prompt_tokens,
            routing.retries,
        ),
    )


def _restored_routing(cls: type[Any], *fields: Any) -> Any:
    sample_id, session_id, handle, lease, origin, *rest = fields
    restored: Any = object.__new__(cls)
    restored.__setstate__((sample_id, session_id, handle, lease, _ORIGINS[origin], *rest))
    return restored
