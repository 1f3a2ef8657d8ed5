"""Ending many leases (or sessions) in one step: all of them, then the first failure.

Every container that ends many holders at once (the replay buffer, a training batch,
the trace store, a checkpoint restore that failed halfway) goes through this module, so
the rule is written once: one failed release (a dead shard answering ``RoutesLost``)
never stops the others. Each item is attempted; the caller learns which ones failed
(to keep them, visibly, for a retry or a revoke) and then gets the *first* error raised,
with a one-line summary of the others attached as a note (``__notes__``), bounded in
length whatever the errors say.

Only ``Exception`` is caught: a ``KeyboardInterrupt`` still stops the loop at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["attach_notes", "attempt_each", "first_error", "raise_first", "release_each"]

T = TypeVar("T")

_SHOWN = 5
"""Further errors named in the note (the rest are counted)."""
_CHARS = 200
"""Characters kept of each further error's message."""


def attempt_each(items: Iterable[T], action: Callable[[T], object]) -> list[tuple[T, Exception]]:
    """Run ``action`` on every item, whatever the earlier ones raised; returns the
    ``(item, error)`` of each failure, in order.

    Example:
        >>> attempt_each([1, 0, 2], lambda x: 1 / x)[0][0]
        0
    """
    failures: list[tuple[T, Exception]] = []
    for item in items:
        try:
            action(item)
        except Exception as exc:  # keep going: the rest must still be released
            failures.append((item, exc))
    return failures


def first_error(errors: Sequence[Exception], what: str) -> Exception | None:
    """The first of ``errors`` with the others summarized in a note (None if empty).

    Example:
        >>> err = first_error([KeyError("a"), ValueError("b")], "releasing 2 leases")
        >>> err.__notes__
        ['1 more failure while releasing 2 leases: ValueError: b']
    """
    if not errors:
        return None
    first = errors[0]
    if len(errors) > 1:
        attach_notes(first, errors[1:], what)
    return first


def raise_first(errors: Sequence[Exception], what: str) -> None:
    """Raise ``first_error(errors, what)``; nothing when ``errors`` is empty."""
    error = first_error(errors, what)
    if error is not None:
        raise error


def attach_notes(primary: BaseException, others: Sequence[BaseException], what: str) -> None:
    """Add one bounded note to ``primary`` naming ``others`` (e.g. cleanup failures
    after the error that caused the cleanup)."""
    if not others:
        return
    shown = "; ".join(_describe(exc) for exc in others[:_SHOWN])
    rest = len(others) - _SHOWN
    more = f"; and {rest} more" if rest > 0 else ""
    plural = "failure" if len(others) == 1 else "failures"
    _add_note(primary, f"{len(others)} more {plural} while {what}: {shown}{more}")


def _add_note(exc: BaseException, note: str) -> None:
    # What BaseException.add_note does on 3.11+ (tracebacks print ``__notes__``); done
    # by hand so 3.10 keeps the same attribute.
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        setattr(exc, "__notes__", notes)  # noqa: B010 (mypy: not an attribute on 3.10)
    notes.append(note)


def release_each(items: Iterable[T], release: Callable[[T], object], what: str) -> None:
    """``attempt_each`` then raise ``first_error`` (for callers that keep nothing).

    Example:
        >>> release_each(leases, Lease.release, "closing batch 3")  # doctest: +SKIP
    """
    raise_first([exc for _, exc in attempt_each(items, release)], what)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if len(text) > _CHARS:
        text = text[: _CHARS - 3] + "..."
    return f"{type(exc).__name__}: {text}"
