"""A PNG of the run: object-store bytes and live leases over time, and next to them the
per-step training-inference mismatch (k3 KL) without replay, with R2 and with R3, and the
per-step routing drift the library measured live under R3 next to the no-replay
disagreement (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routeplay.pipeline.report import DemoReport

__all__ = ["plot_timeline"]


def plot_timeline(report: DemoReport, path: Path) -> None:
    """Left, two stacked panels sharing the time axis, the end of each step's training
    as a faint line: object-store bytes in use (sampled every 0.25 s) and the routing
    bytes the route store keeps alive; live leases and payloads (read at the end of
    each rollout and training phase). Right: the per-step k3 KL, log scale, and the
    per-step share of differing routes, live under R3 and without replay."""
    import matplotlib  # the optional `plot` extra; Agg: no display needed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report.timeline
    t = [p.t_s for p in points]
    usage = report.object_store_usage or tuple((p.t_s, p.object_store_bytes) for p in points)
    fig = plt.figure(figsize=(12, 6.5), dpi=110)
    grid = fig.add_gridspec(2, 2, width_ratios=(3, 2))
    top = fig.add_subplot(grid[0, 0])
    bottom = fig.add_subplot(grid[1, 0], sharex=top)
    _plot_kl(fig.add_subplot(grid[0, 1]), report)
    _plot_drift(fig.add_subplot(grid[1, 1]), report)
    top.plot([s for s, _ in usage], [b / 1024 for _, b in usage], label="object store in use")
    routing = [p.routing_bytes / 1024 for p in points]
    top.plot(t, routing, marker=".", ms=4, label="routing kept alive (route store)")
    top.set_ylabel("KiB")
    top.set_title("object store", fontsize="medium")
    top.legend(loc="upper left", fontsize="small")
    bottom.plot(t, [p.leases for p in points], marker=".", ms=4, label="live leases")
    bottom.plot(t, [p.live_payloads for p in points], marker=".", ms=4, label="live payloads")
    bottom.set_ylabel("count")
    bottom.set_xlabel("seconds since start")
    bottom.legend(loc="upper left", fontsize="small")
    for p in points:
        if p.phase == "train":
            for axis in (top, bottom):
                axis.axvline(p.t_s, color="grey", alpha=0.2, lw=0.8)
    fig.suptitle(
        f"routeplay demo ({report.wire}, {report.steps} steps): leaked leases "
        f"{report.leaked_leases}, leaked bytes {report.leaked_bytes}, "
        f"mismatched routes with replay {report.r3.mismatched_routes_with}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _plot_kl(axis: Any, report: DemoReport) -> None:
    """Per-step mean k3 KL(engine || trainer), the three ways, on the same tokens."""
    per_step = report.r3.kl_k3_per_step
    steps = list(range(len(per_step)))
    for index, (label, marker) in enumerate(
        (("no replay", "o"), ("R2 (trainer's own routing)", "x"), ("R3 (engine's routing)", "s"))
    ):
        values = [float("nan") if step[index] is None else step[index] for step in per_step]
        axis.plot(steps, values, marker=marker, ms=5, label=label)
    axis.set_yscale("log")
    axis.set_xticks(steps)
    axis.set_xlabel("RL step")
    axis.set_ylabel("k3 KL per token")
    axis.set_title(
        f"training-inference mismatch (trainer {report.trainer_dtype}, engine bf16)",
        fontsize="medium",
    )
    axis.legend(loc="best", fontsize="small")


def _plot_drift(axis: Any, report: DemoReport) -> None:
    """Per-step share of (token, layer) routes whose experts differ from the engine's:
    each router's own choice live under R3 (the library's ``DriftMeter``), and the
    trainer's routing without replay, on the same rows."""
    per_step = report.r3.drift_per_step
    steps = list(range(len(per_step)))
    for label, marker, values in (
        ("no replay", "o", [s.no_replay["route_diff_share"] for s in per_step]),
        ("live under R3", "s", [s.live["route_diff_share"] for s in per_step]),
    ):
        axis.plot(steps, [100 * v for v in values], marker=marker, ms=5, label=label)
    axis.set_xticks(steps)
    axis.set_xlabel("RL step")
    axis.set_ylabel("routes differing (%)")
    axis.set_title(
        "routing drift (under replay, hidden states change after the first replayed layer)",
        fontsize="small",
    )
    axis.legend(loc="best", fontsize="small")
