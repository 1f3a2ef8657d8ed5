"""Which routeplay a peer actor runs, checked before it is first called.

A detached engine store, and the shards of a run joined by name, outlive the process
that started them: after an upgrade on one side, a caller would send its calls to code
that answers them another way (the engine store's reply to an adoption changed shape
between two versions, for one). So each caller asks a peer once, before its first
call, which protocol it speaks, and refuses with ``ProtocolMismatch`` on a difference:
a shard before its first call to an engine store, a client before its first ``free`` or
``get_ref`` there, ``start_engine_store`` when it joins a store, ``StoreConfig(join=True)``
each shard it joins. Another release that speaks the same protocol is accepted.

``PROTOCOL`` names the calls between routeplay's processes (client, shards, engine
stores): bump it whenever one of them changes its arguments, its reply or its meaning.
``tests/unit/test_protocol.py`` pins it to the actors' method signatures and the fields
of the dataclasses they exchange, so a change there fails until it is bumped; a change
in what a reply contains or means, with the same signature, is not seen there: bump it
by hand. A store that was pickled into another process (``StoreConfig`` travels, the
store does not) never asks: it was made by this very process. The question
runs inside the peer (Ray's ``__ray_call__`` with a function sent by value) and answers
from the modules the peer has loaded, so the answer is the code the peer really runs,
even if its routeplay was replaced on disk since; a routeplay from before this module
has none loaded, and an actor of another kind (LMDeploy's own ``SharedStore``) has no
routeplay at all: both are refused, each named for what it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from routeplay import __version__
from routeplay.errors import ProtocolMismatch, describe
from routeplay.store.flow import Flow, awaiting
from routeplay.store.remote import ray_calls

__all__ = [
    "ENGINE_STORE_HINT",
    "PROTOCOL",
    "SHARDS_HINT",
    "ask_engine_stores",
    "ask_peers",
    "check_answer",
]

PROTOCOL: Final = 5
"""The version of the calls between routeplay's processes (see the module docstring)."""

_BEFORE: Final = "before-protocol"  # a routeplay from before this module
_FOREIGN: Final = "no-routeplay"  # an actor that has not loaded routeplay at all

ENGINE_STORE_HINT: Final = (
    "The engine store is detached and outlives upgrades: stop the engine, "
    "ray.kill(ray.get_actor(name, namespace=namespace)), call start_engine_store() from "
    "this routeplay, then start the engine again (the old store's keys go with it). "
    "See docs/engine-store.md."
)
SHARDS_HINT: Final = (
    "The run's shards were started by another routeplay: finish that run with the "
    "routeplay that started it, or start this job under a new run id."
)


def ask_peers(peers: Sequence[tuple[Any, str]], hint: str, timeout_s: float) -> Flow[None]:
    """Ask each ``(actor, where)`` which protocol it speaks, all at once under one
    deadline; raise ``ProtocolMismatch`` (naming the first that differs, with ``hint``)
    unless every one speaks this one's.

    Example:
        asked = [(engine_store, "Ray actor lmdeploy/shared_store")]
        drive(ask_peers(asked, ENGINE_STORE_HINT, timeout_s=60.0), ray_calls.RAY)
    """
    if not peers:
        return
    for actor, where in peers:
        _refuse_other_kinds(actor, where, hint)
    question = _question()
    pending = [actor.__ray_call__.remote(question) for actor, _ in peers]
    what = f"{', '.join(where for _, where in peers)}: protocol"
    answers = yield from awaiting(pending, what, timeout_s=timeout_s)
    for (_, where), answer in zip(peers, answers, strict=True):
        check_answer(answer, where, hint)


def ask_engine_stores(
    wheres: Iterable[tuple[str, str]], timeout_s: float
) -> Flow[dict[tuple[str, str], Any]]:
    """Look up the engine stores ``(name, namespace)`` afresh and ask them all at once;
    their handles once every one speaks this protocol (a caller caches only those: after
    a refusal the user restarts the store, and the next ask must reach the new actor).

    Example:
        handles = drive(ask_engine_stores([("shared_store", "lmdeploy")], 60.0), ray_calls.RAY)
    """
    found = {where: ray_calls.get_actor(*where) for where in sorted(set(wheres))}
    asked = [(engine, ray_calls.actor_where(ns, name)) for (name, ns), engine in found.items()]
    yield from ask_peers(asked, ENGINE_STORE_HINT, timeout_s)
    return found


def check_answer(answer: object, where: str, hint: str) -> None:
    """Raise ``ProtocolMismatch`` unless ``answer`` (a peer's) is ``(PROTOCOL, version)``
    (any version: releases that speak the same protocol work together).

    Example:
        check_answer((PROTOCOL, "0.2.0"), "Ray actor lmdeploy/shared_store", hint)  # passes
    """
    named = isinstance(answer, tuple) and len(answer) == 2 and type(answer[0]) is int
    if named and answer[0] == PROTOCOL:  # type: ignore[index]
        return
    if named:
        found = f"protocol {answer[0]} (routeplay {answer[1]})"  # type: ignore[index]
    elif answer == _BEFORE:
        found = "a routeplay from before protocol versions (no routeplay.store.protocol module)"
    elif answer == _FOREIGN:
        found = "an actor that does not run routeplay (no routeplay module loaded)"
    else:
        found = f"an answer that names no protocol: {describe(answer)}"
    raise ProtocolMismatch(
        "a routeplay actor runs another routeplay than this process",
        where=where,
        expected=f"protocol {PROTOCOL} (routeplay {__version__})",
        found=found,
        hint=hint,
    )


def _refuse_other_kinds(actor: Any, where: str, hint: str) -> None:
    """An actor not of routeplay's classes (LMDeploy's own ``SharedStore`` under the
    engine store's name) is refused from its handle: such a handle, built where its class
    cannot be imported, refuses even the question's arguments."""
    kind = ray_calls.class_of(actor)
    if kind is None or kind.startswith("routeplay."):
        return
    raise ProtocolMismatch(
        "the actor is not one of routeplay's",
        where=where,
        expected=f"a routeplay actor of protocol {PROTOCOL} (routeplay {__version__})",
        found=f"an actor of class {kind}",
        hint=hint,
    )


def _question() -> Callable[[Any], tuple[int, str] | str]:
    """The function the peer runs. Nested, so Ray's pickler sends its code (by value):
    the peer needs no module of ours to run it."""

    before, foreign = _BEFORE, _FOREIGN  # bound here: the function carries their values

    def protocol_of(_actor: Any) -> tuple[int, str] | str:
        import sys  # inside: the function travels alone

        # What the peer has loaded, not what is on its disk now: every routeplay actor
        # loads this module with its class (routeplay.store.remote.actors imports it).
        if "routeplay" not in sys.modules:
            return foreign
        # Protocol 3 moved this module; a protocol-2 peer has it at its old path.
        homes = ("routeplay.store.remote.protocol", "routeplay.store.protocol")
        spoken = next(
            (p for h in homes if (p := getattr(sys.modules.get(h), "PROTOCOL", None)) is not None),
            None,
        )
        version = getattr(sys.modules["routeplay"], "__version__", "unknown")
        return before if spoken is None else (spoken, str(version))

    return protocol_of
