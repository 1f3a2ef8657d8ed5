"""``examples/verl_flow.py`` runs to its end state: a verl-shaped step through verl
0.9.1's own classes (``TokenOutput``, ``DataProto``, ``get_tensordict``,
``prepare_micro_batches``, its Megatron engine's ``prepare_model_inputs``, its R3 alignment
and mask), with exact rows on every rank and no lease left, also after a rank raised."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import ray

pytestmark = pytest.mark.e2e

pytest.importorskip(
    "verl.workers.engine.megatron.transformer_impl",
    reason="verl's Megatron engine does not import (make test installs its dependencies)",
)

EXAMPLE = Path(__file__).parents[2] / "examples" / "verl_flow.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verl_flow", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # its actors, for Ray's workers
    return module


@pytest.mark.usefixtures("ray_local")
def test_the_verl_flow_ends_with_exact_rows_and_nothing_left() -> None:
    flow = load_example()
    report = flow.main()
    assert [rank.samples for rank in report.ranks] == [flow.PROMPTS * flow.N // flow.DP] * 2
    assert all(rank.micro_batches > 1 for rank in report.ranks)  # verl split by tokens
    rows = sum(flow.truth(s).shape[0] for s in range(flow.PROMPTS * flow.N))
    assert sum(rank.bytes_read for rank in report.ranks) == flow.SPEC.nbytes(rows)
    assert report.leases_after_step == 0
    assert report.live_bytes_after_step == 0
    assert report.failed_step_error == "the rank's forward failed"
    assert report.leases_after_failed_step == 0
