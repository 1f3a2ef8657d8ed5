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
import types
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["fast_state", "fields_reduced", "replaced", "restored_fields", "slot_builder"]

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
    found = _slots(cls, names)
    if found is None:
        raise TypeError(f"fast_state needs a slotted dataclass; {cls.__name__} is not")
    values_of = _values_getter(names)

    def __getstate__(self: Any) -> tuple[Any, ...]:  # a function: attrgetter does not bind
        return values_of(self)

    # setattr: mypy cannot see that a class may take these methods after it is made.
    setattr(cls, "__getstate__", __getstate__)  # noqa: B010
    setattr(cls, "__setstate__", _setstate_function(tuple(found.values())))  # noqa: B010
    return cls


def slot_builder(cls: type, names: tuple[str, ...]) -> Callable[..., Any]:
    """``build(*values)``: a new object of ``cls`` with ``names`` set to ``values`` in
    order through their slots, without ``__init__``: nothing is checked, so the caller
    checks what needs checking first (an unpickled segment's rows against its source).
    For a frozen, slotted dataclass rebuilt by the thousand a step; ``TypeError`` unless
    ``names`` are all its fields, each in a slot (no half-built object).

    Example:
        >>> build = slot_builder(Row, ("at", "name"))
        >>> build(3, "a")
        Row(at=3, name='a')
    """
    fields = {field.name for field in dataclasses.fields(cls)}
    found = _slots(cls, names) if set(names) == fields and len(names) == len(fields) else None
    if found is None:
        raise TypeError(
            f"slot_builder needs every field of a slotted dataclass: {cls.__name__} has "
            f"{sorted(fields)}, got {list(names)}"
        )
    values = ", ".join(f"v{at}" for at in range(len(names)))
    lines = [f"def build({values}):", "    new = make(cls)", *_set_lines("new", len(names))]
    scope = {"make": object.__new__, "cls": cls, **_setters(tuple(found.values()))}
    return _compiled([*lines, "    return new"], scope, "build")


def _setstate_function(slots: tuple[Any, ...]) -> Callable[[Any, tuple[Any, ...]], None]:
    """``__setstate__(self, state)`` writing ``state`` through ``slots`` in order (a state
    of another length raises ``ValueError``). Generated: a loop over the slots costs a
    Python call per field, and a trainer rank sets thousands of packed samples' states
    per step."""
    values = ", ".join(f"v{at}" for at in range(len(slots)))
    lines = ["def __setstate__(self, state):", f"    [{values}] = state"]
    return _compiled([*lines, *_set_lines("self", len(slots))], _setters(slots), "__setstate__")


def _set_lines(target: str, count: int) -> list[str]:
    """Source lines writing ``v0``, ``v1``, ... into ``target`` through ``set0``, ..."""
    return [f"    set{at}({target}, v{at})" for at in range(count)]


def _setters(slots: tuple[Any, ...]) -> dict[str, Any]:
    """``set0``, ``set1``, ...: each slot's own setter (it writes past a frozen
    ``__setattr__``, as ``__init__`` does)."""
    return {f"set{at}": slot.__set__ for at, slot in enumerate(slots)}


def _compiled(lines: list[str], scope: dict[str, Any], name: str) -> Callable[..., Any]:
    """The function ``name`` defined by ``lines`` in ``scope``. Generated, as
    ``dataclasses`` generates ``__init__``: the templates hold numbered names and
    dataclass field names (identifiers, which ``dataclasses`` checks) only."""
    exec("\n".join(lines), scope)
    compiled: Callable[..., Any] = scope[name]
    return compiled


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
    if cls in _COPIERS:
        copier = _COPIERS[cls]
    else:
        copier = _COPIERS[cls] = _Copier.of(cls)
    if copier is None:  # checks to run, or fields outside slots: the standard way
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    return copier.copy(obj, changes)  # type: ignore[no-any-return]


class _Copier:
    """Copies objects of one frozen, slotted dataclass with one generated function per
    class: each field read by attribute and written through its slot (no frozen
    ``__setattr__``), the changed ones taken from ``changes``. Generated, as
    ``dataclasses`` generates ``__init__``: a loop over the slots costs a Python call per
    field, 1.7x as long for a ``SampleRouting`` (``benchmarks/record_copies.py``), copied
    at each of a step's lease hand-offs, a thousand a step."""

    __slots__ = ("_cls", "_copy", "_names")

    def __init__(self, cls: type, names: tuple[str, ...], slots: dict[str, Any]) -> None:
        self._cls = cls
        self._names = frozenset(names)
        self._copy = _copy_function(cls, names, slots)

    @classmethod
    def of(cls, target: type) -> _Copier | None:
        """The copier of ``target``, or None where ``dataclasses.replace`` must copy: a
        ``__post_init__`` to run, or a field not held in a slot (a subclass without
        ``slots=True`` keeps its fields in a ``__dict__``)."""
        if hasattr(target, "__post_init__"):
            return None
        names = tuple(f.name for f in dataclasses.fields(target))
        slots = _slots(target, names)
        return None if slots is None or not names else cls(target, names, slots)

    def copy(self, obj: Any, changes: dict[str, Any]) -> Any:
        if not self._names.issuperset(changes):
            unknown = sorted(set(changes) - self._names)
            raise TypeError(f"{self._cls.__name__} has no fields {unknown}")
        return self._copy(obj, changes)


def _copy_function(
    cls: type, names: tuple[str, ...], slots: dict[str, Any]
) -> Callable[[Any, dict[str, Any]], Any]:
    """``copy(obj, changes)`` for ``cls``: a new object, each field from ``changes`` or
    else from ``obj``."""
    lines = ["def copy(obj, changes):", "    new = make(cls)"]
    lines += [
        f"    set{at}(new, changes[{name!r}] if {name!r} in changes else obj.{name})"
        for at, name in enumerate(names)
    ]
    scope = {"make": object.__new__, "cls": cls, **_setters(tuple(slots.values()))}
    return _compiled([*lines, "    return new"], scope, "copy")


def _values_getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """A function giving an object's ``names`` values as a tuple: one C call
    (``operator.attrgetter``) for two or more, which returns a bare value for one."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    return lambda obj: tuple([getattr(obj, name) for name in names])


_COPIERS: dict[type, _Copier | None] = {}
"""The copier of each class ``replaced`` has copied (None: it copies the standard way)."""


def _slots(cls: type, names: tuple[str, ...]) -> dict[str, Any] | None:
    """Each field's slot descriptor (``__set__`` writes past a frozen ``__setattr__``),
    the first the class's MRO defines; None when a field has none (it lives in a
    ``__dict__``, or a class attribute, such as its default, shadows the slot)."""
    found: dict[str, Any] = {}
    for name in names:
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        slot = None if owner is None else vars(owner)[name]
        if not isinstance(slot, types.MemberDescriptorType):
            return None
        found[name] = slot
    return found


def fields_reduced(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """A dataclass object's ``__reduce__`` by every field its class has, slotted or not:
    what a class with a faster pickled form of its own falls back to for a subclass,
    which may add fields.

    Example:
        >>> build, args = fields_reduced(Row(3, "a"))
        >>> build(*args)
        Row(at=3, name='a')
    """
    names = tuple(f.name for f in dataclasses.fields(obj))
    return (restored_fields, (type(obj), names, tuple(getattr(obj, n) for n in names)))


def restored_fields(cls: type, names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    """An object of ``cls`` with each named field set, without ``__init__`` (frozen or
    not, slotted or not): ``fields_reduced``'s constructor, and any pickled form's.

    Example:
        >>> restored_fields(Row, ("at", "name"), (3, "a"))
        Row(at=3, name='a')
    """
    restored: Any = object.__new__(cls)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(restored, name, value)
    return restored
