"""verl's data path against routeplay's (``routeplay.bench.verl_step``) as one table.

The results' ``verl_step`` object: ``shape`` (samples, prompt, response, dp, tp, pp,
passes, pack_tokens, runs), ``model``, ``verl_batch`` (verl's ``DataProto`` or the numpy
stand-in), ``stages``, ``paths`` -> ``verl`` / ``routeplay`` -> ``median_ms``, ``min_ms``,
``max_ms``, ``bytes_into`` (per node role), ``bytes_into_ranks``, ``rank_peak_bytes``,
``driver_routing_bytes``, ``runs``; ``verl_over_routeplay`` (step_time,
bytes_into_driver_node, bytes_into_trainer_node, bytes_into_ranks, rank_peak,
driver_routing), ``rows_checked`` and ``store_end``.

Example:
    console.print(verl_step_table(results))
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["verl_step_table"]

LABELS = {"verl": "verl (DataProto)", "routeplay": "routeplay"}
COLUMNS = (
    "path",
    "step ms \\[min-max]",  # escaped: rich would take [min-max] for markup
    "into driver node",
    "into trainer node",
    "into ranks",
    "rank peak",
    "driver routing",
)
RATIOS = (
    "step_time",
    "bytes_into_driver_node",
    "bytes_into_trainer_node",
    "bytes_into_ranks",
    "rank_peak",
    "driver_routing",
)


def verl_step_table(results: dict[str, Any]) -> Table:
    """One row per path (the step's median [min-max], bytes into the driver's and the
    trainer's node, into the rank processes, a rank's peak, the routing the driver
    held), then verl's figures over routeplay's. A results file without the section
    gives an empty table.

    Example:
        console.print(verl_step_table(results))
    """
    section = results.get("verl_step", {})
    table = Table(title=_title(section))
    for column in COLUMNS:
        table.add_column(column, no_wrap=True)
    paths = section.get("paths", {})
    for path, label in LABELS.items():
        if path in paths:
            table.add_row(label, *_cells(paths[path]))
    if ratios := section.get("verl_over_routeplay"):
        table.add_row("verl / routeplay", *(_times(ratios[key]) for key in RATIOS))
    return table


def _title(section: dict[str, Any]) -> str:
    shape = section.get("shape", {})
    if not shape:
        return "verl's data path against routeplay's: not measured"
    return (
        f"verl's R3 data path against routeplay's: a step (the batch to the driver, then "
        f"{shape['passes']} passes) over {shape['samples']} samples of prompt "
        f"{shape['prompt']} + response {shape['response']} tokens (padded), "
        f"{section.get('model', '?')}, DP{shape['dp']} x TP{shape['tp']} x PP{shape['pp']} "
        f"ranks (medians of {shape['runs']})"
    )


def _cells(figures: dict[str, Any]) -> tuple[str, ...]:
    into = figures["bytes_into"]
    return (
        f"{figures['median_ms']:.0f} \\[{figures['min_ms']:.0f}-{figures['max_ms']:.0f}]",
        _size(into["head"]),
        _size(into["trainer"]),
        _size(figures["bytes_into_ranks"]),
        _size(figures["rank_peak_bytes"]),
        _size(figures["driver_routing_bytes"]),
    )


def _size(nbytes: int) -> str:
    """Bytes in the largest unit that keeps a number at least 1 (KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _times(ratio: float) -> str:
    """A ratio as ``12.5x``; thousands grouped (a node routeplay wrote nothing to counts
    as 1 B, so verl's bytes there read as the ratio)."""
    return f"{ratio:,.0f}x" if ratio >= 1000 else f"{ratio:g}x"
