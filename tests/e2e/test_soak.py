"""A small soak: every fault kind fires at least once (forced by the seeded plan), and
every invariant still holds: nothing released under a holder, nothing leaked, no engine
key left after its TTL, the object store back at its baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from routeplay.cli.main import main
from routeplay.pipeline import soak as soak_module
from routeplay.pipeline.config import recipe
from routeplay.pipeline.faults import FAULT_KINDS, FaultConfig
from routeplay.pipeline.soak import SoakConfig, run_soak
from routeplay.pipeline.soak_report import SoakReport

pytestmark = [pytest.mark.e2e, pytest.mark.long]


@pytest.mark.usefixtures("ray_local")
def test_every_fault_fires_and_every_invariant_holds(tmp_path: Path) -> None:
    # One step per fault kind: each_at_least_once forces kind i at step i if the draws
    # have not fired it yet. Workers are killed mid-job: the pool revokes the leases a
    # dead worker took under its jobs' holder names (its new lease, a borrowed prefix).
    # Run through the CLI (`routeplay soak`), with a spy keeping the report it rendered.
    out = tmp_path / "soak.json"
    reports: list[SoakReport] = []

    def spy(*args: Any, **kwargs: Any) -> SoakReport:
        reports.append(run_soak(*args, **kwargs))
        return reports[-1]

    argv = ["soak", "--steps", str(len(FAULT_KINDS)), "--seed", "5", "--key-ttl", "3"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(soak_module, "run_soak", spy)
        status = main([*argv, "--json", str(out)])
    [report] = reports
    data = json.loads(out.read_text())
    assert status == 0
    assert data["ok"], data["broken"]
    assert data["faults_fired"] == report.faults_fired
    assert report.broken == ()
    assert all(report.faults_fired[kind] > 0 for kind in FAULT_KINDS), report.faults_fired
    assert report.samples_trained > 0
    assert report.samples_retried > 0
    # Each fault that loses samples shows up under its own typed error.
    for kind in ("InjectedFault", "RayActorError", "EngineUnavailable", "MalformedPayload"):
        assert report.samples_lost.get(kind, 0) > 0, report.samples_lost
    assert report.premature_releases == 0
    assert report.untyped_errors == 0
    assert (report.leaked_leases, report.leaked_bytes, report.engine_keys_left) == (0, 0, 0)
    # The dropped response's key and the corrupted answer's key both expire unread.
    assert report.engine_keys_expired >= report.dropped_responses + 1
    assert report.object_store_excess_bytes == 0


@pytest.mark.usefixtures("ray_local")
def test_group_writes_under_faults_lose_only_the_faulty_members() -> None:
    # A wire that carries the rows: each group's members go to one worker call and one
    # packed write; a corrupted answer, a killed worker or engine cost only their own
    # members (or that call), and nothing leaks or is released early. Only the faults
    # that reach a group write fire, drawn often, so four steps see each of them (seed 5:
    # a corrupted answer every step, workers killed in steps 0 and 3, the engine in 0
    # and 2); the first soak covers the other kinds.
    demo = recipe("smoke").replace(wire="sglang")
    others = {kind: 0.0 for kind in FAULT_KINDS}
    faults = FaultConfig(
        **{**others, "malformed_payload": 1.0, "worker_kill": 0.5, "engine_kill": 0.5},
        seed=5,
        each_at_least_once=False,
    )
    report = run_soak(SoakConfig(steps=4, faults=faults, demo=demo))
    assert report.broken == ()
    assert report.samples_trained > 0
    assert min(report.faults_fired[k] for k in ("worker_kill", "engine_kill")) > 0
    # One sample per corrupted answer: a whole-group failure would lose the group.
    malformed = report.faults_fired["malformed_payload"]
    assert malformed > 0
    assert report.samples_lost.get("MalformedPayload", 0) == malformed, report.samples_lost
    assert report.premature_releases == 0
    assert report.untyped_errors == 0
    assert (report.leaked_leases, report.leaked_bytes) == (0, 0)
    assert report.object_store_excess_bytes == 0
