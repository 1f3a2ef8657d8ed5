"""The demo report without Ray: whose figures it reports. The route store's leases and
bytes and the run's engine keys are always the run's; Ray's object-store counters only
when nobody else shared the cluster, else they are left out (None) and the one-write
invariant is not evaluated: neither a false pass nor a false failure."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from routeplay.pipeline.config import recipe
from routeplay.pipeline.meter import Sharing, StoreTotals
from routeplay.pipeline.metrics import ReplayTally, Timeline
from routeplay.pipeline.report import MAX_WRITES_PER_PAYLOAD, DemoReport, build_report, render
from routeplay.pipeline.rollouts import PoolStats
from routeplay.pipeline.services import Teardown
from routeplay.rollout.buffer import BufferStats

ALONE = Sharing(other_runs=(), other_jobs=())
SHARED = Sharing(other_runs=("demo-0b0b0b0b",), other_jobs=())
PAYLOADS = 100


def _teardown(
    sharing: Sharing,
    *,
    objects: int,
    leaked: int = 0,
    after: int = 0,
    keys: int = 0,
    engine_objects: int = 0,
) -> Teardown:
    """A teardown of 100 payloads of 100 bytes, ``objects`` object-store writes (of
    which ``engine_objects`` were the engine's)."""
    return Teardown(
        leaked_leases=leaked,
        leaked_bytes=100 * leaked,
        leak_holders=("buffer/g-1",) if leaked else (),
        payloads=PAYLOADS,
        payload_bytes=100 * PAYLOADS,
        prompt_bytes_saved=0,
        engine_keys_left=keys,
        engine_keys_unclaimed=0,
        written=StoreTotals(used_bytes=0, created_bytes=100 * objects, created_objects=objects),
        engine_objects=engine_objects,
        engine_bytes=100 * engine_objects,
        object_store_bytes_after=after,
        sharing=sharing,
    )


def _services() -> Any:
    """What ``build_report`` reads of a finished run's services."""
    buffer = BufferStats(
        groups=0, samples=0, retried_samples=2, discarded_groups=0, sampled_groups=4,
        waiting_retries=0,
    )  # fmt: skip
    return SimpleNamespace(
        buffer=SimpleNamespace(stats=lambda: buffer),
        pool=SimpleNamespace(stats=PoolStats()),
        meter=SimpleNamespace(timeline=Timeline()),
        run="demo-0a0a0a0a",
        trainer=SimpleNamespace(spec=SimpleNamespace(num_layers=2)),
    )


def _report(teardown: Teardown) -> DemoReport:
    return build_report(recipe("smoke"), _services(), ReplayTally(), [], teardown, 1.0)


def test_alone_the_counters_are_the_runs_and_the_one_write_invariant_is_evaluated() -> None:
    report = _report(_teardown(ALONE, objects=PAYLOADS))
    assert not report.object_store_shared
    assert (report.other_runs, report.other_jobs) == ((), ())
    assert report.writes_per_payload == report.bytes.writes_per_payload == 1.0
    assert report.bytes.written_per_stored_byte == 1.0
    assert report.object_store_objects_written == PAYLOADS
    assert report.object_store_bytes_after == 0
    assert report.unchecked == ()
    assert report.to_json()["unchecked"] == []
    assert report.ok


def test_alone_two_writes_per_payload_fail_the_run() -> None:
    report = _report(_teardown(ALONE, objects=2 * PAYLOADS))
    assert report.writes_per_payload == 2.0 > MAX_WRITES_PER_PAYLOAD
    assert not report.ok


def test_shared_the_counters_are_left_out_and_not_evaluated() -> None:
    # The manual two-demo run: 1.78 "writes per payload", the other run's objects counted.
    report = _report(_teardown(SHARED, objects=178, after=4096))
    assert report.object_store_shared
    assert report.other_runs == ("demo-0b0b0b0b",)
    for figure in (
        report.writes_per_payload,
        report.bytes.writes_per_payload,
        report.bytes.written_per_stored_byte,
        report.object_store_bytes_written,
        report.object_store_objects_written,
        report.object_store_bytes_after,
    ):
        assert figure is None
    assert report.unchecked == ("writes_per_payload",)
    assert report.ok  # no false failure from another run's objects
    data = json.loads(json.dumps(report.to_json()))
    assert data["object_store_shared"] is True
    assert data["other_runs"] == ["demo-0b0b0b0b"]
    assert data["writes_per_payload"] is None
    assert data["unchecked"] == ["writes_per_payload"]
    assert data["bytes"]["writes_per_payload"] is None


@pytest.mark.parametrize("sharing", [ALONE, SHARED], ids=["alone", "shared"])
def test_the_runs_own_leaks_fail_it_shared_or_not(sharing: Sharing) -> None:
    report = _report(_teardown(sharing, objects=PAYLOADS, leaked=1, keys=3))
    assert (report.leaked_leases, report.leaked_bytes) == (1, 100)
    assert report.engine_keys_left == 3
    assert not report.ok


def test_another_ray_job_makes_the_cluster_shared() -> None:
    sharing = Sharing(other_runs=(), other_jobs=("02000000",))
    assert sharing.shared
    report = _report(_teardown(sharing, objects=PAYLOADS))
    assert report.other_jobs == ("02000000",)
    assert report.writes_per_payload is None


def _rendered(report: DemoReport) -> str:
    console = Console(record=True, width=200)
    render(console, report)
    return " ".join(console.export_text().split())  # captions wrap at the table's width


def test_the_table_says_the_cluster_was_shared_and_what_was_not_evaluated() -> None:
    text = _rendered(_report(_teardown(SHARED, objects=178)))
    assert "the cluster was shared (1 other run)" in text
    assert "not evaluated on a shared cluster: writes_per_payload" in text
    assert "1.78" not in text
    alone = _rendered(_report(_teardown(ALONE, objects=PAYLOADS)))
    assert "all invariants hold" in alone
    assert "shared" not in alone


def test_the_engines_own_writes_are_counted_apart() -> None:
    # LMDeploy key mode: two engine objects per key (its array, the store's copy), then
    # routeplay's one compact write per payload.
    report = _report(_teardown(ALONE, objects=3 * PAYLOADS, engine_objects=2 * PAYLOADS))
    assert report.engine_objects_written == 2 * PAYLOADS
    assert report.writes_per_payload == 1.0
    assert report.bytes.written_per_stored_byte == 1.0
    assert report.ok
