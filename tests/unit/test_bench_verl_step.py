"""verl's data path against routeplay's (``routeplay.bench.verl_step``), without a Ray
cluster: the ranks' two passes in process over a local store deliver the same rows (the
check a benchmark's first step makes), a rank that got other rows from verl's chunk is
caught, the check's other refusals, the leak check, and the table read back from a
hand-built results section."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from routeplay.bench import verl_path
from routeplay.bench.verl_figures import Rank, RankPass, RowsCheck, check_rows, ranks_of
from routeplay.bench.verl_report import verl_step_table
from routeplay.bench.verl_roles import _VerlRank, sample_rows
from routeplay.bench.verl_step import check_nothing_left
from routeplay.bench.workloads import VerlStepShape
from routeplay.core import Routes
from routeplay.errors import MisuseError
from routeplay.store import RouteStore, StoreConfig

# Two DP chunks of two samples, TP2 (sequence parallel) x PP2 (47 MoE layers a stage),
# packs of 256 positions: every rank reads part of every sample of its chunk.
SHAPE = VerlStepShape(samples=4, prompt=64, response=128, dp=2, tp=2, pp=2, pack_tokens=256, runs=1)


def _verl_chunks(shape: VerlStepShape, rows: list[np.ndarray]) -> list[Any]:
    parts = [
        verl_path.sample_batch(
            [array],
            [str(s)],
            prompt_length=shape.prompt,
            response_length=shape.response,
            prompt_tokens=shape.lengths(s)[0],
        )
        for s, array in enumerate(rows)
    ]
    return verl_path.chunk(verl_path.concat(parts), shape.dp)


def _first_passes(shape: VerlStepShape, verl_rows: list[np.ndarray]) -> dict[Rank, RankPass]:
    """Each rank's checked verl pass over ``verl_rows``, then its checked routeplay pass
    over the samples' own rows, on one local store (the step's batch leased meanwhile)."""
    store = RouteStore.local(StoreConfig(run="verl-step-unit"))
    rows = [sample_rows(shape, s) for s in range(shape.samples)]
    handles = store.put_many([Routes(array=array, spec=shape.spec) for array in rows])
    leases = store.acquire_many([(h, "train/step") for h in handles])
    samples = [(str(s), h, sum(shape.lengths(s))) for s, h in enumerate(handles)]
    per = shape.samples // shape.dp
    chunks = _verl_chunks(shape, verl_rows)
    out = {}
    for rank in ranks_of(shape):
        dp = rank[0]
        worker = _VerlRank(store, shape, *rank)
        assert worker.verl_pass(chunks[dp], check=True).check is None
        out[rank] = worker.routeplay_pass(samples[dp * per : (dp + 1) * per], check=True)
    store.release_many(leases)
    check_nothing_left(store, "routeplay")
    return out


def test_every_rank_gets_the_same_rows_on_both_paths() -> None:
    rows = [sample_rows(SHAPE, s) for s in range(SHAPE.samples)]
    first = _first_passes(SHAPE, rows)
    every_row = sum(sum(SHAPE.lengths(s)) - 1 for s in range(SHAPE.samples))
    assert check_rows(first, SHAPE) == SHAPE.pp * every_row  # each stage its layers
    for result in first.values():
        assert result.check is not None
        assert 0 < result.check.compared < every_row  # a TP part of a chunk
        assert 0 < result.peak <= result.bytes_in


def test_a_rank_that_got_other_rows_from_verl_fails_the_check() -> None:
    rows = [sample_rows(SHAPE, s) for s in range(SHAPE.samples)]
    rows[3] = rows[3].copy()
    rows[3][-1, -1] = rows[3][-1, -1] ^ 1  # the last layer (stage 1) of the last row
    first = _first_passes(SHAPE, rows)
    with pytest.raises(RuntimeError, match=r"dp1-tp1-pp1 got other rows from routeplay"):
        check_rows(first, SHAPE)
    del first[1, 1, 1]  # the other ranks agree
    with pytest.raises(RuntimeError, match=r"dp1-tp1-pp1 compared no rows"):
        check_rows(first, SHAPE)


def _passed(compared: int, digest: str = "a") -> RankPass:
    return RankPass(1, 1, RowsCheck(compared, compared, digest, digest))


def test_rows_a_stage_never_compared_fail_the_check() -> None:
    shape = VerlStepShape(samples=2, prompt=64, response=128, dp=1, tp=2, pp=1, runs=1)
    chunk = sum(shape.lengths(0)) + sum(shape.lengths(1)) - 2
    first = {(0, 0, 0): _passed(chunk // 2), (0, 1, 0): _passed(chunk - chunk // 2)}
    assert check_rows(first, shape) == chunk
    first[0, 1, 0] = _passed(chunk - chunk // 2 - 1)
    with pytest.raises(RuntimeError, match=f"dp0-pp0 compared {chunk - 1} rows, their chunk "):
        check_rows(first, shape)
    first[0, 1, 0] = RankPass(1, 1, RowsCheck(5, 4, "a", "a"))  # a real row left out
    with pytest.raises(RuntimeError, match="4 of its 5 rows compared"):
        check_rows(first, shape)


def test_a_lease_left_in_the_store_fails_the_run() -> None:
    store = RouteStore.local(StoreConfig(run="verl-step-leak"))
    handle = store.put(Routes(array=sample_rows(SHAPE, 0), spec=SHAPE.spec))
    left = r"leaked: 1 leases \(train/left-over\), 1 payloads"
    with store.acquire(handle, "train/left-over"), pytest.raises(RuntimeError, match=left):
        check_nothing_left(store, "routeplay")
    check_nothing_left(store, "routeplay")  # released: nothing left


def test_the_shape_refuses_what_cannot_run() -> None:
    with pytest.raises(MisuseError, match="whole chunk"):
        VerlStepShape(samples=3, dp=2)
    with pytest.raises(MisuseError, match="do not split over the pipeline"):
        VerlStepShape(pp=15)  # 94 layers: neither even nor with first and last alike
    with pytest.raises(MisuseError, match="a pack it fits in"):
        VerlStepShape(prompt=1024, response=3072, pack_tokens=2048)
    assert VerlStepShape().stage_layers() == (23, 23)  # PP4: 23 + 24 + 24 + 23


def _path(ms: float, trainer: int, head: int, ranks: int, peak: int, driver: int) -> dict[str, Any]:
    return {
        "median_ms": ms,
        "min_ms": ms - 1,
        "max_ms": ms + 1,
        "bytes_into": {"head": head, "engine": 0, "rollout": 0, "trainer": trainer},
        "bytes_into_ranks": ranks,
        "rank_peak_bytes": peak,
        "driver_routing_bytes": driver,
        "runs": 5,
    }


def test_the_table_shows_both_paths_and_their_ratios() -> None:
    section = {
        "shape": {"samples": 32, "prompt": 1024, "response": 3072, "dp": 2, "tp": 2, "pp": 4},
        "model": "qwen3-235b-a22b",
        "paths": {
            "verl": _path(900.0, 3 * 2**30, 2**30, 8 * 2**30, 2**29, 2**28),
            "routeplay": _path(300.0, 2**28, 2**20, 2**30, 2**24, 2048),
        },
        "verl_over_routeplay": {
            "step_time": 3.0,
            "bytes_into_driver_node": 1024.0,
            "bytes_into_trainer_node": 12.0,
            "bytes_into_ranks": 8.0,
            "rank_peak": 32.0,
            "driver_routing": 131072,
        },
    }
    section["shape"] |= {"passes": 3, "runs": 5}
    results = json.loads(json.dumps({"verl_step": section}))  # as read back from the file
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(verl_step_table(results))
    text = console.export_text()
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in text.splitlines()
        if line.startswith("│")
    ]
    by_path = {row[0]: row[1:] for row in rows}
    assert by_path["verl (DataProto)"] == [
        "900 [899-901]",
        "1.0 GiB",
        "3.0 GiB",
        "8.0 GiB",
        "512.0 MiB",
        "256.0 MiB",
    ]
    assert by_path["routeplay"][1:] == ["1.0 MiB", "256.0 MiB", "1.0 GiB", "16.0 MiB", "2.0 KiB"]
    assert by_path["verl / routeplay"] == ["3x", "1,024x", "12x", "8x", "32x", "131,072x"]
    assert "DP2 x TP2 x PP4" in text
    console.print(verl_step_table({}))  # a results file from before the section: no error
