"""The bench's report read back from a committed full run: the goals the closing notes
quote follow from the run's own figures, the tables show them, and the plot is drawn
(the smoke runs in the suite have no Qwen3-235B/SP=4 workload and no scaling curves)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from rich.console import Console

from routeplay.bench.measure import adoption_summary, phases_ms
from routeplay.bench.report import (
    adoption_table,
    goals,
    phases_table,
    scaling_figure,
    scaling_table,
    sessions_table,
    workload_table,
    write_plot,
)
from routeplay.bench.rl_report import rl_calls_table, rl_step_table
from routeplay.bench.roles import RankRead

FULL_RUN = Path(__file__).parents[2] / "benchmarks/results/data-path_full_vm_2026-12-05T0628Z.json"
PHASED_RUN = FULL_RUN.with_name("data-path_full_vm_2026-12-05T1214Z.json")  # with phases_ms
HEADLINE = "qwen3-235b-a22b/32k/x8/sp4"


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    document = json.loads(FULL_RUN.read_text(encoding="utf-8"))
    document["recorded_goals"] = document.pop("goals")
    return document


def test_the_headline_goals_are_the_ratios_of_the_largest_235b_sp4_workload(
    run: dict[str, Any],
) -> None:
    derived = goals(run)
    w = next(w for w in run["workloads"] if w["name"] == HEADLINE)
    by_path = w["limit"]["by_path"]
    assert derived["headline_workload"] == HEADLINE  # the 32k one, not the 8k one
    assert derived["adopt_over_limit"] == round(w["adopt_ms"] / by_path["adopt"], 2) == 1.49
    assert derived["producer_over_limit"] == round(w["routeplay_ms"] / by_path["producer"], 2)
    assert derived["eager_over_adopt"] == round(w["eager_ms"] / w["adopt_ms"], 2) == 8.61
    # the limit is bounded by the bare floor's best run, so its median is at least 1x
    assert derived["bare_ray_fetch_over_limit"] >= 1
    assert derived["headline_cpu"]["cores"] == run["host_cores"] == 2
    assert derived == run["recorded_goals"]  # a stored run reads back to the same goals


def test_the_tables_show_the_headline_the_scaling_and_the_sessions(
    run: dict[str, Any],
) -> None:
    console = Console(width=400, record=True, file=io.StringIO())
    for table in (workload_table(run), scaling_table(run), sessions_table(run)):
        console.print(table)
    text = console.export_text()
    [headline] = [line for line in text.splitlines() if HEADLINE in line]
    assert "1.49x" in headline  # adopt over its limit
    assert "compacted to 1 segment(s)" in text  # the 1,000-segment handle, compacted
    assert "lmdeploy-key/session" in text


def test_the_plot_has_the_scaling_curves_and_the_compacted_segments(
    run: dict[str, Any], tmp_path: Path
) -> None:
    figure = scaling_figure(run)
    tokens, _, segments = figure.axes
    assert [line.get_label() for line in tokens.get_lines()] == [
        "eager",
        "producer",
        "adopt",
        "limit",
    ]
    compacted = next(line for line in segments.get_lines() if "compacted" in line.get_label())
    points = run["scaling"]["segments_per_handle"]
    assert list(compacted.get_xdata()) == [p["segments"] for p in points]
    assert list(compacted.get_ydata()) == [p["compacted_overhead_ms"] for p in points]
    plt.close(figure)
    path = write_plot(run, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    unmeasured = {**run, "scaling": {key: [] for key in run["scaling"]}}
    empty = write_plot(unmeasured, tmp_path / "empty.png")
    # the curves are drawn: the run's figure holds twice the pixels' worth of an empty one
    assert path.stat().st_size > 2 * empty.stat().st_size


def test_a_steps_phases_are_its_slowest_ranks_and_what_lies_outside_them() -> None:
    # rank 0 waits longer for its grant, rank 1 takes longer in all (12 + 190 < 5 + 200)
    reads = [RankRead(0, "", 0.012, 0.190), RankRead(0, "", 0.005, 0.200)]
    assert phases_ms(0.25, reads) == {"outside_ranks": 45.0, "acquire": 5.0, "read": 200.0}


def test_the_phases_table_and_goals_show_where_the_headline_step_went(
    run: dict[str, Any],
) -> None:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(phases_table(run))  # an older file: no phases, no rows
    assert HEADLINE not in console.export_text()
    phased = json.loads(PHASED_RUN.read_text(encoding="utf-8"))
    console.print(phases_table(phased))
    rows = [line for line in console.export_text().splitlines() if HEADLINE in line]
    assert [row.split("│")[2].strip() for row in rows] == ["producer", "adopt"]
    w = next(w for w in phased["workloads"] if w["name"] == HEADLINE)
    phases = w["adopt"]["phases_ms"]
    cells = [cell.strip() for cell in rows[1].split("│")[1:-1]]
    assert cells == [
        HEADLINE,
        "adopt",
        f"{w['adopt_ms']:.1f}",
        f"{phases['outside_ranks']:.1f}",
        f"{phases['acquire']:.1f}",
        f"{phases['read']:.1f}",
        f"{w['bare_ray_fetch_ms']:.1f} (fetch)",
    ]
    # a run's three phases add up to its step, so their medians come close to the step's
    assert sum(phases.values()) == pytest.approx(w["adopt_ms"], rel=0.15)
    recorded = phased.pop("goals")
    assert goals(phased) == recorded  # the phased run reads back to its goals
    assert recorded["headline_phases_ms"]["adopt"] == phases
    assert (
        recorded["adopt_read_beyond_bare_ray_fetch_ms"] == w["adopt_read_beyond_bare_ray_fetch_ms"]
    )


def test_the_adoption_is_summed_up_over_every_sample_of_every_timed_run() -> None:
    # two runs of four samples adopted one by one, one run of a group of four (one call)
    runs = [
        {"adoption_ms": [3.0, 1.0, 2.0, 40.0], "adoption_calls": 4},
        {"adoption_ms": [2.0, 2.5, 1.5, 1.0], "adoption_calls": 4},
        {"adoption_ms": [9.0] * 4, "adoption_calls": 1},
    ]
    summary = adoption_summary(runs)
    assert summary["samples"] == 12
    assert summary["calls"] == 9
    assert summary["p50"] == 2.75  # between the 6th and 7th of the 12 sorted samples
    # the slowest sample (the first of a step, its validation still running) sets p99
    assert 9.0 < summary["p99"] < 40.0
    assert summary["p99"] == pytest.approx(9.0 + 0.89 * 31.0, abs=0.01)


def _with_adoption(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` as a run since 2026-12-06 writes it: each adopted-key path with its
    adoption per sample (figures made up) and the floor's rank time."""
    for w in document["workloads"]:
        for path, p50 in (("adopt", 4.0), ("adopt_at_step", 31.0)):
            samples = w["samples"] * w[path]["runs"]
            calls = w[path]["runs"] if w["shared_prompt"] else samples
            w[path]["adoption_ms"] = {
                "p50": p50,
                "p99": 2 * p50,
                "samples": samples,
                "calls": calls,
            }
        w["adoption_p50_ms"], w["adoption_p99_ms"] = 4.0, 8.0
        w.setdefault("bare_ray_fetch_rank_ms", 180.0)
    return document


def test_the_adoption_table_shows_each_adopted_key_path_next_to_its_read(
    run: dict[str, Any],
) -> None:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(adoption_table(run))  # an older file: adopted on the step, no rows
    assert HEADLINE not in console.export_text()
    phased = _with_adoption(json.loads(PHASED_RUN.read_text(encoding="utf-8")))
    console.print(adoption_table(phased))
    lines = console.export_text().splitlines()
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│" in line]
    w = next(w for w in phased["workloads"] if w["name"] == HEADLINE)
    at_ingest, at_adoption = [row for row in rows if row[0] == HEADLINE]
    assert at_ingest == [
        HEADLINE,
        "adopt",
        "at ingest",  # the run counted its ingest validations
        f"{8 * w['adopt']['runs']} ({8 * w['adopt']['runs']})",
        "4.0",
        "8.0",
        f"{w['adopt_ms']:.1f}",
        f"{w['adopt']['phases_ms']['read']:.1f}",
        "180.0",
        f"{w['adopt_read_beyond_bare_ray_fetch_ms']:.1f}",
    ]
    assert at_adoption[1:4] == ["adopt validated at adoption", "at adoption", "40 (40)"]
    assert at_adoption[-2:] == ["", ""]  # no floor is paired with that path
    grpo = next(row for row in rows if row[0].startswith("grpo/") and row[1] == "adopt")
    runs = next(w for w in phased["workloads"] if w["shared_prompt"])["adopt"]["runs"]
    assert grpo[2:4] == ["at adoption (group)", f"{8 * runs} ({runs})"]  # a call per group
    recorded = phased.pop("goals")
    derived = goals(phased)
    assert derived.pop("headline_adoption_ms") == {
        "adopt": w["adopt"]["adoption_ms"],
        "adopt_at_step": w["adopt_at_step"]["adoption_ms"],
    }
    assert derived == recorded  # the rest reads back as before


def _rl_path(
    ms: float, calls: int, over_floor: float, *, gc: bool = True, over_owned: float | None = None
) -> dict[str, Any]:
    phases = {
        "writes": ms / 2,
        "buffer": ms / 8,
        "batch": ms / 8,
        "reads": ms / 8,
        "releases": ms / 8,
    }
    return {
        "median_ms": ms,
        "min_ms": ms - 1,
        "max_ms": ms + 1,
        "per_sample_ms": ms / 64,
        "phases_ms": phases,
        "shard_calls": calls,
        "shard_calls_per_sample": calls / 64,
        "calls_by_phase": {"writes": {"adopt_from_many": 8, "lease_many": 8}} if calls else {},
        "shard_call_cpu_ms": 5.0,
        "shard_process_cpu_ms": 50.0,
        "over_ray_floor": over_floor,
        # a results file from before the owned floor was measured has no ratio to it
        **({"over_ray_owned": over_owned} if over_owned is not None else {}),
        # a results file from before the collections were counted has neither
        **(
            {"gc_cpu_ms": {"driver": 2.4, "rollout": 30.0, "ranks": 12.2}, "gc_full": 1}
            if gc
            else {}
        ),
    }


def test_the_rl_step_tables_show_each_path_and_name_a_skipped_one(run: dict[str, Any]) -> None:
    point = {
        "samples": 64,
        "paths": {
            "producer": _rl_path(150.0, 47, 5.0, over_owned=3.0),
            "adopt": _rl_path(200.0, 47, 6.67),
            "ray_floor": _rl_path(30.0, 0, 1.0, gc=False),
            "ray_owned": _rl_path(50.0, 0, 1.67, over_owned=1.0),
        },
        "skipped": {"verl": "needs ~19.0 GiB of memory at its peak"},
    }
    results = {"rl_step": {"shape": {"group": 8, "tokens": 1024}, "points": [point]}}
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(rl_step_table(results))
    console.print(rl_calls_table(results))
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in console.export_text().splitlines()
        if line.startswith("│")
    ]
    producer = next(row for row in rows if row[1] == "routeplay producer" and "[" in row[2])
    assert producer[2:5] == ["150 [149-151]", "2.34", "75.0"]  # step, ms/sample, writes
    # shard calls, shard CPU, collections, over Ray's floor and over its owned floor; no
    # verl: no ratio to it
    assert producer[-6:] == ["47 (0.73)", "5|50", "2|30|12 (1)", "5.00x", "3.00x", ""]
    adopt = next(row for row in rows if row[1] == "routeplay LMDeploy key" and "[" in row[2])
    assert adopt[-3:] == ["6.67x", "", ""]  # no owned floor in that results file
    floor = next(row for row in rows if row[1] == "Ray's floor" and "[" in row[2])
    assert floor[-4] == "-"  # not counted in that results file
    owned = next(row for row in rows if row[1] == "Ray's floor, actor-owned" and "[" in row[2])
    assert owned[-3:] == ["1.67x", "1.00x", ""]
    verl = next(row for row in rows if row[1] == "verl")
    assert verl[2].startswith("skipped: needs ~19.0 GiB")
    calls = next(row for row in rows if row[1] == "routeplay producer" and "[" not in row[2])
    assert calls[2] == "adopt_from_many 8, lease_many 8"
    assert "Ray's floor" not in [row[1] for row in rows[-2:]]  # no calls table row for Ray
    # a results file from before the RL step: empty tables, no error
    console.print(rl_step_table(run), rl_calls_table(run))
