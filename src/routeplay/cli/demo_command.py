"""``routeplay demo``: the end-to-end RL loop on Ray with the reference engine.

Picks a recipe (``routeplay.pipeline.config.RECIPES``; ``default``: the R3 run, ``smoke``:
the tiny e2e run), applies a few overrides (``--trainer-dtype bf16`` runs the trainer in
the engine's precision), runs it
with progress bars, prints the report, and writes the JSON report and the timeline PNG.
Exit status: 0 when every invariant holds (no routing mismatch, nothing leaked, at most
one object-store write per payload), 2 when one failed, 1 on usage errors.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from routeplay.cli.options import engine_format_option

EXIT_OK, EXIT_USAGE, EXIT_BROKEN = 0, 1, 2


_TRAINER_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def _trainer_dtype(value: str) -> str:
    if value not in _TRAINER_DTYPES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(_TRAINER_DTYPES)}")
    return _TRAINER_DTYPES[value]


def demo_command(
    engine_format: Annotated[
        str | None,
        engine_format_option(
            "Wire format the engine speaks (default recipe: vllm; smoke: lmdeploy-key)."
        ),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help="RL steps (recipe default: 3; smoke: 2).")
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(help="Ray cluster to join (e.g. auto); default: start a local instance."),
    ] = None,
    recipe_name: Annotated[str, typer.Option("--recipe", help="default or smoke.")] = "default",
    trainer_dtype: Annotated[
        str | None,
        typer.Option(
            "--trainer-dtype",
            parser=_trainer_dtype,
            metavar="[fp32|bf16]",
            help="Trainer precision (recipe default: fp32; the engine is bf16).",
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of prompts and sampling.")] = None,
    num_cpus: Annotated[
        int | None, typer.Option("--num-cpus", min=1, help="CPUs of the local Ray instance.")
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the report as JSON here.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write the timeline PNG here (needs matplotlib).")
    ] = Path("build/demo/timeline.png"),
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Skip the PNG.")] = False,
) -> int:
    """Run the RL demo: engine, rollout workers, replay buffer, trainer with R3 replay."""
    from routeplay.errors import MisuseError
    from routeplay.pipeline.config import recipe
    from routeplay.pipeline.demo import run_demo
    from routeplay.pipeline.progress import RichProgress
    from routeplay.pipeline.report import render, write_json

    console = Console()
    try:
        config = recipe(recipe_name)
        overrides = {
            "wire": engine_format,
            "steps": steps,
            "address": address,
            "seed": seed,
            "num_cpus": num_cpus,
        }
        config = config.replace(**{k: v for k, v in overrides.items() if v is not None})
        if trainer_dtype is not None:
            config = config.replace(trainer=replace(config.trainer, dtype=trainer_dtype))
    except MisuseError as exc:
        Console(stderr=True).print(f"usage error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        with RichProgress(config.steps, console) as progress:
            report = run_demo(config, progress)
    except ConnectionError as exc:  # ray.init could not join --address
        Console(stderr=True).print(
            f"usage error: cannot join the Ray cluster at {address}: {exc}\n"
            "(a cluster with token authentication needs its token, see Ray's token-auth docs)",
            markup=False,
        )
        raise typer.Exit(EXIT_USAGE) from exc
    render(console, report)
    if json_path is not None:
        write_json(report, json_path)
        console.print(f"report: {json_path}")
    if plot is not None and not no_plot:
        from routeplay.pipeline.plot import plot_timeline

        plot_timeline(report, plot)
        console.print(f"timeline: {plot}")
    raise typer.Exit(EXIT_OK if report.ok else EXIT_BROKEN)
