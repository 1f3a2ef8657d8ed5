"""Replay-buffer checkpoints: routing saved by value, leases recreated on load.

A checkpoint is a folder with ``buffer.json`` (samples, tokens, statuses, and each
routing handle's segments as ``[rows, weight_version]``) and ``routing.npz`` (one
canonical array per sample). References to the object store are never saved: they
would not survive the process, and pickled refs have no owner. ``np.load`` runs with
``allow_pickle=False`` and every array is validated again on load (a checkpoint is
outside data). Loading puts each array into the store once, leases it for its sample
(``RoutingRecord.restore``) and the buffer takes it over; queued retries come back
without routing (they regenerate). A load that fails halfway releases whatever it
leased, every step attempted, the cleanup's own failures attached as notes to the error
that stopped the load.

Any ``RoutedSample`` can be checkpointed: the routing part of each record is its
``SampleRouting`` (``sample_id``, ``session_id``, ``origin``, ``retries``, the routing's
array and segments), the rest is the sample's own, written and read by a
``SampleCodec`` (``codec=``; routeplay's own ``RolloutState``'s, ``ROLLOUT_STATE_CODEC``,
by default).
A single sample's routing is recorded and restored with ``RoutingRecord.of`` /
``RoutingRecord.restore`` (``record_routings`` for many with one read).

Format versions: 2 (current) records ``origin``, ``retries``, ``routing_kind`` and
per-segment weight versions; 1 (older) had none of them and still loads, with routing
marked ``RESTORED``, one weight version per sample, and retries 0.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from routeplay.core.handle import Handle, Segment
from routeplay.core.spec import RouteSpec
from routeplay.core.validate import canonicalize
from routeplay.errors import HandleError, MalformedPayload, RouteplayError
from routeplay.rollout.buffer import BufferConfig, ReplayBuffer, release_samples
from routeplay.rollout.releasing import attach_notes, attempt_each
from routeplay.rollout.routing_terms import Origin, RoutesPutter, RowReader, sample_holder
from routeplay.rollout.sample_routing import RoutedSample, SampleRouting
from routeplay.rollout.state import ROLLOUT_STATE_CODEC

if TYPE_CHECKING:  # the client loads Ray; a restore only calls it
    from routeplay.store.client.route_store import RouteStore

__all__ = [
    "FORMAT",
    "VERSION",
    "RoutingRecord",
    "SampleCodec",
    "cut_segments",
    "load_buffer",
    "record_routings",
    "record_sample",
    "restore_sample",
    "save_buffer",
]

FORMAT = "routeplay.replay_buffer"
VERSION = 2

S = TypeVar("S", bound=RoutedSample)
S_co = TypeVar("S_co", bound=RoutedSample, covariant=True)


# -- one sample's routing by value -----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingRecord:
    """A ``SampleRouting`` by value: what a checkpoint keeps (never an object-store
    reference: it would not survive the process, and a pickled ref has no owner).

    Example:
        >>> meta, array = record.to_json(), record.array  # doctest: +SKIP
        >>> again = RoutingRecord.from_json(meta, array)
    """

    sample_id: str
    """The sample's id."""
    session_id: str | None
    """Its trace session, if any."""
    origin: Origin
    """Who produced the rows (restored routing is marked ``RESTORED``)."""
    retries: int
    """Regenerations so far."""
    response_versions: tuple[int, ...]
    """Per-response-token versions kept on the routing (often empty)."""
    prompt_tokens: int | None
    """Prompt length recorded by ``complete()``."""
    segments: tuple[tuple[int, int], ...]
    """``(rows, weight_version)`` of each handle segment, in order (empty: no routing)."""
    array: npt.NDArray[Any] | None = field(default=None, compare=False)
    """The rows, canonical (None: no routing)."""

    @classmethod
    def of(cls, routing: SampleRouting, store: RowReader) -> RoutingRecord:
        """``routing`` by value (rows read now; no object-store reference), for a
        checkpoint. ``record_routings`` records many with one read.

        Example:
            >>> record = RoutingRecord.of(sample.routing, store)  # doctest: +SKIP
            >>> restored = record.restore(store, spec)
        """
        return record_routings([routing], store)[0]

    def to_json(self) -> dict[str, Any]:
        """The record without its array (JSON-safe)."""
        return {
            "sample_id": self.sample_id,
            "session_id": self.session_id,
            "origin": self.origin.value,
            "retries": self.retries,
            "response_versions": list(self.response_versions),
            "prompt_length": self.prompt_tokens,
            "segments": [list(seg) for seg in self.segments],
        }

    @classmethod
    def from_json(cls, meta: dict[str, Any], array: npt.NDArray[Any] | None) -> RoutingRecord:
        """A record from ``to_json()`` and its array (a checkpoint is outside data: a
        record that does not parse raises ``MalformedPayload``)."""
        try:
            prompt = meta.get("prompt_length")
            return cls(
                sample_id=str(meta["sample_id"]),
                session_id=meta.get("session_id"),
                origin=Origin(meta.get("origin", Origin.NONE.value)),
                retries=int(meta.get("retries", 0)),
                response_versions=tuple(int(v) for v in meta.get("response_versions", ())),
                prompt_tokens=None if prompt is None else int(prompt),
                segments=tuple((int(r), int(v)) for r, v in meta.get("segments", ())),
                array=array,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedPayload(
                "a routing record does not parse",
                expected="the fields RoutingRecord.to_json() writes",
                found=f"{type(exc).__name__}: {exc}"[:200],
                where=f"record {str(meta.get('sample_id', '?'))[:80]}",
            ) from exc

    def restore(
        self, store: RoutesPutter, spec: RouteSpec, *, holder: str | None = None
    ) -> SampleRouting:
        """The routing stored anew and leased (``holder``, default the sample's own),
        its segments' weight versions as recorded, marked ``RESTORED``; without an array
        (a queued retry) nothing is stored and the routing comes back empty.

        The array is validated again (``canonicalize``); a lease that cannot be taken
        leaves the stored payload unleased, for the store's TTL."""
        base = SampleRouting(
            sample_id=self.sample_id,
            session_id=self.session_id,
            origin=Origin.NONE,
            retries=self.retries,
            response_versions=self.response_versions,
        )
        if self.array is None:
            return base
        where = f"checkpoint sample {self.sample_id}"
        routes = canonicalize(self.array, spec, where=where)
        if sum(rows for rows, _ in self.segments if rows >= 0) > routes.rows:
            raise HandleError(
                "recorded segments cover more rows than the array",
                expected=f"at most {routes.rows} rows",
                found=f"segments {list(self.segments)[:8]}",
                where=where,
            )
        stored = cut_segments(store.put(routes), spec, self.segments)
        lease = store.acquire(stored, holder or sample_holder(self.sample_id))
        restored = base.attach(stored, lease, Origin.RESTORED)
        return dataclasses.replace(restored, prompt_tokens=self.prompt_tokens)


def record_routings(routings: Sequence[SampleRouting], store: RowReader) -> list[RoutingRecord]:
    """Each routing by value, with one batched read for all of them (one metadata call
    per shard, each block once).

    Example:
        >>> records = record_routings([s.routing for s in samples], store)  # doctest: +SKIP
    """
    routed = [r.handle for r in routings if r.handle is not None]
    arrays = iter(store.read_many([(handle, 0, handle.rows) for handle in routed]))
    records = []
    for routing in routings:
        handle = routing.handle
        records.append(
            RoutingRecord(
                sample_id=routing.sample_id,
                session_id=routing.session_id,
                origin=routing.origin,
                retries=routing.retries,
                response_versions=routing.response_versions,
                prompt_tokens=routing.prompt_tokens,
                segments=tuple((seg.rows, seg.weight_version) for seg in handle.segments)
                if handle is not None
                else (),
                array=np.asarray(next(arrays)) if handle is not None else None,
            )
        )
    return records


def cut_segments(stored: Handle, spec: RouteSpec, segments: Sequence[tuple[int, int]]) -> Handle:
    """A freshly stored payload cut back into recorded ``(rows, weight_version)``
    segments (``rows < 0``: up to the end)."""
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


# -- samples and buffers --------------------------------------------------------------


class SampleCodec(Protocol, Generic[S]):
    """How a checkpoint writes and reads a sample's own fields (everything but its
    ``SampleRouting``); ``RolloutStateCodec`` is routeplay's.

    Example:
        >>> class XtunerCodec:  # doctest: +SKIP
        ...     def to_record(self, s): return {"prompt_ids": s.prompt_ids, ...}
        ...     def from_record(self, record, routing): return Sample(..., routing=routing)
    """

    def to_record(self, sample: S) -> dict[str, Any]:
        """The sample's own fields, JSON-safe (keys other than the routing's)."""
        ...

    def from_record(self, record: dict[str, Any], routing: SampleRouting) -> S:
        """The sample from ``to_record``'s fields, carrying ``routing``."""
        ...


_ROUTING_KEYS = ("sample_id", "session_id", "origin", "retries", "routing")


def save_buffer(
    buffer: ReplayBuffer[Any],
    folder: Path,
    spec: RouteSpec,
    *,
    codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC,
) -> None:
    """Write every waiting group and queued retry, routing by value.

    Example:
        >>> save_buffer(buffer, Path("ckpt/step-3"), spec, codec=codec)  # doctest: +SKIP
    """
    folder.mkdir(parents=True, exist_ok=True)
    waiting = buffer.groups()
    samples = [s for g in waiting for s in g.states] + list(buffer.pending_retries())
    routings = [s.sample_routing for s in samples]
    # One batched read for the whole buffer: one metadata call per shard, each block once.
    records = record_routings(routings, buffer.store)
    names: dict[int, str] = {}
    arrays: dict[str, Any] = {}
    for i, record in enumerate(records):
        if record.array is not None:
            names[i] = f"r{len(arrays)}"  # by position: sample ids may repeat
            arrays[names[i]] = record.array
    entries = [
        _sample_record(codec, sample, record, names.get(i))
        for i, (sample, record) in enumerate(zip(samples, records, strict=True))
    ]
    cut = sum(len(g.states) for g in waiting)
    groups, start = [], 0
    for group in waiting:
        stop = start + len(group.states)
        groups.append({"group_id": group.group_id, "states": entries[start:stop]})
        start = stop
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "spec": _spec_record(spec),
        "groups": groups,
        "retries": entries[cut:],
    }
    save: Any = np.savez  # its stub types **arrays as the allow_pickle flag
    save(folder / "routing.npz", allow_pickle=False, **arrays)
    (folder / "buffer.json").write_text(json.dumps(meta), encoding="utf-8")


def load_buffer(
    folder: Path,
    store: RouteStore,
    config: BufferConfig,
    *,
    codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC,
) -> ReplayBuffer[Any]:
    """A buffer holding the checkpoint's groups, its routing stored anew and leased.

    Example:
        >>> buffer = load_buffer(Path("ckpt/3"), store, BufferConfig(), codec=c)  # doctest: +SKIP
    """
    try:
        return _load_buffer(folder, store, config, codec)
    except RouteplayError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        # A checkpoint is outside data: a field missing or of another type than this
        # module writes is refused typed (whatever was leased is released by then).
        raise MalformedPayload(
            "the checkpoint does not parse",
            expected="the buffer.json and routing.npz save_buffer writes",
            found=f"{type(exc).__name__}: {exc}"[:200],
            where=str(folder),
        ) from exc


def _load_buffer(
    folder: Path, store: RouteStore, config: BufferConfig, codec: SampleCodec[Any]
) -> ReplayBuffer[Any]:
    meta = json.loads((folder / "buffer.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT or meta.get("version") not in (1, 2):
        raise MalformedPayload(
            "not a routeplay replay-buffer checkpoint",
            expected=f"format {FORMAT}, version 1 or 2",
            found=f"format {meta.get('format')}, version {meta.get('version')}",
            where=str(folder),
        )
    spec = _spec_from_record(meta["spec"])
    buffer = config.build(store, sessions=None)
    pending: list[Any] = []  # restored and leased, not yet owned by the buffer
    try:
        with np.load(folder / "routing.npz", allow_pickle=False) as arrays:
            for group in meta["groups"]:
                for record in group["states"]:
                    routing = _routing_record(record, arrays).restore(store, spec)
                    pending.append(_sample_of(codec, record, routing))
                buffer.add(group["group_id"], pending)
                pending = []
            # Queued retries regenerate: their old routing is neither stored nor kept.
            retries = [
                _sample_of(codec, record, _routing_record(record, None).restore(store, spec))
                for record in meta.get("retries", [])
            ]
    except BaseException as exc:  # a half-loaded checkpoint leaves no lease, no payload
        cleanup = [e for _, e in attempt_each([buffer], ReplayBuffer.close)]
        cleanup += release_samples(pending)[1]
        attach_notes(exc, cleanup, f"cleaning up the checkpoint {folder} that failed to load")
        raise
    buffer.requeue(retries)
    return buffer


def record_sample(
    sample: Any, store: RouteStore, *, codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC
) -> tuple[dict[str, Any], npt.NDArray[Any] | None]:
    """One sample's checkpoint: its record (JSON-safe, the same layout a buffer checkpoint
    writes per sample) and its routing rows by value (None without routing). The sample
    keeps its lease: recording reads, it never releases.

    Example:
        >>> record, rows = record_sample(state, store, codec=codec)  # doctest: +SKIP
        >>> again = restore_sample(record, rows, store, spec, codec=codec)
    """
    [routing] = record_routings([sample.sample_routing], store)
    array = routing.array
    return _sample_record(codec, sample, routing, None if array is None else "rows"), array


def restore_sample(
    record: dict[str, Any],
    array: npt.NDArray[Any] | None,
    store: RouteStore,
    spec: RouteSpec,
    *,
    codec: SampleCodec[Any] = ROLLOUT_STATE_CODEC,
) -> Any:
    """The sample of ``record_sample``: its rows validated, stored anew and leased for the
    sample (``rollout/<id>``), segments at their recorded weight versions, ``RESTORED``.

    Example:
        >>> state = restore_sample(record, rows, store, spec, codec=codec)  # doctest: +SKIP
        >>> state.lease.holder
        'rollout/a'
    """
    arrays = None if array is None else {"rows": array}
    return _sample_of(codec, record, _routing_record(record, arrays).restore(store, spec))


def _sample_of(codec: SampleCodec[Any], record: dict[str, Any], routing: SampleRouting) -> Any:
    """The codec's sample carrying ``routing`` (restored and leased); if the record's own
    fields do not parse, nobody will own that lease: it ends before the error goes on."""
    try:
        return codec.from_record(record, routing)
    except BaseException as exc:
        _, error = routing.discard()
        attach_notes(exc, [error] if error is not None else [], "releasing the restored routing")
        raise


def _sample_record(
    codec: SampleCodec[Any], sample: Any, record: RoutingRecord, array: str | None
) -> dict[str, Any]:
    own = codec.to_record(sample)
    clash = set(own) & set(_ROUTING_KEYS)
    if clash:
        raise MalformedPayload(
            "a sample codec wrote keys the routing record owns",
            expected=f"none of {list(_ROUTING_KEYS)}",
            found=sorted(clash),
            where=f"sample {record.sample_id}",
        )
    routing = None
    if array is not None:
        routing = {
            "array": array,
            "segments": [list(seg) for seg in record.segments],
            "prompt_length": record.prompt_tokens,
            "response_versions": list(record.response_versions),
        }
    return {
        "sample_id": record.sample_id,
        "session_id": record.session_id,
        **own,
        "origin": record.origin.value,
        "retries": record.retries,
        "routing": routing,
    }


def _routing_record(record: dict[str, Any], arrays: Any) -> RoutingRecord:
    """The routing part of a sample record (``arrays`` None: leave the rows out)."""
    routing = record.get("routing")
    array = None
    meta = {
        "sample_id": record["sample_id"],
        "session_id": record.get("session_id"),
        "origin": record.get("origin", Origin.RESTORED.value),
        "retries": record.get("retries", 0),
    }
    if routing is not None and arrays is not None and routing.get("array") is not None:
        array = arrays[routing["array"]]
        meta["segments"] = _segments(routing, record)
        meta["prompt_length"] = routing.get("prompt_length")
        meta["response_versions"] = routing.get("response_versions", [])
    return RoutingRecord.from_json(meta, array)


def _segments(routing: dict[str, Any], record: dict[str, Any]) -> list[tuple[int, int]]:
    if "segments" in routing:  # version 2
        return [(int(rows), int(version)) for rows, version in routing["segments"]]
    versions = record.get("weight_versions") or [0]  # version 1: one version for the sample
    return [(-1, int(routing.get("weight_version", min(versions))))]


def _spec_from_record(record: dict[str, Any]) -> RouteSpec:
    layer_map = record.get("layer_map")
    return RouteSpec(
        num_layers=int(record["num_layers"]),
        top_k=int(record["top_k"]),
        num_experts=int(record["num_experts"]),
        layer_map=tuple(int(i) for i in layer_map) if layer_map else None,
        total_layers=record.get("total_layers"),
        mtp_layers=int(record.get("mtp_layers", 0)),  # absent before protocol 3: none
        name=str(record.get("name", "")),
    )


def _spec_record(spec: RouteSpec) -> dict[str, Any]:
    return {
        "num_layers": spec.num_layers,
        "top_k": spec.top_k,
        "num_experts": spec.num_experts,
        "layer_map": list(spec.layer_map) if spec.layer_map else None,
        "total_layers": spec.total_layers,
        "mtp_layers": spec.mtp_layers,
        "name": spec.name,
    }
