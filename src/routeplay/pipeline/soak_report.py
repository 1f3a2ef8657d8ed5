"""The soak's report: what the samples went through, what every fault did, and the
invariants (``SoakReport.broken`` names each one that failed; the CLI exits 2 then).

Invariants: no premature release (no ``AlreadyReleased`` / ``RoutesLost`` anywhere), no
untyped error, no lease or byte leaked after teardown, no routing mismatch under replay,
no engine key left once the TTL ran, at least one key expired per dropped response
(key wires), the object store back at its starting baseline, and every fault kind with
a non-zero rate fired at least once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from routeplay.pipeline.faults import FAULT_KINDS

if TYPE_CHECKING:
    from routeplay.pipeline.services import DemoServices, Teardown
    from routeplay.pipeline.soak_config import SoakConfig, SoakTally

__all__ = ["SoakReport", "build_soak_report", "render_soak", "write_soak_json"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakReport:
    """One soak's outcome (every count over the whole run)."""

    steps: int
    """RL steps run."""
    seed: int
    """Seed of the fault draws."""
    wire: str
    """Engine wire format."""
    faults_fired: dict[str, int]
    """Times each fault kind really happened."""
    faults_expected: tuple[str, ...]
    """Kinds with a non-zero rate (each must have fired)."""
    samples_produced: int
    """Samples the rollout workers returned."""
    samples_trained: int
    """Samples in training steps that completed."""
    samples_retried: int
    """Samples the replay buffer sent back for regeneration (stale)."""
    samples_lost: dict[str, int]
    """Samples lost, by the typed error that lost them."""
    lost_examples: tuple[str, ...]
    """One message per error type (why)."""
    premature_releases: int
    """AlreadyReleased / RoutesLost errors (must be 0)."""
    premature_examples: tuple[str, ...]
    """Their messages."""
    untyped_errors: int
    """Errors outside routeplay's tree (must be 0)."""
    leaked_leases: int
    """Leases left after teardown (must be 0)."""
    leak_holders: tuple[str, ...]
    """Who holds the leaked leases."""
    leaked_bytes: int
    """Routing bytes the route store still kept after teardown (must be 0)."""
    routing_mismatches: int
    """Rows whose replayed experts differ from the engine's (must be 0)."""
    engine_keys_expired: int
    """Engine keys dropped by the TTL, never consumed."""
    engine_keys_left: int
    """Engine keys still live after the TTL wait (must be 0)."""
    dropped_responses: int
    """Requests whose key nobody read (key wires: each must have expired)."""
    object_store_bytes_before: int
    """Ray object-store bytes in use when the pipeline had started."""
    object_store_bytes_after: int
    """The same after teardown, once Ray settled."""
    object_store_excess_bytes: int
    """After minus the baseline, floored at 0 (must be 0)."""
    duration_s: float
    """Wall time of the soak."""

    @property
    def broken(self) -> tuple[str, ...]:
        """The invariants that failed (empty: all hold)."""
        checks = {
            "premature releases": self.premature_releases == 0,
            "untyped errors": self.untyped_errors == 0,
            "leaked leases": self.leaked_leases == 0,
            "leaked bytes": self.leaked_bytes == 0,
            "routing mismatches": self.routing_mismatches == 0,
            "engine keys left": self.engine_keys_left == 0,
            "dropped keys expired": self.engine_keys_expired >= self.dropped_responses
            or self.wire != "lmdeploy-key",
            "object store at baseline": self.object_store_excess_bytes == 0,
            "every fault fired": all(self.faults_fired.get(k, 0) > 0 for k in self.faults_expected),
        }
        return tuple(name for name, ok in checks.items() if not ok)

    @property
    def ok(self) -> bool:
        """True when every invariant holds."""
        return not self.broken


def build_soak_report(
    config: SoakConfig,
    svc: DemoServices,
    fired: Mapping[str, int],
    tally: SoakTally,
    teardown: Teardown,
    keys: tuple[int, int],
    duration_s: float,
    mismatches: int,
) -> SoakReport:
    """Assemble the report from the run's parts (after teardown)."""
    baseline = svc.meter.start.used_bytes
    return SoakReport(
        steps=config.steps,
        seed=config.faults.seed,
        wire=config.demo.wire,
        faults_fired={kind: int(fired.get(kind, 0)) for kind in FAULT_KINDS},
        faults_expected=tuple(k for k in FAULT_KINDS if config.faults.rate(k) > 0),
        samples_produced=tally.produced,
        samples_trained=tally.trained,
        samples_retried=svc.buffer.stats().retried_samples,
        samples_lost=dict(sorted(tally.lost.items())),
        lost_examples=tuple(tally.examples.values()),
        premature_releases=len(tally.premature),
        premature_examples=tuple(tally.premature[:5]),
        untyped_errors=len(tally.untyped),
        leaked_leases=teardown.leaked_leases,
        leak_holders=teardown.leak_holders,
        leaked_bytes=teardown.leaked_bytes,
        routing_mismatches=mismatches,
        engine_keys_expired=keys[0],
        engine_keys_left=keys[1],
        dropped_responses=int(fired.get("dropped_response", 0)),
        object_store_bytes_before=baseline,
        object_store_bytes_after=baseline + teardown.object_store_bytes_after,
        object_store_excess_bytes=teardown.object_store_bytes_after,
        duration_s=round(duration_s, 1),
    )


def render_soak(report: SoakReport, console: Console) -> None:
    """Print the report as two rich tables (faults; outcomes) and the verdict."""
    faults = Table(title="faults injected")
    faults.add_column("fault")
    faults.add_column("fired", justify="right")
    for kind, times in report.faults_fired.items():
        faults.add_row(kind, str(times))
    console.print(faults)
    outcome = Table(title=f"soak: {report.steps} steps, seed {report.seed}, {report.wire}")
    outcome.add_column("measure")
    outcome.add_column("value", justify="right")
    for name, value in _rows(report):
        outcome.add_row(name, value)
    console.print(outcome)
    for line in report.lost_examples:
        console.print(f"lost: {line}", markup=False, highlight=False)
    verdict = "all invariants hold" if report.ok else f"BROKEN: {', '.join(report.broken)}"
    console.print(verdict, markup=False)


def _rows(report: SoakReport) -> list[tuple[str, str]]:
    lost = ", ".join(f"{k} {v}" for k, v in report.samples_lost.items()) or "0"
    return [
        ("samples produced", str(report.samples_produced)),
        ("samples trained", str(report.samples_trained)),
        ("samples retried", str(report.samples_retried)),
        ("samples lost (by error)", lost),
        ("premature releases", str(report.premature_releases)),
        ("untyped errors", str(report.untyped_errors)),
        ("leaked leases / bytes", f"{report.leaked_leases} / {report.leaked_bytes}"),
        ("leak holders", ", ".join(report.leak_holders) or "-"),
        ("routing mismatches", str(report.routing_mismatches)),
        ("engine keys expired by TTL", str(report.engine_keys_expired)),
        ("engine keys left", str(report.engine_keys_left)),
        (
            "object store bytes before / after",
            f"{report.object_store_bytes_before} / {report.object_store_bytes_after}",
        ),
        ("object store at baseline", "yes" if report.object_store_excess_bytes == 0 else "no"),
        ("duration", f"{report.duration_s} s"),
    ]


def write_soak_json(report: SoakReport, path: Path) -> None:
    """Write the report (with ``ok`` and ``broken``) as JSON."""
    data: dict[str, Any] = dataclasses.asdict(report)
    data.update(ok=report.ok, broken=list(report.broken))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
