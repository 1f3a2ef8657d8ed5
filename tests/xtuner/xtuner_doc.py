"""Run ``docs/xtuner.md`` as written: its ``python`` blocks in order, in one namespace and
one event loop (top-level ``await`` allowed, as in a notebook), and its patch blocks
applied to XTuner's own source.

A patch block is fenced ```` ```python patch=<file>:<first>-<last> <Qualified.name> ````:
its lines replace lines ``first..last`` (1-based, inclusive) of ``<file>`` in the XTuner
checkout (commit ``b934f462``), inside the function or method ``<Qualified.name>``. The
function is rebuilt from XTuner's file with every patch of it so far and bound where
XTuner's modules see it (the class, the module, and every XTuner module that imported it
by name), its globals being XTuner's module's plus the page's namespace (the recipe's
helpers the patched lines call, as an ``import`` at the top of XTuner's file would give
them). No XTuner line is copied: the patched function is made from the checkout.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FunctionType, ModuleType
from typing import Any

FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
PATCH = re.compile(r"patch=(?P<file>[\w/.]+):(?P<first>\d+)-(?P<last>\d+)\s+(?P<name>[\w.]+)")


@dataclass(frozen=True)
class Block:
    """One fenced ``python`` block of the page."""

    code: str
    line: int
    """Line of the page the block's code starts on."""
    patch: Patch | None = None


@dataclass(frozen=True)
class Patch:
    """Lines of an XTuner file that a block replaces, inside one function."""

    file: str
    first: int
    last: int
    name: str

    @property
    def module(self) -> str:
        return self.file.removesuffix(".py").replace("/", ".")

    @property
    def replaced(self) -> int:
        return self.last - self.first + 1


def blocks(markdown: str) -> list[Block]:
    """Every ``python`` block of the page, in order."""
    found = []
    for match in FENCE.finditer(markdown):
        info, code = match.group(1).strip(), match.group(2)
        line = markdown.count("\n", 0, match.start(2)) + 1
        patch = PATCH.fullmatch(info)
        if info and patch is None:
            raise ValueError(f"line {line}: unknown python block info {info!r}")
        found.append(
            Block(
                code=code,
                line=line,
                patch=Patch(
                    file=patch["file"],
                    first=int(patch["first"]),
                    last=int(patch["last"]),
                    name=patch["name"],
                )
                if patch
                else None,
            )
        )
    return found


class Patcher:
    """Applies the page's patches to XTuner's modules; ``undo`` puts XTuner back."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.patches: dict[tuple[str, str], list[tuple[Patch, str]]] = {}
        self.originals: dict[tuple[str, str], Any] = {}
        self.bound: list[tuple[object, str, Any]] = []
        self.current: dict[tuple[str, str], Any] = {}

    def apply(self, patch: Patch, code: str, namespace: dict[str, Any]) -> None:
        key = (patch.module, patch.name)
        module = importlib.import_module(patch.module)
        if key not in self.originals:
            self.originals[key] = _lookup(module, patch.name)
        self.patches.setdefault(key, []).append((patch, code))
        original = self.originals[key]
        function = inspect.unwrap(original)
        lines, start = inspect.getsourcelines(function)
        path = Path(inspect.getsourcefile(function) or "")
        assert path.resolve() == (self.root / patch.file).resolve(), (path, patch.file)
        stop = start + len(lines) - 1
        new = list(lines)
        for each, text in sorted(self.patches[key], key=lambda p: -p[0].first):
            if not start < each.first <= each.last <= stop:
                raise AssertionError(
                    f"{each.file}:{each.first}-{each.last} is not inside {patch.name} "
                    f"(lines {start}-{stop}): is the XTuner checkout at b934f462?"
                )
            body = [line + "\n" for line in text.rstrip("\n").split("\n")]
            new[each.first - start : each.last - start + 1] = body
        source = textwrap.dedent("".join(new))
        code = compile(source, f"<patched {patch.file}:{patch.name}>", "exec")
        for name in sorted(_global_names(code) - module.__dict__.keys()):
            if name in namespace:  # the recipe's helpers, as an import in XTuner's file
                self._set(module, name, namespace[name])
        scope: dict[str, Any] = {}
        exec(code, module.__dict__, scope)
        made = scope[function.__name__]
        patched = FunctionType(
            made.__code__, module.__dict__, made.__name__, made.__defaults__, made.__closure__
        )
        patched.__kwdefaults__ = made.__kwdefaults__
        patched.__qualname__ = function.__qualname__
        self._bind(module, patch.name, original, patched)

    def _bind(self, module: ModuleType, name: str, original: Any, patched: FunctionType) -> None:
        owner_name, _, attr = name.rpartition(".")
        if owner_name:
            self._set(_lookup(module, owner_name), attr, patched)
        else:  # the module, and every XTuner module that imported the function by name
            earlier = self.current.get((module.__name__, name), original)
            for other in list(sys.modules.values()):
                held = getattr(other, "__dict__", {}).get(attr)
                named = getattr(other, "__name__", "")
                if named.startswith("xtuner.") and (held is original or held is earlier):
                    self._set(other, attr, patched)
        self.current[(module.__name__, name)] = patched

    def _set(self, owner: object, attr: str, value: Any) -> None:
        self.bound.append((owner, attr, owner.__dict__.get(attr, _ABSENT)))
        setattr(owner, attr, value)

    def undo(self) -> None:
        for owner, attr, value in reversed(self.bound):
            if value is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)
        self.bound.clear()


_ABSENT = object()


def _global_names(code: CodeType) -> set[str]:
    """Every global name a compiled block (and the functions in it) may load."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _global_names(const)
    return names


def _lookup(module: ModuleType, dotted: str) -> Any:
    value: Any = module
    for part in dotted.split("."):
        value = value.__dict__[part] if isinstance(value, type) else getattr(value, part)
    return value


def run(
    markdown: str, namespace: dict[str, Any], patcher: Patcher, *, stop_at: int | None = None
) -> Iterator[Block]:
    """Run the page's blocks in order in ``namespace`` (one event loop for all), patches
    applied as they come; yields each block once it ran. Raises what a block raises, with
    the page line in a note."""
    loop = asyncio.new_event_loop()
    try:
        for block in blocks(markdown):
            if stop_at is not None and block.line > stop_at:
                return
            try:
                if block.patch is not None:
                    patcher.apply(block.patch, block.code, namespace)
                else:
                    _execute(block, namespace, loop)
            except BaseException as exc:
                exc.add_note(f"docs/xtuner.md, the block at line {block.line}")
                raise
            yield block
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _execute(block: Block, namespace: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code = compile(block.code, f"<docs/xtuner.md:{block.line}>", "exec", flags=flags)
    result = eval(code, namespace)  # the page's own code, by design
    if inspect.iscoroutine(result):
        asyncio.set_event_loop(loop)
        loop.run_until_complete(result)
