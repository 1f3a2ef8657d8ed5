"""The bench's physical limit: measured on the workload's own bytes (what crosses nodes,
what each SP rank copies), and a path below it named, so the bench fails."""

from __future__ import annotations

from typing import Any

import pytest

from routeplay.bench import limit
from routeplay.bench.limit import beaten, object_sizes, rank_byte_ranges, rank_shares, tightened
from routeplay.bench.report import below_limit
from routeplay.bench.workloads import BenchConfig, Workload

GRPO = Workload(model="qwen3-30b-a3b", tokens=1536, samples=4, sp=1, prompt_tokens=1024)


def test_the_pulled_objects_are_the_workloads_cross_node_bytes() -> None:
    for w in (*BenchConfig.full().workloads, GRPO):
        assert sum(object_sizes(w)) == w.unique_bytes
    assert len(object_sizes(GRPO)) == GRPO.samples + 1  # the shared prompt once


def test_the_ranks_copy_every_row_of_the_step_once() -> None:
    for w in BenchConfig.full().workloads:
        shares = rank_shares(w)
        assert len(shares) == w.sp
        assert sum(shares) == w.payload_bytes


LIMIT = {"by_path": {"producer": 45.0, "adopt": 50.0}}


def test_a_path_faster_than_its_limit_is_named() -> None:
    assert beaten({"producer": 46.0, "adopt": 50.0}, LIMIT) == []
    assert beaten({"producer": 40.0, "adopt": 90.0}, LIMIT) == [
        "producer: 40.0 ms < its limit 45.0 ms"
    ]


def test_below_limit_collects_workloads_and_scaling_points() -> None:
    def point(name: str, lines: list[str]) -> dict[str, Any]:
        return {"name": name, "below_limit": lines}

    results = {
        "workloads": [point("a", []), point("b", ["adopt: 1 ms < its limit 2 ms"])],
        "scaling": {
            "tokens_per_sample": [point("t", ["producer: 3 ms < its limit 4 ms"])],
            "samples_per_step": [point("s", [])],
        },
    }
    assert below_limit(results) == [
        "b: adopt: 1 ms < its limit 2 ms",
        "t: producer: 3 ms < its limit 4 ms",
    ]


def test_bare_ray_ranks_copy_the_rows_the_path_ranks_copy() -> None:
    for w in (GRPO, Workload(model="qwen3-235b-a22b", tokens=4096, samples=3, sp=4)):
        row = w.spec.row_nbytes
        copied = sum(hi - lo for rank in range(w.sp) for _, lo, hi in rank_byte_ranges(w, rank))
        assert copied == w.payload_bytes  # every row of every sample, once
        sizes = object_sizes(w)
        for rank in range(w.sp):
            for index, lo, hi in rank_byte_ranges(w, rank):
                assert 0 <= lo < hi <= sizes[index]
                assert lo % row == 0
                assert hi % row == 0


def test_the_validation_probe_validates_each_sample_of_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the adopted-key path validates per step: every sample's whole raw payload.
    seen: list[tuple[tuple[int, ...], str]] = []
    real = limit.canonicalize

    def counted(array: Any, spec: Any, **kwargs: Any) -> Any:
        seen.append((array.shape, str(array.dtype)))
        return real(array, spec, **kwargs)

    monkeypatch.setattr(limit, "canonicalize", counted)
    w = BenchConfig.smoke().workloads[0]
    assert limit.validate_s(w, runs=2) > 0
    assert seen == [((w.rows, w.spec.decoder_layers, w.spec.top_k), "uint16")] * 2 * w.samples


def test_a_floor_run_faster_than_the_probe_lowers_that_paths_limit_only() -> None:
    probed = {"by_path": {"producer": 240.0, "adopt": 230.0}, "limit_ms": 230.0, "runs": 5}
    limit = tightened(probed, {"producer": [260.0, 250.0], "adopt": [240.0, 221.5, 260.0]})
    assert limit["by_path"] == {"producer": 240.0, "adopt": 221.5}
    assert limit["limit_ms"] == 221.5
    assert limit["probe_by_path"] == probed["by_path"]
    assert limit["floor_best_ms"] == {"producer": 250.0, "adopt": 221.5}
    assert limit["runs"] == 5
    # A floor median below the probe (seen in a full run) can no longer beat the limit.
    assert beaten({"producer": 245.0, "adopt": 225.0}, limit) == []
    assert tightened(probed, {"adopt": []})["by_path"] == probed["by_path"]
