"""Starting the engine-side store where engines look for it, and refusing impostors.

Start it *before* the engine, on the same Ray cluster: LMDeploy's engine first calls
``ray.get_actor("shared_store", namespace="lmdeploy")`` and only creates its own actor
when that fails, so it finds and uses this one. SGLang setups that keep routing in a
Ray store use the same actor under namespace ``sglang``.

Invariant: ``start_engine_store`` returns only a handle to a live routeplay engine store.
If the name is already held by another actor (LMDeploy's own ``SharedStore``, started
first), it raises ``ForeignEngineStore`` instead of joining it; if the actor's Ray worker
cannot import routeplay, it raises ``RouteplayNotImportable``; if it runs another
routeplay (a detached store outlives upgrades), ``ProtocolMismatch``. The checks are
cheap: the first reads the method names Ray keeps on the handle (no call), the others
are one question (``routeplay.store.remote.protocol``), answered once the actor is up.

``astart_engine_store`` and ``aleave_engine_store`` are the awaitable twins (one flow
each, ``routeplay.store.flow``: awaited on Ray's references, no ``ray.get``), for an
asyncio rollout service that owns the engine store. A start cancelled in flight leaves
a started (detached) actor, as a finished start would: start again to join it.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import ray

from routeplay.core.spec import RouteSpec
from routeplay.errors import (
    ForeignEngineStore,
    RouteplayNotImportable,
    RoutesLost,
    StoreFailure,
    StoreTimeout,
)
from routeplay.store.flow import Flow, adrive, awaiting, drive
from routeplay.store.remote import ray_calls
from routeplay.store.remote.actors import EngineStoreActor, EngineStoreShell
from routeplay.store.remote.protocol import ENGINE_STORE_HINT, ask_peers

__all__ = [
    "LMDEPLOY_NAME",
    "LMDEPLOY_NAMESPACE",
    "SGLANG_NAMESPACE",
    "aleave_engine_store",
    "astart_engine_store",
    "leave_engine_store",
    "start_engine_store",
]

LMDEPLOY_NAME = "shared_store"
LMDEPLOY_NAMESPACE = "lmdeploy"
SGLANG_NAMESPACE = "sglang"

_CONTRACT = tuple(
    name
    for name, _ in inspect.getmembers(EngineStoreShell, inspect.isfunction)
    if not name.startswith("_")
)
"""Methods every routeplay engine store has; LMDeploy's has only put/get (and clear)."""

_IMPORT_HINT = (
    "routeplay must be importable in every process that uses the engine store: the actor's "
    "worker, the engine, and each consumer (Ray rebuilds the actor from its class there). "
    "Install routeplay in that Python environment, or ship it with runtime_env="
    "{'py_modules': [routeplay]}. See docs/engine-store.md."
)


def start_engine_store(
    *,
    name: str = LMDEPLOY_NAME,
    namespace: str = LMDEPLOY_NAMESPACE,
    ttl_s: float | None = 600.0,
    resources: dict[str, float] | None = None,
    runtime_env: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    user: str = "",
    spec: RouteSpec | None = None,
) -> Any:
    """Start (or join) the detached engine store actor, as LMDeploy would create its own.

    ``resources`` pins it (e.g. to the engine's node, so payloads are written there);
    ``runtime_env`` is the actor's Ray runtime environment. Waits up to ``timeout_s`` for
    the actor to answer. ``user`` (a run id) is counted among the shared actor's users,
    so that ``leave_engine_store`` ends it only when its last user leaves. ``spec`` (the
    engine's model) has each payload put from then on validated and narrowed as it
    arrives, on the store's node, off the trainer's step (``routeplay.store.engine.ingest``);
    adopting a key with the same spec then only moves bytes. Raises
    ``ForeignEngineStore`` if another kind of actor holds ``namespace/name``,
    ``RouteplayNotImportable`` if the actor's worker cannot import routeplay,
    ``ProtocolMismatch`` if it runs another routeplay protocol, ``StoreTimeout`` if the
    actor does not come up in time.

    Example:
        >>> store = start_engine_store(ttl_s=600, spec=spec)  # before the LMDeploy server
        >>> key = ray.get(store.put.remote(routing))  # what LMDeploy's engine then does
    """
    flow = _start(name, namespace, ttl_s, resources, runtime_env, timeout_s, user, spec)
    return drive(flow, ray_calls.RAY)


async def astart_engine_store(
    *,
    name: str = LMDEPLOY_NAME,
    namespace: str = LMDEPLOY_NAMESPACE,
    ttl_s: float | None = 600.0,
    resources: dict[str, float] | None = None,
    runtime_env: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    user: str = "",
    spec: RouteSpec | None = None,
) -> Any:
    """Awaitable ``start_engine_store`` (same arguments, same refusals).

    Example:
        >>> store = await astart_engine_store(namespace=SGLANG_NAMESPACE)  # doctest: +SKIP
    """
    flow = _start(name, namespace, ttl_s, resources, runtime_env, timeout_s, user, spec)
    return await adrive(flow, ray_calls.RAY)


def _start(
    name: str,
    namespace: str,
    ttl_s: float | None,
    resources: dict[str, float] | None,
    runtime_env: dict[str, Any] | None,
    timeout_s: float,
    user: str,
    spec: RouteSpec | None,
) -> Flow[Any]:
    where = ray_calls.actor_where(namespace, name)
    actor = EngineStoreActor.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,  # an existing actor of that name is returned, whatever its class
        num_cpus=0,
        resources=resources or {},
        runtime_env=runtime_env,
    ).remote(ttl_s, timeout_s)
    _refuse_foreign(actor, where)
    yield from _wait_until_up(actor, where, timeout_s)
    if user:
        attach = [actor.attach.remote(user)]
        yield from awaiting(attach, f"{where}: attach", timeout_s=timeout_s)
    if spec is not None:
        ingest = [actor.validate_as.remote(spec)]
        yield from awaiting(ingest, f"{where}: validate at ingest", timeout_s=timeout_s)
    return actor


def leave_engine_store(
    actor: Any, user: str, *, end_if_last: bool, timeout_s: float = 60.0
) -> bool:
    """``user`` (a run) is done with the shared engine store; returns whether it ended it.

    One engine store serves every run on the cluster, so a run's teardown never kills it
    while another run still uses it: the actor counts its users (``start_engine_store(
    user=...)``) and is killed here only when ``end_if_last`` (this run created it) and
    no user remains. A store someone else started (``end_if_last=False``) is theirs.

    Example:
        >>> store = start_engine_store(user="run-7")
        >>> leave_engine_store(store, "run-7", end_if_last=True)  # last user: ended
        True
    """
    return drive(_leave(actor, user, end_if_last, timeout_s), ray_calls.RAY)


async def aleave_engine_store(
    actor: Any, user: str, *, end_if_last: bool, timeout_s: float = 60.0
) -> bool:
    """Awaitable ``leave_engine_store``.

    Example:
        >>> await aleave_engine_store(store, "run-7", end_if_last=True)  # doctest: +SKIP
        True
    """
    return await adrive(_leave(actor, user, end_if_last, timeout_s), ray_calls.RAY)


def _leave(actor: Any, user: str, end_if_last: bool, timeout_s: float) -> Flow[bool]:
    detach = [actor.detach.remote(user)]
    [remaining] = yield from awaiting(detach, "engine store: detach", timeout_s=timeout_s)
    if end_if_last and remaining == 0:
        ray.kill(actor)
        return True
    return False


def _refuse_foreign(actor: Any, where: str) -> None:
    """Raise ``ForeignEngineStore`` unless the handle has every method of ours."""
    missing = [method for method in _CONTRACT if not hasattr(actor, method)]
    if not missing:
        return
    raise ForeignEngineStore(
        "another actor already holds the engine store's name",
        where=where,
        expected=f"routeplay's {EngineStoreShell.__module__}.{EngineStoreShell.__qualname__}",
        found=f"{ray_calls.class_of(actor) or 'an actor of another class'} without "
        f"{', '.join(missing)}",
        hint="It is most likely LMDeploy's own SharedStore, started before routeplay's. "
        "Stop the engine, ray.kill(ray.get_actor(name, namespace=namespace)), call "
        "start_engine_store() and then start the engine again.",
    )


def _wait_until_up(actor: Any, where: str, timeout_s: float) -> Flow[None]:
    """One question, which protocol it speaks: the actor exists, runs routeplay's code,
    the same protocol as ours (``ProtocolMismatch``; a detached one may be older), and
    can answer us."""
    try:
        yield from ask_peers([(actor, where)], ENGINE_STORE_HINT, timeout_s)
    except StoreTimeout as exc:
        raise StoreTimeout(
            "the engine store actor did not come up in time",
            where=where,
            expected=f"an answer within {timeout_s}s",
            hint="Are the resources it is pinned to (resources=...) on the cluster?",
        ) from exc.__cause__
    except RoutesLost as exc:  # the actor died: Ray's own error is the cause
        cause = str(exc.__cause__)
        if "failed to import" in cause:  # Ray's words when the actor's class won't load
            raise RouteplayNotImportable(
                "the engine store actor's Ray worker cannot import routeplay",
                where=where,
                found=_import_failure(cause),
                hint=_IMPORT_HINT,
            ) from exc.__cause__
        raise StoreFailure(
            "the engine store actor died while starting",
            where=where,
            found=type(exc.__cause__).__name__,
        ) from exc.__cause__


def _import_failure(message: str) -> str:
    """The ``ModuleNotFoundError: ...`` line of Ray's message, else its first line."""
    found = re.search(r"(?:ModuleNotFoundError|ImportError): [^\n]*", message)
    return found.group(0) if found else message.strip().splitlines()[0][:300]
