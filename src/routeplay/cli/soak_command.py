"""``routeplay soak``: the demo pipeline for N steps under injected faults.

Runs the demo's smoke recipe (``routeplay.pipeline.config``) with the faults of
``routeplay.pipeline.faults.FaultConfig`` (a seed makes a run repeatable), prints the
report (``routeplay.pipeline.soak_report``) and writes it as JSON with ``--json``.
Exit status: 0 when every invariant holds, 2 when one failed, 1 on usage errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from routeplay.cli.options import engine_format_option

if TYPE_CHECKING:
    from routeplay.pipeline.soak import SoakConfig

EXIT_OK, EXIT_USAGE, EXIT_BROKEN = 0, 1, 2


def soak_command(
    steps: Annotated[int, typer.Option(min=1, help="RL steps.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of the fault draws and of the demo.")] = 0,
    rate: Annotated[
        float | None,
        typer.Option(min=0.0, max=1.0, help="One per-step rate for every fault kind."),
    ] = None,
    key_ttl: Annotated[
        float, typer.Option("--key-ttl", min=0.5, help="Engine-store TTL in seconds.")
    ] = 5.0,
    kill_between_jobs: Annotated[
        bool,
        typer.Option(
            "--kill-between-jobs",
            help="Kill rollout workers before a step's jobs reach them, not mid-job.",
        ),
    ] = False,
    num_cpus: Annotated[
        int | None, typer.Option("--num-cpus", min=1, help="CPUs of the local Ray instance.")
    ] = None,
    engine_format: Annotated[
        str | None,
        engine_format_option(
            "Wire format the engine speaks (default: the smoke recipe's lmdeploy-key; "
            "vllm or sglang run the group writes)."
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the report as JSON here.")
    ] = None,
) -> int:
    """Run the demo pipeline under injected faults and check that nothing leaks.

    Example:
        routeplay soak --steps 20 --seed 3 --json build/soak.json
    """
    from routeplay.errors import MisuseError
    from routeplay.pipeline.progress import RichProgress
    from routeplay.pipeline.soak import run_soak
    from routeplay.pipeline.soak_report import render_soak, write_soak_json

    console = Console()
    try:
        config = soak_config(
            steps=steps,
            seed=seed,
            rate=rate,
            key_ttl=key_ttl,
            kill_between_jobs=kill_between_jobs,
            num_cpus=num_cpus,
            engine_format=engine_format,
        )
    except MisuseError as exc:
        Console(stderr=True).print(f"usage error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from exc
    with RichProgress(config.steps, console) as progress:
        report = run_soak(config, progress)
    render_soak(report, console)
    if json_path is not None:
        write_soak_json(report, json_path)
        console.print(f"report written to {json_path}", markup=False)
    return EXIT_OK if report.ok else EXIT_BROKEN


def soak_config(
    *,
    steps: int,
    seed: int,
    rate: float | None,
    key_ttl: float,
    kill_between_jobs: bool,
    num_cpus: int | None,
    engine_format: str | None,
) -> SoakConfig:
    """The soak run the command's options describe (``MisuseError`` on a bad value).

    Example:
        >>> soak_config(steps=20, seed=3, rate=None, key_ttl=5.0,
        ...             kill_between_jobs=False, num_cpus=None, engine_format="sglang")
    """
    from routeplay.pipeline.faults import FAULT_KINDS, FaultConfig
    from routeplay.pipeline.soak import SoakConfig

    faults = FaultConfig(seed=seed, worker_kill_in_flight=not kill_between_jobs)
    if rate is not None:
        faults = faults.replace(**dict.fromkeys(FAULT_KINDS, rate))
    config = SoakConfig(steps=steps, faults=faults, key_ttl_s=key_ttl)
    demo = config.demo.replace(seed=seed, num_cpus=num_cpus)
    if engine_format is not None:
        demo = demo.replace(wire=engine_format)
    return config.replace(demo=demo)
