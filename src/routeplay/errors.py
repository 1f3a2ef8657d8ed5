"""Every exception routeplay raises, in one tree.

Three families, kept apart so a caller can tell whose fault it was::

    RouteplayError
    ├── MisuseError                  the caller did something the contract forbids
    │   ├── AlreadyReleased          a lease used after its release
    │   ├── AlreadyConsumed          an engine key read a second time
    │   ├── RunMismatch              data of another run resolved or released
    │   ├── HandleError              a handle sliced or stitched out of its rows
    │   ├── ForeignEngineStore       the engine store's actor name is held by another actor
    │   └── RouteplayNotImportable   a Ray process of the engine store cannot import routeplay
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
        └── DuplicateExperts         one (token, layer) row names an expert twice

Every error built by routeplay carries ``expected``, ``found`` and ``where`` so that
a log line alone tells what to fix; ``str(err)`` joins them into one sentence.
"""

from __future__ import annotations

__all__ = [
    "AlreadyConsumed",
    "AlreadyReleased",
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
    "ReleaseFailed",
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
]


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
            parts.append(f"expected {self.expected}")
        if self.found is not None:
            parts.append(f"found {self.found}")
        message = "; ".join(parts)
        return f"{message}. {self.hint}" if self.hint else message


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


class RouteplayNotImportable(MisuseError):
    """A Ray process that must run routeplay's engine store code cannot import routeplay
    (Ray rebuilds an actor, and every handle to it, from the actor's class)."""


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
