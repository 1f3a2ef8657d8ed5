"""No module outside ``routeplay.core.wires`` names a field of an engine body.

Every string literal in ``src/routeplay`` (docstrings and other bare string statements
aside: they document, they do not read or build bodies) is checked against the field
names of the engines' bodies; a literal that *is* one of them, outside the wire modules,
means a second place knows the protocol.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import routeplay

PACKAGE = Path(routeplay.__file__).parent
WIRES = PACKAGE / "core" / "wires"
BODY_FIELDS = frozenset(
    {
        "routed_experts",
        "prompt_routed_experts",
        "routed_experts_start_len",
        "routed_experts_prompt_start",
        "return_routed_experts",
        "return_meta_info",
        "include_stop_str_in_output",
        "return_logprob",
        "return_token_ids",
        "meta_info",
        "sglext",
        "sgl_ext",
        "choices",
        "usage",
        "prompt_tokens",
        "completion_tokens",
        "input_tokens",
        "output_tokens",
        "output_ids",
        "output_token_logprobs",
        "token_logprobs",
    }
)
# verl's path in the bench builds verl's own DataProto, and the verl integration fills
# verl's model inputs, whose key for the routes is the engine field's name: a trainer's
# format, not an engine body.
TRAINER_FORMATS = {PACKAGE / "bench" / "verl_path.py", PACKAGE / "integrations" / "verl.py"}
MODULES = sorted(
    p for p in PACKAGE.rglob("*.py") if WIRES not in p.parents and p not in TRAINER_FORMATS
)


def _field_literals(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    documenting = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in documenting
        and node.value in BODY_FIELDS
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_body_field_name_outside_the_wire_modules(path: Path) -> None:
    found = _field_literals(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(PACKAGE)} names engine body fields: {found}"


def test_the_check_finds_field_names_in_code_and_not_in_docstrings() -> None:
    code = '"""routed_experts in a docstring"""\nx = {"meta_info": 1}\n"usage"\ny = f"{x}"\n'
    assert _field_literals(code) == [(2, "meta_info")]


def test_the_wire_modules_do_name_the_fields() -> None:
    # Guard against a check that silently scans nothing: the wire modules hold them all.
    names = {
        value
        for path in WIRES.glob("*.py")
        for _, value in _field_literals(path.read_text(encoding="utf-8"))
    }
    assert {"routed_experts", "meta_info", "sglext", "choices", "usage"} <= names
    assert {"output_ids", "output_token_logprobs", "return_logprob"} <= names
    assert len(MODULES) > 20


def test_the_reference_server_builds_bodies_without_the_fakes() -> None:
    # The server and the fakes share the wire modules' body builders; neither copies the other.
    for module in ("engine/server.py", "engine/requests.py"):
        tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "routeplay.rollout.fake_engines" not in imported, module
        assert any(name and name.startswith("routeplay.core.wires") for name in imported)
