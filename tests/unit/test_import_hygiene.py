"""Trainer-side modules import only what they use, in a fresh interpreter.

A Megatron or FSDP trainer process may run without Ray (an optional extra), and the
packing plan is pure bookkeeping: each case imports modules with some packages *blocked*
(a meta-path finder that refuses them, as if not installed) and checks what got loaded.
Also pins the public names of ``routeplay.train`` and ``routeplay.integrations.megatron``.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

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
    code = _BLOCKER.format(blocked={"ray"}, body="import routeplay.store")
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


TRAIN_NAMES = [
    "FAMILIES",
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
    "find_routers",
    "local_ranges",
    "local_tokens",
    "model_spec",
    "pack_samples",
    "padding_rows",
    "record",
    "replay",
    "seq_alignment",
]
MEGATRON_NAMES = [
    "MegatronLayout",
    "MegatronReplay",
    "MegatronReplayStats",
    "MegatronRouter",
    "QkvFormat",
    "Recording",
    "find_megatron_routers",
]


def test_exported_members() -> None:
    pytest.importorskip("torch")
    import routeplay.integrations.megatron as megatron
    import routeplay.train as train

    for package, names in ((train, TRAIN_NAMES), (megatron, MEGATRON_NAMES)):
        assert sorted(package.__all__) == names
        for name in names:
            member = getattr(package, name)  # every pinned name resolves
            if inspect.isclass(member) or inspect.isfunction(member):
                assert member.__module__.startswith(package.__name__), name
    with pytest.raises(AttributeError):
        _ = train.no_such_name
