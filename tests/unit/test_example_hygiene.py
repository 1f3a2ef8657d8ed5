"""``examples/xtuner_flow.py`` is a user of routeplay's public API only: it never imports
or constructs routeplay's ``RolloutState`` (its sample is XTuner's own), imports no
``_``-prefixed name or module, and every name it imports from routeplay is in that
module's ``__all__`` (or is a public submodule)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).parents[2] / "examples" / "xtuner_flow.py"


def violations(source: str) -> list[str]:
    """What in ``source`` is not the public API (one line per finding)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "RolloutState":
            found.append(f"line {node.lineno}: uses RolloutState")
        elif isinstance(node, ast.Attribute) and node.attr == "RolloutState":
            found.append(f"line {node.lineno}: uses .RolloutState")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found += _private(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module:
            private = _private(node.module, node.lineno)
            found += private
            for alias in node.names:
                found += [] if private else _imported(node.module, alias.name, node.lineno)
    return found


def _private(module: str, line: int) -> list[str]:
    if any(p.startswith("_") and not p.endswith("__") for p in module.split(".")):
        return [f"line {line}: imports private module {module}"]
    return []


def _imported(module: str, name: str, line: int) -> list[str]:
    if name == "RolloutState":
        return [f"line {line}: imports RolloutState from {module}"]
    if name.startswith("_"):
        return [f"line {line}: imports private name {module}.{name}"]
    if module.split(".")[0] != "routeplay":
        return []
    imported = importlib.import_module(module)
    if name in getattr(imported, "__all__", ()) or _is_submodule(imported, name):
        return []
    return [f"line {line}: {module}.{name} is not in {module}.__all__"]


def _is_submodule(package: ModuleType, name: str) -> bool:
    if not hasattr(package, "__path__"):  # a module, not a package
        return False
    return importlib.util.find_spec(f"{package.__name__}.{name}") is not None


def test_the_xtuner_example_uses_only_the_public_api_and_not_rolloutstate() -> None:
    assert violations(EXAMPLE.read_text(encoding="utf-8")) == []


def test_the_scan_finds_each_kind_of_violation() -> None:
    bad = "\n".join(
        [
            "from routeplay.rollout import RolloutState",
            "import routeplay.rollout",
            "s = routeplay.rollout.RolloutState(sample_id='a')",
            "from routeplay.rollout.state import _step",
            "from routeplay.store._hidden import x",
            "from routeplay.rollout.group_ingest import ingest_routing_group",
            "from routeplay.rollout.checkpoint import ROLLOUT_STATE_CODEC",
        ]
    )
    found = violations(bad)
    assert sorted(f.split(":")[0] for f in found) == [
        "line 1",
        "line 3",
        "line 4",
        "line 5",
        "line 7",
    ], found
