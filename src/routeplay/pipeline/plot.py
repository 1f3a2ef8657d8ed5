"""A PNG of the run's object-store bytes and live leases over time (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from routeplay.pipeline.report import DemoReport

__all__ = ["plot_timeline"]


def plot_timeline(report: DemoReport, path: Path) -> None:
    """Two stacked panels sharing the time axis; the end of each step's training as a
    faint line. Top: object-store bytes in use (sampled every 0.25 s) and the routing
    bytes the route store keeps alive; bottom: live leases and payloads (both read at
    the end of each rollout and each training phase)."""
    import matplotlib  # the optional `plot` extra; Agg: no display needed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report.timeline
    t = [p.t_s for p in points]
    usage = report.object_store_usage or tuple((p.t_s, p.object_store_bytes) for p in points)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=110)
    top.plot([s for s, _ in usage], [b / 1024 for _, b in usage], label="object store in use")
    routing = [p.routing_bytes / 1024 for p in points]
    top.plot(t, routing, marker=".", ms=4, label="routing kept alive (route store)")
    top.set_ylabel("KiB")
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
        f"{report.leaked_leases}, leaked bytes {report.leaked_bytes}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
