"""The layers depend one way: core <- store <- rollout <- train <- engine/pipeline/bench/cli."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import routeplay

PACKAGE = Path(routeplay.__file__).parent
RANK = {"errors": 0, "core": 0, "store": 1, "rollout": 2, "train": 3}
TOP = 4  # engine, pipeline, bench, cli and anything newer
FORBIDDEN = {
    "core": {"ray", "torch", "transformers", "fastapi", "httpx", "typer", "rich"},
    "store": {"torch", "transformers"},
    "rollout": {"torch", "transformers"},
    "cli": {"torch", "transformers"},  # torch lives in train and engine only
}


def _layer(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else ""


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import (absolute imports only)"
            names.append(node.module or "")
    return names


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if _layer(p))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_lower_layers(path: Path) -> None:
    layer = _layer(path)
    rank = RANK.get(layer, TOP)
    for name in _imports(path):
        root, _, rest = name.partition(".")
        if root == "routeplay" and rest:
            target = rest.split(".")[0]
            assert RANK.get(target, TOP) <= rank, f"{path.name} ({layer}) imports {name}"
        assert root not in FORBIDDEN.get(layer, set()), f"{path.name} ({layer}) imports {name}"


def test_core_import_pulls_in_neither_ray_nor_torch() -> None:
    code = (
        "import sys, routeplay.core, routeplay.errors\n"
        "bad = sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_layering_check_sees_modules() -> None:
    # Guard against a rglob that silently finds nothing (which would make the test vacuous).
    assert any(_layer(p) == "core" for p in MODULES)
    assert any(_layer(p) == "cli" for p in MODULES)


# Where Ray and torch may be imported at all (any layer): actors and their clients, and
# the modules that make tensors. Everything else takes their objects as arguments, so a
# process pays for neither until it uses them (test_import_hygiene checks the result).
RAY_HOMES = {
    "store/remote/accounting.py",
    "store/remote/actors.py",
    "store/remote/backend.py",
    "store/engine/service.py",
    "store/remote/producer.py",
    "store/remote/ray_calls.py",
    "rollout/trace_actor.py",
}
TORCH_HOMES = {
    "train/drift.py",
    "train/hf.py",
    "train/replay_check.py",
    "train/replay_core.py",
    "train/routers.py",
    "integrations/megatron/drift.py",
    "integrations/megatron/routers.py",
    "integrations/megatron/recording.py",
    "integrations/megatron/session.py",
    "integrations/verl.py",
    "integrations/verl_replay.py",
    "integrations/verl_fsdp.py",
}
FREE_LAYERS = {"engine", "pipeline", "bench"}  # the top: a demo, a reference engine, benchmarks


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_ray_and_torch_are_imported_only_where_they_are_used(path: Path) -> None:
    rel = str(path.relative_to(PACKAGE))
    if _layer(path) in FREE_LAYERS:
        return
    roots = {name.partition(".")[0] for name in _imports(path)}
    assert "ray" not in roots or rel in RAY_HOMES, f"{rel} imports ray"
    assert "torch" not in roots or rel in TORCH_HOMES, f"{rel} imports torch"


def test_the_homes_exist() -> None:
    for rel in RAY_HOMES | TORCH_HOMES:
        assert (PACKAGE / rel).is_file(), rel
