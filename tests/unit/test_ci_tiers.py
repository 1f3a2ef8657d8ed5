"""The suite's two tiers: ``make test`` (what a newcomer runs first, under 6 minutes on a
fresh clone) leaves out the ``long`` end-to-end runs, ``make test-long`` runs exactly
those, and CI runs both, the newcomer's first, with the type check between them; the
modules the workers start with exist, and the bytecode warm-up's list names this venv's
modules."""

from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _recipe(target: str) -> str:
    """The recipe lines of a Makefile target."""
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert match, f"no target {target} in the Makefile"
    return match.group(1)


def test_make_test_leaves_the_long_runs_to_make_test_long() -> None:
    assert '-m "not long"' in _recipe("pytest")
    assert "-m long" in _recipe("test-long")
    assert "$(MAKE) --no-print-directory pytest" in _recipe("test")


def test_ci_runs_the_newcomers_suite_the_type_check_then_the_long_runs() -> None:
    commands = [
        line.strip()
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert commands.index("make test") < commands.index("make typecheck")
    assert commands.index("make typecheck") < commands.index("make test-long")
    assert "mypy" in _recipe("typecheck")


def test_the_modules_the_workers_start_with_exist() -> None:
    # Read, not imported: ``conftest`` names a module in several test folders.
    tree = ast.parse((ROOT / "tests/conftest.py").read_text())
    [names] = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "LONGEST_FIRST"
    ]
    assert names
    assert all((ROOT / "tests" / name).is_file() for name in names)


def test_the_bytecode_warm_up_lists_what_this_venv_imports() -> None:
    # scripts/warm-bytecode compiles requirements/warm-modules.txt's modules before the
    # tests: a list gone stale (a new lock without `--record`) would silently leave each
    # test worker and Ray process compiling torch and Ray again.
    purelib = Path(sysconfig.get_paths()["purelib"])
    listed = [
        purelib / folder / f"{module}.py"
        for folder, *modules in (
            line.split(" ")
            for line in (ROOT / "requirements/warm-modules.txt").read_text().splitlines()
        )
        for module in modules
    ]
    assert len(listed) > 5000
    missing = [path for path in listed if not path.is_file()]
    assert len(missing) < 0.05 * len(listed), missing[:10]
    for package in ("ray", "torch", "numpy", "transformers"):
        assert purelib / package / "__init__.py" in listed
