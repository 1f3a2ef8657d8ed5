"""The demo's report: one frozen record, as JSON and as a readable table.

Invariants a run must show (``DemoReport.ok``; the e2e test asserts them):
``routing_mismatches == 0`` (the experts used in training are the engine's, on every
real row), ``leaked_leases == 0`` and ``leaked_bytes == 0`` after teardown, and at most
one object-store write per payload (``writes_per_payload`` counts every object the run
created, so a stray object of Ray's own is tolerated; the eager path writes each
payload at least twice).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from rich.console import Console
from rich.table import Table

from routeplay.pipeline.metrics import Point, ReplayTally

if TYPE_CHECKING:  # the services and trainer pull in Ray and torch
    from routeplay.pipeline.config import DemoConfig
    from routeplay.pipeline.services import DemoServices, Teardown
    from routeplay.pipeline.trainer import StepStats

__all__ = ["MAX_WRITES_PER_PAYLOAD", "DemoReport", "build_report", "render", "write_json"]

MAX_WRITES_PER_PAYLOAD: Final = 1.1
"""One write per payload, plus room for a few objects Ray creates for itself."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoReport:
    """Everything one demo run measured."""

    wire: str
    """Engine wire format."""
    run: str
    """Run id (scopes the store's actors and payloads)."""
    steps: int
    """RL steps run."""
    wall_s: float
    """Seconds from start-up to teardown, Ray start included."""
    samples_trained: int
    """Samples that went through a training step."""
    samples_retried: int
    """Samples reset for regeneration because their group went stale."""
    partial_resumes: int
    """Interrupted samples resumed (history rows kept, new rows appended)."""
    sessions: int
    """Multi-turn trace sessions opened (turn 2 borrows turn 1's rows)."""
    discarded_groups: int
    """Groups dropped after their retries ran out."""
    failed_rollouts: int
    """Rollout jobs that failed (their inputs' leases released)."""
    routing_rows_replayed: int
    """Real token rows trained under replay."""
    routing_mismatches: int
    """(token, layer) rows where the experts used in training differ from the engine's."""
    layers: int
    """MoE layers of the model (L)."""
    payloads: int
    """Routing payloads the route store took."""
    payload_bytes: int
    """Their bytes, as stored."""
    object_store_bytes_written: int
    """Bytes written into Ray's object store during the run (all nodes, all objects)."""
    object_store_objects_written: int
    """Objects created in Ray's object store during the run."""
    writes_per_payload: float
    """Object-store objects created per routing payload (one-write path: <= 1; payloads
    under Ray's 100 KiB inline limit travel inside the reply to their owner: 0)."""
    peak_object_store_bytes: int
    """Most object-store bytes in use at any sampled point."""
    object_store_bytes_after: int
    """Object-store bytes in use after teardown above the starting baseline, once Ray
    freed what was released (it frees asynchronously; teardown waits up to 10 s)."""
    peak_routing_bytes: int
    """Most routing bytes the trainer's materializer held at once."""
    leaked_leases: int
    """Leases still held after teardown."""
    leaked_bytes: int
    """Payload bytes still alive after teardown."""
    leak_holders: tuple[str, ...]
    """Holders of the leaked leases (empty when nothing leaked)."""
    engine_keys_left: int
    """Engine-store keys nobody consumed (LMDeploy key mode)."""
    route_diff_fraction_no_replay: float
    """Fraction of (token, layer) routes where the trainer (float32, no replay) picks other
    experts than the engine (bf16), same weights."""
    token_diff_fraction_no_replay: float
    """Fraction of tokens with at least one such layer."""
    logprob_abs_diff_no_replay: float
    """Mean |trainer - engine| log-prob of generated tokens, trainer routing natively."""
    logprob_abs_diff_replay: float
    """The same with the engine's routing replayed (R3)."""
    logprob_abs_diff_no_replay_affected: float
    """Mean |trainer - engine| log-prob, no replay, over tokens after a routing difference
    in their sample (where replay can matter)."""
    logprob_abs_diff_replay_affected: float
    """The same with replay."""
    tokens_affected: int
    """Tokens behind the two affected means."""
    rows_compared: int
    """Rows behind the two route fractions."""
    tokens_compared: int
    """Tokens behind the two log-prob means."""
    rewards: tuple[float, ...]
    """Mean toy reward of each step's batch."""
    losses: tuple[float, ...]
    """Loss of each step."""
    timeline: tuple[Point, ...]
    """Object-store bytes, routing bytes and live leases at the end of each phase."""
    object_store_usage: tuple[tuple[float, int], ...]
    """(seconds, object-store bytes in use), sampled every 0.25 s."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the timeline as a list of points)."""
        out = asdict(self)
        out["timeline"] = [asdict(p) for p in self.timeline]
        out["object_store_usage"] = [list(sample) for sample in self.object_store_usage]
        return out

    @property
    def ok(self) -> bool:
        """True when every invariant holds."""
        return (
            self.routing_mismatches == 0
            and self.leaked_leases == 0
            and self.leaked_bytes == 0
            and self.writes_per_payload <= MAX_WRITES_PER_PAYLOAD
        )


def build_report(
    config: DemoConfig,
    svc: DemoServices,
    tally: ReplayTally,
    steps: list[StepStats],
    teardown: Teardown,
    wall_s: float,
) -> DemoReport:
    """The report of a finished run, from its services, tallies and teardown."""
    written, buffer, pool, timeline = (
        teardown.written,
        svc.buffer.stats(),
        svc.pool.stats,
        svc.meter.timeline,
    )
    effect = tally.summary()
    return DemoReport(
        wire=config.wire,
        run=svc.run,
        steps=len(steps),
        wall_s=round(wall_s, 2),
        samples_trained=sum(s.samples for s in steps),
        samples_retried=buffer.retried_samples,
        partial_resumes=pool.resume,
        sessions=pool.conversation,
        discarded_groups=buffer.discarded_groups,
        failed_rollouts=pool.failed,
        routing_rows_replayed=tally.rows_replayed,
        routing_mismatches=tally.mismatches,
        layers=svc.trainer.spec.num_layers,
        payloads=teardown.payloads,
        payload_bytes=teardown.payload_bytes,
        object_store_bytes_written=written.created_bytes,
        object_store_objects_written=written.created_objects,
        writes_per_payload=round(written.created_objects / max(1, teardown.payloads), 3),
        peak_object_store_bytes=timeline.peak_bytes(),
        object_store_bytes_after=teardown.object_store_bytes_after,
        peak_routing_bytes=max((s.peak_routing_bytes for s in steps), default=0),
        leaked_leases=teardown.leaked_leases,
        leaked_bytes=teardown.leaked_bytes,
        leak_holders=teardown.leak_holders,
        engine_keys_left=teardown.engine_keys_left,
        route_diff_fraction_no_replay=round(effect["route_diff_fraction_no_replay"], 6),
        token_diff_fraction_no_replay=round(effect["token_diff_fraction_no_replay"], 6),
        logprob_abs_diff_no_replay=effect["logprob_abs_diff_no_replay"],
        logprob_abs_diff_replay=effect["logprob_abs_diff_replay"],
        logprob_abs_diff_no_replay_affected=effect["logprob_abs_diff_no_replay_affected"],
        logprob_abs_diff_replay_affected=effect["logprob_abs_diff_replay_affected"],
        tokens_affected=int(effect["tokens_affected"]),
        rows_compared=int(effect["rows_compared"]),
        tokens_compared=int(effect["tokens_compared"]),
        rewards=tuple(round(s.reward, 4) for s in steps),
        losses=tuple(round(s.loss, 6) for s in steps),
        timeline=tuple(timeline.points),
        object_store_usage=tuple(timeline.usage),
    )


def write_json(report: DemoReport, path: Path) -> None:
    """Write the report as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")


def render(console: Console, report: DemoReport) -> None:
    """Print the report as three short tables and a verdict."""
    r = report
    run = _table(f"routeplay demo: {r.wire}, {r.steps} steps, {r.wall_s:.1f} s ({r.run})", 4)
    run.add_row("samples trained", f"{r.samples_trained}", "reward", _trend(r.rewards))
    run.add_row(
        "stale retries", f"{r.samples_retried}", "discarded groups", f"{r.discarded_groups}"
    )
    run.add_row(
        "partial resumes", f"{r.partial_resumes}", "failed rollouts", f"{r.failed_rollouts}"
    )
    run.add_row("trace sessions", f"{r.sessions}", "", "")

    rows = max(r.routing_rows_replayed, 1)
    replay = Table(title="routing: trainer (float32) vs engine (bf16)", title_justify="left")
    replay.add_column("", style="dim")
    replay.add_column("without replay", justify="right")
    replay.add_column("with replay (R3)", justify="right")
    replay.add_row(
        "(token, layer) routes differing",
        f"{r.route_diff_fraction_no_replay:.2%}",
        f"{r.routing_mismatches / (rows * max(1, r.layers)):.2%} "
        f"({_flag(r.routing_mismatches)} in {r.routing_rows_replayed} rows)",
    )
    replay.add_row(
        "tokens with a differing layer",
        f"{r.token_diff_fraction_no_replay:.2%}",
        "0.00%" if r.routing_mismatches == 0 else "> 0",
    )
    replay.add_row(
        f"mean |dlogprob| ({r.tokens_compared} tokens)",
        f"{r.logprob_abs_diff_no_replay:.2e}",
        f"{r.logprob_abs_diff_replay:.2e}",
    )
    replay.add_row(
        f"  after a routing difference ({r.tokens_affected})",
        f"{r.logprob_abs_diff_no_replay_affected:.2e}",
        f"{r.logprob_abs_diff_replay_affected:.2e}",
    )

    memory = _table("bytes and lifetimes", 4)
    # Ray returns values under 100 KiB inline to their owner instead of writing them to the
    # object store, so the demo's tiny payloads can show 0 writes; large ones show 1.
    memory.caption = (
        "writes: objects created in Ray's object store (payloads < 100 KiB travel inline)"
    )
    payloads = f"{r.payloads} ({_size(r.payload_bytes)})"
    memory.add_row("payloads", payloads, "writes per payload", f"{r.writes_per_payload:.2f}")
    memory.add_row(
        "object store written",
        _size(r.object_store_bytes_written),
        "peak object store",
        _size(r.peak_object_store_bytes),
    )
    memory.add_row("leaked leases", _flag(r.leaked_leases), "leaked bytes", _flag(r.leaked_bytes))
    memory.add_row(
        "engine keys left",
        _flag(r.engine_keys_left),
        "object store after",
        _flag(r.object_store_bytes_after),
    )
    for table in (run, replay, memory):
        console.print(table)
    if r.leak_holders:
        console.print(f"[red]leases still held by:[/] {', '.join(r.leak_holders)}")
    verdict = "[green]all invariants hold[/]" if r.ok else "[red]an invariant failed[/]"
    console.print(verdict)


def _table(title: str, columns: int) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    for index in range(columns):
        label = index % 2 == 0
        table.add_column(style="dim" if label else None, justify="left" if label else "right")
    return table


def _trend(values: tuple[float, ...]) -> str:
    if not values:
        return "-"
    return f"{values[0]:.3f} -> {values[-1]:.3f}"


def _flag(value: int) -> str:
    return f"[green]{value}[/]" if value == 0 else f"[red]{value}[/]"


def _flag_size(nbytes: int) -> str:
    return f"[green]{nbytes} B[/]" if nbytes == 0 else f"[yellow]{_size(nbytes)}[/]"


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
