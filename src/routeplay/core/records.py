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
import operator
from typing import Any, TypeVar

__all__ = ["fast_state", "replaced"]

T = TypeVar("T")
C = TypeVar("C", bound=type)


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
    values_of = operator.attrgetter(*names) if len(names) > 1 else None
    slots = tuple(_slots(cls, names).values())

    def __getstate__(self: Any) -> tuple[Any, ...]:
        if values_of is None:
            return tuple([getattr(self, name) for name in names])
        return values_of(self)

    def __setstate__(self: Any, state: tuple[Any, ...]) -> None:
        for slot, value in zip(slots, state, strict=True):
            slot.__set__(self, value)

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
    copier = _COPIERS.get(cls)
    if copier is None:
        copier = _COPIERS[cls] = _Copier(cls)
    return copier.copy(obj, changes)  # type: ignore[no-any-return]


class _Copier:
    """Copies objects of one frozen, slotted dataclass: every field read at once
    (``operator.attrgetter``), written through its slot (no frozen ``__setattr__``)."""

    __slots__ = ("_cls", "_names", "_slots", "_values_of")

    def __init__(self, cls: type) -> None:
        self._cls = cls
        self._names = tuple(f.name for f in dataclasses.fields(cls))
        self._slots = _slots(cls, self._names)
        self._values_of = operator.attrgetter(*self._names) if len(self._names) > 1 else None

    def copy(self, obj: Any, changes: dict[str, Any]) -> Any:
        slots = self._slots
        unknown = [name for name in changes if name not in slots]
        if unknown:
            raise TypeError(f"{self._cls.__name__} has no fields {sorted(unknown)}")
        new: Any = object.__new__(self._cls)
        values = (
            (getattr(obj, self._names[0]),) if self._values_of is None else self._values_of(obj)
        )
        for slot, value in zip(slots.values(), values, strict=True):
            slot.__set__(new, value)
        for name, value in changes.items():
            slots[name].__set__(new, value)
        return new


_COPIERS: dict[type, _Copier] = {}
"""The copier of each class ``replaced`` has copied, built once."""


def _slots(cls: type, names: tuple[str, ...]) -> dict[str, Any]:
    """Each field's slot descriptor (``__set__`` writes past a frozen ``__setattr__``),
    from the class that declares it."""
    found: dict[str, Any] = {}
    for name in names:
        owner = next(k for k in cls.__mro__ if name in vars(k))
        found[name] = vars(owner)[name]
    return found
