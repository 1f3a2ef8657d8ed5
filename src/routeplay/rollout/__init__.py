"""routeplay.rollout: samples between the engine and the trainer, on handles and leases.

``SampleRouting`` (one sample's routing and leases, with the lifecycle steps; any sample
type embeds it and becomes a ``RoutedSample``), ``RolloutState`` (routeplay's own
sample, embedding one ``SampleRouting`` the same way), engine adapters (``ADAPTERS``,
``stitch`` for partial rollouts), group steps (``ingest_routing_group`` writes a GRPO
group's answers for any sample type and ``finish_all`` leases them, one call per store
shard for the group; ``ingest_and_finish_group`` does both, a fresh group's write
granting its members' leases in the same call), the per-session token-trie
``TraceStore`` (served by the ``TraceStoreActor`` and called through
``TraceStoreClient``), the ``ReplayBuffer`` with staleness retries, the
``TrainingBatch`` hand-off and the ``SessionLedger`` (a session lives while one of its
samples waits): the containers hold any ``RoutedSample`` and move
a group's or a batch's leases with one call per shard (``routing_groups``). Every holder
releases only its own lease; nothing here ever guesses who owns routing.

Names are resolved on first use (PEP 562): everything but the trace-store actor, its
config and its client is plain Python and imports without Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from routeplay.core.lazy import LazyExports

if TYPE_CHECKING:
    from routeplay.rollout.adapters import (
        ADAPTERS,
        EngineAdapter,
        HttpAdapter,
        ProducerWriter,
        RoutesWriter,
        stitch,
    )
    from routeplay.rollout.batch import TrainingBatch
    from routeplay.rollout.buffer import BufferConfig, Group, ReplayBuffer, SamplingPolicy
    from routeplay.rollout.checkpoint import (
        RoutingRecord,
        SampleCodec,
        load_buffer,
        record_routings,
        record_sample,
        restore_sample,
        save_buffer,
    )
    from routeplay.rollout.group_finish import aingest_and_finish_group, ingest_and_finish_group
    from routeplay.rollout.group_ingest import (
        AsyncBatchWriter,
        AsyncLeasedBatchWriter,
        BatchWriter,
        LeasedBatchWriter,
        aingest_routing_group,
        ingest_routing_group,
    )
    from routeplay.rollout.routing_continuation import RoutingContinuation
    from routeplay.rollout.routing_groups import afinish_all, finish_all
    from routeplay.rollout.routing_terms import StalenessBasis, sample_holder
    from routeplay.rollout.sample_routing import Expiry, RoutedSample, SampleRouting
    from routeplay.rollout.session_compaction import CompactionPolicy
    from routeplay.rollout.sessions import SessionLedger
    from routeplay.rollout.state import (
        ROLLOUT_STATE_CODEC,
        Origin,
        RolloutState,
        RoutingKind,
        Status,
    )
    from routeplay.rollout.token_trie import TokenTrie
    from routeplay.rollout.trace_actor import TraceStoreActor, TraceStoreClient, TraceStoreConfig
    from routeplay.rollout.trace_store import (
        Exported,
        PrefixMatch,
        TraceStore,
        TraceStoreStats,
        session_holder,
    )

_HOME = {
    "ADAPTERS": "adapters",
    "AsyncBatchWriter": "group_ingest",
    "AsyncLeasedBatchWriter": "group_ingest",
    "BatchWriter": "group_ingest",
    "LeasedBatchWriter": "group_ingest",
    "ROLLOUT_STATE_CODEC": "state",
    "BufferConfig": "buffer",
    "CompactionPolicy": "session_compaction",
    "EngineAdapter": "adapters",
    "Exported": "trace_store",
    "Expiry": "sample_routing",
    "Group": "buffer",
    "HttpAdapter": "adapters",
    "Origin": "state",
    "PrefixMatch": "trace_store",
    "ProducerWriter": "adapters",
    "ReplayBuffer": "buffer",
    "RolloutState": "state",
    "RoutedSample": "sample_routing",
    "RoutesWriter": "adapters",
    "RoutingContinuation": "routing_continuation",
    "RoutingKind": "state",
    "RoutingRecord": "checkpoint",
    "SampleCodec": "checkpoint",
    "SampleRouting": "sample_routing",
    "SamplingPolicy": "buffer",
    "SessionLedger": "sessions",
    "StalenessBasis": "routing_terms",
    "Status": "state",
    "TokenTrie": "token_trie",
    "TraceStore": "trace_store",
    "TraceStoreActor": "trace_actor",
    "TraceStoreClient": "trace_actor",
    "TraceStoreConfig": "trace_actor",
    "TraceStoreStats": "trace_store",
    "TrainingBatch": "batch",
    "afinish_all": "routing_groups",
    "aingest_and_finish_group": "group_finish",
    "aingest_routing_group": "group_ingest",
    "finish_all": "routing_groups",
    "ingest_and_finish_group": "group_finish",
    "ingest_routing_group": "group_ingest",
    "load_buffer": "checkpoint",
    "record_routings": "checkpoint",
    "record_sample": "checkpoint",
    "restore_sample": "checkpoint",
    "sample_holder": "routing_terms",
    "save_buffer": "checkpoint",
    "session_holder": "trace_store",
    "stitch": "adapters",
}

__all__ = [
    "ADAPTERS",
    "ROLLOUT_STATE_CODEC",
    "AsyncBatchWriter",
    "AsyncLeasedBatchWriter",
    "BatchWriter",
    "BufferConfig",
    "CompactionPolicy",
    "EngineAdapter",
    "Expiry",
    "Exported",
    "Group",
    "HttpAdapter",
    "LeasedBatchWriter",
    "Origin",
    "PrefixMatch",
    "ProducerWriter",
    "ReplayBuffer",
    "RolloutState",
    "RoutedSample",
    "RoutesWriter",
    "RoutingContinuation",
    "RoutingKind",
    "RoutingRecord",
    "SampleCodec",
    "SampleRouting",
    "SamplingPolicy",
    "SessionLedger",
    "StalenessBasis",
    "Status",
    "TokenTrie",
    "TraceStore",
    "TraceStoreActor",
    "TraceStoreClient",
    "TraceStoreConfig",
    "TraceStoreStats",
    "TrainingBatch",
    "afinish_all",
    "aingest_and_finish_group",
    "aingest_routing_group",
    "finish_all",
    "ingest_and_finish_group",
    "ingest_routing_group",
    "load_buffer",
    "record_routings",
    "record_sample",
    "restore_sample",
    "sample_holder",
    "save_buffer",
    "session_holder",
    "stitch",
]


_LAZY = LazyExports(__name__, _HOME)


def __getattr__(name: str) -> Any:
    return _LAZY.resolve(name)


def __dir__() -> list[str]:
    return _LAZY.names(__all__)
