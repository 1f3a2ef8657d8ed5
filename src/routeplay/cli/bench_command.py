"""``routeplay bench``: the data path side by side, on a local 3-node Ray cluster.

A thin command over ``routeplay.bench`` (``benchmarks/data_path.py`` is the same run as
a script): eager vs routeplay's producer path vs the adopted-key path vs the physical
limit, measured in one run, then the realistic RL step (``routeplay.bench.rl_step``:
routeplay vs Ray's floor vs verl's path at several step sizes, on a cluster of its own),
then verl's R3 data path against routeplay's on verl's DP x TP x PP Megatron ranks
(``routeplay.bench.verl_step``: step time, bytes into the driver's and the trainer's
node and into the ranks, a rank's peak, the driver's routing, on a cluster of its own);
prints the tables, writes the results file (named for what, where and when) into
``--out-dir``, a copy to ``--json`` and the scaling PNG.
Exit status: 0 on success, 2 when the paths delivered different rows, a step leaked or a
path beat its physical limit (a lower bound: its measurement is off), 1 on usage errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

EXIT_OK, EXIT_USAGE, EXIT_BROKEN = 0, 1, 2


def bench_command(
    quick: Annotated[
        bool, typer.Option("--quick", help="A few minutes instead of the full run.")
    ] = False,
    smoke: Annotated[bool, typer.Option("--smoke", help="Seconds: tiny payloads (tests).")] = False,
    runs: Annotated[
        int | None,
        typer.Option(
            min=1, help="Timed runs per path (default 5; the RL step's: 3; verl's path: 5)."
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the results here.")
    ] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Folder of the results file.")] = Path(
        "benchmarks/results"
    ),
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write the scaling PNG.")] = True,
    address: Annotated[
        str | None,
        typer.Option(
            help="Run on this Ray cluster (one node per role: resources head, engine, "
            "rollout, trainer) instead of a local one of its own."
        ),
    ] = None,
) -> int:
    """Benchmark the routing data path: eager vs routeplay vs the physical limit.

    Example: ``routeplay bench --quick --json build/bench/quick.json``
    """
    import dataclasses

    from routeplay.bench.measure import run_bench
    from routeplay.bench.report import (
        adoption_table,
        below_limit,
        phases_table,
        scaling_table,
        sessions_table,
        workload_table,
        write_plot,
        write_results,
    )
    from routeplay.bench.rl_report import rl_calls_table, rl_step_table
    from routeplay.bench.rl_step import rl_steps
    from routeplay.bench.verl_report import verl_step_table
    from routeplay.bench.verl_step import verl_steps
    from routeplay.bench.workloads import BenchConfig
    from routeplay.errors import MisuseError

    console = Console()
    if quick and smoke:
        Console(stderr=True).print(
            "usage error: --quick and --smoke exclude each other", markup=False, soft_wrap=True
        )
        return EXIT_USAGE
    config = BenchConfig.smoke() if smoke else BenchConfig.quick() if quick else BenchConfig.full()
    if runs is not None:
        rl_step = dataclasses.replace(config.rl_step, runs=runs)
        verl_step = dataclasses.replace(config.verl_step, runs=runs)
        config = dataclasses.replace(config, runs=runs, rl_step=rl_step, verl_step=verl_step)

    def progress(line: str) -> None:
        console.print(line, markup=False)

    try:
        results = run_bench(config, address=address, progress=progress)
        results["rl_step"] = rl_steps(config.rl_step, address=address, progress=progress)
        results["verl_step"] = verl_steps(config.verl_step, address=address, progress=progress)
    except MisuseError as exc:  # --address: a cluster without a node per role
        Console(stderr=True).print(f"usage error: {exc}", markup=False)
        return EXIT_USAGE
    except RuntimeError as exc:  # the paths disagreed on the rows they delivered, or leaked
        Console(stderr=True).print(f"broken: {exc}", markup=False)
        return EXIT_BROKEN
    wide = Console(width=max(console.width, 180))  # the tables have many columns
    wide.print(workload_table(results))
    wide.print(phases_table(results))
    wide.print(adoption_table(results))
    wide.print(scaling_table(results))
    wide.print(sessions_table(results))
    wide.print(rl_step_table(results))
    wide.print(rl_calls_table(results))
    wide.print(verl_step_table(results))
    path = write_results(results, config, out_dir, json_path=json_path)
    console.print(f"results: {path}", markup=False)
    if plot:
        png = write_plot(results, path.with_suffix(".png"))
        console.print(f"plot: {png}", markup=False)
    if beaten := below_limit(results):  # the limit is a lower bound: its measurement is off
        Console(stderr=True).print(
            "broken: a path beat its physical limit (a lower bound), so the limit was "
            "mismeasured:\n  " + "\n  ".join(beaten),
            markup=False,
        )
        return EXIT_BROKEN
    return EXIT_OK
