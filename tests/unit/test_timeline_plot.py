"""The demo's timeline figure (``routeplay.pipeline.plot``), drawn from a report built
without Ray: sampled counts are step functions through every sample (a release drops at
once, not along a slope), and every title fits inside the figure without overlapping
another."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from routeplay.core.wires import WIRE_NAMES
from routeplay.pipeline.config import recipe
from routeplay.pipeline.meter import Sharing, StoreTotals
from routeplay.pipeline.metrics import Point, ReplayTally, Timeline
from routeplay.pipeline.plot import plot_timeline, timeline_figure
from routeplay.pipeline.report import DemoReport, StepRoutingDrift, build_report
from routeplay.pipeline.rollouts import PoolStats
from routeplay.pipeline.services import Teardown
from routeplay.rollout.buffer import BufferStats

# (seconds, phase, leases, live payloads, routing KiB): 8 leases taken in step 0's
# rollout, all released at once by its training, then step 1 the same, then teardown.
SAMPLES = [
    (0.0, "start", 0, 0, 0),
    (1.0, "rollout", 8, 8, 64),
    (2.5, "train", 0, 0, 0),
    (3.0, "rollout", 8, 8, 64),
    (4.0, "train", 0, 2, 16),
    (4.5, "teardown", 0, 0, 0),
]


def _points() -> list[Point]:
    return [
        Point(
            t_s=t, step=0, phase=phase, object_store_bytes=1 << 20, routing_bytes=kib * 1024,
            leases=leases, live_payloads=payloads,
        )
        for t, phase, leases, payloads, kib in SAMPLES
    ]  # fmt: skip


def _report(wire: str = "vllm", steps: int = 3, dtype: str = "float32") -> DemoReport:
    """A finished run's report, its timeline and three steps' figures filled in
    (``steps`` only lengthens the title)."""
    usage = [(0.25 * i, (1 << 20) + (i % 5) * 4096) for i in range(19)]
    buffer = BufferStats(
        groups=0, samples=0, retried_samples=0, discarded_groups=0, sampled_groups=0,
        waiting_retries=0,
    )  # fmt: skip
    services = SimpleNamespace(
        buffer=SimpleNamespace(stats=lambda: buffer),
        pool=SimpleNamespace(stats=PoolStats()),
        meter=SimpleNamespace(timeline=Timeline(points=_points(), usage=usage)),
        run="demo-0a0a0a0a",
        trainer=SimpleNamespace(spec=SimpleNamespace(num_layers=2)),
    )
    teardown = Teardown(
        leaked_leases=0, leaked_bytes=0, leak_holders=(), payloads=16, payload_bytes=1600,
        prompt_bytes_saved=0, engine_keys_left=0, engine_keys_unclaimed=0,
        written=StoreTotals(used_bytes=0, created_bytes=1600, created_objects=16),
        engine_objects=0, engine_bytes=0, object_store_bytes_after=0,
        sharing=Sharing(other_runs=(), other_jobs=()),
    )  # fmt: skip
    config = recipe("smoke").replace(wire=wire)
    config = config.replace(trainer=dataclasses.replace(config.trainer, dtype=dtype))
    report = build_report(config, services, ReplayTally(), [], teardown, 4.5)  # type: ignore[arg-type]
    drift = StepRoutingDrift(live={"route_diff_share": 0.01}, no_replay={"route_diff_share": 0.1})
    r3 = dataclasses.replace(
        report.r3,
        kl_k3_per_step=((1e-3, 1e-3, 1e-5),) * 3,
        drift_per_step=(drift,) * 3,
    )
    return dataclasses.replace(report, r3=r3, steps=steps)


@pytest.fixture
def figure() -> Iterator[Figure]:
    import matplotlib.pyplot as plt

    fig = timeline_figure(_report())
    yield fig
    plt.close(fig)


def _line(fig: Figure, label: str) -> Line2D:
    found = [line for ax in fig.axes for line in ax.get_lines() if line.get_label() == label]
    assert len(found) == 1, f"no single line labelled {label!r}"
    return found[0]


@pytest.mark.parametrize(
    ("label", "column"),
    [("live leases", 2), ("live payloads", 3), ("routing kept alive", 4)],
)
def test_counts_are_steps_through_every_sample(figure: Figure, label: str, column: int) -> None:
    line = _line(figure, label)
    assert line.get_drawstyle() == "steps-post"
    times = [sample[0] for sample in SAMPLES]
    assert list(line.get_xdata()) == times  # every sample, none thinned out
    path = line.get_path().vertices  # what is drawn: the step conversion applied
    moves = np.diff(path, axis=0)
    assert np.all((moves[:, 0] == 0) | (moves[:, 1] == 0)), "a sloped segment"
    rises = [(start[0], end[1]) for start, end in itertools.pairwise(path) if start[1] != end[1]]
    values = [sample[column] for sample in SAMPLES]  # routing: drawn in KiB, given in KiB
    changes = [(times[i], values[i]) for i in range(1, len(values)) if values[i] != values[i - 1]]
    # Each change is vertical at the sample that saw it: the old value held until then.
    assert rises == changes


def test_a_release_of_all_leases_drops_at_once(figure: Figure) -> None:
    path = _line(figure, "live leases").get_path().vertices
    # Between the rollout (1.0 s, 8 leases) and the training end (2.5 s, 0) the drawn
    # count stays 8, then falls to 0 in one vertical segment at 2.5 s.
    drawn = path.tolist()
    at = drawn.index([1.0, 8.0])
    assert drawn[at - 1 : at + 3] == [[1.0, 0.0], [1.0, 8.0], [2.5, 8.0], [2.5, 0.0]]


def _titles(fig: Figure) -> Iterator[Any]:
    suptitle = fig.get_suptitle()
    assert suptitle, "the figure has no title"
    yield fig._suptitle  # the Text of fig.suptitle (matplotlib has no public getter)
    for ax in fig.axes:
        assert ax.get_title(), "a panel has no title"
        yield ax.title


def _inside(box: Any, frame: Any) -> bool:
    return bool(
        frame.x0 <= box.x0 <= box.x1 <= frame.x1 and frame.y0 <= box.y0 <= box.y1 <= frame.y1
    )


@pytest.mark.parametrize(
    ("wire", "steps", "dtype"),
    [("vllm", 3, "float32"), (max(WIRE_NAMES, key=len), 1000, "bfloat16")],
    ids=["default", "longest"],
)
def test_every_title_fits_the_figure_and_no_two_overlap(wire: str, steps: int, dtype: str) -> None:
    import matplotlib.pyplot as plt

    fig = timeline_figure(_report(wire, steps, dtype))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _titles(fig)]
        for text, box in boxes:
            assert _inside(box, fig.bbox), (
                f"title {text!r} spans x {box.x0:.0f}..{box.x1:.0f}, y {box.y0:.0f}.."
                f"{box.y1:.0f}; the figure is {fig.bbox.width:.0f} x {fig.bbox.height:.0f}"
            )
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
            assert not box_a.overlaps(box_b), f"titles {a!r} and {b!r} overlap"
    finally:
        plt.close(fig)


def test_plot_timeline_writes_a_png(tmp_path: Any) -> None:
    path = tmp_path / "demo" / "timeline.png"
    plot_timeline(_report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
