"""Multi-turn bytes: what a long session and a resumed rollout keep stored, per unique row.

Two workloads on every wire (``SESSION_WIRES``: vLLM with ``routed_experts_prompt_start``,
SGLang with ``routed_experts_start_len``, LMDeploy keys adopted from the history's end),
run by ``routeplay.bench.session_roles``' rollout worker through routeplay's lifecycle:

- **session**: one agentic session of ``SessionShape.path_turns`` turns or more, a trunk
  and two branches continuing its last turn (the trunk is their shared prefix), every
  turn stored in a trace-store actor;
- **partial**: one sample interrupted and resumed ``pieces - 1`` times, its own routing
  the history of each resume, the weights a version newer at each.

Each is measured before and after its compaction (the trace store's ``compact``; the
sample's ``RouteStore.compact``). *Unique rows* are the distinct routing rows the
workload has (a row of the shared trunk once); *bytes stored* are measured, never
derived: ``stored`` from the route store's own accounting (``stats().live_bytes``:
canonical payload bytes) and ``object_store`` from Ray's raylets (bytes in use on every
node: Ray's per-object headers included). Both are deltas from a settled baseline and
divided by the unique rows' canonical bytes, so 1.0 is every row stored once, compactly.

Also measured: every write while the turns ran (Ray's created bytes, all nodes) and the
part of it beyond what the route store keeps (``engine_side``: on the LMDeploy key path,
the engine's own ``shared_store`` copy of every row of every turn's whole context, as
uint16 over every decoder layer; routeplay stores only the new rows, but the engine
wrote them all), the compaction's cost (wall time, rows copied, bytes written), the
segments and stored payloads before and after, whether every row read back exactly (at
its weight version), and what was left once the workload released its leases.

Example:
    figures = session_bytes(store, SessionShape())
    figures["wires"]["vllm"]["session"]["after"]["object_store_per_unique_row"]  # ~1.0
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ray

from routeplay.bench.session_roles import SESSION_WIRES, SessionEngine, SessionWorker
from routeplay.bench.workloads import SessionShape
from routeplay.core import preset
from routeplay.rollout.session_compaction import CompactionPolicy
from routeplay.rollout.trace_actor import TraceStoreActor, TraceStoreClient, TraceStoreConfig
from routeplay.store import RouteStore
from routeplay.store.remote.accounting import node_store_stats

__all__ = ["session_bytes"]

_DEADLINE_S = 600.0
"""Deadline of every blocking Ray call here: a hung actor fails the run, never hangs it."""

_POLICY = CompactionPolicy(auto=False)
"""Compaction on request only, so "before" is measured before any compaction."""


def session_bytes(
    store: RouteStore, shape: SessionShape, *, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Both workloads on every wire; the ``sessions`` figures of ``routeplay bench``."""
    actor = TraceStoreActor.options(num_cpus=0, resources={"rollout": 0.01}).remote(store, _POLICY)
    traces = TraceStoreClient(actor=actor, config=TraceStoreConfig(timeout_s=_DEADLINE_S))
    engine = SessionEngine.options(resources={"engine": 0.01}).remote(preset(shape.model))
    worker = SessionWorker.options(resources={"rollout": 0.01}).remote(store, traces, engine, shape)
    wires: dict[str, Any] = {}
    base = _settled(store, None)  # Ray holds nothing beyond the store's payloads
    try:
        for wire in SESSION_WIRES:
            progress(f"multi-turn bytes: {wire}")
            steps = {"session": _session_steps(worker, traces, wire)}
            steps["partial"] = _partial_steps(worker, wire)
            wires[wire] = {}
            for kind, workload in steps.items():
                wires[wire][kind], base = _measure(store, shape, workload, base)
    finally:
        for handle in (worker, engine, actor):
            ray.kill(handle)
    return {"shape": asdict(shape), "wires": wires}


@dataclass(frozen=True, slots=True, kw_only=True)
class _Steps:
    """One workload's calls, each blocking until done."""

    run: Callable[[], dict[str, Any]]
    """Every turn (or piece); returns ``turns`` and ``unique_rows``."""
    layout: Callable[[], dict[str, Any]]
    """``segments`` (of the longest handle) and stored ``payloads``."""
    compact: Callable[[], dict[str, Any]]
    """The compaction; returns ``rows_copied`` and ``payloads_written``."""
    check: Callable[[], bool]
    """True when every row reads back exactly, at its weight version."""
    end: Callable[[], object]
    """Release what the workload holds."""


def _call(method: Any, *args: Any) -> Any:
    return ray.get(method.remote(*args), timeout=_DEADLINE_S)


def _session_steps(worker: Any, traces: TraceStoreClient, wire: str) -> _Steps:
    session = f"bench/{wire}"

    def compact() -> dict[str, Any]:
        report = traces.compact(session)
        assert report is not None  # the session exists: its turns were just stored
        return {"rows_copied": report.rows_copied, "payloads_written": report.payloads_written}

    return _Steps(
        run=lambda: _call(worker.converse, wire, session),
        layout=lambda: _call(worker.session_layout, session),
        compact=compact,
        check=lambda: _call(worker.check_session, session),
        end=lambda: _call(worker.end_session, session),
    )


def _partial_steps(worker: Any, wire: str) -> _Steps:
    return _Steps(
        run=lambda: _call(worker.resume_rollout, wire, f"bench/{wire}/partial"),
        layout=lambda: _call(worker.partial_layout),
        compact=lambda: _call(worker.compact_partial),
        check=lambda: _call(worker.check_partial),
        end=lambda: _call(worker.end_partial),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Snapshot:
    """What is stored now: the route store's payload bytes, Ray's bytes in use and
    Ray's bytes ever created (all nodes)."""

    stored: int
    used: int
    created: int


HEADERS = 1.02
"""Ray's per-object headers: at most 2% on top of a payload (turns of a few hundred
rows and more; Ray keeps objects under 100 KiB out of the object store altogether)."""


def _settled(store: RouteStore, base: _Snapshot | None, *, timeout_s: float = 10.0) -> _Snapshot:
    """A snapshot once releases have landed and Ray's frees (asynchronous: up to a second
    and more for a consumed engine key) are done: when Ray's bytes in use beyond ``base``
    are at most the route store's payloads beyond it, headers included, or after
    ``timeout_s``. Either way it reads what is there: more than that is reported."""
    store.flush()
    deadline = time.monotonic() + timeout_s
    while True:
        stored = store.stats().live_bytes
        nodes = node_store_stats().values()
        used, created = sum(n.used_bytes for n in nodes), sum(n.created_bytes for n in nodes)
        now = _Snapshot(stored=stored, used=used, created=created)
        extra = (used - base.used, stored - base.stored) if base else (used, stored)
        if extra[0] <= extra[1] * HEADERS or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def _measure(
    store: RouteStore, shape: SessionShape, steps: _Steps, base: _Snapshot
) -> tuple[dict[str, Any], _Snapshot]:
    """One workload from a settled ``base``: turns, before, compaction, after, check,
    release; returns its figures and the settled end (the next workload's base)."""
    ran = steps.run()
    before = _settled(store, base)
    layout_before = steps.layout()
    start = time.perf_counter()
    compacted = steps.compact()
    compact_ms = (time.perf_counter() - start) * 1e3
    after = _settled(store, base)
    layout_after = steps.layout()
    exact = steps.check()
    steps.end()
    end = _settled(store, base)
    unique = int(ran["unique_rows"]) * preset(shape.model).nbytes(1)

    def per_row(n: int) -> float:
        return round(n / unique, 4)

    def stored(now: _Snapshot, layout: dict[str, Any]) -> dict[str, Any]:
        return {
            "stored_per_unique_row": per_row(now.stored - base.stored),
            "object_store_per_unique_row": per_row(now.used - base.used),
            **layout,
        }

    figures = {
        "turns": ran["turns"],
        "unique_rows": ran["unique_rows"],
        "unique_bytes": unique,
        "before": stored(before, layout_before),
        "after": stored(after, layout_after),
        "written_per_unique_row": per_row(before.created - base.created),
        "engine_side_per_unique_row": per_row(
            before.created - base.created - (before.stored - base.stored)
        ),
        "compaction": {
            "ms": round(compact_ms, 1),
            "rows_copied_per_unique_row": round(compacted["rows_copied"] / ran["unique_rows"], 4),
            "written_per_unique_row": per_row(after.created - before.created),
            "payloads_written": compacted["payloads_written"],
        },
        "rows_exact": exact,
        "left_after_release": {
            "stored": end.stored - base.stored,
            "object_store": end.used - base.used,
        },
    }
    return figures, end
