"""Shard calls go through the typed layer (``routeplay.store.shard.api``) only.

No store module outside ``shard.api`` passes a shard operation's name as a string to
the call machinery: not in a tuple (the old ``(shard, "release", args)`` shape), not to
``getattr``, not as an argument of a call that builds or sends shard calls; and none
builds a ``ShardCall`` by hand. Every call is ``shard_call(i, ShardApi.<op>, ...)``,
whose arguments mypy checks against the operation's signature.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import routeplay.store
from routeplay.store.remote.actors import StoreShardShell
from routeplay.store.shard.api import ShardApi, shard_call
from routeplay.store.shard.shard import StoreShard

STORE = Path(routeplay.store.__file__).parent
OPERATIONS = frozenset(name for name in vars(ShardApi) if not name.startswith("_"))
MACHINERY = frozenset(
    {
        "call",
        "send",
        "submit",
        "send_and_wait",
        "wait_for",
        "_call",
        "_calls",
        "_grant_all",
        "_each_shard",
        "ShardCall",
    }
)
MODULES = sorted(p for p in STORE.rglob("*.py") if p != STORE / "shard" / "api.py")


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _named_operations(nodes: list[ast.expr]) -> list[str]:
    return [
        node.value
        for node in nodes
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if node.value in OPERATIONS
    ]


def violations(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every place ``source`` names a shard operation by string."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found += [
                (node.lineno, f"{name!r} in a literal") for name in _named_operations(node.elts)
            ]
        elif isinstance(node, ast.Call):
            callee = _callee(node)
            args = [*node.args, *(keyword.value for keyword in node.keywords)]
            if callee in ("getattr", "hasattr", "setattr") or callee in MACHINERY:
                found += [
                    (node.lineno, f"{name!r} passed to {callee}")
                    for name in _named_operations(args)
                ]
            if callee == "ShardCall":
                found.append((node.lineno, "a ShardCall built by hand"))
    return found


def test_the_checker_finds_the_old_string_calls() -> None:
    old = """
self._call([(i, "release", (lid,)) for i, lid in parts.items()], "end a lease")
getattr(self._shards[i], "lease_many").remote(requests, run)
self._each_shard("stats")
backend.submit([ShardCall(0, "release_many", (ids,), {})])
"""
    assert sorted(line for line, _ in violations(old)) == [2, 3, 4, 5, 5]


def test_the_checker_leaves_typed_calls_and_labels_alone() -> None:
    typed = """
self._call([shard_call(i, ShardApi.release, lid) for i, lid in parts.items()], "end a lease")
self._check_live("clone")
"""
    assert violations(typed) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(STORE)))
def test_no_store_module_names_a_shard_operation_by_string(path: Path) -> None:
    found = violations(path.read_text())
    assert not found, f"{path.relative_to(STORE)}: use shard_call(i, ShardApi.<op>, ...): {found}"


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_both_shards_implement_every_operation_with_its_parameters(name: str) -> None:
    wanted = list(inspect.signature(getattr(ShardApi, name)).parameters)
    for shard in (StoreShard, StoreShardShell):
        have = list(inspect.signature(getattr(shard, name)).parameters)
        assert have[: len(wanted)] == wanted, f"{shard.__name__}.{name}"


def test_a_call_carries_the_operation_it_was_built_from() -> None:
    call = shard_call(2, ShardApi.clone, "run/2/lease-ab", "train/step-1")
    assert (call.shard, call.method, call.args, call.kwargs) == (
        2,
        "clone",
        ("run/2/lease-ab", "train/step-1"),
        {},
    )
