"""The demo's report: one frozen record, as JSON and as a readable table.

Invariants a run must show (``DemoReport.ok``; the e2e test asserts them):
``routing_mismatches == 0`` (the experts used in training are the engine's, on every
real row), ``leaked_leases == 0`` and ``leaked_bytes == 0`` after teardown, and at most
one object-store write per payload (``writes_per_payload`` counts every object the run
created, so a stray object of Ray's own is tolerated; the eager path writes each
payload at least twice).

Whose figures: the route store's (leases, bytes, payloads) and the engine-store keys a
run claimed are the run's own, whoever else uses the cluster. Ray's object-store
counters (bytes and objects written, bytes in use) are the cluster's: Ray cannot say
which job wrote an object. When the meter saw other routeplay runs or other Ray jobs
during the run (``object_store_shared``, named in ``other_runs`` / ``other_jobs``), the
figures drawn from those counters (``object_store_bytes_written``,
``object_store_objects_written``, ``writes_per_payload``, ``object_store_bytes_after``,
``bytes.writes_per_payload``, ``bytes.written_per_stored_byte``) are ``None`` and the
one-write invariant is not evaluated (``unchecked`` names it): neither a pass nor a
failure is claimed for what the run cannot attribute. The object-store timeline and
its peak stay cluster-wide, as labelled. Unclaimed engine keys count in
``engine_keys_left`` only when the cluster was not shared (``engine_keys_unclaimed``
reports them either way).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from rich.console import Console
from rich.table import Table

from routeplay.pipeline.metrics import Point, ReplayTally, StepDrift

if TYPE_CHECKING:  # the services and trainer pull in Ray and torch
    from routeplay.pipeline.config import DemoConfig
    from routeplay.pipeline.services import DemoServices, Teardown
    from routeplay.pipeline.trainer import StepStats

__all__ = [
    "MAX_WRITES_PER_PAYLOAD",
    "ByteMetrics",
    "DemoReport",
    "R3Metrics",
    "StepRoutingDrift",
    "build_report",
    "render",
    "write_json",
]

MAX_WRITES_PER_PAYLOAD: Final = 1.1
"""One write per payload, plus room for a few objects Ray creates for itself."""

_SHARED: Final = "[yellow]shared[/]"
"""Shown for a figure of Ray's cluster-wide counters when others shared the cluster."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRoutingDrift:
    """One step's routing drift, as the library's ``RoutingDrift.as_metrics(prefix="")``.

    Keys (``docs/replay.md``): ``route_diff_share``, ``overlap``, ``token_diff_share``,
    ``layers_per_token``, ``tokens``, ``routes``, ``layer_{l}/route_diff_share``,
    ``layer_{l}/overlap``, and with log-probs ``kl_k3``, ``logprob_abs_gap``,
    ``logprob_tokens``.

    Example:
        >>> step = report.r3.drift_per_step[0]
        >>> step.live["route_diff_share"], step.no_replay["route_diff_share"]
    """

    live: dict[str, float]
    """Measured live under R3 by the HF replay: each router's own top-k against the
    engine's ids, in the training forward."""
    no_replay: dict[str, float]
    """The trainer's own routing (a forward without replay) against the engine's, same
    rows. Close to ``live`` but not equal: under replay every layer after the first
    replayed one sees hidden states computed with the engine's experts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class R3Metrics:
    """The R3 paper's measurements, on the same tokens without replay, with R2 and with R3.

    Routes are compared per (token, layer) as expert sets, on rows produced by the weights
    the trainer holds; log-probs over the generated tokens of samples produced entirely by
    them. R2 replays the routing the trainer recorded in its own no-replay pass, so its
    routes are by construction the no-replay ones. Every figure is the library's
    (``DriftMeter``, ``RoutingDrift``): the demo computes none itself.

    Example:
        >>> R3Metrics.from_tally(ReplayTally()).mismatched_routes_with
        0
    """

    route_disagreement: float | None
    """Fraction of (token, layer) routes where the trainer, without replay, picks other
    experts than the engine did (None here and below: no route was compared)."""
    tokens_any_layer: float | None
    """Fraction of tokens with at least one such layer."""
    layers_per_token: float | None
    """Mean number of differing layers per token."""
    live_route_disagreement: float | None
    """The same fraction measured live under R3 (the trainer's routers' own choice in
    the replayed training forward against the engine's ids)."""
    live_tokens_any_layer: float | None
    """Live under R3: fraction of tokens with at least one differing layer."""
    live_layers_per_token: float | None
    """Live under R3: mean number of differing layers per token."""
    kl_k3_without: float
    """Mean k3 estimate of KL(engine || trainer) per token, trainer routing natively."""
    kl_k3_with: float
    """The same with the engine's routing replayed (R3)."""
    kl_k3_r2: float
    """The same with the trainer's own recorded routing replayed (R2)."""
    abs_dlogprob_without: float
    """Mean |trainer - engine| log-prob per token, no replay."""
    abs_dlogprob_with: float
    """The same with R3."""
    abs_dlogprob_r2: float
    """The same with R2."""
    mismatched_routes_with: int
    """(token, layer) routes where the experts used in training (R3) differ from the
    engine's: must be 0."""
    kl_k3_per_step: tuple[tuple[float | None, float | None, float | None], ...]
    """Per step: mean k3 KL without replay, with R2, with R3 (None: no token compared)."""
    drift_per_step: tuple[StepRoutingDrift, ...]
    """Per step: the live drift under R3 next to the no-replay disagreement."""

    @classmethod
    def from_tally(cls, tally: ReplayTally) -> R3Metrics:
        """Read the run's tally."""
        total = tally.total() or StepDrift.empty(top_k=1)
        native, live = total.no_replay, total.live
        return cls(
            route_disagreement=native.route_share,
            tokens_any_layer=native.token_share,
            layers_per_token=native.layers_per_token,
            live_route_disagreement=live.route_share,
            live_tokens_any_layer=live.token_share,
            live_layers_per_token=live.layers_per_token,
            kl_k3_without=_mean(native.kl_k3),
            kl_k3_with=_mean(live.kl_k3),
            kl_k3_r2=_mean(total.r2.kl_k3),
            abs_dlogprob_without=_mean(native.logprob_gap),
            abs_dlogprob_with=_mean(live.logprob_gap),
            abs_dlogprob_r2=_mean(total.r2.logprob_gap),
            mismatched_routes_with=total.used.differing,
            kl_k3_per_step=tuple(
                (_finite(a), _finite(b), _finite(c)) for a, b, c in (s.kl_k3 for s in tally.steps)
            ),
            drift_per_step=tuple(
                StepRoutingDrift(
                    live=s.live.as_metrics(prefix=""), no_replay=s.no_replay.as_metrics(prefix="")
                )
                for s in tally.steps
            ),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ByteMetrics:
    """How big the payloads were and how often they were written.

    Example:
        >>> ByteMetrics(
        ...     payload_bytes_mean=0.0, writes_per_payload=0.0, prompt_bytes_saved=0,
        ...     sample_bytes_mean=0.0, written_per_stored_byte=0.0,
        ... ).writes_per_payload
        0.0
    """

    payload_bytes_mean: float
    """Mean bytes of a payload the route store took (as stored). A group's request round
    is one payload (its prompt's rows once, then every member's own rows; for resumes and
    second turns, the rows each member adds)."""
    writes_per_payload: float | None
    """Object-store objects routeplay created per payload (the engine's own writes of
    its answers apart): 1 (a shard writes a payload Ray would keep inline in its heap,
    under 100 KiB, to the object store once); None: the cluster was shared."""
    prompt_bytes_saved: int
    """Bytes not written because a GRPO group's verified-equal prompt rows were stored
    once (0 when the store does not share prefixes)."""
    sample_bytes_mean: float
    """Mean routing bytes of a trained sample, ``[T, L, K]`` in the model's compact dtype
    (what replay reads)."""
    written_per_stored_byte: float | None
    """Object-store bytes routeplay wrote per payload byte stored (the engine's own
    apart; about 1.0: no byte is written twice; the eager path writes each at least
    twice); None: shared cluster."""


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
    object_store_bytes_written: int | None
    """Bytes written into Ray's object store during the run (all nodes, all objects);
    None when the cluster was shared (``object_store_shared``)."""
    object_store_objects_written: int | None
    """Objects created in Ray's object store during the run; None: shared cluster."""
    engine_objects_written: int
    """Of those, what the engine side wrote (LMDeploy key mode: each answer's array and
    the engine store's copy of it; 0 for wires that carry the rows)."""
    writes_per_payload: float | None
    """Objects routeplay created per routing payload (the run's objects less the
    engine's own): 1, small payloads included (a shard writes those to the object store
    itself; an adopted key's compact copy under 100 KiB stays in its shard's heap: 0);
    None when the cluster was shared (not evaluated)."""
    peak_object_store_bytes: int
    """Most object-store bytes in use at any sampled point (cluster-wide)."""
    object_store_bytes_after: int | None
    """Object-store bytes in use after teardown above the starting baseline, once Ray
    freed what was released (it frees asynchronously; teardown waits up to 10 s);
    None when the cluster was shared."""
    object_store_shared: bool
    """Other routeplay runs or Ray jobs used the cluster during this run: Ray's counters
    were not this run's alone, so the figures drawn from them are None."""
    other_runs: tuple[str, ...]
    """Run ids of the other routeplay runs seen (their route stores were alive)."""
    other_jobs: tuple[str, ...]
    """Ids of the other Ray jobs (drivers) seen alive."""
    peak_routing_bytes: int
    """Most routing bytes the trainer's materializer held at once."""
    leaked_leases: int
    """Leases still held after teardown."""
    leaked_bytes: int
    """Payload bytes still alive after teardown."""
    leak_holders: tuple[str, ...]
    """Holders of the leaked leases (empty when nothing leaked)."""
    engine_keys_left: int
    """This run's engine-store keys nobody consumed (LMDeploy key mode): those it
    claimed, plus the unclaimed ones when the cluster was not shared."""
    engine_keys_unclaimed: int
    """Live engine-store keys no run had claimed at teardown (cluster-wide)."""
    route_diff_fraction_no_replay: float | None
    """Fraction of (token, layer) routes where the trainer (float32, no replay) picks other
    experts than the engine (bf16), same weights."""
    token_diff_fraction_no_replay: float | None
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
    trainer_dtype: str
    """Precision the trainer ran in (the engine: bf16)."""
    r3: R3Metrics
    """The R3 paper's measurements: no replay, R2, R3."""
    bytes: ByteMetrics
    """Payload sizes, writes, prompt sharing."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the timeline as a list of points; ``unchecked`` added)."""
        out = asdict(self)
        out["unchecked"] = list(self.unchecked)
        out["timeline"] = [asdict(p) for p in self.timeline]
        out["object_store_usage"] = [list(sample) for sample in self.object_store_usage]
        out["r3"]["kl_k3_per_step"] = [list(step) for step in self.r3.kl_k3_per_step]
        return out

    @property
    def ok(self) -> bool:
        """True when every invariant the run can attribute holds (see ``unchecked``)."""
        writes = self.writes_per_payload
        return (
            self.routing_mismatches == 0
            and self.leaked_leases == 0
            and self.leaked_bytes == 0
            and (writes is None or writes <= MAX_WRITES_PER_PAYLOAD)
        )

    @property
    def unchecked(self) -> tuple[str, ...]:
        """Invariants not evaluated, because the figures behind them are not the run's."""
        return ("writes_per_payload",) if self.writes_per_payload is None else ()


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
    total = tally.total() or StepDrift.empty(top_k=1)
    sharing = teardown.sharing
    own = not sharing.shared  # Ray's counters are this run's alone
    # routeplay's own writes: the engine's writes of its answers are counted apart
    objects = written.created_objects - teardown.engine_objects
    nbytes = written.created_bytes - teardown.engine_bytes
    writes = round(objects / max(1, teardown.payloads), 3) if own else None
    per_byte = round(nbytes / max(1, teardown.payload_bytes), 3) if own else None
    return DemoReport(
        trainer_dtype=config.trainer.dtype,
        r3=R3Metrics.from_tally(tally),
        bytes=ByteMetrics(
            payload_bytes_mean=round(teardown.payload_bytes / max(1, teardown.payloads), 1),
            writes_per_payload=writes,
            prompt_bytes_saved=teardown.prompt_bytes_saved,
            sample_bytes_mean=round(
                sum(s.routing_bytes for s in steps) / max(1, sum(s.samples for s in steps)), 1
            ),
            written_per_stored_byte=per_byte,
        ),
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
        object_store_bytes_written=written.created_bytes if own else None,
        object_store_objects_written=written.created_objects if own else None,
        engine_objects_written=teardown.engine_objects,
        writes_per_payload=writes,
        peak_object_store_bytes=timeline.peak_bytes(),
        object_store_bytes_after=teardown.object_store_bytes_after if own else None,
        object_store_shared=sharing.shared,
        other_runs=sharing.other_runs,
        other_jobs=sharing.other_jobs,
        peak_routing_bytes=max((s.peak_routing_bytes for s in steps), default=0),
        leaked_leases=teardown.leaked_leases,
        leaked_bytes=teardown.leaked_bytes,
        leak_holders=teardown.leak_holders,
        engine_keys_left=teardown.engine_keys_left,
        engine_keys_unclaimed=teardown.engine_keys_unclaimed,
        route_diff_fraction_no_replay=_rounded(total.no_replay.route_share),
        token_diff_fraction_no_replay=_rounded(total.no_replay.token_share),
        logprob_abs_diff_no_replay=_mean(total.no_replay.logprob_gap),
        logprob_abs_diff_replay=_mean(total.live.logprob_gap),
        logprob_abs_diff_no_replay_affected=_mean(total.no_replay_affected.logprob_gap),
        logprob_abs_diff_replay_affected=_mean(total.live_affected.logprob_gap),
        tokens_affected=total.live_affected.logprob_tokens,
        rows_compared=total.no_replay.tokens,
        tokens_compared=total.live.logprob_tokens,
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

    for table in (run, _r3_table(r), _drift_table(r), _memory_table(r)):
        console.print(table)
    if r.leak_holders:
        console.print(f"[red]leases still held by:[/] {', '.join(r.leak_holders)}")
    console.print(_verdict(r))


def _memory_table(r: DemoReport) -> Table:
    """Payloads, writes and what was left; figures Ray cannot attribute to the run when
    others shared the cluster read "shared"."""
    memory = _table("bytes and lifetimes", 4)
    # Counted by Ray's raylets, not by routeplay: every payload, small ones included, is
    # one object written once.
    memory.caption = "writes: objects created in Ray's object store, per payload"
    if r.engine_objects_written:
        memory.caption += (
            f" (the engine's own {r.engine_objects_written} writes of its answers apart)"
        )
    if r.object_store_shared:
        memory.caption += (
            f"; the cluster was shared ({_others(r)}): Ray's object-store counters are "
            "cluster-wide, so the figures marked shared are not this run's"
        )
    payloads = f"{r.payloads} ({_size(r.payload_bytes)})"
    memory.add_row("payloads", payloads, "writes per payload", _ratio(r.writes_per_payload))
    memory.add_row(
        "mean payload",
        _size(int(r.bytes.payload_bytes_mean)),
        "prompt bytes saved",
        _size(r.bytes.prompt_bytes_saved),
    )
    memory.add_row(
        "mean sample routing",
        _size(int(r.bytes.sample_bytes_mean)),
        "written / stored bytes",
        _ratio(r.bytes.written_per_stored_byte),
    )
    written = r.object_store_bytes_written
    memory.add_row(
        "object store written",
        _SHARED if written is None else _size(written),
        "peak object store",
        _size(r.peak_object_store_bytes),
    )
    memory.add_row("leaked leases", _flag(r.leaked_leases), "leaked bytes", _flag(r.leaked_bytes))
    after = r.object_store_bytes_after
    memory.add_row(
        "engine keys left",
        _flag(r.engine_keys_left),
        "object store after",
        _SHARED if after is None else _flag(after),
    )
    return memory


def _verdict(r: DemoReport) -> str:
    if not r.ok:
        return "[red]an invariant failed[/]"
    if r.unchecked:
        return (
            "[green]every invariant this run can attribute holds[/]; [yellow]not evaluated "
            f"on a shared cluster: {', '.join(r.unchecked)}[/]"
        )
    return "[green]all invariants hold[/]"


def _others(r: DemoReport) -> str:
    counts = ((len(r.other_runs), "other run"), (len(r.other_jobs), "other Ray job"))
    return ", ".join(f"{n} {what}{'s' if n > 1 else ''}" for n, what in counts if n)


def _ratio(value: float | None) -> str:
    return _SHARED if value is None else f"{value:.2f}"


def _r3_table(r: DemoReport) -> Table:
    """The R3 paper's comparison: the same tokens without replay, with R2, with R3."""
    m = r.r3
    table = Table(
        title=f"training-inference mismatch: trainer ({r.trainer_dtype}) vs engine (bf16), "
        f"{r.tokens_compared} tokens, {r.rows_compared} rows x {r.layers} layers",
        title_justify="left",
    )
    for name in ("", "routes differing", "tokens, >= 1 layer", "layers / token"):
        table.add_column(name, style="dim" if not name else None, justify="right")
    table.add_column("k3 KL", justify="right")
    table.add_column("mean |dlogprob|", justify="right")
    replayed = max(1, r.routing_rows_replayed * max(1, r.layers))
    without = (_shown(m.route_disagreement, ".2%"), _shown(m.tokens_any_layer, ".2%"))
    table.add_row(
        "no replay", *without, _shown(m.layers_per_token, ".2f"), _sci(m.kl_k3_without),
        _sci(m.abs_dlogprob_without),
    )  # fmt: skip
    table.add_row(
        "R2 (own routing)", *without, _shown(m.layers_per_token, ".2f"), _sci(m.kl_k3_r2),
        _sci(m.abs_dlogprob_r2),
    )  # fmt: skip
    table.add_row(
        "R3, routers' own (live)", _shown(m.live_route_disagreement, ".2%"),
        _shown(m.live_tokens_any_layer, ".2%"), _shown(m.live_layers_per_token, ".2f"), "", "",
    )  # fmt: skip
    table.add_row(
        "R3 (engine's)", f"{m.mismatched_routes_with / replayed:.2%}",
        "-", f"{_flag(m.mismatched_routes_with)} routes", _sci(m.kl_k3_with),
        _sci(m.abs_dlogprob_with),
    )  # fmt: skip
    cut = 1 - m.kl_k3_with / m.kl_k3_without if m.kl_k3_without > 0 else 0.0
    table.caption = (
        f"R3 cuts the k3 KL by {cut:.0%}; after a routing difference ({r.tokens_affected} "
        f"tokens) |dlogprob| {_sci(r.logprob_abs_diff_no_replay_affected)} -> "
        f"{_sci(r.logprob_abs_diff_replay_affected)}"
    )
    return table


def _drift_table(r: DemoReport) -> Table:
    """Per step: the drift the library measured live under R3 next to the no-replay
    disagreement on the same rows."""
    table = Table(title="routing drift per step (library: DriftMeter)", title_justify="left")
    for name in ("step", "no replay", "live under R3", "no replay", "live under R3"):
        table.add_column(name, justify="right")
    for step, drift in enumerate(r.r3.drift_per_step):
        native, live = drift.no_replay, drift.live
        table.add_row(
            f"{step}", _shown(native.get("route_diff_share"), ".2%"),
            _shown(live.get("route_diff_share"), ".2%"),
            _shown(native.get("layers_per_token"), ".2f"),
            _shown(live.get("layers_per_token"), ".2f"),
        )  # fmt: skip
    table.caption = (
        "routes differing (first two), differing layers per token (last two); live: each "
        "router's own top-k inside the replayed training forward against the engine's ids. "
        "They differ a little from the no-replay figures: under replay the hidden states "
        "change after the first replayed layer"
    )
    return table


def _sci(value: float) -> str:
    return f"{value:.2e}"


def _shown(value: float | None, spec: str) -> str:
    """A figure, or "-" where the meter compared nothing (no figure, never a 0)."""
    return "-" if value is None else format(value, spec)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _mean(value: float | None) -> float:
    """A mean of the library's figures, 0.0 where nothing was compared."""
    return 0.0 if value is None else value


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


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
