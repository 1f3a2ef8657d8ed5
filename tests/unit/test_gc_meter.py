"""``routeplay.bench.gc_meter``: a settle leaves the count at zero, and the collections
after it are counted by generation with their CPU."""

from __future__ import annotations

import gc
import threading

import pytest

from routeplay.bench import gc_meter


def test_a_settle_starts_the_count_from_zero() -> None:
    gc_meter.settle()
    gc.collect()
    gc_meter.settle()
    assert gc_meter.collected() == {"cpu_ms": 0.0, "by_generation": [0, 0, 0]}


def test_collections_after_a_settle_are_counted_by_generation() -> None:
    gc_meter.settle()
    gc.collect(0)
    gc.collect(2)
    counted = gc_meter.collected()
    assert counted["by_generation"][0] >= 1
    assert counted["by_generation"][2] >= 1
    assert counted["cpu_ms"] > 0.0


def test_garbage_made_during_a_run_triggers_counted_collections() -> None:
    gc_meter.settle()
    made = [[index] for index in range(50_000)]  # tracked containers: gen-0 collections
    assert len(made) == 50_000
    assert sum(gc_meter.collected()["by_generation"]) >= 1


def test_a_collection_that_starts_inside_the_meters_lock_does_not_hang() -> None:
    # settle() and collected() allocate while they hold the meter's lock, so a
    # collection can start there; its hook then takes the lock again on that thread.
    gc_meter.settle()
    done = threading.Event()

    def collect_under_the_lock() -> None:
        with gc_meter._lock:
            gc.collect(0)
        done.set()

    threading.Thread(target=collect_under_the_lock, daemon=True).start()
    assert done.wait(10.0), "the collection's hook waited on the lock its own thread held"
    assert gc_meter.collected()["by_generation"][0] >= 1


def test_a_meter_never_settled_refuses_to_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_meter, "_installed", False)
    with pytest.raises(RuntimeError, match="before any settle"):
        gc_meter.collected()
