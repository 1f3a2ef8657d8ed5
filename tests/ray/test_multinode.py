"""Four nodes on one machine (a head that hosts the store shards, then engine, rollout
and trainer), started once for this module (each node is a raylet and its agents: the
dearest set-up of the suite).

On them: an adopted key is validated and narrowed once, on the engine's node (one
compact write there), and the trainer pulls those compact rows straight from it;
nothing is written on the rollout node or on the store's node. The eager path relays
the payload through the rollout node.

And ``routeplay bench --smoke --address``: the whole benchmark with tiny payloads. It
checks what the full run reports: every path delivers the same rows, the routeplay
paths write each payload once (the adoption's writes counted), a GRPO group its prompt
once, a rank holds only its share, each sample's adoption is timed apart from the step,
and the results file carries the figures under the documented keys; verl's data path
is measured against routeplay's, and the two deliver the same rows.

The whole module is in ``make test-long``: the four nodes' start alone takes 19 s of a
fresh clone's ``make test``.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from rich.console import Console

from routeplay.bench.measure import ROLES, node_roles
from routeplay.bench.measure import cluster as bench_cluster
from routeplay.bench.report import adoption_table
from routeplay.bench.transfer_paths import actors_on
from routeplay.bench.verl_report import verl_step_table
from routeplay.bench.workloads import BenchConfig, VerlStepShape
from routeplay.cli.bench_command import EXIT_BROKEN, EXIT_OK
from routeplay.cli.main import main
from routeplay.core import preset
from routeplay.store import StoreConfig, start_engine_store
from routeplay.store.remote.accounting import node_store_stats

SPEC = preset("qwen3-235b-a22b")
ROWS = 4000
RAW_BYTES = ROWS * SPEC.decoder_layers * SPEC.top_k * 2
COMPACT_BYTES = SPEC.nbytes(ROWS)  # uint8, MoE layers only


@pytest.fixture(scope="module")
def nodes() -> Iterator[str]:
    """The bench's own four-node cluster (``routeplay.bench.measure.cluster``), connected;
    its address."""
    with bench_cluster(BenchConfig.smoke().store_bytes):
        yield ray.get_runtime_context().gcs_address


# -- routeplay bench --smoke (first: the nodes are the bench's alone) --------------

KEYS = (
    "name",
    "eager_ms",
    "routeplay_ms",
    "adopt_ms",
    "adopt_at_step_ms",
    "adoption_p50_ms",
    "adoption_p99_ms",
    "limit_ms",
    "bytes_written",
    "bytes_pulled",
    "peak_rank_bytes",
)
METADATA = 1.02  # Ray's per-object headers, at most 2% on top of the payload


@pytest.fixture(scope="module")
def results(nodes: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out: Path = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--smoke", "--address", nodes, "--out-dir", str(out)]
    status = main([*argv, "--json", str(out / "r.json")])
    [stored] = out.glob("data-path_smoke_*.json")
    assert re.fullmatch(r"data-path_smoke_.+_\d{4}-\d\d-\d\dT\d{4}Z\.json", stored.name)
    assert stored.with_suffix(".png").stat().st_size > 0
    document: dict[str, Any] = json.loads((out / "r.json").read_text())
    assert document == json.loads(stored.read_text())
    # The run fails on a path timed below its limit (how fast this machine was is the
    # bench's to report) and on nothing else.
    assert status == (EXIT_BROKEN if document["goals"]["below_limit"] else EXIT_OK)
    return document


@pytest.mark.long
def test_every_workload_has_the_documented_figures(results: dict[str, object]) -> None:
    workloads = results["workloads"]
    assert isinstance(workloads, list)
    assert len(workloads) == 2
    for w in workloads:
        assert all(key in w for key in KEYS)
        for path in ("eager", "producer", "adopt", "adopt_at_step"):
            assert w[path]["runs"] == 1
            assert w[path]["min_ms"] <= w[path]["median_ms"] <= w[path]["max_ms"]
            assert set(w["bytes_written"]) == {"eager", "producer", "adopt"}
        assert w["rows_identical_across_paths"] is True
        assert w["limit_ms"] > 0
    assert {"ray", "numpy", "routeplay"} <= set(results["versions"])  # type: ignore[arg-type]
    assert results["config"]["mode"] == "smoke"  # type: ignore[index]


@pytest.mark.long
def test_each_path_has_its_limit_and_a_path_timed_below_it_is_reported(
    results: dict[str, object],
) -> None:
    """Whether a path was timed below its limit, and whether the probe or Ray's floor
    set the limit, is this machine's timing: the bench's to report (and fail on), not
    this test's. It checks how the limit is made (the probe's parts, lowered to the
    floor's best run) and that the report names exactly the paths timed below it."""
    for w in results["workloads"]:  # type: ignore[attr-defined]
        limit = w["limit"]
        assert limit["cross_node_bytes"] == w["unique_bytes"]  # the workload's own bytes
        assert limit["runs"] >= 5
        assert w["limit_ms"] == min(limit["by_path"].values())
        assert set(limit["by_path"]) == {"producer", "adopt"}
        for path, ms in limit["by_path"].items():
            probe = limit["probe_by_path"][path]
            assert probe == pytest.approx(limit["copy_ms"] + limit["pull_ms"][path], abs=0.02)
            assert ms == min(probe, limit["floor_best_ms"].get(path, probe))
            assert ms > 0
        assert w["below_limit"] == [
            f"{path}: {w[path]['median_ms']} ms < its limit {limit['by_path'][path]} ms"
            for path in ("producer", "adopt")
            if w[path]["median_ms"] < limit["by_path"][path]
        ]
        # The limit is at most the floor's best run, which is at most its median (0.1 ms
        # rounding): Ray's floor is never below the limit.
        best_floor = limit["floor_best_ms"]["producer"]
        assert 0 < limit["by_path"]["producer"] <= best_floor <= w["bare_ray_ms"] + 0.05
        assert limit["validate_ms"] > 0
        assert set(limit["pull_core_ms"]) == {"producer", "adopt"}
        for path in ("eager", "producer", "adopt"):
            # Busy core-ms in a path's window: at most every core for all of it (two
            # readings of 10 ms resolution each).
            cores = results["host_cores"]
            assert 0 <= w[path]["core_ms"] <= cores * (w[path]["max_ms"] + 20)
        # One bare Ray run next to each producer run (one each here: the pair's difference)
        assert w["bare_ray_runs"] == w["producer"]["runs"]
        assert w["producer_minus_bare_ray_medians_ms"] == pytest.approx(
            w["producer"]["median_ms"] - w["bare_ray_ms"], abs=0.11
        )
        assert w["producer_beyond_bare_ray_ms"] == pytest.approx(
            w["producer"]["median_ms"] - w["bare_ray_ms"], abs=0.11
        )
        assert w["bare_ray_fetch_ms"] > 0  # the adopt path's floor, one pair here too
        assert w["adopt_beyond_bare_ray_fetch_ms"] == pytest.approx(
            w["adopt"]["median_ms"] - w["bare_ray_fetch_ms"], abs=0.11
        )
        # the read against the floor's own rank time, clock for clock
        assert w["adopt_read_beyond_bare_ray_fetch_ms"] == pytest.approx(
            w["adopt"]["phases_ms"]["read"] - w["bare_ray_fetch_rank_ms"], abs=0.11
        )
        assert 0 < w["bare_ray_fetch_rank_ms"] < w["bare_ray_fetch_ms"]
    scaling: dict[str, Any] = results["scaling"]  # type: ignore[assignment]
    points = [
        *results["workloads"],  # type: ignore[misc]
        *scaling["tokens_per_sample"],
        *scaling["samples_per_step"],
    ]
    for point in points[len(results["workloads"]) :]:  # type: ignore[arg-type]
        assert point["below_limit"] == [
            f"{path}: {point[f'{path}_ms']} ms < its limit {point['limit']['by_path'][path]} ms"
            for path in ("producer", "adopt")
            if point[f"{path}_ms"] < point["limit"]["by_path"][path]
        ]
    assert results["goals"]["below_limit"] == [  # type: ignore[index]
        f"{point['name']}: {line}" for point in points for line in point["below_limit"]
    ]


@pytest.mark.long
def test_each_step_is_split_into_its_phases(results: dict[str, object]) -> None:
    for w in results["workloads"]:  # type: ignore[attr-defined]
        for path in ("eager", "producer", "adopt", "adopt_at_step"):
            phases, step = w[path]["phases_ms"], w[path]["median_ms"]
            assert set(phases) == {"outside_ranks", "acquire", "read"}
            # One run each here: the phases of one step, which add up to it
            assert 0 < phases["read"] < step
            assert 0 < phases["outside_ranks"] < step
            assert sum(phases.values()) == pytest.approx(step, abs=0.2)
        assert w["eager"]["phases_ms"]["acquire"] == 0  # the eager path has no leases
        assert w["adopt"]["phases_ms"]["acquire"] > 0


@pytest.mark.long
def test_each_adoption_is_timed_apart_from_the_step_per_sample(
    results: dict[str, object],
) -> None:
    """The adopted-key paths adopt before their steps, one call per sample (per group
    for GRPO), each timed by the rollout worker; every sample of every timed run counts."""
    for w in results["workloads"]:  # type: ignore[attr-defined]
        for path in ("adopt", "adopt_at_step"):
            adoption, runs = w[path]["adoption_ms"], w[path]["runs"]
            assert adoption["samples"] == w["samples"] * runs  # the checked run left out
            # one adopt_key per sample; a GRPO step is one group: one adopt_keys call
            assert adoption["calls"] == (runs if w["shared_prompt"] else adoption["samples"])
            assert 0 < adoption["p50"] <= adoption["p99"]
        assert w["adoption_p50_ms"] == w["adopt"]["adoption_ms"]["p50"]
        assert w["adoption_p99_ms"] == w["adopt"]["adoption_ms"]["p99"]
        assert "adoption_ms" not in w["producer"]
        assert "adoption_ms" not in w["eager"]
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(adoption_table(results))  # type: ignore[arg-type]
    rows = [line for line in console.export_text().splitlines() if "qwen3-30b-a3b/" in line]
    plain = results["workloads"][0]  # type: ignore[index]
    assert len(rows) == 2  # adopt, adopt validated at adoption: the plain workload's
    assert [cell.strip() for cell in rows[0].split("│")[1:-1]][2:4] == [
        "at ingest",
        f"{plain['samples']} ({plain['samples']})",
    ]


@pytest.mark.long
def test_routeplay_writes_once_and_a_rank_holds_its_share(results: dict[str, object]) -> None:
    plain, grpo = results["workloads"]  # type: ignore[misc]
    payload = plain["payload_bytes"]
    for path in ("producer", "adopt", "adopt_at_step"):
        assert payload <= plain[path]["bytes_written"] <= payload * METADATA
        assert payload <= plain[path]["bytes_pulled"] <= payload * METADATA
    # The adopted-key path: every payload validated as the engine put it (its write
    # counted all the same, above), none when the engine store has no spec.
    assert plain["adopt"]["validated_at_ingest"] == plain["samples"]
    assert plain["adopt_at_step"]["validated_at_ingest"] == 0
    assert grpo["adopt"]["validated_at_ingest"] == 0  # a group is laid out at adoption
    assert plain["bytes_written"]["eager"] >= 2 * payload  # relayed through the rollout node
    sp = plain["sp"]
    assert plain["peak_rank_bytes"]["producer"] <= plain["peak_rank_bytes"]["eager"] / sp
    assert grpo["shared_prompt"] > 0
    for path in ("producer", "adopt"):  # the group's prompt is written once on both paths
        assert (
            grpo["unique_bytes"] <= grpo["bytes_written"][path] <= grpo["unique_bytes"] * METADATA
        )


@pytest.mark.long
def test_goals_and_small_costs_are_reported(results: dict[str, object]) -> None:
    goals = results["goals"]
    assert goals["writes_per_payload"]["producer"] <= METADATA  # type: ignore[index]
    segments = results["scaling"]["segments_per_handle"]  # type: ignore[index]
    assert [p["segments"] for p in segments] == [1, 50]
    # compacted: the 50 payloads become one (one weight version), compacting is timed
    assert [p["compacted_segments"] for p in segments] == [1, 1]
    assert segments[1]["compact_ms"] > 0
    small = results["small_puts"]
    assert small["samples"] == 16  # type: ignore[index]
    assert small["put_many_per_s"] > 0  # type: ignore[index]
    assert results["store_end"] == {"live_payloads": 0, "leases": 0}


@pytest.mark.long
def test_verl_data_path_is_measured_against_routeplays(results: dict[str, Any]) -> None:
    """verl's padded int16 batch reaches the driver and, on every pass, each rank of its
    DP chunk whole; routeplay's rows cross once from the rollout node, each rank taking
    its own. The checked step compared every row of each stage."""
    section = results["verl_step"]
    shape = VerlStepShape(**section["shape"])
    assert shape == BenchConfig.smoke().verl_step
    rows = sum(sum(shape.lengths(s)) - 1 for s in range(shape.samples))
    assert section["rows_identical_across_paths"] is True
    assert section["rows_checked"] == shape.pp * rows  # each stage, its layers
    assert section["store_end"] == {"live_payloads": 0, "leases": 0}
    verl, ours = section["paths"]["verl"], section["paths"]["routeplay"]
    for figures in (verl, ours):
        assert figures["runs"] == 1
        assert 0 < figures["min_ms"] <= figures["median_ms"] <= figures["max_ms"]
    batch, passes = verl["driver_routing_bytes"], shape.passes
    assert batch == shape.samples * (shape.prompt + shape.response) * shape.spec.row_nbytes * 2
    assert verl["bytes_into_ranks"] == passes * shape.tp * shape.pp * batch
    assert verl["rank_peak_bytes"] == batch // shape.dp  # its chunk, every layer
    assert verl["bytes_into"]["head"] >= (1 + passes) * batch  # the batch, then each chunk
    assert verl["bytes_into"]["trainer"] >= passes * batch
    canonical = shape.spec.nbytes(rows)
    assert canonical <= ours["bytes_into"]["trainer"] <= passes * canonical * METADATA
    assert ours["driver_routing_bytes"] < 1024 * shape.samples  # handles, no rows
    ratios = section["verl_over_routeplay"]
    assert set(ratios) == {
        "step_time",
        "bytes_into_ranks",
        "bytes_into_trainer_node",
        "bytes_into_driver_node",
        "rank_peak",
        "driver_routing",
    }
    assert all(ratio > 0 for ratio in ratios.values())
    assert ratios["bytes_into_trainer_node"] > 1
    assert ratios["driver_routing"] > 100
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(verl_step_table(results))
    text = console.export_text()
    for label in ("verl (DataProto)", "routeplay", "verl / routeplay"):
        assert f"│ {label} " in text


@pytest.mark.long
def test_multi_turn_bytes_are_one_per_unique_row_after_compaction_on_every_wire(
    results: dict[str, object],
) -> None:
    sessions = results["sessions"]
    shape = sessions["shape"]  # type: ignore[index]
    wires = sessions["wires"]  # type: ignore[index]
    assert set(wires) == {"vllm", "sglang", "lmdeploy-key"}
    goals = results["goals"]["multi_turn_bytes_per_unique_row"]  # type: ignore[index]
    for wire, kinds in wires.items():
        session, partial = kinds["session"], kinds["partial"]
        assert session["turns"] == shape["trunk_turns"] + 2 * shape["branch_turns"]
        assert partial["turns"] == shape["pieces"]
        for kind, w in kinds.items():
            assert w["rows_exact"] is True, (wire, kind)  # every row, at its version
            for phase in ("before", "after"):  # the shared trunk counted once
                assert w[phase]["stored_per_unique_row"] == 1.0, (wire, kind, phase)
                ray_bytes = w[phase]["object_store_per_unique_row"]
                assert 1.0 <= ray_bytes <= METADATA, (wire, kind, phase, ray_bytes)
            assert w["compaction"]["rows_copied_per_unique_row"] == 1.0  # each row once
            assert w["left_after_release"] == {"stored": 0, "object_store": 0}
            assert goals[f"{wire}/{kind}"]["after"] == w["after"]["object_store_per_unique_row"]
        # a turn per segment (the second branch's first borrows one row of the first's)
        # before; after, a section per weight-version run: trunk, its last row, branch
        assert session["before"]["segments"] == shape["trunk_turns"] + shape["branch_turns"] + 1
        assert session["after"] == {**session["after"], "segments": 3, "payloads": 3}
        # the resumed rollout: one payload, a segment per piece (a version each)
        assert (partial["before"]["payloads"], partial["after"]["payloads"]) == (3, 1)
        assert partial["after"]["segments"] == shape["pieces"]
    # vLLM and SGLang send only rows from the request's start: nothing but the store's
    # payloads is written; LMDeploy's key holds every row of every turn's context
    for wire in ("vllm", "sglang"):
        assert wires[wire]["session"]["engine_side_per_unique_row"] < METADATA - 1
    assert wires["lmdeploy-key"]["session"]["engine_side_per_unique_row"] > 2


# -- one engine key, the lazy and the eager path ---------------------------------


@pytest.fixture(scope="module")
def cluster(nodes: str) -> Iterator[dict[str, Any]]:
    store = StoreConfig(run="run-3node", resources=(("head", 0.01),), timeout_s=60).build()
    start_engine_store(resources={"engine": 0.01})
    actors = actors_on(store, SPEC, pinned=True)
    try:
        yield {"actors": actors, "roles": node_roles(), "store": store}
    finally:
        for actor in (actors.engine, actors.rollout, actors.trainer):
            ray.kill(actor)
        store.shutdown()


def _written_per_role(roles: dict[str, str]) -> dict[str, int]:
    return {roles[node]: stats.created_bytes for node, stats in node_store_stats().items()}


RELAY_FLOOR = 4096
"""Bytes below which a node's object-store writes cannot be a relayed payload."""


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {role: after[role] - before[role] for role in ROLES}


@pytest.mark.long
def test_trainer_reads_from_the_engine_node_and_nothing_is_relayed(cluster: dict[str, Any]) -> None:
    actors, roles = cluster["actors"], cluster["roles"]
    start = _written_per_role(roles)
    key = ray.get(actors.engine.generate_one_write.remote(ROWS))
    after_put = _written_per_role(roles)
    handle = ray.get(actors.rollout.lazy.remote(key, ROWS))
    ray.get(actors.trainer.read_lazy.remote(handle))
    put, moved = _delta(start, after_put), _delta(after_put, _written_per_role(roles))
    assert RAW_BYTES <= put["engine"] < RAW_BYTES * 1.01
    # The rollout worker only handled a handle and the shards never see payload bytes: a
    # relay would write >= COMPACT_BYTES there; a few bytes of Ray bookkeeping may appear
    # on a loaded machine (8 bytes seen once), which is not routing.
    assert moved["rollout"] < RELAY_FLOOR
    assert put["head"] < RELAY_FLOOR
    assert moved["head"] < RELAY_FLOOR
    # validated once where the engine wrote it; the trainer pulls the compact rows once
    assert COMPACT_BYTES <= moved["engine"] < COMPACT_BYTES * 1.01
    assert COMPACT_BYTES <= moved["trainer"] < COMPACT_BYTES * 1.01


@pytest.mark.long
def test_eager_path_relays_through_the_rollout_node(cluster: dict[str, Any]) -> None:
    actors, roles = cluster["actors"], cluster["roles"]
    key = ray.get(actors.engine.generate_one_write.remote(ROWS))
    before = _written_per_role(roles)
    wrapped = ray.get(actors.rollout.eager.remote(key))
    ray.get(actors.trainer.read_eager.remote(wrapped))
    moved = _delta(before, _written_per_role(roles))
    assert moved["rollout"] >= 2 * RAW_BYTES  # pulled in, then put again
    assert moved["trainer"] >= RAW_BYTES
    ray.get(actors.rollout.drop.remote())
