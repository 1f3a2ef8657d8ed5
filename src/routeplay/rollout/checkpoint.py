"""Replay-buffer checkpoints: routing saved by value, leases recreated on load.

A checkpoint is a folder with ``buffer.json`` (samples, tokens, statuses, and each
routing handle's segments as ``[rows, weight_version]``) and ``routing.npz`` (one
canonical array per sample). References to the object store are never saved: they
would not survive the process, and pickled refs have no owner. ``np.load`` runs with
``allow_pickle=False`` and every array is validated again on load (a checkpoint is
outside data). Loading puts each array into the store once and the buffer leases it;
queued retries come back without routing (they regenerate). A load that fails halfway
releases whatever it leased and drops whatever it stored, every step attempted, the
cleanup's own failures attached as notes to the error that stopped the load.

Format versions: 2 (current) records ``origin``, ``retries``, ``routing_kind`` and
per-segment weight versions; 1 (older) had none of them and still loads, with routing
marked ``RESTORED``, one weight version per sample, and retries 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from routeplay.core.handle import Handle, Segment
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize
from routeplay.errors import MalformedPayload
from routeplay.rollout.buffer import BufferConfig, ReplayBuffer
from routeplay.rollout.releasing import attach_notes, attempt_each
from routeplay.rollout.state import Origin, RolloutState, RoutingKind, Status

if TYPE_CHECKING:  # the client loads Ray; a restore only calls it
    from routeplay.store.client import RouteStore

__all__ = ["FORMAT", "VERSION", "load_buffer", "save_buffer"]

FORMAT = "routeplay.replay_buffer"
VERSION = 2


def save_buffer(buffer: ReplayBuffer, folder: Path, spec: RouteSpec) -> None:
    """Write every waiting group and queued retry, routing by value."""
    folder.mkdir(parents=True, exist_ok=True)
    waiting = buffer.groups()
    states = [s for g in waiting for s in g.states] + list(buffer.pending_retries())
    routed = [(s, s.routing) for s in states if s.routing is not None]
    # One batched read for the whole buffer: one metadata call per shard, each block once.
    rows = buffer.store.read_many([(handle, 0, handle.rows) for _, handle in routed])
    names = {id(s): f"r{i}" for i, (s, _) in enumerate(routed)}  # by identity: ids may repeat
    arrays = {names[id(s)]: array for (s, _), array in zip(routed, rows, strict=True)}
    groups = [
        {"group_id": g.group_id, "states": [_state_record(s, names) for s in g.states]}
        for g in waiting
    ]
    retries = [_state_record(s, names) for s in buffer.pending_retries()]
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "spec": _spec_record(spec),
        "groups": groups,
        "retries": retries,
    }
    save: Any = np.savez  # its stub types **arrays as the allow_pickle flag
    save(folder / "routing.npz", allow_pickle=False, **arrays)
    (folder / "buffer.json").write_text(json.dumps(meta), encoding="utf-8")


def load_buffer(folder: Path, store: RouteStore, config: BufferConfig) -> ReplayBuffer:
    """A buffer holding the checkpoint's groups, its routing stored anew and leased."""
    meta = json.loads((folder / "buffer.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT or meta.get("version") not in (1, 2):
        raise MalformedPayload(
            "not a routeplay replay-buffer checkpoint",
            expected=f"format {FORMAT}, version 1 or 2",
            found=f"format {meta.get('format')}, version {meta.get('version')}",
            where=str(folder),
        )
    spec = _spec_from_record(meta["spec"])
    buffer = config.build(store)
    pending: list[RolloutState] = []  # stored, not yet owned by the buffer
    try:
        with np.load(folder / "routing.npz", allow_pickle=False) as arrays:
            for group in meta["groups"]:
                for record in group["states"]:
                    pending.append(_restore(record, spec, store, arrays))
                buffer.add(group["group_id"], pending)
                pending = []
            # Queued retries regenerate: their old routing is neither stored nor kept.
            retries = [_restore(record, spec, None, arrays) for record in meta.get("retries", [])]
    except BaseException as exc:  # a half-loaded checkpoint leaves no lease, no payload
        cleanup = [e for _, e in attempt_each([buffer], ReplayBuffer.close)]
        cleanup += [e for _, e in attempt_each(pending, lambda state: _drop(store, state))]
        attach_notes(exc, cleanup, f"cleaning up the checkpoint {folder} that failed to load")
        raise
    buffer.requeue(retries)
    return buffer


def _drop(store: RouteStore, state: RolloutState) -> None:
    """A payload stored for a state nobody will own: one lease and its release drop it."""
    if state.routing is not None and state.routing.rows:
        store.acquire(state.routing, "checkpoint/discard").release()


def _state_record(state: RolloutState, names: dict[int, str]) -> dict[str, Any]:
    routing = None
    if state.routing is not None:
        segments = [[seg.rows, seg.weight_version] for seg in state.routing.segments]
        routing = {"array": names[id(state)], "segments": segments}
    return {
        "sample_id": state.sample_id,
        "group_id": state.group_id,
        "session_id": state.session_id,
        "prompt_ids": list(state.prompt_ids),
        "response_ids": list(state.response_ids),
        "logprobs": list(state.logprobs),
        "weight_versions": list(state.weight_versions),
        "status": state.status.value,
        "finish_reason": state.finish_reason,
        "routing_kind": state.routing_kind.value,
        "origin": state.origin.value,
        "retries": state.retries,
        "routing": routing,
    }


def _restore(
    record: dict[str, Any], spec: RouteSpec, store: RouteStore | None, arrays: Any
) -> RolloutState:
    """A state from its record; its routing stored anew (not at all without ``store``)."""
    routing = record.get("routing")
    handle = None
    if routing is not None and store is not None:
        where = f"checkpoint sample {record['sample_id']}"
        routes = canonicalize(arrays[routing["array"]], spec, where=where)
        stored = store.put(routes)
        handle = _with_versions(stored, spec, _segments(routing, record))
    kind = record.get("routing_kind", RoutingKind.MOE.value)
    return RolloutState(
        sample_id=record["sample_id"],
        group_id=record["group_id"],
        session_id=record.get("session_id"),
        prompt_ids=tuple(record["prompt_ids"]),
        response_ids=tuple(record["response_ids"]),
        logprobs=tuple(record["logprobs"]),
        weight_versions=tuple(record["weight_versions"]),
        status=Status(record["status"]),
        finish_reason=record.get("finish_reason"),
        routing_kind=RoutingKind(kind),
        routing=handle,
        origin=Origin.RESTORED if handle is not None else Origin.NONE,
        retries=int(record.get("retries", 0)),
    )


def _segments(routing: dict[str, Any], record: dict[str, Any]) -> list[tuple[int, int]]:
    if "segments" in routing:  # version 2
        return [(int(rows), int(version)) for rows, version in routing["segments"]]
    versions = record.get("weight_versions") or [0]  # version 1: one version for the sample
    return [(-1, int(routing.get("weight_version", min(versions))))]


def _with_versions(stored: Handle, spec: RouteSpec, segments: list[tuple[int, int]]) -> Handle:
    """The stored payload, cut back into the recorded (rows, weight version) segments."""
    if not stored.segments:  # a sample with no routing rows yet
        return stored
    source = stored.segments[0].source
    parts, start = [], 0
    for rows, version in segments:
        stop = stored.rows if rows < 0 else start + rows
        parts.append(
            Segment(source=source, start=start, stop=stop, spec=spec, weight_version=version)
        )
        start = stop
    return Handle(spec, parts)


def _spec_from_record(record: dict[str, Any]) -> RouteSpec:
    layer_map = record.get("layer_map")
    return RouteSpec(
        num_layers=int(record["num_layers"]),
        top_k=int(record["top_k"]),
        num_experts=int(record["num_experts"]),
        layer_map=tuple(int(i) for i in layer_map) if layer_map else None,
        total_layers=record.get("total_layers"),
        name=str(record.get("name", "")),
    )


def _spec_record(spec: RouteSpec) -> dict[str, Any]:
    return {
        "num_layers": spec.num_layers,
        "top_k": spec.top_k,
        "num_experts": spec.num_experts,
        "layer_map": list(spec.layer_map) if spec.layer_map else None,
        "total_layers": spec.total_layers,
        "name": spec.name,
    }
