"""A PNG of the run: object-store bytes and live leases over time, and next to them the
per-step training-inference mismatch (k3 KL) without replay, with R2 and with R3, and the
per-step routing drift the library measured live under R3 next to the no-replay
disagreement (matplotlib, Agg).

Invariant: what the meter samples (bytes, leases, payloads) is drawn as a step function
through every sample (``steps-post``: each value holds until the next sample), because a
straight line between two samples made a release look gradual when it happened at once.
Titles are short enough to fit the figure (a test renders them and checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from routeplay.pipeline.report import DemoReport

if TYPE_CHECKING:  # the optional `plot` extra: imported when a figure is drawn
    from matplotlib.figure import Figure

__all__ = ["plot_timeline", "timeline_figure"]

_STEPS: dict[str, Any] = {"drawstyle": "steps-post", "marker": ".", "ms": 4}
"""How a sampled quantity is drawn: held until the next sample, each sample marked."""


def plot_timeline(report: DemoReport, path: Path) -> None:
    """Write ``timeline_figure(report)`` as a PNG at ``path`` (its folder created).

    Example:
        >>> plot_timeline(run_demo(recipe("smoke")), Path("timeline.png"))  # doctest: +SKIP
    """
    fig = timeline_figure(report)  # first: it picks the Agg backend before pyplot loads
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def timeline_figure(report: DemoReport) -> Figure:
    """Left, two stacked panels sharing the time axis, the end of each step's training
    as a faint line: object-store bytes in use (sampled every 0.25 s) and the routing
    bytes the route store keeps alive; live leases and payloads (read at the end of
    each rollout and training phase). Right: the per-step k3 KL, log scale, and the
    per-step share of differing routes, live under R3 and without replay. The caller
    closes it (``plt.close(fig)``).

    Example:
        >>> fig = timeline_figure(report); fig.savefig("timeline.png")  # doctest: +SKIP
    """
    import matplotlib  # the optional `plot` extra; Agg: no display needed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 6.5), dpi=110)
    grid = fig.add_gridspec(2, 2, width_ratios=(3, 2))
    top = fig.add_subplot(grid[0, 0])
    bottom = fig.add_subplot(grid[1, 0], sharex=top)
    _plot_bytes(top, report)
    _plot_counts(bottom, report)
    _plot_kl(fig.add_subplot(grid[0, 1]), report)
    _plot_drift(fig.add_subplot(grid[1, 1]), report)
    for p in report.timeline:
        if p.phase == "train":
            for axis in (top, bottom):
                axis.axvline(p.t_s, color="grey", alpha=0.2, lw=0.8)
    fig.suptitle(
        f"routeplay demo ({report.wire}, {report.steps} steps): leaked leases "
        f"{report.leaked_leases}, leaked bytes {report.leaked_bytes}, mismatched routes "
        f"with replay {report.r3.mismatched_routes_with}",
        fontsize="medium",
    )
    fig.tight_layout()
    return fig


def _plot_bytes(axis: Any, report: DemoReport) -> None:
    """Object-store bytes in use (the background samples) and the routing bytes the
    route store keeps alive (the phase-end points), in KiB."""
    points = report.timeline
    usage = report.object_store_usage or tuple((p.t_s, p.object_store_bytes) for p in points)
    axis.step(
        [s for s, _ in usage], [b / 1024 for _, b in usage], where="post", label="object store"
    )
    axis.plot(
        [p.t_s for p in points],
        [p.routing_bytes / 1024 for p in points],
        label="routing kept alive",
        **_STEPS,
    )
    axis.set_ylabel("KiB")
    axis.set_title("memory in use", fontsize="medium")
    axis.legend(loc="upper left", fontsize="small")


def _plot_counts(axis: Any, report: DemoReport) -> None:
    """Live leases and payloads at each phase-end point."""
    t = [p.t_s for p in report.timeline]
    axis.plot(t, [p.leases for p in report.timeline], label="live leases", **_STEPS)
    axis.plot(t, [p.live_payloads for p in report.timeline], label="live payloads", **_STEPS)
    axis.set_ylabel("count")
    axis.set_xlabel("seconds since start")
    axis.set_title("leases and payloads", fontsize="medium")
    axis.legend(loc="upper left", fontsize="small")


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
    axis.xaxis.set_major_locator(_step_ticks())
    axis.set_xlabel("RL step")
    axis.set_ylabel("k3 KL per token")
    axis.set_title(
        f"train-inference k3 KL (trainer {report.trainer_dtype}, engine bf16)",
        fontsize="medium",
    )
    axis.legend(loc="best", fontsize="small")


def _plot_drift(axis: Any, report: DemoReport) -> None:
    """Per-step share of (token, layer) routes whose experts differ from the engine's:
    each router's own choice live under R3 (the library's ``DriftMeter``), and the
    trainer's routing without replay, on the same rows."""
    per_step = report.r3.drift_per_step
    steps = list(range(len(per_step)))
    # A step that compared no route has no share (the key is absent): NaN draws no
    # point there, where 0 would claim a perfect step.
    nan = float("nan")
    for label, marker, values in (
        ("no replay", "o", [s.no_replay.get("route_diff_share", nan) for s in per_step]),
        ("live under R3", "s", [s.live.get("route_diff_share", nan) for s in per_step]),
    ):
        axis.plot(steps, [100 * v for v in values], marker=marker, ms=5, label=label)
    axis.xaxis.set_major_locator(_step_ticks())
    axis.set_xlabel("RL step")
    axis.set_ylabel("routes differing (%)")
    # Two short lines, not one long one: a title wider than its panel ran off the figure.
    axis.set_title(
        "routing drift per step\n(under R3, later layers see replayed hidden states)",
        fontsize="medium",
    )
    axis.legend(loc="best", fontsize="small")


def _step_ticks() -> Any:
    """Whole RL steps, a handful of them: a tick per step crowded a 100-step run."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)
