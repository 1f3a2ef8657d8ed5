"""Every blocking Ray call in ``src/`` has a deadline: a hung actor (a trace store, a
worker, a shard) raises a typed timeout instead of hanging the job (issue 12).

An AST walk over every module (``pipeline/`` and ``bench/`` included): ``ray.get(...)``
and ``ray.wait(...)`` must pass a ``timeout=`` that is not ``None``
(``routeplay.store.remote.ray_calls.get``, which the store uses, requires one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "routeplay"
MODULES = sorted(PACKAGE.rglob("*.py"))
BLOCKING = {"get", "wait"}


def _undeadlined(source: str) -> list[str]:
    """``"<line> ray.get"`` for each blocking Ray call without a deadline."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "ray"
            and node.func.attr in BLOCKING
        ):
            continue
        timeout = next((kw.value for kw in node.keywords if kw.arg == "timeout"), None)
        if timeout is None or (isinstance(timeout, ast.Constant) and timeout.value is None):
            out.append(f"{node.lineno} ray.{node.func.attr}")
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_blocking_ray_call_has_a_deadline(path: Path) -> None:
    assert _undeadlined(path.read_text()) == []


def test_the_check_sees_calls() -> None:
    # Guard against a walk that silently finds nothing (a vacuous test).
    assert sum("ray.get(" in p.read_text() for p in MODULES) >= 5
    probe = "import ray\nray.get(x)\nray.wait(y, timeout=None)\nray.get(z, timeout=5)\n"
    assert _undeadlined(probe) == ["2 ray.get", "3 ray.wait"]
