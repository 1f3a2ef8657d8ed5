"""No routeplay module outside ``RolloutState``'s own needs ``RolloutState``.

*Needs* means: imports the name ``RolloutState``, or anything from
``routeplay.rollout.state`` (its codec, ``Status``, ``RoutingKind``: parts of
routeplay's own sample), at run time or under ``TYPE_CHECKING``. Naming it in a
docstring or comment is not a need. So the containers (buffer, batch, ledger, trace
store, checkpoint) and the lifecycle steps (``SampleRouting``) work on any
``RoutedSample``, and a framework's own sample never drags ``RolloutState`` in.

Allowed, each for a stated reason:

- ``rollout/state.py``: ``RolloutState`` itself;
- ``rollout/checkpoint.py``: its calls take ``RolloutState``'s codec as their default
  (``codec=``; any sample type passes its own, and nothing else there names the state);
- ``rollout/__init__.py``: the package facade re-exports it (names only, resolved lazily);
- ``pipeline/``: the demo, a user of the library that picked ``RolloutState`` as its
  sample type, as XTuner picks its own;
- ``bench/``: the benchmark's session workloads, a user of the same kind.
"""

from __future__ import annotations

import ast
from pathlib import Path

import routeplay

PACKAGE = Path(routeplay.__file__).parent
ALLOWED = {
    "rollout/state.py",
    "rollout/checkpoint.py",
    "rollout/__init__.py",
}
ALLOWED_FOLDERS = ("pipeline/", "bench/")


def needs(source: str) -> list[str]:
    """Each import in ``source`` that makes the module need ``RolloutState``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [alias.name for alias in node.names]
            if node.module == "routeplay.rollout.state":
                found.append(f"line {node.lineno}: from routeplay.rollout.state import {names}")
            elif "RolloutState" in names:
                found.append(f"line {node.lineno}: imports RolloutState from {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {alias.name}"
                for alias in node.names
                if alias.name == "routeplay.rollout.state"
            ]
        elif isinstance(node, ast.Attribute) and node.attr == "RolloutState":
            found.append(f"line {node.lineno}: uses .RolloutState")
    return found


def test_no_module_outside_rolloutstates_own_needs_it() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in ALLOWED or name.startswith(ALLOWED_FOLDERS):
            continue
        found = needs(path.read_text(encoding="utf-8"))
        if found:
            offenders[name] = found
    assert offenders == {}


def test_the_allowed_modules_exist() -> None:
    # A renamed module must not leave a stale allowance behind.
    assert all((PACKAGE / name).is_file() for name in ALLOWED)


def test_the_scan_finds_each_kind_of_need() -> None:
    source = "\n".join(
        [
            '"""RolloutState in a docstring is no need."""',
            "from routeplay.rollout.state import ROLLOUT_STATE_CODEC",
            "from routeplay.rollout import RolloutState",
            "import routeplay.rollout.state",
            "x = routeplay.rollout.RolloutState",
            "from routeplay.rollout.sample_routing import SampleRouting",
        ]
    )
    assert sorted(f.split(":")[0] for f in needs(source)) == [
        "line 2",
        "line 3",
        "line 4",
        "line 5",
    ]
