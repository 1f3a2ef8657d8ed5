"""Every public module imports only what it uses, in a fresh interpreter.

A Megatron or FSDP trainer process may run without Ray (an optional extra), a rollout
process without torch, and the plain classes (packing, the materializer, the rollout
state, buffer, trie and the routing holder's steps, the lease tables) need neither. Each case
imports modules with some packages *blocked* (a meta-path finder that refuses them, as
if not installed) and checks what got loaded.

``NEEDS`` names the modules that may import Ray or torch (where actors live, where
tensors are made); every other module of the package must import with both blocked,
and every module that needs one must import with the other blocked. A new module is
covered automatically (it needs nothing until it is listed here).
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import routeplay

_BLOCKER = """
import importlib.abc, json, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
{body}
print(json.dumps(sorted(m for m in ("ray", "torch", "megatron") if m in sys.modules)))
"""


def run_blocked(body: str, blocked: tuple[str, ...]) -> list[str]:
    """Run ``body`` with ``blocked`` packages unimportable; the heavy modules it loaded."""
    code = _BLOCKER.format(blocked=set(blocked), body=body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_the_blocker_really_blocks() -> None:
    # Guard against a vacuous test: with Ray blocked, importing the store must fail.
    code = _BLOCKER.format(blocked={"ray"}, body="import routeplay.store.client.route_store")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "blocked by the test" in out.stderr


def test_packing_loads_neither_torch_nor_ray() -> None:
    assert run_blocked("import routeplay.train.packing", ("ray", "torch")) == []


def test_the_materializer_imports_without_ray_or_torch() -> None:
    body = "import routeplay.train.materializer\nfrom routeplay.train import Materializer"
    assert run_blocked(body, ("ray", "torch")) == []


def test_train_and_the_megatron_adapter_import_without_ray() -> None:
    pytest.importorskip("torch")
    body = (
        "import routeplay.train, routeplay.integrations.megatron\n"
        "from routeplay.train import replay, ReplaySource, Materializer, pack_samples\n"
        "from routeplay.integrations.megatron import MegatronReplay, MegatronLayout"
    )
    loaded = run_blocked(body, ("ray",))
    assert "ray" not in loaded
    assert "torch" in loaded  # replay makes tensors
    assert "megatron" not in loaded  # imported when a session looks for routers


def test_the_megatron_layout_plans_without_torch() -> None:
    body = (
        "from routeplay.integrations.megatron import MegatronLayout\n"
        "MegatronLayout(tp_size=2, sequence_parallel=True, cp_size=2).coords()"
    )
    assert run_blocked(body, ("ray", "torch")) == []


def test_replay_names_the_function_and_the_module_is_replay_core() -> None:
    pytest.importorskip("torch")
    import routeplay.train as train
    from routeplay.train import hf, replay_core

    assert train.replay is hf.replay
    assert callable(train.replay)
    assert replay_core.ReplaySource is train.ReplaySource


RAY, TORCH = frozenset({"ray"}), frozenset({"torch"})
NEEDS: dict[str, frozenset[str]] = {
    # actors and their clients
    **dict.fromkeys(
        [
            f"routeplay.store.{name}"
            for name in (
                "remote.accounting",
                "remote.actors",
                "remote.backend",
                "client.route_store",
                "client.accounting",
                "client.core",
                "client.keys",
                "client.leases",
                "client.write_path",
                "engine.service",
                "remote.producer",
                "remote.protocol",
                "remote.ray_calls",
                "client.read_path",
                "client.releases",
            )
        ],
        RAY,
    ),
    "routeplay.rollout.trace_actor": RAY,
    **dict.fromkeys(
        [
            f"routeplay.bench.{name}"
            for name in (
                "limit",
                "measure",
                "report",
                "rl_roles",
                "rl_step",
                "roles",
                "session_roles",
                "sessions",
                "transfer_paths",
                "verl_roles",
                "verl_step",
            )
        ],
        RAY,
    ),
    **dict.fromkeys(
        [
            f"routeplay.pipeline.{name}"
            for name in ("faults", "meter", "rollout_worker", "rollouts", "soak_report")
        ],
        RAY,
    ),
    "routeplay.pipeline.soak_worker": RAY,
    # where tensors are made
    **dict.fromkeys(
        [
            "routeplay.engine",
            "routeplay.engine.generator",
            "routeplay.engine.model",
            "routeplay.engine.requests",
            "routeplay.engine.server",
            "routeplay.engine.wide_experts",
            "routeplay.integrations.megatron.drift",
            "routeplay.integrations.megatron.recording",
            "routeplay.integrations.megatron.routers",
            "routeplay.integrations.megatron.session",
            "routeplay.integrations.verl",
            "routeplay.integrations.verl_fsdp",
            "routeplay.integrations.verl_replay",
            "routeplay.train.drift",
            "routeplay.train.hf",
            "routeplay.train.replay_check",
            "routeplay.train.replay_core",
            "routeplay.train.routers",
        ],
        TORCH,
    ),
    # the demo's driver: the trainer (torch) on Ray
    **dict.fromkeys(
        [
            f"routeplay.pipeline.{name}"
            for name in ("config", "demo", "services", "soak", "soak_config", "trainer")
        ],
        RAY | TORCH,
    ),
}
HEAVY = RAY | TORCH
SUBMODULES = sorted(m.name for m in pkgutil.walk_packages(routeplay.__path__, "routeplay."))
MODULES = ["routeplay", *SUBMODULES]

_PROBE = """
import importlib
failed = {{}}
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(failed))
"""


def _blocked_for(module: str) -> frozenset[str]:
    return HEAVY - NEEDS.get(module, frozenset())


@pytest.fixture(scope="module")
def import_failures() -> dict[str, str]:
    """Each module imported with what it must not need blocked: module -> error.

    One fresh interpreter per blocked set (three in all), each importing its modules in
    turn: a module that imports cleanly after another one did needs nothing blocked
    either (the blocker refuses every import of a blocked package, cached or not).
    """
    failures: dict[str, str] = {}
    for blocked in {_blocked_for(m) for m in MODULES} - {frozenset()}:
        modules = [m for m in MODULES if _blocked_for(m) == blocked]
        code = _BLOCKER.format(blocked=set(blocked), body=_PROBE.format(modules=modules))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        failures.update(json.loads(out.stdout.strip().splitlines()[-2]))
    return failures


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_without_what_it_does_not_use(
    module: str, import_failures: dict[str, str]
) -> None:
    blocked = sorted(_blocked_for(module))
    assert module not in import_failures, f"{module} with {blocked} blocked: " + (
        import_failures.get(module, "")
    )


def test_the_module_list_is_real() -> None:
    # Guard against a walk that finds nothing, and a table naming modules that are gone.
    assert {"routeplay.rollout.sample_routing", "routeplay.train.packing"} <= set(MODULES)
    assert set(NEEDS) <= set(MODULES)


def test_the_plain_rollout_and_store_names_resolve_without_ray_or_torch() -> None:
    body = (
        "from routeplay.rollout import (RolloutState, ReplayBuffer, TrainingBatch,\n"
        "    TokenTrie, TraceStore, SessionLedger, load_buffer, save_buffer,\n"
        "    SampleRouting, RoutingContinuation, ingest_routing_group, ADAPTERS, stitch)\n"
        "from routeplay.store import Lease, LeaseTable, EngineStore\n"
        "import routeplay.core, routeplay.core.wires, routeplay.train\n"
        "try:\n"
        "    from routeplay.rollout import TraceStoreClient\n"
        "except ModuleNotFoundError as exc:\n"
        "    assert 'blocked by the test' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('TraceStoreClient needs Ray: it must not resolve')\n"
    )
    assert run_blocked(body, ("ray", "torch")) == []


def test_a_rollout_worker_module_loads_ray_but_not_torch() -> None:
    loaded = run_blocked("import routeplay.pipeline.rollout_worker", ("torch",))
    assert loaded == ["ray"]
