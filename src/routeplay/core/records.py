"""Frozen, slotted dataclasses that a step builds and ships by the thousand: their
pickled state and their copies without walking ``dataclasses.fields`` on every call.

``dataclasses`` gives a frozen slotted class a ``__getstate__`` / ``__setstate__`` that
call ``fields(self)`` for every object, and ``replace`` walks the fields again and runs
``__init__``: a few microseconds each, paid per sample several times a step (a driver
unpickling 4,096 samples from its rollout workers, moving their leases into a buffer and
a batch, releasing them), on the step's critical path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["fast_state", "replaced"]

T = TypeVar("T")
C = TypeVar("C", bound=type)

_FIELDS: dict[type, tuple[str, ...]] = {}
"""Field names of each class ``replaced`` has copied, looked up once."""


def fast_state(cls: C) -> C:
    """Class decorator, above ``@dataclass(frozen=True, slots=True)``: its objects pickle
    as one tuple of their fields, set back without ``__init__`` (as ``dataclasses`` does
    for such a class), the field names looked up once per class, not once per object.

    Example:
        >>> @fast_state
        ... @dataclass(frozen=True, slots=True)
        ... class Row:
        ...     at: int
        ...     name: str = ""
        >>> pickle.loads(pickle.dumps(Row(3, "a")))
        Row(at=3, name='a')
    """
    names = tuple(field.name for field in dataclasses.fields(cls))

    def __getstate__(self: Any) -> tuple[Any, ...]:
        return tuple([getattr(self, name) for name in names])

    def __setstate__(self: Any, state: tuple[Any, ...]) -> None:
        for name, value in zip(names, state, strict=True):
            object.__setattr__(self, name, value)

    # setattr: mypy cannot see that a class may take these methods after it is made.
    setattr(cls, "__getstate__", __getstate__)  # noqa: B010
    setattr(cls, "__setstate__", __setstate__)  # noqa: B010
    return cls


def replaced(obj: T, **changes: Any) -> T:
    """``dataclasses.replace`` for a frozen, slotted dataclass with nothing to check at
    construction (no ``__post_init__``): the same new object, made without walking the
    fields' metadata or running ``__init__``. A class with a ``__post_init__`` goes
    through ``dataclasses.replace``, so its checks still run.

    Example:
        >>> replaced(Row(3, "a"), name="b")
        Row(at=3, name='b')
    """
    cls = type(obj)
    if hasattr(cls, "__post_init__"):
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(obj))  # type: ignore[arg-type]
    unknown = set(changes) - set(names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    new = object.__new__(cls)
    for name in names:
        object.__setattr__(new, name, changes[name] if name in changes else getattr(obj, name))
    return new
