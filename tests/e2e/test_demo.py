"""The demo end to end: two steps of the smoke recipe on every engine wire format, and
the default recipe once through the CLI, exactly as ``make demo`` runs it (its report,
JSON and PNG: a long run, ``make test-long``), with the same invariants.

Each run goes through partial resumes, stale retries (the smoke recipe's staleness 0
makes step 0's leftover group stale in step 1), two-turn trace sessions and R3 training,
and must show: the experts used in training are the engine's on every real row, nothing
is leaked after teardown, and no payload is written to the object store more than once.
A contract check (no Ray) pins the rollout worker's requests to the engine server's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from routeplay.cli.main import main
from routeplay.core import read_response
from routeplay.core.wires import WIRE_NAMES, wire
from routeplay.engine.generator import ReferenceEngine
from routeplay.engine.model import EngineConfig
from routeplay.engine.server import WireHandler
from routeplay.pipeline import demo as demo_module
from routeplay.pipeline.config import recipe
from routeplay.pipeline.demo import run_demo
from routeplay.pipeline.report import MAX_WRITES_PER_PAYLOAD, DemoReport

pytestmark = pytest.mark.e2e

REQUIRED = (
    "steps",
    "samples_trained",
    "samples_retried",
    "partial_resumes",
    "sessions",
    "routing_rows_replayed",
    "routing_mismatches",
    "payload_bytes",
    "object_store_bytes_written",
    "writes_per_payload",
    "peak_object_store_bytes",
    "leaked_leases",
    "leaked_bytes",
    "object_store_shared",
    "route_diff_fraction_no_replay",
    "token_diff_fraction_no_replay",
    "logprob_abs_diff_no_replay",
    "logprob_abs_diff_replay",
)


SMOKE_ROUTE_DIFF = 0.1
"""Most routes a tiny smoke model's trainer may disagree on without replay."""
DEFAULT_ROUTE_DIFF = 0.3
"""The default recipe's model is scaled so that about 12% of routes differ."""


def _check_invariants(report: DemoReport, steps: int, max_route_diff: float) -> None:
    assert report.steps == steps
    assert report.routing_mismatches == 0
    assert report.routing_rows_replayed > 0
    assert (report.leaked_leases, report.leaked_bytes) == (0, 0)
    assert report.engine_keys_left == 0
    assert report.failed_rollouts == 0
    assert report.samples_trained > 0
    assert report.samples_retried > 0
    assert report.partial_resumes > 0
    assert report.sessions > 0
    # A packed forward that leaked attention across samples, or rows shifted by one,
    # would make the trainer's own routing disagree with the engine's almost everywhere.
    assert report.rows_compared > 0
    assert report.route_diff_fraction_no_replay < max_route_diff
    # The live drift (the library's meter inside the replayed training forward) and the
    # no-replay disagreement count the same rows, and agree exactly at the first MoE
    # layer: it sees the same hidden states either way (later layers may differ a little).
    assert len(report.r3.drift_per_step) == report.steps
    for step in report.r3.drift_per_step:
        assert step.live["tokens"] == step.no_replay["tokens"] > 0
        first = "layer_0/route_diff_share"
        assert step.live[first] == pytest.approx(step.no_replay[first], abs=1e-12)
    assert report.timeline[-1].leases == 0
    # Alone on its Ray instance: Ray's object-store counters are the run's own.
    assert (report.object_store_shared, report.other_runs, report.other_jobs) == (False, (), ())
    assert report.object_store_bytes_after == 0  # Ray freed every byte the run wrote
    assert report.ok


# The smoke recipe's wire (LMDeploy's keys) runs in `make test`; the other three wires,
# whose parsing and requests the fast tests below and the wire tests cover, run their two
# demo steps in `make test-long` (CI runs both).
FIRST_TIER_WIRES = ("lmdeploy-key",)
DEMO_WIRES = [
    name if name in FIRST_TIER_WIRES else pytest.param(name, marks=pytest.mark.long)
    for name in WIRE_NAMES
]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("name", DEMO_WIRES)
def test_two_steps_keep_every_invariant(name: str) -> None:
    report = run_demo(recipe("smoke").replace(wire=name, seed=1))
    _check_invariants(report, steps=2, max_route_diff=SMOKE_ROUTE_DIFF)
    assert report.writes_per_payload is not None
    if wire(name).key_store:
        # The engine writes each answer's array (and its store a copy): counted apart.
        # The store's compact copy of a payload this small stays in its shard's heap.
        assert report.engine_objects_written > 0
        assert report.writes_per_payload <= MAX_WRITES_PER_PAYLOAD
    else:
        # Payloads this small would stay in the shard's heap (Ray's 100 KiB inline
        # limit); the shard writes each to the object store once instead.
        assert report.engine_objects_written == 0
        assert 1.0 <= report.writes_per_payload <= MAX_WRITES_PER_PAYLOAD
        assert report.object_store_bytes_written >= report.payload_bytes


class _KeyStore:
    """An in-process engine store: ``put.remote`` answers the key itself."""

    def __init__(self) -> None:
        self.put = self
        self.arrays: list[object] = []

    def remote(self, array: object) -> str:
        self.arrays.append(array)
        return f"{len(self.arrays):056x}"


@pytest.mark.parametrize("name", WIRE_NAMES)
def test_worker_requests_fit_the_engine_server(name: str) -> None:
    engine = ReferenceEngine(EngineConfig())
    fmt = wire(name)
    store = _KeyStore() if fmt.key_store else None
    handler = WireHandler(engine, name, engine_store=store)
    prompt = (5, 9, 2, 7)
    path, body = fmt.request(prompt, max_new_tokens=6, temperature=1.0, seed=3, stop_after=4)
    assert path == handler.path
    first = fmt.read_completion(handler(body))
    assert (len(first.token_ids), first.finish_reason) == (4, "abort")
    # The resume asks for the rows its history lacks (SGLang, vLLM) and gets exactly those.
    resumed_prompt = prompt + first.token_ids
    history = len(resumed_prompt) - 1
    start = fmt.routing_start(history)
    path, body = fmt.request(
        resumed_prompt, max_new_tokens=2, temperature=1.0, seed=4, start_row=start
    )
    answer = handler(body)
    second = fmt.read_completion(answer)
    assert (len(second.token_ids), second.finish_reason) == (2, "length")
    routing = read_response(fmt.engine, answer, engine.spec, start_row=start)
    if routing.key is not None:
        assert routing.key.rows == len(resumed_prompt) + 1
    else:
        assert routing.routes is not None
        assert routing.routes.start_row == start
        assert routing.routes.stop_row == len(resumed_prompt) + 1


R3_FIELDS = (
    "route_disagreement",
    "tokens_any_layer",
    "layers_per_token",
    "kl_k3_without",
    "kl_k3_with",
    "kl_k3_r2",
    "abs_dlogprob_without",
    "abs_dlogprob_with",
    "mismatched_routes_with",
    "live_route_disagreement",
    "live_tokens_any_layer",
    "live_layers_per_token",
)
BYTES_FIELDS = ("payload_bytes_mean", "writes_per_payload", "prompt_bytes_saved")


def test_the_default_recipe_is_the_r3_model() -> None:
    # The geometry and init the issue measured paper-like disagreement with; the trainer
    # in float32 against the bf16 engine.
    config = recipe("default")
    engine = config.engine
    assert (engine.num_layers, engine.num_experts, engine.top_k) == (24, 128, 8)
    assert (engine.expert_init_scale, engine.lm_head_init_scale) == (1.5, 16.0)
    assert (engine.dtype, config.trainer.dtype) == ("bfloat16", "float32")
    lo, _ = config.rollout.prompt_tokens
    row_bytes = engine.num_layers * engine.top_k  # uint8 ids (128 experts)
    assert lo * row_bytes > 100 * 1024  # a fresh payload is over Ray's inline limit


@pytest.fixture(scope="module")
def default_run(
    ray_local: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[DemoReport, dict[str, Any], Path]:
    """The default recipe run exactly as ``make demo`` runs it: the CLI with its JSON
    report and PNG. The report object is the one the CLI rendered (a spy on
    ``run_demo`` keeps it), so the figures, the JSON and the plot come from one run."""
    out = tmp_path_factory.mktemp("demo")
    report_path, plot = out / "report.json", out / "timeline.png"
    reports: list[DemoReport] = []

    def spy(*args: Any, **kwargs: Any) -> DemoReport:
        reports.append(run_demo(*args, **kwargs))
        return reports[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo_module, "run_demo", spy)
        status = main(["demo", "--json", str(report_path), "--plot", str(plot)])
    assert status == 0
    [report] = reports
    return report, json.loads(report_path.read_text()), plot


@pytest.mark.long
def test_the_cli_writes_a_report_and_a_plot(
    default_run: tuple[DemoReport, dict[str, Any], Path],
) -> None:
    _, data, plot = default_run
    assert set(REQUIRED) <= set(data)
    assert data["routing_mismatches"] == data["leaked_leases"] == data["leaked_bytes"] == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.long
def test_the_json_report_carries_the_r3_and_bytes_objects(
    default_run: tuple[DemoReport, dict[str, Any], Path],
) -> None:
    _, data, _ = default_run
    r3, sizes = data["r3"], data["bytes"]
    assert set(R3_FIELDS) <= set(r3)
    assert set(BYTES_FIELDS) <= set(sizes)
    assert r3["mismatched_routes_with"] == data["routing_mismatches"] == 0
    assert data["leaked_leases"] == data["leaked_bytes"] == data["object_store_bytes_after"] == 0
    assert 0.0 <= r3["route_disagreement"] <= r3["tokens_any_layer"] <= 1.0
    # Differing layers per token: between "route fraction x L" and L, consistently.
    layers = data["layers"]
    assert r3["layers_per_token"] == pytest.approx(r3["route_disagreement"] * layers)
    assert r3["layers_per_token"] <= r3["tokens_any_layer"] * layers + 1e-9
    assert min(r3["kl_k3_without"], r3["kl_k3_with"], r3["kl_k3_r2"]) >= 0.0
    assert r3["abs_dlogprob_without"] > 0.0  # a bf16 engine never matches float32 exactly
    assert len(r3["kl_k3_per_step"]) == data["steps"]
    assert len(r3["drift_per_step"]) == data["steps"]
    for step in r3["drift_per_step"]:
        for figures in (step["live"], step["no_replay"]):
            assert {"route_diff_share", "layers_per_token", f"layer_{layers - 1}/overlap"} <= set(
                figures
            )
    assert sizes["payload_bytes_mean"] == pytest.approx(
        data["payload_bytes"] / data["payloads"], abs=0.1
    )
    assert sizes["writes_per_payload"] == data["writes_per_payload"]
    # No byte written twice: at most the payloads' bytes plus each object's few hundred
    # bytes of Ray serialization.
    overhead = 512 * data["object_store_objects_written"]
    assert data["object_store_bytes_written"] <= data["payload_bytes"] * 1.02 + overhead
    assert sizes["written_per_stored_byte"] == pytest.approx(
        data["object_store_bytes_written"] / data["payload_bytes"], abs=1e-3
    )
    assert sizes["sample_bytes_mean"] > 0
    assert data["trainer_dtype"] == "float32"


@pytest.mark.long
def test_the_default_run_shows_what_the_r3_paper_shows(
    default_run: tuple[DemoReport, dict[str, Any], Path],
) -> None:
    # The main job's own claims (issue: "the main job shows what the R3 paper shows"),
    # on the default recipe exactly as `make demo` runs it.
    report, _, _ = default_run
    _check_invariants(report, steps=recipe("default").steps, max_route_diff=DEFAULT_ROUTE_DIFF)
    figures = {k: v for k, v in report.to_json().items() if k not in ("timeline", "r3")}
    assert report.ok, figures  # no mismatch, no leak, one write per payload
    assert (report.leaked_leases, report.leaked_bytes, report.failed_rollouts) == (0, 0, 0)
    assert report.object_store_bytes_after == 0
    assert min(report.samples_retried, report.partial_resumes, report.sessions) > 0
    r3, sizes = report.r3, report.bytes
    assert r3.route_disagreement >= 0.05
    assert r3.tokens_any_layer >= 0.80
    # R3 cuts the KL by a quarter at least. The k3 estimate over this recipe's 168
    # scored tokens is heavy-tailed: runs of the default recipe cut it by 45-58% on a
    # quiet machine (seeds 0-3) and by 35% once under CI's load (other seeds of torch's
    # thread pool, other sampled tokens), so a cut of 40% was no bound on R3.
    assert r3.kl_k3_with <= 0.75 * r3.kl_k3_without
    assert r3.mismatched_routes_with == 0
    assert sizes.payload_bytes_mean > 100 * 1024, figures  # real-size payloads ...
    # ... each written to the object store once (Ray may add an object of its own)
    assert sizes.writes_per_payload is not None
    assert 1.0 <= sizes.writes_per_payload <= MAX_WRITES_PER_PAYLOAD, figures
    assert sizes.prompt_bytes_saved > 0
