"""The realistic RL step's tables (``routeplay.bench.rl_step``): per step size and path,
the step split into its phases next to Ray's floor and verl's path, and each routeplay
path's shard calls by phase and operation.

The results' ``rl_step`` object: ``shape`` (the step: model, tokens, prompt, group, DP
ranks, pack length, step sizes, runs), ``verl_batch`` (verl's ``DataProto`` or the numpy
stand-in), ``points`` (one per step size: ``samples``, ``groups``, bytes, ``paths`` ->
path -> medians of ``ms`` and ``phases_ms``, ``per_sample_ms``, ``shard_calls``,
``calls_by_phase``, the shards' CPU, the garbage collections' CPU by process
(``gc_cpu_ms``) and how many were full (``gc_full``), ``over_ray_floor``, ``over_ray_owned``
(over Ray's floor with an owner actor; absent before it was measured); ``verl_over_producer``,
``verl_over_adopt``, ``skipped``) and ``store_end``.

Example:
    console.print(rl_step_table(results))
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["rl_calls_table", "rl_step_table"]

LABELS = {
    "producer": "routeplay producer",
    "adopt": "routeplay LMDeploy key",
    "ray_floor": "Ray's floor",
    "ray_owned": "Ray's floor, actor-owned",
    "verl": "verl",
}
PHASE_COLUMNS = (
    ("writes", "writes"),
    ("buffer", "buffer"),
    ("batch", "batch"),
    ("reads", "reads"),
    ("releases", "releases"),
)


def rl_step_table(results: dict[str, Any]) -> Table:
    """One row per step size and path: the step (median ms [min-max]), per sample, its
    phases (medians), shard calls and the shard's CPU, over Ray's floor, and verl's
    path over this one. A results file without the RL step gives an empty table.

    Example:
        console.print(rl_step_table(results))
    """
    section = results.get("rl_step", {})
    shape = section.get("shape", {})
    table = Table(
        title=f"an RL step, engine done -> every DP rank read its rows, nothing held (ms, "
        f"medians; generation: writes, buffer; the trainer's step: batch, reads, releases): "
        f"GRPO x{shape.get('group', '?')} of {shape.get('tokens', '?')} tokens "
        f"({shape.get('shared_prompt', '?')} shared), {shape.get('model', '?')}, "
        f"DP={shape.get('dp', '?')}"
    )
    columns = (
        "samples",
        "path",
        "step \\[min-max]",
        "ms/sample",
        *(label for _, label in PHASE_COLUMNS),
        "shard calls (/sample)",
        "shard CPU ms (calls|process)",
        "GC CPU ms: driver|rollout|ranks (full)",
        "x Ray's floor",
        "x actor-owned",
        "verl / this",
    )
    for column in columns:
        table.add_column(column, no_wrap=column in ("path", "step \\[min-max]"))
    for point in section.get("points", []):
        verl = point["paths"].get("verl", {}).get("median_ms")
        for path, label in LABELS.items():
            figures = point["paths"].get(path)
            if figures is None:
                why = point.get("skipped", {}).get(path, "not measured")
                table.add_row(str(point["samples"]), label, f"skipped: {why}")
                continue
            phases = figures["phases_ms"]
            table.add_row(
                str(point["samples"]),
                label,
                f"{figures['median_ms']:.0f} \\[{figures['min_ms']:.0f}-{figures['max_ms']:.0f}]",
                f"{figures['per_sample_ms']:.2f}",
                *(f"{phases[phase]:.1f}" for phase, _ in PHASE_COLUMNS),
                f"{figures['shard_calls']:.0f} ({figures['shard_calls_per_sample']:.2f})",
                f"{figures['shard_call_cpu_ms']:.0f}|{figures['shard_process_cpu_ms']:.0f}",
                _collections(figures),
                _times(figures.get("over_ray_floor")),
                _times(figures.get("over_ray_owned")),
                _times(verl / figures["median_ms"] if verl and path != "verl" else None),
            )
    return table


def rl_calls_table(results: dict[str, Any]) -> Table:
    """Per step size and routeplay path: the shard calls of each phase, by operation
    (what a batched call would fold into one).

    Example:
        console.print(rl_calls_table(results))
    """
    table = Table(title="an RL step's shard calls by phase and operation (its last run)")
    for column in ("samples", "path", *(label for _, label in PHASE_COLUMNS)):
        table.add_column(column, no_wrap=column in ("samples", "path"))
    for point in results.get("rl_step", {}).get("points", []):
        for path in ("producer", "adopt"):
            figures = point["paths"].get(path)
            if figures is None:
                continue
            calls = figures["calls_by_phase"]
            table.add_row(
                str(point["samples"]),
                LABELS[path],
                *(_ops(calls.get(phase, {})) for phase, _ in PHASE_COLUMNS),
            )
    return table


def _collections(figures: dict[str, Any]) -> str:
    """The garbage collections a run's allocations triggered (results before they were
    counted: "-")."""
    cpu = figures.get("gc_cpu_ms")
    if cpu is None:
        return "-"
    return f"{cpu['driver']:.0f}|{cpu['rollout']:.0f}|{cpu['ranks']:.0f} ({figures['gc_full']:.0f})"


def _ops(ops: dict[str, int]) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(ops.items())) or "-"


def _times(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"
