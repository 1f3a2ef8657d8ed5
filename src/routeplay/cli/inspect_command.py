"""``routeplay inspect``: decode and validate one engine HTTP response body.

The body comes from a file, or from standard input (``-`` or no path), read with a cap
(``routeplay.cli.body``); the geometry from a model's ``config.json``, a preset or three
counts (``routeplay.cli.geometry``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from routeplay.cli.body import DEFAULT_MAX_BYTES, parse_body, read_body
from routeplay.cli.geometry import spec_from_flags
from routeplay.core import Engine, EngineRouting, read_response
from routeplay.errors import MisuseError, RouteplayError, SpecMismatch

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2


def inspect_command(
    engine: Annotated[Engine, typer.Option(help="Engine that produced the body.")],
    path: Annotated[
        Path | None,
        typer.Argument(help="File holding one whole JSON response body; - or none: stdin."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="The model's config.json (transformers) for L/K/E."),
    ] = None,
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
    max_bytes: Annotated[
        int, typer.Option("--max-bytes", min=1, help="Refuse a body larger than this.")
    ] = DEFAULT_MAX_BYTES,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> int:
    """Decode and validate the routed experts in an engine response, never executing bytes.

    Example: ``curl -s $URL -d @req.json | routeplay inspect --engine vllm --config
    Qwen3-30B-A3B/config.json -``
    """
    console = Console()
    try:
        spec = spec_from_flags(
            config=config, model=model, layers=layers, top_k=top_k, experts=experts
        )
        _refuse_a_terminal(path)
        text, where = read_body(path, max_bytes=max_bytes)
    except (MisuseError, SpecMismatch, OSError) as exc:
        Console(stderr=True).print(f"usage error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        body = parse_body(text, where)
        del text  # the parsed body is all that is needed from here on
        result = read_response(engine, body, spec, choice=choice, start_row=start_row, where=where)
    except RouteplayError as exc:  # bad data, or a body that asks for something impossible
        _report_refusal(console, exc, as_json)
        raise typer.Exit(EXIT_REFUSED) from exc
    report = _summary(result)
    if as_json:
        console.out(json.dumps(report), highlight=False)
    else:
        _print_table(console, report, result)
    raise typer.Exit(EXIT_OK)


def _refuse_a_terminal(path: Path | None) -> None:
    # No path and a terminal on stdin is a forgotten argument, not a body being typed:
    # waiting for input would look like a hang. An explicit ``-`` still reads it.
    if path is None and sys.stdin.isatty():
        raise MisuseError(
            "inspect has no body to read",
            expected="a file, or a body piped into standard input",
            found="no path and a terminal on standard input",
            hint="Pass the file, or pipe the body in: curl ... | routeplay inspect ... -",
        )


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
