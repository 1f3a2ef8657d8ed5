"""``routeplay inspect``: decode and validate one engine HTTP response body from a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from routeplay.core import Engine, EngineRouting, RouteSpec, preset, read_response
from routeplay.errors import MalformedPayload, RouteplayError, SpecMismatch

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2


def inspect_command(
    path: Annotated[Path, typer.Argument(help="File holding one whole JSON response body.")],
    engine: Annotated[Engine, typer.Option(help="Engine that produced the body.")],
    layers: Annotated[int | None, typer.Option("--layers", help="MoE layers (L).")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Experts per token (K).")] = None,
    experts: Annotated[int | None, typer.Option("--experts", help="Experts per layer (E).")] = None,
    model: Annotated[
        str | None, typer.Option("--preset", help="Model preset instead of L/K/E.")
    ] = None,
    choice: Annotated[
        int, typer.Option(min=0, help="Choice of an OpenAI body, or element of a batched list.")
    ] = 0,
    start_row: Annotated[
        int,
        typer.Option(
            "--start-row",
            min=0,
            help="First routing row the request asked for (SGLang routed_experts_start_len, "
            "vLLM routed_experts_prompt_start): engines never echo it.",
        ),
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> int:
    """Decode and validate the routed experts in an engine response, never executing bytes."""
    console = Console()
    try:
        spec = _spec(layers, top_k, experts, model)
        text = path.read_bytes()
    except (typer.BadParameter, SpecMismatch, OSError) as exc:
        Console(stderr=True).print(f"usage error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        result = read_response(
            engine,
            _parse_json(text, path),
            spec,
            choice=choice,
            start_row=start_row,
            where=path.name,
        )
    except RouteplayError as exc:  # bad data, or a body that asks for something impossible
        _report_refusal(console, exc, as_json)
        raise typer.Exit(EXIT_REFUSED) from exc
    report = _summary(result)
    if as_json:
        console.out(json.dumps(report), highlight=False)
    else:
        _print_table(console, report, result)
    raise typer.Exit(EXIT_OK)


def _spec(
    layers: int | None, top_k: int | None, experts: int | None, model: str | None
) -> RouteSpec:
    if model is not None:
        return preset(model)
    if layers is None or top_k is None or experts is None:
        raise typer.BadParameter("give --layers, --top-k and --experts, or --preset")
    return RouteSpec(num_layers=layers, top_k=top_k, num_experts=experts)


def _parse_json(text: bytes, path: Path) -> Any:
    try:
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise MalformedPayload(
            "response body is not UTF-8 text",
            expected="a UTF-8 JSON document",
            found=f"byte {exc.start} = {text[exc.start : exc.start + 1]!r}",
            where=path.name,
        ) from exc
    except json.JSONDecodeError as exc:
        raise MalformedPayload(
            "response body is not JSON",
            expected="one JSON object",
            found=f"{exc.msg} at line {exc.lineno} column {exc.colno}",
            where=path.name,
        ) from exc
    except RecursionError as exc:  # nesting deeper than the interpreter's stack
        raise MalformedPayload(
            "response body nests too deeply to parse",
            expected=f"JSON nested less than about {sys.getrecursionlimit()} levels",
            found="deeper nesting",
            where=path.name,
        ) from exc
    except ValueError as exc:  # an integer over sys.get_int_max_str_digits() digits
        raise MalformedPayload(
            "response body holds a number too long to parse",
            expected=f"integers of at most {sys.get_int_max_str_digits()} digits",
            found=str(exc)[:160],
            where=path.name,
        ) from exc


def _summary(result: EngineRouting) -> dict[str, Any]:
    return {"ok": True, **result.summary()}


def _report_refusal(console: Console, exc: RouteplayError, as_json: bool) -> None:
    if as_json:
        report = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        console.out(json.dumps(report), highlight=False)
        return
    console.print(f"refused ({type(exc).__name__}): {exc}", style="bold red", markup=False)


def _print_table(console: Console, report: dict[str, Any], result: EngineRouting) -> None:
    verdict = "valid" if result.routes is not None else "a store key (data not fetched)"
    table = Table(title=f"{result.engine.value} routed experts: {verdict}", show_header=False)
    for name, value in report.items():
        if name != "ok":
            table.add_row(name, Text(str(value)))
    console.print(table)
