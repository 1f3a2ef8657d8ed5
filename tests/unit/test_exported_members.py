"""The public names of each package are pinned (as httpx's ``test_exported_members``).

A name added to or dropped from a package's ``__all__`` fails here until this list says
so; every pinned name resolves (lazy ``__getattr__`` homes included), a class or
function is defined inside the package it is exported from, and no exported name
shadows a submodule of the package with something else (``routeplay.train.replay`` was
once the function while ``train/replay.py`` existed).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

EXPORTS: dict[str, list[str]] = {
    "routeplay": [
        "Engine",
        "EngineKey",
        "EngineRouting",
        "Handle",
        "InlineSource",
        "PRESETS",
        "RouteSpec",
        "Routes",
        "Segment",
        "StoreRef",
        "canonicalize",
        "errors",
        "preset",
        "read_response",
        "read_responses",
        "read_stream",
        "spec_from_hf_config",
    ],
    "routeplay.core": [
        "DegenerateCheck",
        "Engine",
        "EngineKey",
        "EngineRouting",
        "Handle",
        "InlineSource",
        "PRESETS",
        "Piece",
        "RouteSpec",
        "Routes",
        "Segment",
        "Source",
        "StoreRef",
        "canonical_dtype",
        "canonicalize",
        "expected_rows",
        "preset",
        "read_response",
        "read_responses",
        "read_stream",
        "spec_from_hf_config",
    ],
    "routeplay.core.wires": [
        "Answer",
        "BodyOptions",
        "Completion",
        "ENGINES",
        "Engine",
        "EngineRouting",
        "EngineWire",
        "KeyPut",
        "WIRES",
        "WIRE_NAMES",
        "WireFormat",
        "engine_wire",
        "read_response",
        "read_responses",
        "read_stream",
        "wire",
        "wire_layers",
    ],
    "routeplay.store": [
        "Compacted",
        "CompactionReport",
        "EngineStore",
        "EngineStoreStats",
        "LeakRecord",
        "Lease",
        "LeaseTable",
        "PayloadState",
        "RouteStore",
        "AsyncRoutesProducer",
        "RoutesProducer",
        "StoreConfig",
        "StoreStats",
        "TableStats",
        "aleave_engine_store",
        "astart_engine_store",
        "leave_engine_store",
        "producer_actor",
        "start_engine_store",
    ],
    "routeplay.rollout": [
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
    ],
    "routeplay.train": [
        "DRIFT_BY_DEFAULT",
        "DriftMeter",
        "FAMILIES",
        "LayerDrift",
        "Materializer",
        "MaterializerStats",
        "MicroBatchRoutes",
        "Pack",
        "PackedSample",
        "PackingPlan",
        "RankCoords",
        "RecorderStats",
        "ReplaySource",
        "ReplayStats",
        "RouteRecorder",
        "RoutingDrift",
        "find_routers",
        "local_ranges",
        "local_tokens",
        "logprob_gaps",
        "model_spec",
        "pack_samples",
        "padding_rows",
        "record",
        "replay",
        "seq_alignment",
    ],
    "routeplay.integrations.megatron": [
        "MegatronLayout",
        "MegatronReplay",
        "MegatronReplayStats",
        "MegatronRouter",
        "QkvFormat",
        "Recording",
        "find_megatron_routers",
    ],
    "routeplay.engine": [
        "DTYPES",
        "EngineConfig",
        "EngineServer",
        "EngineStats",
        "FINISH_REASONS",
        "Generation",
        "ReferenceEngine",
        "ServerLimits",
        "ServerStats",
        "WIRES",
        "WireHandler",
        "build_model",
    ],
    "routeplay.pipeline": [],  # nothing: Ray workers import its modules one by one
}


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_exported_members(package: str) -> None:
    pytest.importorskip("torch")  # train, engine and megatron resolve torch-backed names
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(EXPORTS[package])
    for name in module.__all__:
        member = getattr(module, name)  # every pinned name resolves
        if inspect.isclass(member) or inspect.isfunction(member):
            assert member.__module__.startswith("routeplay."), name
            home = package if package != "routeplay" else "routeplay.core"
            assert member.__module__.startswith(home), (name, member.__module__)


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_no_exported_name_shadows_a_submodule(package: str) -> None:
    module = importlib.import_module(package)
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    for name in set(module.__all__) & submodules:
        assert inspect.ismodule(getattr(module, name)), f"{package}.{name} is not the module"


@pytest.mark.parametrize("package", ["routeplay.rollout", "routeplay.store", "routeplay.train"])
def test_a_lazy_package_refuses_unknown_names(package: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = module.no_such_name
    assert set(module.__all__) <= set(dir(module))
