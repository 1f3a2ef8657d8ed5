"""routeplay.rollout: samples between the engine and the trainer, on handles and leases.

``RolloutState`` (one sample), engine adapters (``ADAPTERS``, ``stitch`` for partial
rollouts), the per-session token-trie ``TraceStore``, the ``ReplayBuffer`` with
staleness retries, the ``TrainingBatch`` hand-off and the ``SessionLedger`` (a session
lives while one of its samples waits). Every holder releases only its own lease;
nothing here ever guesses who owns routing.
"""

from routeplay.rollout.adapters import ADAPTERS, EngineAdapter, HttpAdapter, RoutesWriter, stitch
from routeplay.rollout.batch import TrainingBatch
from routeplay.rollout.buffer import BufferConfig, Group, ReplayBuffer, SamplingPolicy
from routeplay.rollout.checkpoint import load_buffer, save_buffer
from routeplay.rollout.sessions import SessionLedger
from routeplay.rollout.state import Origin, RolloutState, RoutingKind, Status
from routeplay.rollout.token_trie import TokenTrie
from routeplay.rollout.trace_store import (
    Exported,
    PrefixMatch,
    TraceStore,
    TraceStoreActor,
    TraceStoreStats,
    session_holder,
)

__all__ = [
    "ADAPTERS",
    "BufferConfig",
    "EngineAdapter",
    "Exported",
    "Group",
    "HttpAdapter",
    "Origin",
    "PrefixMatch",
    "ReplayBuffer",
    "RolloutState",
    "RoutesWriter",
    "RoutingKind",
    "SamplingPolicy",
    "SessionLedger",
    "Status",
    "TokenTrie",
    "TraceStore",
    "TraceStoreActor",
    "TraceStoreStats",
    "TrainingBatch",
    "load_buffer",
    "save_buffer",
    "session_holder",
    "stitch",
]
