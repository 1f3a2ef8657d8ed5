"""Every exception routeplay raises, in one tree.

Three families, kept apart so a caller can tell whose fault it was::

    RouteplayError
    ├── MisuseError                  the caller did something the contract forbids
    │   ├── AlreadyReleased          a lease used after its release
    │   ├── AlreadyConsumed          an engine key read a second time
    │   ├── RunMismatch              data of another run resolved or released
    │   ├── HandleError              a handle sliced or stitched out of its rows
    │   ├── ForeignEngineStore       the engine store's actor name is held by another actor
    │   ├── ProtocolMismatch         a routeplay actor called runs another routeplay protocol
    │   ├── RouteplayNotImportable   a Ray process of the engine store cannot import routeplay
    │   └── ReplayNotApplied         a router did not use the experts it was made to replay
    ├── LifetimeError                something happened to data the caller held
    │   ├── RoutesLost               the owner died or the object is gone
    │   ├── RoutesExpired            a TTL ran out before anyone claimed the data
    │   │   └── KeyExpired           ... an engine key (a KeyError too, for LMDeploy clients)
    │   ├── EngineUnavailable        the inference engine failed or did not answer
    │   ├── StoreTimeout             a remote call did not answer in time
    │   ├── StoreFailure             a store actor failed in an unexpected way
    │   └── ReleaseFailed            a release sent earlier failed (raised at the next call)
    └── RoutesDataError (ValueError) the bytes an engine sent are not valid routing
        ├── MalformedPayload         undecodable: bad base64, bad npy, ragged lists
        │   └── UnsafePayload        pickle or object arrays: refused, never executed
        ├── DtypeError               the element type cannot carry expert ids
        ├── SpecMismatch             layers or top_k differ from the model's RouteSpec
        ├── RowCountMismatch         rows differ from prompt + completion - 1 - start
        ├── ExpertOutOfRange         an id is negative or >= num_experts
        ├── DuplicateExperts         one (token, layer) row names an expert twice
        └── DegenerateRouting        rows an engine bug produced (fill rows, a frozen layer)

Every error built by routeplay carries ``expected``, ``found`` and ``where`` so that
a log line alone tells what to fix; ``str(err)`` joins them into one sentence.
Messages show values through ``describe``: bounded in length and depth, never recursive,
so a hostile value (a 4 MB string, JSON nested 100,000 deep, a 10,000-digit integer) can
neither blow up nor break the error that reports it.
"""

from __future__ import annotations

from enum import Enum
from pathlib import PurePath

__all__ = [
    "AlreadyConsumed",
    "AlreadyReleased",
    "DegenerateRouting",
    "DtypeError",
    "DuplicateExperts",
    "EngineStoreLost",
    "EngineUnavailable",
    "ExpertOutOfRange",
    "ForeignEngineStore",
    "HandleError",
    "KeyExpired",
    "LifetimeError",
    "MalformedPayload",
    "MisuseError",
    "ProtocolMismatch",
    "ReleaseFailed",
    "ReplayNotApplied",
    "RouteplayError",
    "RouteplayNotImportable",
    "RoutesDataError",
    "RoutesExpired",
    "RoutesLost",
    "RowCountMismatch",
    "RunMismatch",
    "SpecMismatch",
    "StoreFailure",
    "StoreTimeout",
    "UnsafePayload",
    "describe",
]

_TEXT_CHARS = 160
"""Characters of a string (or a str() of a scalar) a message shows."""
_ITEMS = 8
"""Elements of a list or entries of a dict a message shows."""
_DEPTH = 3
"""Nesting levels a message descends into."""
_BUDGET = 400
"""Characters of one described value, at most."""


def describe(value: object) -> str:
    """A short, bounded description of ``value`` for an error message.

    Strings are cut after a few dozen characters, containers after a few items and a few
    levels (with their true length), integers too long to print show their digit count.
    The walk is iterative, touches at most a few dozen nodes and never calls ``repr`` or
    ``str`` on a container, so it cannot recurse or allocate in proportion to ``value``.

    Example:
        >>> describe([1, "x" * 1000, {"a": [[[[1]]]]}])[:40]
        "list of 3: [1, 'xxxxxxxxxxxxxxxxxxxxxxxx"
    """
    parts: list[str] = []
    # An explicit stack of (value, depth) or literal text to emit: no recursion.
    stack: list[tuple[object, int] | str] = [(value, 0)]
    size = 0
    while stack and size < _BUDGET:
        top = stack.pop()
        if isinstance(top, str):
            parts.append(top)
            size += len(top)
            continue
        node, depth = top
        text = _scalar(node)
        if text is None:
            text = _container(node, depth, stack)
        parts.append(text)
        size += len(text)
    shown = "".join(parts)
    if stack or len(shown) > _BUDGET:
        shown = shown[:_BUDGET] + "..."
    return shown


def _scalar(node: object) -> str | None:
    if node is None or isinstance(node, (bool, float)):
        return str(node)
    if isinstance(node, int):
        digits = node.bit_length() * 30103 // 100000 + 1  # log10(2): no str() of huge ints
        return str(node) if digits < 40 else f"<int of about {digits} digits>"
    if isinstance(node, str):
        cut = node[:_TEXT_CHARS]
        more = f"... ({len(node)} chars)" if len(node) > _TEXT_CHARS else ""
        return repr(cut) + more
    if isinstance(node, (bytes, bytearray, memoryview)):
        raw = bytes(node[: _TEXT_CHARS // 4])
        return repr(raw) + (f"... ({len(node)} bytes)" if len(node) > len(raw) else "")
    if isinstance(node, (list, tuple, dict)) or hasattr(node, "__dataclass_fields__"):
        return None
    shape = getattr(node, "shape", None)
    dtype = getattr(node, "dtype", None)
    if shape == () and dtype is not None:  # a numpy scalar
        return str(node)[:_TEXT_CHARS]
    if isinstance(shape, tuple) and dtype is not None:  # an array: never its elements
        return f"<{type(node).__name__} shape {list(shape)} dtype {dtype}>"[:_TEXT_CHARS]
    if isinstance(node, (PurePath, Enum)):
        return str(node)[:_TEXT_CHARS]
    return f"<{type(node).__name__}>"


def _container(node: object, depth: int, stack: list[tuple[object, int] | str]) -> str:
    if isinstance(node, dict):
        entries: list[object] = list(_head(node.items()))
        opening, closing = "{", "}"
    elif not isinstance(node, (list, tuple)):  # a dataclass: its fields, by name
        names = list(node.__dataclass_fields__)  # type: ignore[attr-defined]
        node = {name: getattr(node, name, None) for name in names[:_ITEMS]}
        entries = list(node.items())
        opening, closing = "(", ")"
    else:
        assert isinstance(node, (list, tuple))
        entries = list(node[:_ITEMS])
        opening, closing = ("[", "]") if isinstance(node, list) else ("(", ")")
    cut = len(node) > len(entries)
    label = f"{type(node).__name__} of {len(node)}: " if depth == 0 and cut else ""
    if depth >= _DEPTH:
        return f"{opening}...{len(node)} items{closing}"
    pending: list[tuple[object, int] | str] = []
    for index, entry in enumerate(entries):
        if index:
            pending.append(", ")
        if isinstance(node, dict):
            assert isinstance(entry, tuple)  # dict items
            key: object = entry[0]
            entry_value: object = entry[1]
            pending.extend([(key, depth + 1), ": ", (entry_value, depth + 1)])
        else:
            pending.append((entry, depth + 1))
    if cut:
        pending.append(", ...")
    pending.append(closing)
    stack.extend(reversed(pending))
    return label + opening


def _head(items: object) -> list[object]:
    head: list[object] = []
    for entry in items:  # type: ignore[attr-defined]
        if len(head) == _ITEMS:
            break
        head.append(entry)
    return head


class RouteplayError(Exception):
    """Root of the tree: ``except RouteplayError`` catches everything of ours."""

    def __init__(
        self,
        summary: str,
        *,
        expected: object = None,
        found: object = None,
        where: str = "",
        hint: str = "",
    ) -> None:
        self.summary = summary
        self.expected = expected
        self.found = found
        self.where = where
        self.hint = hint
        super().__init__(self._compose())

    def _compose(self) -> str:
        parts = [self.summary]
        if self.where:
            parts.append(f"at {self.where}")
        if self.expected is not None:
            parts.append(f"expected {_shown(self.expected)}")
        if self.found is not None:
            parts.append(f"found {_shown(self.found)}")
        message = "; ".join(parts)
        return f"{message}. {self.hint}" if self.hint else message


def _shown(value: object) -> str:
    # Our own text (built by routeplay) reads better unquoted; anything else is bounded.
    if isinstance(value, str) and len(value) <= _BUDGET:
        return value
    return describe(value)


class MisuseError(RouteplayError):
    """The caller broke the contract; retrying the same call will fail again."""


class AlreadyReleased(MisuseError):
    """A lease was used after it was released (releasing again is fine: it is idempotent)."""


class AlreadyConsumed(MisuseError, KeyError):
    """An engine key is single-use and was already consumed (a KeyError, as LMDeploy's is)."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""  # KeyError would quote the message


class RunMismatch(MisuseError):
    """The data belongs to another run; runs never touch each other's payloads."""


class HandleError(MisuseError):
    """A handle was sliced, appended or stitched outside the rows it covers."""


class ForeignEngineStore(MisuseError):
    """An actor of another class (e.g. LMDeploy's own ``SharedStore``) holds the name the
    engine store is started under; joining it would fail at the first routeplay call."""


class ProtocolMismatch(MisuseError):
    """A routeplay actor this process calls (a detached engine store, a joined run's
    shards) runs a routeplay whose calls differ from this one's: it outlived an upgrade
    on one side. Calling it would misread its answers, so nothing is called."""


class RouteplayNotImportable(MisuseError):
    """A Ray process that must run routeplay's engine store code cannot import routeplay
    (Ray rebuilds an actor, and every handle to it, from the actor's class)."""


class ReplayNotApplied(MisuseError):
    """A replay did not happen: a router ran on its own choice (a patched or foreign
    ``RouterReplay``, a MoE block that bypasses or overrides its router), or no router
    used the replayed routes at all. Training on would silently train without R3."""


class LifetimeError(RouteplayError):
    """The data the caller referred to no longer exists or cannot be reached."""


class RoutesLost(LifetimeError):
    """The object store lost the payload (owner process died, node lost)."""


class EngineStoreLost(RoutesLost):
    """The engine-side store actor is gone: its unconsumed keys and payloads with it."""


class RoutesExpired(LifetimeError):
    """Nobody leased the payload before its TTL ran out, so it was dropped."""


class KeyExpired(RoutesExpired, KeyError):
    """An engine-store key expired unconsumed (a KeyError, as LMDeploy clients expect)."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class StoreTimeout(LifetimeError):
    """A remote call did not answer within its timeout."""


class EngineUnavailable(LifetimeError):
    """The inference engine refused, failed or could not be reached (HTTP error, timeout)."""


class StoreFailure(LifetimeError):
    """A store actor raised something that is not one of ours (a bug or a crash)."""


class ReleaseFailed(LifetimeError):
    """A lease release sent without waiting failed at its shard; raised at the client's
    next call (or ``flush``), so it is never lost. The lease may still be held."""


class RoutesDataError(RouteplayError, ValueError):
    """The routing an engine sent is not valid for the model; the sample is set aside."""


class MalformedPayload(RoutesDataError):
    """The bytes cannot be decoded in the declared format."""


class UnsafePayload(MalformedPayload):
    """The payload asks to be unpickled; it is refused without executing anything."""


class DtypeError(RoutesDataError):
    """The element type is not an integer type able to hold every expert id."""


class SpecMismatch(RoutesDataError):
    """The array's layers or top_k (or a segment's spec) differ from the expected spec."""


class RowCountMismatch(RoutesDataError):
    """The number of token rows disagrees with the token counts of the sample."""


class ExpertOutOfRange(RoutesDataError):
    """An expert id is negative or not below the model's number of experts."""


class DuplicateExperts(RoutesDataError):
    """A (token, layer) row names the same expert twice: zero padding or an engine bug."""


class DegenerateRouting(RoutesDataError):
    """Rows an engine bug produced, not routing: fill rows (every id of a token the same
    value, e.g. a zero-filled capture of a top-1 model) or a layer frozen on one expert
    set over a whole sample (a capture buffer that was never written)."""
