"""The data-path benchmark's outputs: the results file, the tables, the scaling plot.

The results file is named for what, where and when (``data-path_quick_<host>_<UTC>.json``)
and holds the configuration and library versions next to the figures. Its ``workloads``
list has, per workload, ``name``, ``eager_ms``, ``routeplay_ms`` (producer path),
``adopt_ms`` (the engine store validating each payload as it is put),
``adopt_at_step_ms`` (each payload validated when adopted; the name is kept from when
that adoption ran on the step), ``limit_ms`` (medians of steps), ``adoption_p50_ms`` and
``adoption_p99_ms`` (the adopt path's adoption per sample as the rollout saw it, before
the step), ``bytes_written``, ``bytes_pulled`` and ``peak_rank_bytes`` (each a mapping
eager/producer/adopt -> figure), and each path's full figures under its own key
(``eager``, ``producer``, ``adopt``, ``adopt_at_step``: median/min/max, runs, core-ms,
bytes, per-node bytes; the adopted-key paths' ``adoption_ms``: p50, p99, samples,
calls; absent from files before 2026-12-06, whose adopted-key steps held the adoption).
Its ``sessions`` object holds the multi-turn bytes (``routeplay.bench.sessions``):
``shape`` (the session and rollout sizes) and ``wires`` -> wire -> ``session`` /
``partial`` -> ``unique_rows``, ``before`` / ``after`` compaction (``stored_per_unique_row``
from the route store, ``object_store_per_unique_row`` from Ray's raylets, ``segments``,
``payloads``), ``written_per_unique_row``, ``engine_side_per_unique_row``,
``compaction`` (``ms``, rows copied, bytes written), ``rows_exact`` and
``left_after_release``.
Each routeplay path's figures carry ``phases_ms`` (``outside_ranks``, ``acquire``,
``read``: where its steps went), shown by ``phases_table`` next to Ray's own floor;
``adoption_table`` shows the adoptions next to the read that follows them.

Example:
    path = write_results(results, config, Path("benchmarks/results"))
    console.print(workload_table(results))
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from rich.table import Table

import routeplay
from routeplay.bench.workloads import BenchConfig

if TYPE_CHECKING:  # matplotlib loads only when a plot is drawn
    from matplotlib.figure import Figure

__all__ = [
    "adoption_table",
    "below_limit",
    "goals",
    "phases_table",
    "results_stem",
    "scaling_figure",
    "scaling_table",
    "sessions_table",
    "workload_table",
    "write_plot",
    "write_results",
]


def results_stem(config: BenchConfig, when: datetime) -> str:
    """``data-path_<mode>_<host>_<YYYY-MM-DDTHHMMZ>``: what, where, when."""
    return f"data-path_{config.mode}_{platform.node()}_{when:%Y-%m-%dT%H%MZ}"


def envelope(results: dict[str, Any], config: BenchConfig, when: datetime) -> dict[str, Any]:
    """The results with what was run, where and with which versions."""
    return {
        "benchmark": "data_path",
        "when": when.isoformat(timespec="seconds"),
        "where": {"host": platform.node(), "cpu_count": os.cpu_count(), "nodes": 4},
        "config": dataclasses.asdict(config),
        "definitions": {
            "wall": (
                "a path's step, engine finished -> every SP rank holds its rows (driver "
                "clock); on the adopted-key paths the step starts once the rollout worker "
                "has adopted every sample (adoption_ms, apart), and holds the hop that "
                "hands the handles on and the ranks' acquire and read"
            ),
            "bytes_written": (
                "object-store bytes created on the head, engine and rollout nodes from "
                "before the path's first write to the step's end (adopt: from the engine's "
                "first put, less the engine's own payloads, since the engine store "
                "validates and narrows each payload as it is put; adopt_at_step: from "
                "before the adoption, which writes the validated rows near the engine)"
            ),
            "adopt": (
                "the adopted-key path with the engine store validating each payload as the "
                "engine puts it (start_engine_store(spec=...); routeplay.store.engine.ingest); "
                "adopt_at_step (the name kept from when this adoption ran on the step; "
                "shown as 'adopt validated at adoption'): the engine store without a spec, "
                "each payload validated near the engine when adopted; a GRPO group's keys "
                "are always validated at adoption (their layout needs every member's "
                "rows); both adopt before the step (adoption_ms), so their steps are the "
                "trainer's read of rows already validated; a workload runs the routeplay "
                "paths, then the limit, then the eager path (whose gigabytes Ray frees "
                "afterwards)"
            ),
            "adoption_ms": (
                "per adopted-key path: the adoption as the rollout sees it when a sample "
                "completes, timed by the rollout worker around each call (perf_counter): "
                "right after the engine has put the step's keys, the samples are adopted "
                "one after another, one adopt_key each (a GRPO group's keys in one "
                "adopt_keys(shared_prefix=...), each member counted with its group's "
                "call), each back once its rows' validation has ended accepting them (a "
                "validation at ingest still running is waited for; a raw payload is "
                "validated near the engine and waited for); p50 and p99 over every sample "
                "adopted in the path's timed runs, samples (adopted) and calls; not in "
                "the step's time, bytes counted with the path's; adoption_p50_ms and "
                "adoption_p99_ms: the adopt path's (absent before 2026-12-06, when the "
                "step held the adoption of all its keys in one call)"
            ),
            "bytes_pulled": "object-store bytes created on the trainer node (pulled there)",
            "peak_rank_bytes": "largest routing bytes one rank held at once",
            "core_ms": (
                "busy CPU core-ms of the driver's machine during a path's step (median; "
                "every node's when the cluster is local, Ray's daemons included: an upper "
                "bound of the path's own; routeplay.bench.host_cpu); the table's a-pull is "
                "the limit's adopt-path pull, timed around the whole call; the adopted-key "
                "paths' leave out the adoption and its validation (at ingest while the "
                "engine put its payloads, or at adoption; validate_ms: one core's time for "
                "it); before 2026-12-06 adopt_at_step's included it"
            ),
            "validate_ms": (
                "one core validating the step's engine payloads on the engine node (best "
                "of runs): the adopted-key path's CPU beyond the producer path's"
            ),
            "bare_ray": (
                "the producer path's objects on plain Ray (ray.put on the rollout node, each "
                "rank ray.get + copy of its rows), median: Ray's own floor for that path; "
                "its runs alternate with the producer path's (which goes first alternates; "
                "config.pair_runs pairs, so the producer and adopt paths have that many "
                "runs); "
                "producer_beyond_bare_ray_ms is the median of the pairs' differences, "
                "producer_minus_bare_ray_medians_ms the difference of the two medians; "
                "bare_ray_fetch: the same for the adopt path (the objects already on the "
                "engine node, as validation at ingest leaves them; each rank ray.get + "
                "copy), paired with the adopt runs: adopt_beyond_bare_ray_fetch_ms"
            ),
            "phases_ms": (
                "per path, medians over its runs of where a step's time went, as its "
                "slowest rank (longest acquire + read, rank clock) saw it: that rank's "
                "acquire and read, and outside_ranks, the rest of the step (the rollout "
                "worker's hop: the producer's write, or handing on the handles adopted "
                "before the step, adoption in it before 2026-12-06; the calls to the "
                "ranks and their answers); bare_ray_fetch_rank_ms: the median over the "
                "bare_ray_fetch runs of their slowest rank's own fetch and copy (rank "
                "clock); adopt_read_beyond_bare_ray_fetch_ms: the median of the adopt "
                "runs' read phase less that rank time of the bare_ray_fetch run paired "
                "with each, clock for clock (what routeplay's read adds to Ray's own "
                "fetch and copy of the same objects; before 2026-12-05T15:30Z it was "
                "taken against the whole bare_ray_fetch run, the calls to its ranks "
                "included)"
            ),
            "limit": (
                "per path, best of >= 5 runs: the trainer node pulls the workload's "
                "cross-node objects from the node the path's payloads live on (producer: "
                "rollout, adopt: engine) + the SP ranks copy their shares at once, or the "
                "best run of the path's bare Ray floor where that was faster "
                "(routeplay.bench.limit; probe_by_path, floor_best_ms; scaling points: the "
                "probe only); a lower bound: a path below it fails the run; "
                "bare_ray(_fetch)_over_limit is a floor's median over that limit (its best "
                "run bounds the limit, so at least 1)"
            ),
            "rl_step": (
                "the realistic RL step (routeplay.bench.rl_step, on a local cluster of its "
                "own): per step size and path (producer, adopt: routeplay's public API "
                "only: ingest_and_finish_group, ReplayBuffer, TrainingBatch, each rank's "
                "acquire_many and Materializer; ray_floor: ray.put per group of the same "
                "rows, each rank's ray.get and copy; verl: verl 0.9.1's int16 padded "
                "DataProto, concatenated, chunked, pulled whole by each rank), the step "
                "from the engine having answered to every DP rank having read its rows and "
                "nothing held, split into phases timed one after the other on the "
                "driver's clock (generation: writes, buffer; the trainer's step: batch, "
                "reads, releases; ms is their sum, wall_ms adds the store meter reads "
                "between them), the shard calls of each phase by operation and their CPU "
                "(store.stats() differences: call_cpu_ms, process_cpu_ms), the slowest "
                "rank's own acquire, read and release; medians of runs after a checked "
                "run (the same rows on every path, by digest); over_ray_floor and "
                "verl_over_producer / verl_over_adopt: ratios of medians; a path that "
                "would not fit in the machine's memory is named in skipped"
            ),
            "sessions": (
                "multi-turn bytes: bytes stored (route store payload bytes; Ray's bytes in "
                "use, settled) over the canonical bytes of the distinct rows the session "
                "or resumed rollout has, before and after its compaction; engine_side: "
                "Ray's created bytes while the turns ran beyond the route store's payloads "
                "(the LMDeploy key path's own copy of every row)"
            ),
        },
        "versions": {
            "python": sys.version.split()[0],
            "ray": ray.__version__,
            "numpy": np.__version__,
            "routeplay": routeplay.__version__,
        },
        **results,
        "goals": goals(results),
    }


def write_results(
    results: dict[str, Any], config: BenchConfig, out_dir: Path, *, json_path: Path | None = None
) -> Path:
    """Write the results file (and ``json_path`` too, when given); returns the file."""
    when = datetime.now(timezone.utc)
    document = json.dumps(envelope(results, config, when), indent=2) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{results_stem(config, when)}.json"
    path.write_text(document, encoding="utf-8")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(document, encoding="utf-8")
    return path


def _ms(figures: dict[str, Any]) -> str:
    return f"{figures['median_ms']:.0f} [{figures['min_ms']:.0f}-{figures['max_ms']:.0f}]"


def workload_table(results: dict[str, Any]) -> Table:
    """One row per workload: each path's median [min-max], ratios, bytes, peak per rank.
    The adopted-key paths' steps start once every sample is adopted (``adoption_table``);
    ``adopt validated at adoption`` is the results' ``adopt_at_step``."""
    table = Table(
        title="a step: engine done (adopt: every sample adopted) -> every rank holds its "
        "rows (ms, median \\[min-max])"  # escaped: rich would take [min-max] for markup
    )
    columns = (
        "workload",
        "eager",
        "producer",
        "adopt",
        "adopt validated at adoption",
        "limit p|a",
        "bare ray p|a",
        "eager/prod",
        "eager/adopt",
        "prod/limit",
        "adopt/limit",
        "core-ms p|a|a-pull",
        "writes/payload e|p|a",
        "rank peak MB e|p",
    )
    for column in columns:
        table.add_column(column, no_wrap=column == "workload")
    for w in results["workloads"]:
        written = w["bytes_written"]
        writes = "|".join(f"{written[p] / w['payload_bytes']:.2f}" for p in written)
        peak, limit = w["peak_rank_bytes"], w["limit"]["by_path"]
        table.add_row(
            w["name"],
            _ms(w["eager"]),
            _ms(w["producer"]),
            _ms(w["adopt"]),
            _at_step(w),
            f"{limit['producer']:.0f}|{limit['adopt']:.0f}",
            _bare(w),
            f"{w['eager_ms'] / w['routeplay_ms']:.2f}x",
            f"{w['eager_ms'] / w['adopt_ms']:.2f}x",
            f"{w['routeplay_ms'] / limit['producer']:.2f}x",
            f"{w['adopt_ms'] / limit['adopt']:.2f}x",
            _core_ms(w),
            writes,
            f"{peak['eager'] / 1e6:.1f}|{peak['producer'] / 1e6:.1f}",
        )
    return table


def phases_table(results: dict[str, Any]) -> Table:
    """Where each routeplay path's step went, next to Ray's own floor for its objects
    (workloads of older result files, which have no phases, are left out).

    Example:
        console.print(phases_table(results))
    """
    table = Table(title="where a step goes (ms, medians): outside the ranks, the slowest rank's")
    for column in ("workload", "path", "step", "outside ranks", "acquire", "read", "Ray's floor"):
        table.add_column(column, no_wrap=column == "workload")
    floors = {"producer": "bare_ray_ms", "adopt": "bare_ray_fetch_ms"}
    for w in results["workloads"]:
        for path, floor in floors.items():
            phases = w[path].get("phases_ms")
            if phases is None:
                continue
            table.add_row(
                w["name"],
                path,
                f"{w[path]['median_ms']:.1f}",
                f"{phases['outside_ranks']:.1f}",
                f"{phases['acquire']:.1f}",
                f"{phases['read']:.1f}",
                f"{w[floor]:.1f}" + (" (put + fetch)" if path == "producer" else " (fetch)"),
            )
    return table


def adoption_table(results: dict[str, Any]) -> Table:
    """Per workload and adopted-key path: the adoption as the rollout saw it, before the
    step (ms per sample, rollout clock: p50, p99, samples adopted and calls), next to the
    step that follows it, the slowest rank's read, and, on the adopt path, Ray's own
    fetch and copy of the same objects (rank clock) and the read beyond it (median of the
    paired runs' differences). Workloads of older result files, which adopted on the
    step, are left out.

    Example:
        console.print(adoption_table(results))
    """
    table = Table(
        title="adoption as the rollout sees it (ms per sample, before the step), then the "
        "step's read next to Ray's fetch of the same objects"
    )
    columns = (
        "workload",
        "path",
        "validated",
        "adopted (calls)",
        "p50",
        "p99",
        "step",
        "read",
        "Ray's fetch, rank",
        "read beyond it",
    )
    for column in columns:
        table.add_column(column, no_wrap=column == "workload")
    for w in results["workloads"]:
        for path, label in (("adopt", "adopt"), ("adopt_at_step", "adopt validated at adoption")):
            figures = w.get(path, {})
            adoption = figures.get("adoption_ms")
            if adoption is None:
                continue
            paired = path == "adopt"
            table.add_row(
                w["name"],
                label,
                _validated(figures, w),
                f"{adoption['samples']} ({adoption['calls']})",
                f"{adoption['p50']:.1f}",
                f"{adoption['p99']:.1f}",
                f"{figures['median_ms']:.1f}",
                f"{figures['phases_ms']['read']:.1f}",
                f"{w['bare_ray_fetch_rank_ms']:.1f}" if paired else "",
                f"{w['adopt_read_beyond_bare_ray_fetch_ms']:.1f}" if paired else "",
            )
    return table


def _validated(figures: dict[str, Any], w: dict[str, Any]) -> str:
    """Where the path's payloads were validated, as its runs counted them."""
    if figures["validated_at_ingest"]:
        return "at ingest"
    return "at adoption (group)" if w["shared_prompt"] else "at adoption"


def _bare(w: dict[str, Any]) -> str:
    """Ray's own floor per path (the adopt path's is absent from older result files)."""
    fetch = w.get("bare_ray_fetch_ms")
    return f"{w['bare_ray_ms']:.0f}" + (f"|{fetch:.0f}" if fetch is not None else "")


def _at_step(w: dict[str, Any]) -> str:
    """The adopted-key path validated at adoption (absent from older result files)."""
    return _ms(w["adopt_at_step"]) if "adopt_at_step" in w else ""


def _core_ms(w: dict[str, Any]) -> str:
    pull = w["limit"]["pull_core_ms"]["adopt"]
    return f"{w['producer']['core_ms']}|{w['adopt']['core_ms']}|{pull}"


def scaling_table(results: dict[str, Any]) -> Table:
    """Tokens per sample, samples per step (median ms per path), segments per handle."""
    scale = results["scaling"]
    table = Table(title="scaling (median ms)")
    for column in ("axis", "value", "eager", "producer", "adopt", "limit"):
        table.add_column(column)
    for axis, key in (("tokens/sample", "tokens"), ("samples/step", "samples")):
        rows = scale["tokens_per_sample" if key == "tokens" else "samples_per_step"]
        for point in rows:
            table.add_row(
                axis,
                str(point[key]),
                *(f"{point[f'{p}_ms']:.0f}" for p in ("eager", "producer", "adopt")),
                f"{point['limit_ms']:.0f}",
            )
    for point in scale["segments_per_handle"]:
        table.add_row(
            "segments/handle",
            str(point["segments"]),
            "",
            f"{point['acquire_read_ms']:.1f} (copy {point['copy_ms']:.1f}, overhead: "
            f"{point['overhead_ms']:.1f} on Ray, {point['local_overhead_ms']:.1f} in process; "
            f"Ray's floor for as many objects {point['ray_floor_ms']:.1f})"
            + _compacted_note(point),
            "",
            "",
        )
    return table


def sessions_table(results: dict[str, Any]) -> Table:
    """Per wire and workload: bytes stored per unique row before -> after compaction
    (route store | Ray), segments and payloads, the compaction's cost, the key path's own."""
    table = Table(title="multi-turn bytes per unique row (route store | Ray's object store)")
    columns = (
        "wire/workload",
        "turns",
        "unique rows",
        "before",
        "after",
        "segments",
        "payloads",
        "compact ms",
        "engine side",
        "exact",
    )
    for column in columns:
        table.add_column(column, no_wrap=column == "wire/workload")
    for wire, kinds in results.get("sessions", {}).get("wires", {}).items():
        for kind, w in kinds.items():
            before, after = w["before"], w["after"]
            table.add_row(
                f"{wire}/{kind}",
                str(w["turns"]),
                str(w["unique_rows"]),
                _per_row(before),
                _per_row(after),
                f"{before['segments']} -> {after['segments']}",
                f"{before['payloads']} -> {after['payloads']}",
                f"{w['compaction']['ms']:.0f}",
                f"{w['engine_side_per_unique_row']:.2f}",
                "yes" if w["rows_exact"] else "NO",
            )
    return table


def _per_row(figures: dict[str, Any]) -> str:
    return f"{figures['stored_per_unique_row']:.3f}|{figures['object_store_per_unique_row']:.3f}"


def _compacted_note(point: dict[str, Any]) -> str:
    """The compaction figures of a segments point (absent from older result files)."""
    if "compact_ms" not in point:
        return ""
    return (
        f"; compacted to {point['compacted_segments']} segment(s) in "
        f"{point['compact_ms']:.1f}: overhead {point['compacted_overhead_ms']:.1f}"
    )


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, each with the figure that meets it or not."""
    out: dict[str, Any] = {}
    headline = [w for w in results["workloads"] if w["model"] == "qwen3-235b-a22b" and w["sp"] == 4]
    if headline:
        w = max(headline, key=lambda x: x["tokens"])
        out["eager_over_producer"] = round(w["eager_ms"] / w["routeplay_ms"], 2)
        out["eager_over_adopt"] = round(w["eager_ms"] / w["adopt_ms"], 2)
        limit = w["limit"]["by_path"]
        out["producer_over_limit"] = round(w["routeplay_ms"] / limit["producer"], 2)
        out["adopt_over_limit"] = round(w["adopt_ms"] / limit["adopt"], 2)
        out["adopt_at_step_over_limit"] = round(w["adopt_at_step_ms"] / limit["adopt"], 2)
        out["bare_ray_over_limit"] = round(w["bare_ray_ms"] / limit["producer"], 2)
        out["producer_beyond_bare_ray_ms"] = w["producer_beyond_bare_ray_ms"]
        out["producer_minus_bare_ray_medians_ms"] = w["producer_minus_bare_ray_medians_ms"]
        out["bare_ray_fetch_over_limit"] = round(w["bare_ray_fetch_ms"] / limit["adopt"], 2)
        out["adopt_beyond_bare_ray_fetch_ms"] = w["adopt_beyond_bare_ray_fetch_ms"]
        if "phases_ms" in w["adopt"]:  # absent from older result files
            out["headline_phases_ms"] = {p: w[p]["phases_ms"] for p in ("producer", "adopt")}
            out["adopt_read_beyond_bare_ray_fetch_ms"] = w["adopt_read_beyond_bare_ray_fetch_ms"]
        if "adoption_ms" in w["adopt"]:  # absent from files whose steps held the adoption
            out["headline_adoption_ms"] = {
                p: w[p]["adoption_ms"] for p in ("adopt", "adopt_at_step")
            }
        out["headline_cpu"] = {
            "cores": results["host_cores"],
            "producer_core_ms": w["producer"]["core_ms"],
            "adopt_core_ms": w["adopt"]["core_ms"],
            "adopt_at_step_core_ms": w["adopt_at_step"]["core_ms"],
            "limit_pull_core_ms": w["limit"]["pull_core_ms"]["adopt"],
            "validate_ms": w["limit"]["validate_ms"],
        }
        out["headline_workload"] = w["name"]
        out["rank_peak_over_eager"] = round(
            w["peak_rank_bytes"]["producer"] / w["peak_rank_bytes"]["eager"], 3
        )
    plain = [w for w in results["workloads"] if not w["shared_prompt"]]
    out["writes_per_payload"] = {
        p: round(max(w["bytes_written"][p] / w["payload_bytes"] for w in plain), 3)
        for p in ("producer", "adopt")
    }
    grpo = [w for w in results["workloads"] if w["shared_prompt"]]
    if grpo:
        out["grpo_written_over_unique"] = round(
            max(w["bytes_written"]["producer"] / w["unique_bytes"] for w in grpo), 3
        )
    segments = results["scaling"]["segments_per_handle"]
    thousand = [p for p in segments if p["segments"] == 1000]
    out["segments_1000_overhead_ms"] = thousand[0]["overhead_ms"] if thousand else None
    out["segments_1000_local_overhead_ms"] = thousand[0]["local_overhead_ms"] if thousand else None
    out["segments_1000_ray_floor_ms"] = thousand[0]["ray_floor_ms"] if thousand else None
    out["segments_1000_compacted_overhead_ms"] = (
        thousand[0].get("compacted_overhead_ms") if thousand else None
    )
    out["segments_1000_compact_ms"] = thousand[0].get("compact_ms") if thousand else None
    out["below_limit"] = below_limit(results)
    out.update(_session_goals(results.get("sessions", {})))
    small = results["small_puts"]
    out["small_puts_ratio_to_ray_put"] = round(small["put_many_per_s"] / small["ray_put_per_s"], 2)
    return out


def _session_goals(sessions: dict[str, Any]) -> dict[str, Any]:
    """Bytes in Ray's object store per unique row (goal: 1.0 after compaction, Ray's
    headers aside), the key path's own writes, and segments before -> after."""
    per_row, segments = {}, {}
    for wire, kinds in sessions.get("wires", {}).items():
        for kind, w in kinds.items():
            per_row[f"{wire}/{kind}"] = {
                "before": w["before"]["object_store_per_unique_row"],
                "after": w["after"]["object_store_per_unique_row"],
                "engine_side": w["engine_side_per_unique_row"],
            }
            segments[f"{wire}/{kind}"] = [w["before"]["segments"], w["after"]["segments"]]
    return {"multi_turn_bytes_per_unique_row": per_row, "multi_turn_segments": segments}


def below_limit(results: dict[str, Any]) -> list[str]:
    """Every path, workload or scaling point, whose median beat its lower bound: each is a
    measurement to distrust, and the bench fails on any.

    Example:
        below_limit(results)   # [] on a sound run
    """
    scale = results["scaling"]
    points = [*results["workloads"], *scale["tokens_per_sample"], *scale["samples_per_step"]]
    return [f"{p['name']}: {line}" for p in points for line in p["below_limit"]]


def write_plot(results: dict[str, Any], path: Path) -> Path:
    """Scaling plot: ms vs tokens per sample, vs samples per step, overhead vs segments."""
    import matplotlib.pyplot as plt

    fig = scaling_figure(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scaling_figure(results: dict[str, Any]) -> Figure:
    """``write_plot``'s figure (the caller closes it).

    Example:
        >>> figure = scaling_figure(results)  # doctest: +SKIP
        >>> [line.get_label() for line in figure.axes[2].get_lines()]  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = results["scaling"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for axis, key, rows, title in (
        (axes[0], "tokens", scale["tokens_per_sample"], "Qwen3-235B, 2 samples, SP=1"),
        (axes[1], "samples", scale["samples_per_step"], "Qwen3-30B, 8k tokens, SP=1"),
    ):
        if not rows:
            axis.set_title(f"{title}: not measured in this run")
            continue
        xs = [p[key] for p in rows]
        for series in ("eager", "producer", "adopt", "limit"):
            axis.plot(xs, [p[f"{series}_ms"] for p in rows], marker="o", label=series)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel(f"{key} per {'sample' if key == 'tokens' else 'step'}")
        axis.set_ylabel("ms, engine done (adopt: adopted) -> rows on every rank")
        axis.set_title(title)
        axis.legend()
    segs = scale["segments_per_handle"]
    xs = [p["segments"] for p in segs]
    axes[2].plot(xs, [p["overhead_ms"] for p in segs], marker="o", label="Ray store")
    axes[2].plot(xs, [p["local_overhead_ms"] for p in segs], marker="o", label="in process")
    if segs and all("compacted_overhead_ms" in p for p in segs):
        compacted = [p["compacted_overhead_ms"] for p in segs]
        axes[2].plot(xs, compacted, marker="o", label="Ray store, compacted")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("segments per handle (32k rows)")
    axes[2].set_ylabel("acquire + read beyond the copy, ms")
    axes[2].axhline(10, linestyle="--", color="grey", label="goal: 10 ms")
    axes[2].legend()
    fig.tight_layout()
    return fig
