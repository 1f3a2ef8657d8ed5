"""No import circle inside ``routeplay``: every import counts, a lazy one inside a function
and one under ``TYPE_CHECKING`` alike (each only hides a circle from the interpreter, not
from a reader: two modules that need each other are one concern split in two).

The graph is read from the source (``ast``), so the test sees the imports a run would
not execute.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` under ``root``."""
    found = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(tree: ast.AST, known: dict[str, Path], package: str) -> Iterator[str]:
    """The modules of ``package`` an ``ast`` imports (``from a import b``: ``a.b`` when
    that is a module, else ``a``), wherever the import statement sits."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name == package or name.startswith(package + "."):
                yield _nearest_module(name, known)


def _nearest_module(name: str, known: dict[str, Path]) -> str:
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports."""
    known = modules(root, package)
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[name] = {target for target in imported(tree, known, package) if target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append((step, iter(sorted(graph.get(step, ())))))
            elif step in on_stack:
                low[node] = min(low[node], index[step])
    return found


def test_routeplay_has_no_import_circle() -> None:
    graph = import_graph(SRC, "routeplay")
    assert len(graph) > 100  # the walk found the package
    assert circles(graph) == []


def test_the_check_finds_circles_hidden_by_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n"
    )
    (package / "c.py").write_text("def f():\n    import pkg.a\n")
    (package / "d.py").write_text("import pkg.a\n")  # on no circle
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
